"""The w4a16 Triton kernel and tokq's packed integer layout.

Without a GPU the kernel runs on Triton's CPU interpreter (TRITON_INTERPRET=1, set before the kernel
module is imported) with one fixed small tile (16 x 32 x 32), so tiny shapes still cover several K
tiles, ragged M/N/K edges, the three dequantization paths (group a multiple of BLOCK_K, groups
gathered per row, per-channel) and split-K. The interpreter gets bf16 tl.dot wrong, so bf16 and the
timed autotuning are GPU-only tests; the autotuned launch's plumbing runs here with one candidate, and
the kernels are compiled for sm_90 (Hopper) by Triton's own compiler and ptxas, which need no GPU.

Errors are relative, ‖out − ref‖ / ‖ref‖, against `linear_reference` (fp32) and reported in every
assertion; `pytest -s` prints them. fp16 differs from the oracle by fp16 scales, the fp16 cast of
each dequantized weight and the fp16 output (each about 2^-11 relative).

The layout round trips read AutoAWQ, AutoGPTQ (v1, v2, with and without a shuffled act-order g_idx)
and compressed-tensors pack-quantized tensors written by independent packers with the engine's
readers, pack them to tokq's layout and check the dequantized weight bit for bit against the one
computed from the original codes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is decorated

pytest.importorskip("triton")

from tests.formats_writers import pack_along_cols, pack_along_rows, pack_awq  # noqa: E402
from tokq.engine.quant_formats.awq import awq_weight  # noqa: E402
from tokq.engine.quant_formats.base import ShardWeight  # noqa: E402
from tokq.engine.quant_formats.compressed_tensors import compressed_tensors_weight  # noqa: E402
from tokq.engine.quant_formats.gptq import gptq_weight  # noqa: E402
from tokq.engine.quant_formats.loader import _contiguous_perm  # noqa: E402
from tokq.kernels.problem import LinearProblem  # noqa: E402
from tokq.kernels.reference import IntWeight, linear_reference  # noqa: E402
from tokq.kernels.triton import interpreting  # noqa: E402
from tokq.kernels.triton import w4a16 as w4a16_module  # noqa: E402
from tokq.kernels.triton.w4a16 import (  # noqa: E402
    DECODE_M,
    LARGE_BUCKET,
    MEDIUM_M,
    TileConfig,
    _candidates,
    m_bucket,
    prepare_w4a16,
    run_w4a16,
    w4a16_matmul,
    w4a16_supports,
)
from tokq.kernels.triton.w4a16_layout import (  # noqa: E402
    PackedIntWeight,
    dequantize,
    pack_int_weight,
    unpack_int_weight,
)
from tokq.quantization.formats.compressed_tensors import compress_weight  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (bf16 tl.dot is wrong under the Triton interpreter, "
                              "and autotuning times real launches)")

# The small tests' tile (the interpreter's own): BLOCK_K 32 makes groups of 32/64/128 one-row-per-tile,
# groups of 16/20/24 gathered per row, and K of 48..128 span several tiles. Fixed on GPUs too, so the
# same paths run there without autotuning tiny shapes.
SMALL = TileConfig(16, 32, 32, split_k=1, group_m=1, num_warps=4, num_stages=2)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def int_weight(n: int, k: int, bits: int, group_size: int, sym: bool, seed: int = 0) -> IntWeight:
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, k // group_size, generator=g) + 0.5) * 0.02
    zero = None if sym else torch.randint(lo, hi + 1, (n, k // group_size), generator=g, dtype=torch.int8)
    return IntWeight(q, scale, zero, bits, group_size)


def on_device(w: IntWeight) -> IntWeight:
    zero = None if w.zero is None else w.zero.to(DEVICE)
    return IntWeight(w.q.to(DEVICE), w.scale.to(DEVICE), zero, w.bits, w.group_size)


def inputs(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 1, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    b = (0.1 * torch.randn(n, generator=g)).to(dtype).to(DEVICE) if bias else None
    return x, b


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def check(x: torch.Tensor, w: IntWeight, bias: torch.Tensor | None, what: str, **launch) -> float:
    """Pack w for x's dtype, run w4a16_matmul, compare with the fp32 oracle on the same x."""
    packed = pack_int_weight(w, x.dtype)
    out = w4a16_matmul(x, packed, bias, **launch)
    assert out.dtype == x.dtype and out.shape == (x.shape[0], w.q.shape[0]), f"{what}: {out.dtype} {tuple(out.shape)}"
    ref = linear_reference(x.float(), w, None if bias is None else bias.float())
    err = rel(out, ref)
    print(f"w4a16 {what} {NAME[x.dtype]}: relative error {err:.2e}")
    assert err < TOL[x.dtype], f"w4a16 {what} {NAME[x.dtype]}: relative error {err:.2e} > {TOL[x.dtype]:.0e}"
    return err


# --------------------------------------------------------------------------------------------------
# The kernel against the reference (interpreter tile: BLOCK_M 16, BLOCK_N 32, BLOCK_K 32)

CASES = [
    # m, n, k, bits, group, sym, bias, split_k
    (1, 40, 128, 4, 32, True, False, 1),  # groups == BLOCK_K
    (3, 40, 128, 4, 64, False, True, 1),  # groups a multiple of BLOCK_K
    (17, 40, 128, 4, 64, False, False, 2),  # two M tiles, split-K
    (3, 40, 96, 4, 32, False, True, 4),  # 3 K tiles over 4 splits: one split has none
    (3, 40, 72, 4, 24, False, True, 1),  # groups gathered per row (24 is not a multiple of 32)
    (17, 40, 72, 4, 24, True, False, 3),
    (1, 40, 60, 4, 20, False, False, 1),  # K not a multiple of the pack (8): padded codes
    (3, 40, 48, 4, 16, True, True, 2),  # groups smaller than BLOCK_K
    (3, 40, 76, 4, 76, False, True, 1),  # per-channel, K padded in the last word
    (1, 40, 128, 4, 128, True, False, 2),  # per-channel, split-K
    (3, 40, 128, 8, 32, True, True, 1),  # 8-bit fields (4 per word)
    (17, 40, 96, 8, 96, False, False, 2),  # 8-bit per-channel
    (3, 40, 72, 8, 24, False, True, 3),  # 8-bit, gathered groups
    (3, 40, 64, 3, 32, False, False, 1),  # int3 codes in 4-bit fields
    (1, 24, 64, 2, 16, True, True, 1),  # int2 codes, N smaller than BLOCK_N
    (5, 33, 80, 6, 40, False, True, 2),  # int6 codes in 8-bit fields
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m,n,k,bits,group,sym,bias,split_k", CASES)
def test_matches_reference(m, n, k, bits, group, sym, bias, split_k, dtype):
    w = on_device(int_weight(n, k, bits, group, sym, seed=m + k + bits))
    x, b = inputs(m, k, n, dtype, seed=m + n, bias=bias)
    check(x, w, b, f"M={m} N={n} K={k} int{bits} g{group} {'sym' if sym else 'asym'} split{split_k}", config=SMALL,
          split_k=split_k)


@pytest.mark.parametrize("split_k", [1, 2])
def test_split_k_is_deterministic_and_close_to_unsplit(split_k):
    w = on_device(int_weight(40, 128, 4, 32, False, seed=3))
    x, b = inputs(4, 128, 40, torch.float32, bias=True)
    packed = pack_int_weight(w, torch.float32)
    first = w4a16_matmul(x, packed, b, split_k=split_k, config=SMALL)
    assert torch.equal(first, w4a16_matmul(x, packed, b, split_k=split_k, config=SMALL)), "different bits"
    unsplit = w4a16_matmul(x, packed, b, split_k=1, config=SMALL)
    assert rel(first, unsplit) < 1e-6


def test_non_contiguous_x_and_explicit_config():
    w = on_device(int_weight(40, 64, 4, 32, False, seed=5))
    x_wide, b = inputs(3, 128, 40, torch.float16, bias=True)
    x = x_wide[:, ::2]  # stride 2 along K
    check(x, w, b, "strided x", config=SMALL)
    check(x.contiguous(), w, b, "explicit 16x16x16 tile", config=TileConfig(16, 16, 16, split_k=2, group_m=1))


def test_autotuned_launch_plumbing(monkeypatch):
    """The autotuned path (grid from the chosen tile, the split-K it chose, the reduction) with one candidate:
    Triton's autotuner runs a single config without timing it, so this runs under the interpreter too."""
    monkeypatch.setitem(w4a16_module.TUNE_CONFIGS, DECODE_M, [TileConfig(16, 32, 32, split_k=2, group_m=1)])
    monkeypatch.setattr(w4a16_module, "interpreting", lambda: False)  # take the autotuned path ...
    monkeypatch.setattr(w4a16_module, "autotune_enabled", lambda: True)
    monkeypatch.setattr(w4a16_module, "_can_launch_on", lambda device: True)  # ... with the interpreter's tensors
    w4a16_module._tuner.cache_clear()
    try:
        w = on_device(int_weight(40, 64, 4, 32, False, seed=9))
        x, b = inputs(3, 64, 40, torch.float32, bias=True)
        check(x, w, b, "autotuned path, one candidate, split-K 2")
        assert w4a16_module._tuner(DECODE_M, 32, None).best_config.kwargs["SPLIT_K"] == 2
    finally:
        w4a16_module._tuner.cache_clear()


def test_run_w4a16_leading_dims_and_empty_batch():
    w = on_device(int_weight(40, 64, 4, 32, False, seed=2))
    p = LinearProblem.of(w, None, torch.float16, "cuda")
    state = prepare_w4a16(w, p)
    assert isinstance(state, PackedIntWeight) and state.scales.dtype == torch.float16
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0)).half().to(DEVICE)
    y = run_w4a16(x, state, None, None)
    assert y.shape == (2, 3, 40) and y.dtype == torch.float16
    assert torch.equal(y, run_w4a16(x.reshape(6, 64), state, None, None).reshape(2, 3, 40))
    assert run_w4a16(x[:0].reshape(0, 64), state, None, None).shape == (0, 40)


def test_runs_a_weight_read_from_an_awq_checkpoint():
    n, k, group = 40, 64, 32
    q, zeros, scales = _codes(n, k, group, 4, seed=11)
    shard = awq_weight({"qweight": pack_awq(q.t().contiguous()), "qzeros": pack_awq(zeros.t().contiguous()),
                        "scales": scales.t().contiguous()}, 4)
    x, b = inputs(3, k, n, torch.float16, bias=True)
    check(x, on_device(shard.weight), b, "AWQ checkpoint weight", config=SMALL)


# --------------------------------------------------------------------------------------------------
# Errors and supports


def test_clear_errors_for_inputs_it_cannot_take():
    w = on_device(int_weight(40, 64, 4, 32, True))
    state = pack_int_weight(w, torch.float32)
    x, _ = inputs(3, 64, 40, torch.float32)
    with pytest.raises(ValueError, match=r"\[\.\.\., K=64\]"):
        run_w4a16(x[:, :48], state, None, None)
    with pytest.raises(ValueError, match=r"\[M, K=64\]"):
        w4a16_matmul(x.reshape(3, 1, 64), state)
    with pytest.raises(ValueError, match="weight-only: int8 activations"):
        run_w4a16(x, state, None, "int8")
    with pytest.raises(ValueError, match=r"bias has shape \(39,\); expected \[N=40\]"):
        w4a16_matmul(x, state, torch.zeros(39, device=DEVICE))
    with pytest.raises(ValueError, match="float16, bfloat16 or float32 activations"):
        w4a16_matmul(x.double(), state)
    with pytest.raises(ValueError, match="powers of two >= 16"):
        w4a16_matmul(x, state, config=TileConfig(16, 24, 32))
    with pytest.raises(ValueError, match="split_k=0"):
        w4a16_matmul(x, state, split_k=0)
    with pytest.raises(ValueError, match="PackedIntWeight"):
        w4a16_matmul(x, w)


def test_layout_refuses_what_it_cannot_pack():
    w = int_weight(8, 64, 4, 32, False)
    with pytest.raises(ValueError, match="group size 24 does not divide K=64"):
        pack_int_weight(IntWeight(w.q, w.scale, w.zero, 4, 24), torch.float16)
    with pytest.raises(ValueError, match="outside the signed 3-bit range"):
        pack_int_weight(IntWeight(w.q, w.scale, w.zero, 3, 32), torch.float16)
    with pytest.raises(ValueError, match="overflow torch.float16"):
        pack_int_weight(IntWeight(w.q, w.scale * 1e7, w.zero, 4, 32), torch.float16)
    with pytest.raises(ValueError, match="scales of torch.int8"):
        pack_int_weight(w, torch.int8)
    with pytest.raises(ValueError, match="1 to 8 bits"):
        pack_int_weight(IntWeight(w.q.to(torch.int8), w.scale, None, 9, 32), torch.float32)


def _problem(**changes) -> LinearProblem:
    base = dict(device="cuda", fmt="int", bits=4, group_size=64, symmetric=False, act=None, n=40, k=128,
                dtype=torch.float16)
    return LinearProblem(**{**base, **changes})


@pytest.mark.parametrize("changes,expected", [
    ({}, "4-bit fields, groups of 64, fp16 activations"),
    ({"bits": 8, "group_size": 128, "dtype": torch.bfloat16}, "8-bit fields, per-channel scales over K=128"),
    ({"bits": 3, "dtype": torch.float32}, "4-bit fields, groups of 64, fp32"),
])
def test_supports_says_yes(changes, expected):
    ok, reason = w4a16_supports(_problem(**changes))
    assert ok and expected in reason, reason


@pytest.mark.parametrize("changes,expected", [
    ({"device": "cpu"}, "run on CUDA GPUs (the layer is on cpu)"),
    ({"fmt": "fp8", "bits": 8, "group_size": 128}, "takes integer weights, not fp8"),
    ({"act": "int8", "bits": 8, "group_size": 128}, "weight-only: int8 activations need a W8A8 kernel"),
    ({"group_size": 48}, "group size 48 does not divide K=128"),
    ({"bits": 16}, "1 to 8 bits"),
    ({"dtype": torch.float64}, "activations of torch.float64 are not supported"),
])
def test_supports_says_why_not(changes, expected):
    ok, reason = w4a16_supports(_problem(**changes))
    assert not ok and expected in reason, reason


def test_autotune_candidates_per_bucket():
    assert [m_bucket(m) for m in (1, 16, 17, 128, 129, 8192)] == [DECODE_M] * 2 + [MEDIUM_M] * 2 + [LARGE_BUCKET] * 2
    assert {c.block_k for c in _candidates(DECODE_M, 32, None)} == {32}  # tiles inside one group of 32
    assert {c.split_k for c in _candidates(DECODE_M, 128, None)} == {1, 2, 4, 8}
    assert {c.split_k for c in _candidates(MEDIUM_M, 128, None)} == {1}
    assert {c.split_k for c in _candidates(LARGE_BUCKET, 0, 3)} == {3}
    assert len(_candidates(MEDIUM_M, 24, None)) > 1  # no tile fits groups of 24: all are tried (gathered groups)


# --------------------------------------------------------------------------------------------------
# The packed layout


@pytest.mark.parametrize("bits,k,group,sym", [(4, 64, 32, False), (4, 60, 20, True), (3, 72, 24, False),
                                              (2, 16, 16, False), (8, 76, 76, False), (8, 40, 8, True),
                                              (5, 36, 12, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_pack_round_trip_and_bit_positions(bits, k, group, sym, dtype):
    w = int_weight(24, k, bits, group, sym, seed=k)
    w.scale = w.scale.to(dtype).float()  # representable in the packed dtype, so the round trip is exact
    p = pack_int_weight(w, dtype)
    field = 4 if bits <= 4 else 8
    pack = 32 // field
    assert p.bits == field and p.code_bits == bits and p.qweight.dtype == torch.int32
    assert p.qweight.shape == (-(-k // pack), 24) and p.scales.shape == (k // group, 24) and p.scales.dtype == dtype
    # The documented bit positions: row k of column n at bits field*(k % pack) of word [k // pack, n].
    words = p.qweight.to(torch.int64) & 0xFFFFFFFF
    rows = torch.arange(-(-k // pack) * pack)
    fields = (words[rows // pack] >> (field * (rows % pack)).unsqueeze(1)) & ((1 << field) - 1)  # [K_pad, N]
    offset = 1 << (field - 1)
    assert torch.equal(fields[:k], w.q.t().to(torch.int64) + offset)
    assert (fields[k:] == offset).all(), "padding rows must hold the code of 0"
    if sym:
        assert p.zeros is None
    else:
        assert torch.equal(p.zeros.float(), (w.zero.float() + offset).t())
    back = unpack_int_weight(p)
    assert torch.equal(back.q, w.q) and torch.equal(back.scale, w.scale) and back.bits == bits
    assert back.group_size == group and (back.zero is None if sym else torch.equal(back.zero, w.zero))
    assert torch.equal(dequantize(p), w.dequantize())


def _codes(n: int, k: int, group: int, bits: int, seed: int, min_zero: int = 0):
    """Unsigned codes [N, K], unsigned zero points [N, G] and fp16 scales [N, G], as checkpoints hold them."""
    g = torch.Generator().manual_seed(seed)
    maxq = (1 << bits) - 1
    q = torch.randint(0, maxq + 1, (n, k), generator=g)
    zeros = torch.randint(min_zero, maxq + 1, (n, k // group), generator=g)
    scales = ((torch.rand(n, k // group, generator=g) + 0.5) * 0.01).half()
    return q, zeros, scales


def _direct(q, zeros, scales, g_idx) -> torch.Tensor:
    """The dequantized weight straight from the checkpoint's codes: (q - z[g(k)]) * s[g(k)] in fp32."""
    return (q - zeros[:, g_idx]).float() * scales.float()[:, g_idx]


def _packed_dequant_matches(shard: ShardWeight, expected: torch.Tensor, what: str) -> None:
    """Pack the engine's IntWeight (its act-order permutation applied, as the engine's loader does) and compare."""
    weight = shard.weight
    if shard.g_idx is not None:
        perm = _contiguous_perm([shard], weight.group_size)
        assert perm is not None, what
        weight = IntWeight(weight.q[:, perm].contiguous(), weight.scale, weight.zero, weight.bits, weight.group_size)
        expected = expected[:, perm]
    for dtype in (torch.float16, torch.float32):  # checkpoint scales are fp16: both are exact
        p = pack_int_weight(weight, dtype)
        got = dequantize(p)
        assert torch.equal(got, expected), f"{what} packed with {dtype}: max |diff| {(got - expected).abs().max():.3g}"
        back = unpack_int_weight(p)
        assert torch.equal(back.q, weight.q) and torch.equal(back.scale, weight.scale), what


def test_awq_repacks_exactly():
    n, k, group = 40, 96, 32
    q, zeros, scales = _codes(n, k, group, 4, seed=1)
    tensors = {"qweight": pack_awq(q.t().contiguous()), "qzeros": pack_awq(zeros.t().contiguous()),
               "scales": scales.t().contiguous()}
    _packed_dequant_matches(awq_weight(tensors, 4), _direct(q, zeros, scales, torch.arange(k) // group), "AWQ")


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("bits", [4, 8, 2])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_repacks_exactly(version, bits, act_order):
    n, k, group = 32, 128, 32
    # v1 stores zero - 1, so zero points start at 1 there (as AutoGPTQ writes them).
    q, zeros, scales = _codes(n, k, group, bits, seed=bits + version, min_zero=1 if version == 1 else 0)
    g_idx = torch.arange(k) // group
    if act_order:  # the i-th column in GPTQ's order falls in group i // group
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(bits))] = torch.arange(k) // group
    stored_zeros = zeros - 1 if version == 1 else zeros
    tensors = {"qweight": pack_along_rows(q.t().contiguous(), bits),
               "qzeros": pack_along_cols(stored_zeros.t().contiguous(), bits),
               "scales": scales.t().contiguous(), "g_idx": g_idx.to(torch.int32)}
    shard = gptq_weight(tensors, bits, version)
    assert (shard.g_idx is not None) == act_order
    _packed_dequant_matches(shard, _direct(q, zeros, scales, g_idx), f"GPTQ v{version} int{bits} act_order={act_order}")


@pytest.mark.parametrize("bits,group,sym,act_order", [(4, 32, False, False), (4, 48, True, False), (8, 96, False, False),
                                                      (8, 32, True, False), (4, 32, False, True), (2, 16, False, False)])
def test_compressed_tensors_repacks_exactly(bits, group, sym, act_order):
    n, k = 24, 96
    w = int_weight(n, k, bits, group, sym, seed=bits + group)
    tensors = compress_weight(w, "pack-quantized", torch.float16)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = torch.randperm(k, generator=torch.Generator().manual_seed(1)) // group
        tensors["weight_g_idx"] = g_idx.to(torch.int32)
    args = {"num_bits": bits, "type": "int", "symmetric": sym,
            "strategy": "channel" if group == k else "group", "group_size": None if group == k else group}
    shard = compressed_tensors_weight(tensors, args)
    zero = torch.zeros(n, k // group, dtype=torch.int64) if sym else w.zero.long()
    expected = _direct(w.q.long(), zero, w.scale.half(), g_idx)  # CT scales were written as fp16
    _packed_dequant_matches(shard, expected, f"compressed-tensors int{bits} g{group} sym={sym} act_order={act_order}")


# --------------------------------------------------------------------------------------------------
# Compiling for Hopper (sm_90) without a GPU: Triton's NVIDIA backend and its bundled ptxas build the
# cubin on the CPU, so kernel code that the interpreter accepts but the compiler would not (layouts,
# reshape, dot operand types) fails here, on every machine. It runs in a subprocess: in this process
# TRITON_INTERPRET=1 has already turned Triton's own library functions into interpreted ones.

SM90_SCRIPT = r"""
import inspect, json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from tokq.kernels.triton import w4a16

def build(kernel, xdt, constexprs, num_warps=4, num_stages=3):
    pointers = {"qw_ptr": "*i32", "part_ptr": "*fp32"}
    signature = {name: "constexpr" if name in constexprs else
                 (pointers.get(name, "*" + xdt) if name.endswith("_ptr") else "i32")
                 for name in inspect.signature(kernel.fn).parameters}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages}).asm["ptx"]

out = []
for xdt, bits, group, zeros, tile in json.loads(sys.argv[1]):
    tile = w4a16.TileConfig(**tile)
    flags = {"BITS": bits, "GROUP_SIZE": group, "HAS_ZEROS": zeros, "HAS_BIAS": True,
             "DOT_PRECISION": "ieee" if xdt == "fp32" else "tf32", **tile.meta()}
    ptx = build(w4a16._w4a16_kernel, xdt, flags, tile.num_warps, tile.num_stages)
    reduce = build(w4a16._splitk_reduce_kernel, xdt, {"SPLIT_K": 4, "HAS_BIAS": True, "BLOCK": 1024})
    out.append({"mma": "mma" in ptx, "reduce": "ld.global" in reduce})
print(json.dumps(out))
"""

SM90_VARIANTS = [  # x dtype, field width (the BITS constexpr), group (0: per-channel), zeros, tile
    ("fp16", 4, 128, True, TileConfig(16, 64, 128, split_k=4, group_m=1)),  # decode, one scale row per tile
    ("fp16", 4, 16, True, TileConfig(16, 32, 32, split_k=2, group_m=1)),  # groups gathered per row
    ("bf16", 4, 24, False, TileConfig(64, 128, 32)),  # gathered, symmetric, a wgmma-sized tile
    ("fp16", 8, 0, True, TileConfig(128, 128, 64, num_warps=8)),  # 8-bit per-channel, zero points
    ("fp32", 4, 64, False, TileConfig(32, 64, 32, split_k=2)),  # ieee fp32 dot, symmetric
]


def test_compiles_for_sm90(tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    variants = [(xdt, bits, group, zeros, dataclasses.asdict(tile)) for xdt, bits, group, zeros, tile in SM90_VARIANTS]
    run = subprocess.run([sys.executable, "-c", SM90_SCRIPT, json.dumps(variants)], env=env, capture_output=True,
                         text=True, timeout=300)
    if run.returncode and "ptxas" in run.stderr and "FileNotFoundError" in run.stderr:
        pytest.skip("this Triton build has no bundled ptxas to compile for sm_90")
    assert run.returncode == 0, f"compiling for sm_90 failed:\n{run.stderr[-3000:]}"
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for (xdt, bits, group, _, tile), r in zip(SM90_VARIANTS, results, strict=True):
        assert r["reduce"], "the split-K reduction compiled to no global loads"
        assert r["mma"] or xdt == "fp32", f"{xdt} int{bits} g{group} {tile}: no tensor-core instruction in the PTX"


# --------------------------------------------------------------------------------------------------
# GPU only: bf16, the autotuned launches, real layer shapes


@gpu_only
@pytest.mark.parametrize("m,n,k,bits,group,sym,bias,split_k", CASES[:8])
def test_bf16_matches_reference(m, n, k, bits, group, sym, bias, split_k):
    w = on_device(int_weight(n, k, bits, group, sym, seed=m + k))
    x, b = inputs(m, k, n, torch.bfloat16, bias=bias)
    check(x, w, b, f"M={m} N={n} K={k} int{bits} g{group}", config=SMALL, split_k=split_k)


@gpu_only
@pytest.mark.parametrize("m,dtype", [(1, torch.float16), (64, torch.float16), (300, torch.float16),
                                     (1, torch.bfloat16), (16, torch.float32)], ids=lambda v: str(v))
def test_autotuned_launch(m, dtype, monkeypatch):
    """The autotuned path (one autotuning run per case: compiles each candidate tile once)."""
    monkeypatch.setenv("TOKQ_TRITON_AUTOTUNE", "1")  # test_paged_attention turns it off for its own tests
    assert not interpreting()
    w = on_device(int_weight(576, 576, 4, 64, False, seed=m))
    x, b = inputs(m, 576, 576, dtype, seed=m, bias=True)
    check(x, w, b, f"autotuned M={m} N=576 K=576 int4 g64")


@gpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("n,k,bits,group,sym", [(1536, 640, 4, 128, True), (640, 2048, 8, 2048, True),
                                                (960, 576, 4, 576, False), (576, 1536, 4, 64, False)])
def test_real_layer_shapes_fixed_tiles(n, k, bits, group, sym, dtype):
    w = on_device(int_weight(n, k, bits, group, sym, seed=n))
    for m, config in ((1, TileConfig(16, 64, 128, split_k=4, group_m=1)), (200, TileConfig(64, 128, 64))):
        x, b = inputs(m, k, n, dtype, seed=m, bias=True)
        check(x, w, b, f"M={m} N={n} K={k} int{bits} g{group} {config}", config=config)


def test_autotune_switch(monkeypatch):
    """TOKQ_TRITON_AUTOTUNE=0 (and the interpreter) give every kernel one fixed tile config."""
    import tokq.kernels.triton as triton_package

    monkeypatch.setattr(triton_package, "interpreting", lambda: False)
    monkeypatch.setenv(triton_package.AUTOTUNE_ENV, "1")
    assert triton_package.autotune_enabled()
    monkeypatch.setenv(triton_package.AUTOTUNE_ENV, "0")
    assert not triton_package.autotune_enabled()
    monkeypatch.setattr(triton_package, "interpreting", lambda: True)
    monkeypatch.setenv(triton_package.AUTOTUNE_ENV, "1")
    assert not triton_package.autotune_enabled()
