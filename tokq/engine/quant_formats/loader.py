"""Loading a quantized checkpoint: which format it is in, and its projections into quantized Linears.

`load_model` calls `load_quantized_weights` when config.json carries a `quantization_config` (or the
directory has an AutoGPTQ `quantize_config.json`). `quant_format` picks the reader (one of `FORMATS`) by
the config's `quant_method`; the reader unpacks each quantized projection's tensors into tokq's in-memory
layout (`kernels.reference.IntWeight` / `FP8Weight`: signed codes [N, K], fp32 scales [N, G], signed zero
points [N, G] or None), the shards of a merged Linear (q/k/v, gate/up) are concatenated row-wise, and the
Linear is made quantized with `quantize_linear_`. Nothing is dequantized: the runtime computes with the
checkpoint's own integer codes. Dense tensors (embeddings, norms, unquantized layers) are copied as
engine/checkpoint.py copies them.

Activation order (GPTQ desc_act, compressed-tensors g_idx): tokq's integer layout needs each group's
columns to be contiguous, so the input dimension is permuted once at load time (columns sorted by
group; an exact integer repack, no rounding), and the layer permutes its input activations by the
same permutation at run time (`InputPermutedLinearMethod`). That keeps the checkpoint's codes bit for
bit; dequantizing to a dense weight would lose the memory saving and the quantized kernels. All shards
of a merged Linear share one input, so they must share the permutation; when they do not (a GPTQ run
with per-shard orders), that Linear is dequantized to a dense weight, with a warning.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tokq.engine.layers import Linear
from tokq.engine.models import CausalLM
from tokq.engine.quant_formats.awq import AWQFormat
from tokq.engine.quant_formats.base import QuantFormat, ShardWeight, check_shape
from tokq.engine.quant_formats.compressed_tensors import CompressedTensorsFormat
from tokq.engine.quant_formats.gptq import GPTQFormat
from tokq.engine.quant_linear import quantize_linear_
from tokq.engine.safetensors_io import (
    check_all_filled,
    check_tied_copy,
    checkpoint_targets,
    copy_dense_tensor,
    iter_tensors,
    read_checkpoint_header,
)
from tokq.errors import ModelError
from tokq.kernels.reference import FP8Weight, IntWeight, QuantizedWeight

log = logging.getLogger("tokq")

# The readers, in the order the "not supported" message names them; each is chosen by its `method`.
FORMATS: tuple[type[QuantFormat], ...] = (CompressedTensorsFormat, GPTQFormat, AWQFormat)
SUPPORTED_METHODS = tuple(f.method for f in FORMATS)


def read_quantization_config(checkpoint_dir: Path, raw_config: dict) -> dict | None:
    """The checkpoint's quantization config: config.json's `quantization_config`, or AutoGPTQ's quantize_config.json."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        path = Path(checkpoint_dir) / "quantize_config.json"
        if not path.is_file():
            return None
        try:
            qc = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelError(f"{path} is not valid JSON ({exc}); restore it from the original checkpoint") from exc
        if isinstance(qc, dict):
            qc.setdefault("quant_method", "gptq")
    if not isinstance(qc, dict):
        raise ModelError(f"{checkpoint_dir}/config.json: quantization_config is not a JSON object")
    return qc


def quant_format(qc: dict, where: str) -> QuantFormat:
    method = qc.get("quant_method")
    for fmt in FORMATS:
        if fmt.method == method:
            return fmt(qc, where)
    raise ModelError(f"{where}: checkpoint quantization {method!r} is not supported; tokq reads "
                     f"{', '.join(SUPPORTED_METHODS)} checkpoints (or quantize the 16-bit model with tokq)")


# --------------------------------------------------------------------------------------------------
# Merging shards and installing them


def _contiguous_perm(shards: list[ShardWeight], group_size: int) -> torch.Tensor | None:
    """One input permutation that makes every shard's groups contiguous, or None if they disagree."""
    g_idx = next(s.g_idx for s in shards if s.g_idx is not None)
    perm = torch.argsort(g_idx, stable=True)
    k = g_idx.numel()
    target = torch.arange(k, device=g_idx.device) // group_size
    for s in shards:
        gi = s.g_idx if s.g_idx is not None else target
        if not torch.equal(gi[perm], target):
            return None
    return perm


def _merge(name: str, shards: list[ShardWeight]) -> tuple[QuantizedWeight, str | None]:
    first = shards[0]
    for s in shards[1:]:
        same = type(s.weight) is type(first.weight) and s.act == first.act
        if same and isinstance(s.weight, IntWeight):
            same = (s.weight.bits, s.weight.group_size) == (first.weight.bits, first.weight.group_size)
        if not same:
            raise ModelError(f"{name}: the projections merged into this layer are quantized differently; tokq "
                             "runs them as one matrix, so they must share one scheme (bits, group size, activations)")
    if isinstance(first.weight, FP8Weight):
        return FP8Weight(torch.cat([s.weight.q for s in shards]), torch.cat([s.weight.scale for s in shards])), first.act
    ws: list[IntWeight] = [s.weight for s in shards]
    zero = None
    if any(w.zero is not None for w in ws):
        zero = torch.cat([w.zero if w.zero is not None else torch.zeros_like(w.scale, dtype=torch.int8) for w in ws])
    merged = IntWeight(torch.cat([w.q for w in ws]), torch.cat([w.scale for w in ws]), zero, first.weight.bits,
                       first.weight.group_size)
    return merged, first.act


def _install(layer: Linear, module_name: str, shards: list[ShardWeight], device: torch.device, dtype: torch.dtype) -> None:
    weight, act = _merge(module_name, shards)
    perm = None
    if any(s.g_idx is not None for s in shards):
        perm = _contiguous_perm(shards, weight.group_size)
        if perm is None:
            log.warning("%s: its merged projections use different activation orders; dequantizing it to a dense "
                        "weight", module_name)
            dense = torch.cat([_dequantize_with_g_idx(s) for s in shards])
            layer.weight.data.copy_(dense.to(device=device, dtype=dtype))
            return
        weight.q = weight.q[:, perm].contiguous()
    weight = _to_device(weight, device)
    # Checks the shape, drops the dense weight, chooses the layer's kernel (the layer computes in `dtype`).
    quantize_linear_(layer, weight, act, input_perm=None if perm is None else perm.to(device))


def _dequantize_with_g_idx(s: ShardWeight) -> torch.Tensor:
    w = s.weight
    g = s.g_idx if s.g_idx is not None else torch.arange(w.q.shape[1]) // w.group_size
    zero = 0.0 if w.zero is None else w.zero.float()[:, g]
    return (w.q.float() - zero) * w.scale.float()[:, g]


def _to_device(weight: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    if isinstance(weight, FP8Weight):
        return FP8Weight(weight.q.to(device), weight.scale.to(device))
    zero = None if weight.zero is None else weight.zero.to(device)
    return IntWeight(weight.q.to(device), weight.scale.to(device), zero, weight.bits, weight.group_size)


def _checkpoint_keys(checkpoint_dir: Path) -> set[str]:
    """Every tensor name, from the validated headers of exactly the checkpoint's files (no data read)."""
    return set(read_checkpoint_header(checkpoint_dir))


@dataclass
class _PendingLinear:
    name: str  # module name, e.g. model.layers.0.self_attn.qkv_proj
    layer: Linear
    expected: set[str]  # checkpoint tensor names still to come
    tensors: dict[str, dict[str, torch.Tensor]]  # projection name (q_proj's full name) -> suffix -> tensor

    def install(self, fmt: QuantFormat, device: torch.device, dtype: torch.dtype) -> None:
        shards = [fmt.read(n, t) for n, t in self.tensors.items()]
        for n, s, shard in zip(self.tensors, shards, self.layer.shards, strict=True):
            check_shape(f"{n} (unpacked)", s.weight.q, (shard.size, self.layer.in_features), fix="by config.json")
        _install(self.layer, self.name, shards, device, dtype)
        self.tensors.clear()


def load_quantized_weights(model: CausalLM, checkpoint_dir: Path, dtype: torch.dtype, qc: dict,
                           fmt: QuantFormat | None = None) -> None:
    """Fill `model` from a quantized checkpoint: quantized projections become quantized Linears.

    `fmt`: the format read from `qc` already (load_model reads it once, to vet the tensors first)."""
    checkpoint_dir = Path(checkpoint_dir)
    where = str(checkpoint_dir / "config.json")
    fmt = fmt or quant_format(qc, where)
    keys = _checkpoint_keys(checkpoint_dir)
    device = model.device
    targets = checkpoint_targets(model)
    pending: dict[str, _PendingLinear] = {}  # quantized-tensor name -> its Linear's pending entry
    for module_name, module in model.named_modules():
        if not isinstance(module, Linear) or (module is model.lm_head and model.config.tie_word_embeddings):
            continue
        prefix = module_name.rpartition(".")[0]
        prefix = f"{prefix}." if prefix else ""
        names = [f"{prefix}{s.name}" for s in module.shards]
        quantized = [fmt.is_quantized(n, keys) for n in names]
        if not any(quantized):
            continue
        if not all(quantized):
            dense = [n for n, q in zip(names, quantized, strict=True) if not q]
            raise ModelError(f"{checkpoint_dir}: {', '.join(dense)} not quantized while "
                             f"{', '.join(n for n, q in zip(names, quantized, strict=True) if q)} are; tokq merges them into one "
                             "layer, so they must all be quantized the same way")
        entry = _PendingLinear(module_name, module, set(), {n: {} for n in names})
        for n in names:
            targets.pop(f"{n}.weight", None)
            for suffix in fmt.suffixes:
                if f"{n}.{suffix}" in keys:
                    entry.expected.add(f"{n}.{suffix}")
                    pending[f"{n}.{suffix}"] = entry
    filled: set[str] = set()
    installed = 0
    head = None
    for name, tensor in iter_tensors(checkpoint_dir):
        if name == "lm_head.weight":
            head = tensor
        entry = pending.get(name)
        if entry is not None:
            shard_name, _, suffix = name.rpartition(".")
            entry.tensors[shard_name][suffix] = tensor
            entry.expected.discard(name)
            if not entry.expected:  # all of this Linear's tensors are in: unpack, merge, install
                entry.install(fmt, device, dtype)
                installed += 1
            continue
        copy_dense_tensor(model, targets, name, tensor, dtype, checkpoint_dir, filled)
    check_all_filled(targets, filled, checkpoint_dir)
    check_tied_copy(model, head, checkpoint_dir)
    if installed == 0 and not (qc.get("kv_cache_scheme") and not qc.get("config_groups")):  # KV-only: expected
        log.warning("%s: quantization_config says %s but no layer has quantized tensors", checkpoint_dir, fmt.method)
