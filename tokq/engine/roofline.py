"""The decode roofline: how fast a decode step could be if it only had to read what it must read.

A decode step reads every weight once (whatever the batch) and, per sequence, the K/V of its whole
context; at the memory bandwidth measured in the same run (a large device copy), that takes
bytes / bandwidth. The achieved fraction is that time over the measured time per output token step.
Weights count at their stored size: a quantized layer's codes at `bits` per weight plus its scales
and zero points (what a fused kernel reads), a dense one at its dtype; the embedding table is not
read whole (one row per token) unless it is tied to the LM head, which reads it whole.
"""

from __future__ import annotations

import statistics
import time

import torch

from tokq.engine.layers import Linear
from tokq.engine.models import CausalLM


def weight_bytes_per_step(model: CausalLM) -> int:
    """Bytes of weights one decode step reads (every Linear, the LM head included, at stored size)."""
    from tokq.engine.quant_linear import QuantizedLinearMethod

    total = 0
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        method = module.method
        if isinstance(method, QuantizedLinearMethod):
            n, k = method.q.shape
            total += n * k * method.bits // 8 + method.scale.numel() * 2
            if method.zero is not None:
                total += method.zero.numel() * method.bits // 8
        else:
            total += module.weight.numel() * module.weight.element_size()
        if module.bias is not None:
            total += module.bias.numel() * module.bias.element_size()
    return total


def copy_bandwidth(device: torch.device | str = "cpu", mib: int = 256, repeats: int = 5) -> dict:
    """GB/s of dst.copy_(src) on `mib` MiB (read + write counted): the practical memory roofline."""
    device = torch.device(device)
    src = torch.ones(mib << 18, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    rates = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rates.append(2 * src.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return {"bytes": 2 * src.numel() * 4, "gbps_median": statistics.median(rates), "gbps_max": max(rates),
            "gbps_min": min(rates), "device": str(device)}


def decode_roofline(model: CausalLM, kv_bytes_per_token: int, batch: int, mean_context: float,
                    bandwidth_gbps: float) -> dict:
    """The bytes of one decode step of `batch` sequences at `mean_context` tokens, and its time at the bandwidth."""
    weights = weight_bytes_per_step(model)
    kv = int(batch * mean_context * kv_bytes_per_token)
    seconds = (weights + kv) / (bandwidth_gbps * 1e9)
    return {"weight_bytes": weights, "kv_bytes": kv, "bytes_per_step": weights + kv, "batch": batch,
            "mean_context": mean_context, "bandwidth_gbps": bandwidth_gbps, "roofline_step_s": seconds}
