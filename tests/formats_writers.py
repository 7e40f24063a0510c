"""Independent AutoGPTQ- and AutoAWQ-layout checkpoint writers, for tests only.

Written from the formats' documentation with plain torch, sharing no code with tokq, so a test that
writes with these and reads with `tokq.engine.quant_formats` checks both against the documented
layout rather than against each other:

- AutoGPTQ: `qweight` int32 [K*b/32, N]: input row k sits in word k // (32/b) at bit b*(k % (32/b));
  `qzeros` int32 [G, N*b/32] packed the same way along N, holding zero - 1 (checkpoint_format "gptq")
  or the zero itself ("gptq_v2"); `scales` fp16 [G, N]; `g_idx` int32 [K] = group of input column k.
  W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n].
- AutoAWQ GEMM: `qweight` int32 [K, N/8], `qzeros` int32 [G, N/8]: columns packed 8 per word along N,
  word i's nibble p holding column 8*i + [0, 2, 4, 6, 1, 3, 5, 7][p]; `scales` fp16 [G, N];
  zero points stored as is. W[n, k] = (q[k, n] - z[k // gs, n]) * s[k // gs, n].

Each writer quantizes every decoder-layer projection of a tiny HF model (round to nearest on its own
grid), saves the checkpoint, and returns a copy of the HF model whose weights are the dequantized
ones: the reference tokq's logits must match.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

PROJECTION = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
AWQ_NIBBLE_COLUMNS = (0, 2, 4, 6, 1, 3, 5, 7)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit words -> int32 with the same bits."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along_rows(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned [R, C] -> int32 [R*bits/32, C]: row r in word r // (32/bits), bit bits*(r % (32/bits))."""
    per = 32 // bits
    rows, cols = u.shape
    u = u.to(torch.int64).reshape(rows // per, per, cols)
    words = torch.zeros(rows // per, cols, dtype=torch.int64)
    for j in range(per):
        words |= u[:, j, :] << (bits * j)
    return _as_int32(words)


def pack_along_cols(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned [R, C] -> int32 [R, C*bits/32], GPTQ's column packing (qzeros)."""
    return pack_along_rows(u.t().contiguous(), bits).t().contiguous()


def pack_awq(u: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit [R, C] -> int32 [R, C/8] in AWQ's interleaved nibble order."""
    rows, cols = u.shape
    u = u.to(torch.int64).reshape(rows, cols // 8, 8)
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for p, col in enumerate(AWQ_NIBBLE_COLUMNS):
        words |= u[:, :, col] << (4 * p)
    return _as_int32(words)


def _rtn(w: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, sym: bool, min_zero: int):
    """Round to nearest per (row, group): unsigned codes [N, K], zeros [N, G], fp16 scales [N, G]."""
    maxq = 2**bits - 1
    n = w.shape[0]
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            amax = torch.maximum(lo.abs(), hi)
            scales[:, g] = (2 * amax / maxq).clamp_min(1e-6)
            zeros[:, g] = (maxq + 1) // 2
        else:
            scales[:, g] = ((hi - lo) / maxq).clamp_min(1e-6)
            zeros[:, g] = torch.round(-lo / scales[:, g]).clamp(min_zero, maxq).long()
    scales = scales.half()  # the checkpoint's scales are fp16: quantize with exactly those
    s, z = scales.float()[:, g_idx], zeros[:, g_idx]
    q = torch.round(w / s + z).clamp(0, maxq).long()
    return q, zeros, scales


def _dequantized(q, zeros, scales, g_idx):
    return (q - zeros[:, g_idx]).float() * scales.float()[:, g_idx]


def _save(out: Path, hf_model, tensors: dict, quantization_config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = hf_model.config.to_dict()
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _base_tensors(hf_model) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def _input_key(name: str) -> str:
    """Projections that read the same activations (q/k/v, gate/up) share one activation order."""
    m = PROJECTION.match(name)
    shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    return f"{m.group(1)}.{shared.get(m.group(3), m.group(3))}"


def write_gptq_checkpoint(hf_model, out: str | Path, *, bits: int = 4, group_size: int = 32, sym: bool = True,
                          act_order: bool = False, checkpoint_format: str = "gptq", shared_order: bool = True,
                          seed: int = 0):
    """Write `hf_model` as an AutoGPTQ checkpoint; return the HF model with the dequantized weights.

    act_order: each input gets a random column order (g_idx no longer k // group_size); with
    shared_order=False, q/k/v (and gate/up) get different orders, as no real GPTQ run produces.
    """
    gen = torch.Generator().manual_seed(seed)
    reference = copy.deepcopy(hf_model)
    ref_state = reference.state_dict()
    tensors = _base_tensors(hf_model)
    orders: dict[str, torch.Tensor] = {}
    for name, w in hf_model.state_dict().items():
        if not PROJECTION.match(name):
            continue
        w = w.detach().float()
        n, k = w.shape
        gs = k if group_size == -1 else group_size
        groups = k // gs
        if act_order:
            key = _input_key(name) if shared_order else name
            if key not in orders:
                orders[key] = torch.randperm(k, generator=gen)
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[orders[key]] = torch.arange(k) // gs  # the i-th column in GPTQ's order falls in group i // gs
        else:
            g_idx = torch.arange(k) // gs
        # v1 stores zero - 1, so a zero of 0 cannot be written there (AutoGPTQ's overflow); v2 can.
        q, zeros, scales = _rtn(w, g_idx, groups, bits, sym, min_zero=1 if checkpoint_format == "gptq" else 0)
        prefix = name[: -len(".weight")]
        del tensors[name]
        stored_zeros = zeros - 1 if checkpoint_format == "gptq" else zeros
        tensors[f"{prefix}.qweight"] = pack_along_rows(q.t().contiguous(), bits)
        tensors[f"{prefix}.qzeros"] = pack_along_cols(stored_zeros.t().contiguous(), bits)
        tensors[f"{prefix}.scales"] = scales.t().contiguous()
        tensors[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        ref_state[name].copy_(_dequantized(q, zeros, scales, g_idx))
    _save(Path(out), hf_model, tensors, {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": sym,
        "static_groups": False, "true_sequential": True, "damp_percent": 0.01, "checkpoint_format": checkpoint_format,
    })
    return reference


def write_awq_checkpoint(hf_model, out: str | Path, *, group_size: int = 32):
    """Write `hf_model` as an AutoAWQ GEMM checkpoint (4-bit, zero point); return the dequantized HF model."""
    reference = copy.deepcopy(hf_model)
    ref_state = reference.state_dict()
    tensors = _base_tensors(hf_model)
    for name, w in hf_model.state_dict().items():
        if not PROJECTION.match(name):
            continue
        w = w.detach().float()
        n, k = w.shape
        g_idx = torch.arange(k) // group_size
        q, zeros, scales = _rtn(w, g_idx, k // group_size, 4, sym=False, min_zero=0)
        prefix = name[: -len(".weight")]
        del tensors[name]
        tensors[f"{prefix}.qweight"] = pack_awq(q.t().contiguous())  # [K, N/8]
        tensors[f"{prefix}.qzeros"] = pack_awq(zeros.t().contiguous())  # [G, N/8]
        tensors[f"{prefix}.scales"] = scales.t().contiguous()  # [G, N]
        ref_state[name].copy_(_dequantized(q, zeros, scales, g_idx))
    _save(Path(out), hf_model, tensors, {
        "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": None,
    })
    return reference
