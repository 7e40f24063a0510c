"""Quantized linear layers on CPU through native torch ops.

Each path is a `prepare(weight, problem) -> state` run once when a layer is loaded (packing, padding,
casting scales) and a `run(x, state, bias, act) -> y` per call; `supports(problem) -> (ok, reason)`
says whether the op can take that scheme and shape. Measured on an AVX2 CPU (torch 2.13), the
int4/int8 weight-only ops are fast only with bf16 activations (fp32 and fp16 run a scalar path,
10-40x slower), so fp32/fp16 activations are cast to bf16 and the result cast back.

- int4 weight-only: `aten._convert_weight_to_int4pack_for_cpu(codes int32 [N, K] in 0..15,
  innerKTiles)` -> uint8 [N, K/2] and `aten._weight_int4pack_mm_for_cpu(x [M, K], packed,
  group_size, scales_and_zeros [K/group_size, N, 2])`. The op's dequantization (checked against
  torch's tests and by experiment) is W[n, k] = (u[n, k] - 8) * scale[g, n] + zero[g, n], with
  unsigned codes u, scale/zero in the activation dtype, groups of 32, 64, 128 or 256 along K, and N
  a multiple of 16. tokq's W = (q - z) * s with signed q maps exactly onto it: u = q + 8 and
  zero = -z * s (0 when symmetric). Codes of fewer bits (int2/int3) fit the same range.
  The op re-reads and re-dequantizes the packed weight for each few rows of x, so its time grows with
  M; above INT4PACK_MAX_M rows (prefill) the call instead dequantizes the codes to bf16 once and runs a
  dense bf16 GEMM (measured crossover ~40 rows).
- int8 weight-only: `aten._weight_int8pack_mm(x [M, K], q int8 [N, K], scales [N])` = x @ q^T * s,
  per-channel symmetric. With bf16 activations it returns wrong numbers or crashes unless K is a
  multiple of 16 (torch 2.13, AVX2), so such shapes are refused.
- W8A8 int8: per-token dynamic int8 activations (kernels.reference.quantize_per_token_int8, the
  oracle's own quantizer) times per-channel int8 weights with `torch._int_mm` (int32 accumulation;
  on CPU any M and N, and any K but 1, which returns garbage when N > 1), then an fp32 epilogue: acc * s_x * s_w (+ bias). An asymmetric weight's
  zero point is an exact integer correction: acc - sum_k(x_q) * z.
- fp8 (and any other weights with no native op): dequantized once at load into a dense weight of
  the activation dtype, then a plain `F.linear`. Costs dense-weight memory on top of the codes; on
  this CPU that is the fastest way to run fp8 (there is no fp8 matmul for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokq.dtypes import FLOAT_DTYPES

from ..problem import LinearProblem
from ..reference import IntWeight, QuantizedWeight, fake_quantize_activations, quantize_per_token_int8

INT4PACK_GROUPS = (32, 64, 128, 256)
INT4PACK_N_MULTIPLE = 16
INT4PACK_INNER_K_TILES = 2  # ignored by the CPU packing (its layout is fixed), required by the signature
# The int4 op's cost grows linearly with M (it re-dequantizes the weight for every few rows), dense bf16
# GEMM's barely does. Measured on this CPU at 1 thread, gate_up [3072, 576] g64: int4 op 0.69 / 1.40 /
# 2.77 / 11.1 ms at M = 16 / 32 / 64 / 256 against dequantize-once-per-call + bf16 F.linear 1.7-2.2 ms
# flat (the dequantization alone is ~1.2 ms). Above this M (prefill) the call dequantizes instead.
INT4PACK_MAX_M = 32
INT8PACK_K_MULTIPLE = 16
INT_MM_MAX_K = 1 << 16  # |x_q| <= 128, |q| <= 128: K * 2^14 must stay below 2^31 in the int32 accumulator

Support = tuple[bool, str]


def _has_aten(op: str) -> bool:
    return hasattr(torch.ops.aten, op)


def _common(p: LinearProblem, op_name: str, op_present: bool) -> str | None:
    if p.device != "cpu":
        return f"runs on CPU only (the layer is on {p.device})"
    if not op_present:
        return f"this torch build ({torch.__version__}) has no {op_name}"
    if p.dtype not in FLOAT_DTYPES:
        return f"activations of {p.dtype} are not supported (fp32, bf16, fp16)"
    return None


def _cast_note(p: LinearProblem) -> str:
    return "bf16 activations" if p.dtype == torch.bfloat16 else f"{p.dtype} activations cast to bf16 and back"


def _rows(x: torch.Tensor, k: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] as a contiguous [M, K] matrix in `dtype` (no copy when it already is one)."""
    x2 = x.reshape(-1, k)
    return (x2 if dtype is None else x2.to(dtype)).contiguous()


def _finish(y: torch.Tensor, x: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """[M, >=N] -> x's leading dims + [N], in x's dtype, bias added in that dtype."""
    y = y[:, :n].to(x.dtype)
    if bias is not None:
        y = y + bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], n)


# int4 weight-only ------------------------------------------------------------------------------------

@dataclass
class Int4PackState:
    # the op's own layouts, streamed by decode steps (the engine moves them onto huge pages: engine/huge_pages.py)
    packed: torch.Tensor = field(metadata={"streamed": True})  # uint8 [N_pad, K/2]
    scales_and_zeros: torch.Tensor = field(metadata={"streamed": True})  # bf16 [K/group_size, N_pad, 2]
    group_size: int
    n: int
    k: int
    # The layer's own codes/scales (no copy, so not counted as packed bytes): dequantized per call for M > max_m.
    weight: IntWeight = field(repr=False, metadata={"layer_buffers": True})
    max_m: int = INT4PACK_MAX_M


def _weight_only_int(p: LinearProblem, op: str, available: bool) -> str | None:
    """Why a weight-only integer op cannot take this problem (None if the shared checks pass)."""
    why = _common(p, op, available)
    if why:
        return why
    if p.fmt != "int":
        return f"takes integer weights, not {p.fmt}"
    if p.act is not None:
        return f"weight-only: {p.act} activations need a W8A8 kernel"
    return None


def int4pack_supports(p: LinearProblem) -> Support:
    why = _weight_only_int(p, "aten._weight_int4pack_mm_for_cpu",
                           _has_aten("_weight_int4pack_mm_for_cpu") and _has_aten("_convert_weight_to_int4pack_for_cpu"))
    if why:
        return False, why
    if p.bits > 4:
        return False, f"takes codes of at most 4 bits, these have {p.bits}"
    if p.group_size not in INT4PACK_GROUPS:
        kind = f"per-channel scales over K={p.k}" if p.per_channel else f"group size {p.group_size}"
        return False, f"{kind}: aten int4pack takes groups of {', '.join(map(str, INT4PACK_GROUPS))}"
    pad = (-p.n) % INT4PACK_N_MULTIPLE
    return True, _cast_note(p) + (f"; N padded by {pad} to a multiple of {INT4PACK_N_MULTIPLE}" if pad else "")


def prepare_int4pack(weight: IntWeight, p: LinearProblem) -> Int4PackState:
    n, k = weight.q.shape
    pad = (-n) % INT4PACK_N_MULTIPLE
    codes = weight.q.to(torch.int32) + 8  # signed [-8, 7] -> the op's unsigned 0..15
    scale = weight.scale.float()
    zero = torch.zeros_like(scale) if weight.zero is None else -weight.zero.float() * scale
    if pad:  # padded rows: code 8, scale 0, zero 0 -> output 0, sliced off after the matmul
        codes = torch.cat([codes, codes.new_full((pad, k), 8)])
        scale = torch.cat([scale, scale.new_zeros(pad, scale.shape[1])])
        zero = torch.cat([zero, zero.new_zeros(pad, zero.shape[1])])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), INT4PACK_INNER_K_TILES)
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return Int4PackState(packed, scales_and_zeros, weight.group_size, n, k, weight)


def dequantize_bf16(weight: IntWeight) -> torch.Tensor:
    """W = (q - z) * s as bf16 [N, K], computed in fp32 in place (broadcasting ops measured 3-4x slower)."""
    n, k = weight.q.shape
    groups = weight.scale.shape[1]
    w = weight.q.view(n, groups, k // groups).to(torch.float32)
    if weight.zero is not None:
        w.sub_(weight.zero.unsqueeze(-1))
    return w.mul_(weight.scale.unsqueeze(-1)).view(n, k).to(torch.bfloat16)


def run_int4pack(x: torch.Tensor, state: Int4PackState, bias: torch.Tensor | None, act: str | None) -> torch.Tensor:
    rows = _rows(x, state.k, torch.bfloat16)
    if rows.shape[0] > state.max_m:  # prefill: one dequantization, then a dense bf16 GEMM
        y = F.linear(rows, dequantize_bf16(state.weight))
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, state.packed, state.group_size, state.scales_and_zeros)
    return _finish(y, x, state.n, bias)


# int8 weight-only ------------------------------------------------------------------------------------

@dataclass
class Int8PackState:
    q: torch.Tensor  # int8 [N, K]: the layer's own codes (no copy)
    scales: torch.Tensor  # bf16 [N]
    n: int
    k: int


def int8pack_supports(p: LinearProblem) -> Support:
    why = _weight_only_int(p, "aten._weight_int8pack_mm", _has_aten("_weight_int8pack_mm"))
    if why:
        return False, why
    if not p.per_channel:
        return False, f"takes per-channel scales, not groups of {p.group_size}"
    if not p.symmetric:
        return False, "takes symmetric weights (the op has no zero point)"
    if p.k % INT8PACK_K_MULTIPLE:
        return False, (f"K={p.k} is not a multiple of {INT8PACK_K_MULTIPLE} (the op's bf16 path returns wrong "
                       "results or crashes then)")
    return True, _cast_note(p)


def prepare_int8pack(weight: IntWeight, p: LinearProblem) -> Int8PackState:
    n, k = weight.q.shape
    return Int8PackState(weight.q.contiguous(), weight.scale.reshape(n).to(torch.bfloat16).contiguous(), n, k)


def run_int8pack(x: torch.Tensor, state: Int8PackState, bias: torch.Tensor | None, act: str | None) -> torch.Tensor:
    y = torch.ops.aten._weight_int8pack_mm(_rows(x, state.k, torch.bfloat16), state.q, state.scales)
    return _finish(y, x, state.n, bias)


# W8A8 int8 -------------------------------------------------------------------------------------------

@dataclass
class W8A8State:
    q_t: torch.Tensor  # int8 [K, N]: the transposed view of the layer's [N, K] codes
    scale: torch.Tensor  # fp32 [N]
    zero: torch.Tensor | None  # int32 [N] zero points, None when symmetric
    n: int
    k: int


def w8a8_supports(p: LinearProblem) -> Support:
    why = _common(p, "torch._int_mm", hasattr(torch, "_int_mm"))
    if why:
        return False, why
    if p.fmt != "int":
        return False, f"takes integer weights, not {p.fmt}"
    if p.act != "int8":
        return False, "W8A8: needs int8 activations" + ("" if p.act is None else f", not {p.act}")
    if not p.per_channel:
        return False, f"takes per-channel scales, not groups of {p.group_size}"
    if p.k < 2:
        return False, "K=1: torch._int_mm returns wrong results for it (torch 2.13, checked)"
    if p.k > INT_MM_MAX_K:
        return False, f"K={p.k} could overflow the int32 accumulator (at most {INT_MM_MAX_K})"
    return True, "int8 x int8 -> int32, fp32 epilogue"


def prepare_w8a8(weight: IntWeight, p: LinearProblem) -> W8A8State:
    n, k = weight.q.shape
    zero = None if weight.zero is None else weight.zero.reshape(n).to(torch.int32)
    return W8A8State(weight.q.contiguous().t(), weight.scale.reshape(n).float(), zero, n, k)


def run_w8a8(x: torch.Tensor, state: W8A8State, bias: torch.Tensor | None, act: str | None) -> torch.Tensor:
    codes, x_scale = quantize_per_token_int8(_rows(x, state.k))
    acc = torch._int_mm(codes, state.q_t)  # int32 [M, N]
    if state.zero is not None:
        acc = acc - codes.sum(dim=-1, keepdim=True, dtype=torch.int32) * state.zero
    y = acc.float() * x_scale * state.scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], state.n)


# dequantize once (fp8) -------------------------------------------------------------------------------

def dequant_dense_supports(p: LinearProblem) -> Support:
    if p.device != "cpu":
        return False, f"runs on CPU only (the layer is on {p.device})"
    if p.fmt != "fp8":
        return False, "used for fp8 weights only (integer weights have native ops)"
    if p.dtype not in FLOAT_DTYPES:
        return False, f"activations of {p.dtype} are not supported (fp32, bf16, fp16)"
    return True, f"weight dequantized once to a dense {p.dtype} copy (dense memory), F.linear"


def prepare_dequant_dense(weight: QuantizedWeight, p: LinearProblem) -> torch.Tensor:
    return weight.dequantize(torch.float32).to(p.dtype).contiguous()


def run_dequant_dense(x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None, act: str | None) -> torch.Tensor:
    xin = x if act is None else fake_quantize_activations(x, act)
    y = F.linear(xin.to(dense.dtype), dense, None if bias is None else bias.to(dense.dtype))
    return y.to(x.dtype)

