"""Paged attention: the reference against dense causal attention (the contract), the CPU path and the
Triton kernels against the reference on random paged layouts, the KV writers, and input validation.

Errors are relative, ‖out − ref‖ / ‖ref‖, reported in every assertion. Kernels and reference read the
same cache (the same int8 codes for quantized KV) and the same q, so tolerances cover only the
kernels' own rounding: summation order in fp32, fp16 probabilities/outputs in fp16. Without CUDA the
Triton kernels run on the interpreter (tiny shapes); bf16 and fp8 run on a GPU only (the interpreter
gets bf16 `tl.dot` and fp32 -> fp8/bf16 casts wrong).
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any Triton kernel is decorated
os.environ.setdefault("TOKQ_TRITON_AUTOTUNE", "0")  # GPU: one fixed tile config (no tuning time); one test tunes

from tokq.engine.attention import AttentionSpec, DenseCausalAttention
from tokq.kernels import registry
from tokq.kernels.attention import AttentionProblem
from tokq.kernels.cpu import native
from tokq.kernels.cpu.attention import paged_attention_cpu, write_kv_cpu
from tokq.kernels.cpu.native_attention import paged_attention_native, write_kv_native
from tokq.kernels.paged import (
    PagedAttentionMetadata,
    kv_scales,
    paged_attention_reference,
    random_paged_layout,
    write_kv_reference,
)

triton = pytest.importorskip("triton")
import tokq.kernels.triton.paged_attention as pa  # noqa: E402
from tokq.kernels.triton.paged_attention import (  # noqa: E402
    decode_splits,
    paged_attention_triton,
    paged_decode_triton,
    write_kv_triton,
)

GPU = torch.cuda.is_available()
TRITON_DEVICE = "cuda" if GPU else "cpu"
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (the Triton interpreter gets bf16 dot / fp8 casts wrong)")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "int8",
        torch.float8_e4m3fn: "fp8", None: "same"}


def on(t: torch.Tensor | None, device: str) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@dataclass(frozen=True)
class Case:
    seq_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    heads: int = 6
    kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    window: int | None = None
    dtype: torch.dtype = torch.float32
    kv_dtype: torch.dtype | None = None  # None: q's dtype

    def __str__(self) -> str:
        return (f"seqs={self.seq_lens} q={self.query_lens} H={self.heads}/{self.kv_heads} D={self.head_dim} "
                f"bs={self.block_size} win={self.window} {NAME[self.dtype]} kv={NAME[self.kv_dtype]}")


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: PagedAttentionMetadata
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    scale: float
    window: int | None

    def run(self, fn, **kwargs) -> torch.Tensor:
        return fn(self.q, self.k_cache, self.v_cache, self.meta, self.scale, self.window, self.k_scale, self.v_scale,
                  **kwargs)


def make_batch(case: Case, seed: int = 0, device: str = "cpu") -> Batch:
    """Random K/V for every position of every sequence, written through the reference writer into a
    shuffled paged cache; random queries for the last query_lens tokens."""
    g = torch.Generator().manual_seed(seed)
    layout = random_paged_layout(case.seq_lens, case.query_lens, case.block_size, seed=seed)
    kv_dtype = case.kv_dtype or case.dtype
    total = sum(case.seq_lens)
    k = torch.randn(total, case.kv_heads, case.head_dim, generator=g).to(case.dtype)
    v = torch.randn(total, case.kv_heads, case.head_dim, generator=g).to(case.dtype)
    k_cache = torch.zeros(layout.num_blocks, case.block_size, case.kv_heads, case.head_dim, dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    quantized = kv_dtype in (torch.int8, torch.float8_e4m3fn)
    k_scale = kv_scales(k, kv_dtype) if quantized else None
    v_scale = kv_scales(v, kv_dtype) if quantized else None
    write_kv_reference(k, v, k_cache, v_cache, torch.cat(layout.seq_slots), k_scale, v_scale)
    q = (2 * torch.randn(sum(case.query_lens), case.heads, case.head_dim, generator=g)).to(case.dtype)
    return Batch(q.to(device), k_cache.to(device), v_cache.to(device), layout.meta.to(device), on(k_scale, device),
                 on(v_scale, device), case.head_dim ** -0.5, case.window)


def check_against_reference(fn, case: Case, device: str = "cpu", seed: int = 0, **kwargs) -> float:
    batch = make_batch(case, seed, device)
    ref = batch.run(paged_attention_reference)
    out = batch.run(fn, **kwargs)
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    err = rel_err(out, ref)
    assert err < TOL[case.dtype], f"{fn.__name__} {case} {kwargs}: relative error {err:.2e} > {TOL[case.dtype]:.0e}"
    return err


# --------------------------------------------------------------------------------------------------
# The contract: the reference equals dense causal attention on contiguous q/k/v


@pytest.mark.parametrize("window", [None, 6, 100])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (4, 1)])
def test_reference_matches_dense_causal_attention(window, heads, kv_heads):
    """Full prefill and a later chunk (queries = the last tokens) both equal the dense oracle's rows."""
    g = torch.Generator().manual_seed(3)
    lens, dim, block = (23, 23), 32, 8
    q = torch.randn(len(lens), lens[0], heads, dim, generator=g)
    k = torch.randn(len(lens), lens[0], kv_heads, dim, generator=g)
    v = torch.randn(len(lens), lens[0], kv_heads, dim, generator=g)
    spec = AttentionSpec(0, dim ** -0.5, window)
    dense = DenseCausalAttention().attend(q, k, v, spec)
    for query_lens in ((23, 23), (5, 1)):
        layout = random_paged_layout(lens, query_lens, block, seed=1)
        k_cache = torch.zeros(layout.num_blocks, block, kv_heads, dim)
        v_cache = torch.zeros_like(k_cache)
        write_kv_reference(k.flatten(0, 1), v.flatten(0, 1), k_cache, v_cache, torch.cat(layout.seq_slots))
        queries = torch.cat([q[b, lens[b] - n:] for b, n in enumerate(query_lens)])
        expected = torch.cat([dense[b, lens[b] - n:] for b, n in enumerate(query_lens)])
        out = paged_attention_reference(queries, k_cache, v_cache, layout.meta, spec.scale, window)
        err = rel_err(out, expected)
        assert err < 1e-5, f"reference vs dense, window={window} H={heads}/{kv_heads} q={query_lens}: {err:.2e}"


# --------------------------------------------------------------------------------------------------
# Attention paths against the reference

DECODE = (70, 33, 16, 5, 1)  # mixed lengths, some not multiples of the block size, one of exactly one block
CASES = [
    Case(DECODE, (1,) * 5),
    Case(DECODE, (1,) * 5, window=9),
    Case((37, 20, 9), (13, 20, 1)),  # chunk starting mid-block after a prefix; a whole prompt; a decode row
    Case((37, 20, 9), (13, 20, 1), window=7),
    Case((37, 6), (0, 6)),  # an idle sequence (q_len 0) in the batch
    Case((37, 20, 9), (13, 20, 1), window=1),  # each query sees only itself
    Case((37, 20, 9), (1, 1, 1), window=1, block_size=32),
    Case((40, 3), (1, 1), heads=4, kv_heads=1, head_dim=256, window=24),  # Gemma-3 shaped
    Case((21, 19), (8, 19), heads=4, kv_heads=1, head_dim=256),
    Case((29, 17), (1, 1), heads=9, kv_heads=3, head_dim=64),  # SmolLM2 shaped (group of 3)
    Case((29, 17), (11, 2), heads=9, kv_heads=3, head_dim=80),  # head dim padded to 128
    Case(DECODE, (1,) * 5, dtype=torch.float16),
    Case((37, 20, 9), (13, 20, 1), window=7, dtype=torch.float16),
    Case(DECODE, (1,) * 5, kv_dtype=torch.int8, window=30),
    Case((37, 20), (13, 3), kv_dtype=torch.int8, dtype=torch.float16),
]




def random_case(seed: int) -> Case:
    """A random small batch: decode or mixed chunks (q_len 0 allowed), block sizes 8/16/32, windows
    down to 1, GQA groups 1-4, head dims 64-256 incl. non-powers of two, fp32/fp16, float or int8 KV."""
    r = random.Random(seed)
    n = r.randint(1, 4)
    seq_lens = [r.randint(1, 70) for _ in range(n)]
    query_lens = [1] * n if r.random() < 0.5 else [r.randint(0, s) for s in seq_lens]
    query_lens[0] = max(query_lens[0], 1)
    heads, kv_heads = r.choice([(6, 2), (4, 1), (9, 3), (2, 2)])
    return Case(tuple(seq_lens), tuple(query_lens), heads, kv_heads, r.choice([64, 96, 128, 192, 256]),
                r.choice([8, 16, 32]), r.choice([None, None, r.randint(1, 40)]), r.choice([torch.float32, torch.float16]),
                r.choice([None, None, torch.int8]))


RANDOM_CASES = [random_case(seed) for seed in range(12)]


MIXED = [Case((37, 20, 9), (1, 1, 1), kv_dtype=torch.float16), Case((37, 20), (13, 2), kv_dtype=torch.float16),
         Case((37, 20), (13, 2), dtype=torch.float16, kv_dtype=torch.float32)]  # float caches of another dtype


NATIVE = pytest.mark.skipif(native.unavailable() is not None, reason=f"native kernels: {native.unavailable()}")


@pytest.mark.parametrize("case", CASES + MIXED + RANDOM_CASES, ids=str)
def test_cpu_matches_reference(case):
    check_against_reference(paged_attention_cpu, case)


@NATIVE
@pytest.mark.parametrize("case", CASES + MIXED + RANDOM_CASES, ids=str)
def test_native_matches_reference(case):
    """Decode steps through tokq_native::paged_decode, anything else through the CPU path it falls back to."""
    check_against_reference(paged_attention_native, case)


@pytest.mark.parametrize("batch_decode", [False, True])
def test_cpu_decode_batching_matches_reference(batch_decode):
    """Equal-length decode sequences go through one batched SDPA call (or not) with the same result."""
    case = Case((33, 33, 33, 20), (1, 1, 1, 1), window=25)
    check_against_reference(paged_attention_cpu, case, batch_decode=batch_decode)


@pytest.mark.parametrize("cap", [1, 3000, 1 << 30])
@pytest.mark.parametrize("case", [
    Case((33, 70, 5, 20, 48, 1), (1, 1, 1, 1, 1, 1), window=25),
    Case((33, 70, 5, 20, 48, 1), (1, 1, 1, 1, 1, 1), block_size=4, kv_dtype=torch.int8),
    Case((90, 17, 40), (1, 12, 1), dtype=torch.float16, window=30),  # decode and prefill in one batch
], ids=str)
def test_cpu_decode_groups_of_any_size_match_reference(case, cap, monkeypatch):
    """Mixed-length decode sequences batched in groups under a byte cap (1 byte: one sequence per call;
    3000: a few; 1 GiB: all in one call) give the reference's result."""
    import tokq.kernels.cpu.attention as cpu_attention

    monkeypatch.setattr(cpu_attention, "DECODE_BATCH_BYTES", cap)
    check_against_reference(paged_attention_cpu, case)


@pytest.mark.parametrize("path", ["cpu", "triton"])
@pytest.mark.parametrize("query_lens", [(1, 1), (13, 20)])
def test_q_as_view_of_fused_projection(path, query_lens):
    """q as the engine hands it over: a [T, Hq, D] view into the fused qkv output (token stride > Hq * D)."""
    batch = make_batch(Case((37, 20), query_lens), device=TRITON_DEVICE if path == "triton" else "cpu")
    fused = torch.zeros(batch.q.shape[0], (6 + 2 * 2) * 64, device=batch.q.device)
    fused[:, : 6 * 64] = batch.q.flatten(1)
    batch.q = fused[:, : 6 * 64].view(-1, 6, 64)
    assert not batch.q.is_contiguous()
    ref = batch.run(paged_attention_reference)
    err = rel_err(batch.run(paged_attention_cpu if path == "cpu" else paged_attention_triton), ref)
    assert err < 1e-5, f"{path} with a strided q: relative error {err:.2e}"


def test_cpu_fp8_kv_matches_reference():
    check_against_reference(paged_attention_cpu, Case((37, 20), (1, 4), kv_dtype=torch.float8_e4m3fn))


@pytest.mark.parametrize("case", CASES + MIXED + RANDOM_CASES, ids=str)
def test_triton_matches_reference(case):
    check_against_reference(paged_attention_triton, case, TRITON_DEVICE)


def test_triton_decode_automatic_splits():
    """The split policy splits a long context when there are few (sequence, kv head) programs."""
    case = Case((1000, 300), (1, 1), heads=4, kv_heads=1)
    if not GPU:  # the interpreter's policy assumes 4 multiprocessors: min(8 / 2 programs, 1000 // 256) = 3
        assert decode_splits(2, 1, 1000, torch.device("cpu")) == 3
    check_against_reference(paged_decode_triton, case, TRITON_DEVICE)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 40])
def test_triton_decode_splits_match_reference(num_splits, window):
    """Flash-decoding: the context split in 3 (short sequences leave later splits empty) and merged."""
    case = Case(DECODE, (1,) * 5, window=window)
    check_against_reference(paged_decode_triton, case, TRITON_DEVICE, num_splits=num_splits)


def test_triton_decode_int8_split_matches_reference():
    case = Case(DECODE, (1,) * 5, heads=4, kv_heads=1, head_dim=256, dtype=torch.float16, kv_dtype=torch.int8)
    check_against_reference(paged_decode_triton, case, TRITON_DEVICE, num_splits=3)


# --------------------------------------------------------------------------------------------------
# KV writers against the reference writer (exact: same conversion / the same int8 codes)

WRITERS = {"cpu": (write_kv_cpu, "cpu"), "triton": (write_kv_triton, TRITON_DEVICE), "native": (write_kv_native, "cpu")}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e6 -> fp16 is inf, on purpose
@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                            (torch.float32, torch.int8), (torch.float16, torch.int8),
                                            (torch.float32, torch.float16)])
def test_write_kv_matches_reference(writer, dtype, kv_dtype):
    fn, device = WRITERS[writer]
    g = torch.Generator().manual_seed(5)
    blocks, block, heads, dim = 5, 16, 3, 80
    slots = torch.tensor([17, -1, 0, 79, 33, -1, 34, 15, 64])  # padding (-1) and out-of-order slots
    k = (3 * torch.randn(len(slots), heads, dim, generator=g)).to(dtype)
    v = torch.randn(len(slots), heads, dim, generator=g).to(dtype)
    k[0, 0, :3] = torch.tensor([2.5, -0.5, 1e6])  # ties and a value beyond the int8 range (scale below)
    k_scale = torch.tensor([1.0, 0.05, 0.02]) if kv_dtype == torch.int8 else None
    v_scale = kv_scales(v, kv_dtype) if kv_dtype == torch.int8 else None
    ref_k = torch.full((blocks, block, heads, dim), 7, dtype=kv_dtype)  # untouched slots keep their value
    ref_v = ref_k.clone()
    out_k, out_v = ref_k.clone().to(device), ref_v.clone().to(device)
    write_kv_reference(k, v, ref_k, ref_v, slots, k_scale, v_scale)
    fn(k.to(device), v.to(device), out_k, out_v, slots.to(device), on(k_scale, device), on(v_scale, device))
    assert torch.equal(out_k.cpu(), ref_k) and torch.equal(out_v.cpu(), ref_v), \
        f"{writer} write {NAME[dtype]} -> {NAME[kv_dtype]} differs from the reference writer"


def test_triton_write_kv_strided_input():
    """k/v as views into a fused qkv projection output (token stride > Hkv * D)."""
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(7, (4 + 2 * 2) * 64, generator=g)
    k = qkv[:, 256:384].view(7, 2, 64)
    v = qkv[:, 384:].view(7, 2, 64)
    slots = torch.arange(7) * 3
    ref_k, ref_v = torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64)
    write_kv_reference(k, v, ref_k, ref_v, slots)
    out_k, out_v = ref_k.clone().to(TRITON_DEVICE), ref_v.clone().to(TRITON_DEVICE)
    write_kv_triton(k.to(TRITON_DEVICE), v.to(TRITON_DEVICE), out_k, out_v, slots.to(TRITON_DEVICE))
    assert torch.equal(out_k.cpu(), ref_k) and torch.equal(out_v.cpu(), ref_v)


# --------------------------------------------------------------------------------------------------
# Validation: clear errors instead of wrong answers

PATHS = {"reference": paged_attention_reference, "cpu": paged_attention_cpu, "triton": paged_attention_triton,
         "native": paged_attention_native}


def _batch(**changes) -> Batch:
    return make_batch(Case((20, 9), (1, 1), **changes))


def _bad_inputs() -> dict[str, tuple[Batch, str]]:
    good = _batch()
    bad = {}
    b = _batch()
    b.q = b.q[..., :32].contiguous()
    bad["head dims"] = (b, "head dims do not match")
    b = _batch(heads=5, kv_heads=2)
    bad["gqa"] = (b, "not a multiple of num_kv_heads")
    b = _batch()
    b.meta = PagedAttentionMetadata(good.meta.block_tables[:, :1], good.meta.seq_lens, good.meta.query_start_loc, 1, 20)
    bad["short table"] = (b, "block table too short")
    b = _batch()
    b.k_cache, b.v_cache = b.k_cache.double(), b.v_cache.double()
    bad["cache dtype"] = (b, "KV cache dtype float64/float64 is not supported")
    b = _batch(kv_dtype=torch.int8)
    b.k_scale = None
    bad["no scale"] = (b, "needs k_scale as fp32 [2]")
    b = _batch()
    b.k_scale = torch.ones(2)
    bad["scale for float cache"] = (b, "were given for a fp32 KV cache")
    b = _batch()
    b.window = 0
    bad["window"] = (b, "sliding_window must be None or >= 1")
    b = _batch()
    b.meta = PagedAttentionMetadata(good.meta.block_tables, good.meta.seq_lens.long(), good.meta.query_start_loc, 1, 20)
    bad["meta dtype"] = (b, "seq_lens must be a 1-D int32 tensor")
    return bad


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("what", list(_bad_inputs()))
def test_attention_rejects_bad_inputs(path, what):
    batch, message = _bad_inputs()[what]
    with pytest.raises(ValueError, match=re.escape(message)):
        batch.run(PATHS[path])


@pytest.mark.parametrize("path", ["reference", "cpu", pytest.param("native", marks=NATIVE)])
def test_metadata_contents_are_validated(path):
    """Checks that read the metadata's values (the reference and CPU path pay the device sync)."""
    b = _batch()
    b.meta = PagedAttentionMetadata.from_lists([[0, 1], [2]], [20, 4], [1, 5])  # 5 queries, 4 tokens
    b.q = torch.randn(6, 6, 64)
    with pytest.raises(ValueError, match="has 5 queries but seq_len 4"):
        b.run(PATHS[path])
    b = _batch()
    b.meta = PagedAttentionMetadata.from_lists([[0, 1], [99]], [20, 9], [1, 1])
    with pytest.raises(ValueError, match="names block 99, outside the cache's"):
        b.run(PATHS[path])
    b = _batch()
    b.meta = PagedAttentionMetadata(b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc, 1, 12)
    with pytest.raises(ValueError, match="below the real maxima"):
        b.run(PATHS[path])
    b = _batch()
    b.q = b.q[:1]
    with pytest.raises(ValueError, match="query_start_loc must rise from 0 to the number of queries"):
        b.run(PATHS[path])




def test_triton_rejects_what_it_cannot_run():
    b = _batch(head_dim=512)
    with pytest.raises(ValueError, match="head dim 512 is not supported by the Triton kernels"):
        b.run(paged_attention_triton)
    b = make_batch(Case((20, 9), (2, 1)))
    with pytest.raises(ValueError, match="the decode kernel takes one query per sequence"):
        b.run(paged_decode_triton)


@pytest.mark.parametrize("writer", ["reference", "cpu", "triton", pytest.param("native", marks=NATIVE)])
def test_write_kv_rejects_bad_inputs(writer):
    fn = {"reference": write_kv_reference, "cpu": write_kv_cpu, "triton": write_kv_triton,
          "native": write_kv_native}[writer]
    cache = torch.zeros(2, 16, 2, 64)
    k = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="slot 32 is outside the cache"):
        kwargs = {"validate": True} if writer == "triton" else {}
        fn(k, k, cache, cache.clone(), torch.tensor([0, 32, -1]), **kwargs)
    with pytest.raises(ValueError, match="slot_mapping must be int64"):
        fn(k, k, cache, cache.clone(), torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="k and v must both be"):
        fn(k[:, :1], k[:, :1], cache, cache.clone(), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="needs k_scale"):
        fn(k, k, cache.to(torch.int8), cache.to(torch.int8), torch.tensor([0, 1, 2]))


# --------------------------------------------------------------------------------------------------
# GPU only: bf16, fp8 KV, autotuned tiles at real-model sizes

GPU_CASES = [
    Case(DECODE, (1,) * 5, dtype=torch.bfloat16),
    Case((37, 20, 9), (13, 20, 1), window=7, dtype=torch.bfloat16),
    Case(DECODE, (1,) * 5, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, window=30),
    Case((37, 20), (13, 3), dtype=torch.float16, kv_dtype=torch.float8_e4m3fn),
    Case((37, 20), (13, 3), dtype=torch.bfloat16, kv_dtype=torch.int8),
    Case((1500, 700, 513), (1, 1, 1), heads=4, kv_heads=1, head_dim=256, window=512, dtype=torch.bfloat16),
    Case((1500, 700, 513), (1, 1, 1), heads=9, kv_heads=3, head_dim=64, dtype=torch.bfloat16),
    Case((700, 300), (200, 300), heads=4, kv_heads=1, head_dim=256, window=512, dtype=torch.bfloat16),
    Case((700, 300), (200, 300), heads=9, kv_heads=3, head_dim=64, dtype=torch.float32),
]


@gpu_only
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_triton_gpu_matches_reference(case):
    check_against_reference(paged_attention_triton, case, "cuda")


@gpu_only
@pytest.mark.parametrize("case", GPU_CASES[-4:], ids=str)
def test_triton_gpu_autotuned_matches_reference(case, monkeypatch):
    """At real-model sizes with autotuning on (the tuner's winner is checked)."""
    monkeypatch.setenv("TOKQ_TRITON_AUTOTUNE", "1")
    check_against_reference(paged_attention_triton, case, "cuda")


def _tiles(config) -> dict:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


@gpu_only
@pytest.mark.parametrize("config", range(len(pa._DECODE_CONFIGS)))
def test_triton_gpu_every_decode_tile_config(config, monkeypatch):
    """Each config the tuner may pick gives the right answer (ragged edges for every BLOCK_N)."""
    monkeypatch.setattr(pa, "_FIXED_DECODE", _tiles(pa._DECODE_CONFIGS[config]))
    for case in (Case(DECODE, (1,) * 5, heads=4, kv_heads=1, head_dim=256, dtype=torch.bfloat16, window=40),
                 Case((300, 77), (1, 1), heads=9, kv_heads=3, dtype=torch.float32, kv_dtype=torch.int8)):
        for splits in (1, 3):
            check_against_reference(paged_decode_triton, case, "cuda", num_splits=splits)


@gpu_only
@pytest.mark.parametrize("config", range(len(pa._PREFILL_CONFIGS)))
def test_triton_gpu_every_prefill_tile_config(config, monkeypatch):
    monkeypatch.setattr(pa, "_FIXED_PREFILL", _tiles(pa._PREFILL_CONFIGS[config]))
    for case in (Case((300, 77, 20), (130, 77, 1), heads=4, kv_heads=1, head_dim=256, dtype=torch.bfloat16,
                      window=50),
                 Case((300, 77), (45, 3), heads=9, kv_heads=3, dtype=torch.float32, kv_dtype=torch.int8)):
        check_against_reference(paged_attention_triton, case, "cuda")


@gpu_only
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                            (torch.bfloat16, torch.float8_e4m3fn), (torch.float32, torch.float8_e4m3fn)])
def test_triton_gpu_write_kv_matches_reference(dtype, kv_dtype):
    g = torch.Generator().manual_seed(7)
    slots = torch.tensor([17, -1, 0, 79, 33])
    k = torch.randn(5, 2, 64, generator=g).to(dtype)
    v = torch.randn(5, 2, 64, generator=g).to(dtype)
    quant = kv_dtype == torch.float8_e4m3fn
    k_scale, v_scale = (kv_scales(k, kv_dtype), kv_scales(v, kv_dtype)) if quant else (None, None)
    ref_k, ref_v = torch.zeros(5, 16, 2, 64, dtype=kv_dtype), torch.zeros(5, 16, 2, 64, dtype=kv_dtype)
    out_k, out_v = ref_k.clone().cuda(), ref_v.clone().cuda()
    write_kv_reference(k, v, ref_k, ref_v, slots, k_scale, v_scale)
    write_kv_triton(k.cuda(), v.cuda(), out_k, out_v, slots.cuda(), on(k_scale, "cuda"), on(v_scale, "cuda"))
    assert torch.equal(out_k.cpu().float(), ref_k.float()) and torch.equal(out_v.cpu().float(), ref_v.float())


# --------------------------------------------------------------------------------------------------
# The registry's attention kernels


def attention_problem(device: str = "cpu", **changes) -> AttentionProblem:
    fields = dict(device=device, dtype=torch.float32, kv_dtype=torch.float32, num_heads=4, num_kv_heads=2,
                  head_dim=32, block_size=16, sliding_window=None)
    return AttentionProblem(**{**fields, **changes})


def test_registry_chooses_attention_kernels(monkeypatch):
    monkeypatch.delenv(registry.ENV, raising=False)
    cpu, _ = registry.choose(attention_problem())
    assert cpu.name == ("cpu_native_paged" if native.unavailable() is None else "cpu_paged_sdpa")
    assert registry.choose(attention_problem(kv_dtype=torch.int8))[0].name == "cpu_paged_sdpa"  # native: float KV
    verdicts = {v.name: v for v in registry.explain(attention_problem())}
    assert not verdicts["triton_paged"].usable and "CUDA" in verdicts["triton_paged"].reason
    assert registry.choose(attention_problem("cuda"))[0].name == "triton_paged"  # triton comes with the dev extra
    too_wide = registry.explain(attention_problem("cuda", head_dim=512))
    assert not too_wide[0].usable and "512" in too_wide[0].reason
    assert registry.choose(attention_problem("cuda", head_dim=512))[0].name == "paged_reference"


def test_registry_attention_selection():
    problem = attention_problem()
    assert registry.choose(problem, "paged_reference")[0].name == "paged_reference"
    assert registry.choose(problem, "-cpu_native_paged,-cpu_paged_sdpa,-cpu_paged_batched")[0].name == "paged_reference"
    assert registry.choose(problem, "-cpu_native_paged")[0].name == "cpu_paged_sdpa"
    assert registry.choose(problem, "cpu_int4")[0].name == registry.choose(problem)[0].name  # attention unchanged
    with pytest.raises(registry.KernelError, match="triton_paged: Triton kernels run on CUDA.*kernels that can: "
                                                   "(cpu_native_paged, )?cpu_paged_sdpa, cpu_paged_batched, paged_reference"):
        registry.choose(problem, "triton_paged")
    with pytest.raises(registry.KernelError, match="not a multiple of 4 KV heads"):
        registry.choose(attention_problem(num_heads=6, num_kv_heads=4))
    with pytest.raises(registry.KernelError, match="not a kernel.*paged_reference"):
        registry.Selection.parse("paged_refrence")


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8], ids=NAME.get)
@pytest.mark.parametrize("forced", ["cpu_paged_sdpa", "cpu_paged_batched", "paged_reference",
                                    pytest.param("cpu_native_paged", marks=NATIVE)])
def test_prepared_attention_writes_and_reads_one_cache(forced, kv_dtype):
    """The chosen kernel's KV write and attention call, end to end against the reference on fresh inputs."""
    if forced == "cpu_native_paged" and kv_dtype == torch.int8:
        pytest.skip("the native kernel takes float caches only (the registry does not offer it for int8)")
    layout = random_paged_layout([37, 5, 64], [37, 1, 3], 16, num_kv_heads=2, head_dim=32, kv_dtype=kv_dtype,
                                 seed=11)
    problem = attention_problem(kv_dtype=kv_dtype, sliding_window=24)
    kernel = registry.prepare_attention_kernel(problem, forced)
    g = torch.Generator().manual_seed(12)
    tokens = layout.new_slot_mapping.numel()
    k, v = (torch.randn(tokens, 2, 32, generator=g) for _ in range(2))
    q = torch.randn(tokens, 4, 32, generator=g)
    caches = [layout.k_cache.clone(), layout.v_cache.clone()]
    kernel.write_kv(k, v, *caches, layout.new_slot_mapping, layout.k_scale, layout.v_scale)
    ref_caches = [layout.k_cache.clone(), layout.v_cache.clone()]
    write_kv_reference(k, v, *ref_caches, layout.new_slot_mapping, layout.k_scale, layout.v_scale)
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches, strict=True)), f"{forced} KV write differs"
    out = kernel.attend(q, *caches, layout.meta, 32 ** -0.5, 24, layout.k_scale, layout.v_scale)
    ref = paged_attention_reference(q, *ref_caches, layout.meta, 32 ** -0.5, 24, layout.k_scale, layout.v_scale)
    err = rel_err(out, ref)
    assert err < TOL[torch.float32], f"{kernel.name} ({kernel.reason}) vs reference: relative error {err:.2e}"


def test_cpu_write_kv_fp8_cache():
    """fp8 caches on CPU (index_copy_ has no fp8 kernel: the writer copies the bytes) equal the reference writer."""
    g = torch.Generator().manual_seed(8)
    slots = torch.tensor([5, -1, 0, 31, 17])
    k, v = torch.randn(5, 2, 64, generator=g) * 30, torch.randn(5, 2, 64, generator=g)
    k_scale, v_scale = kv_scales(k, torch.float8_e4m3fn), kv_scales(v, torch.float8_e4m3fn)
    ref = [torch.zeros(2, 16, 2, 64, dtype=torch.float8_e4m3fn) for _ in range(2)]
    out = [t.clone() for t in ref]
    write_kv_reference(k, v, *ref, slots, k_scale, v_scale)
    write_kv_cpu(k, v, *out, slots, k_scale, v_scale)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(out, ref, strict=True))


@pytest.mark.parametrize("table,seq_len,window,kv_dtype", [
    ([3, 4, 5, 6], 61, None, None),  # one run: a view of the cache
    ([7, 8, 1, 2, 3], 70, None, None),  # two runs (a shared prefix's blocks, then the sequence's own)
    ([9, 2, 5, 6, 0], 77, 40, None),  # three runs, the window starting mid-block
    ([1, 3, 5, 7, 9, 11], 90, None, None),  # six runs: more than VIEW_MAX_RUNS, gathered
    ([7, 8, 1, 2], 60, None, torch.int8),  # runs of an int8 cache, dequantized per run
])
def test_cpu_batch1_decode_reads_block_runs_in_place(table, seq_len, window, kv_dtype):
    """A lone decode sequence is attended through views of its runs of consecutive blocks, each run's softmax
    merged by its log-sum-exp: the reference's result whatever the runs."""
    g = torch.Generator().manual_seed(len(table) * seq_len)
    bs, heads, kv_heads, dim = 16, 9, 3, 64
    k_cache = torch.randn(12, bs, kv_heads, dim, generator=g)
    v_cache = torch.randn(12, bs, kv_heads, dim, generator=g)
    scales = (None, None)
    if kv_dtype is torch.int8:
        scales = (k_cache.abs().amax((0, 1, 3)) / 127, v_cache.abs().amax((0, 1, 3)) / 127)
        k_cache = (k_cache / scales[0][:, None]).round().clamp(-127, 127).to(torch.int8)
        v_cache = (v_cache / scales[1][:, None]).round().clamp(-127, 127).to(torch.int8)
    q = torch.randn(1, heads, dim, generator=g)
    meta = PagedAttentionMetadata.from_lists([table], [seq_len], [1])
    args = (q, k_cache, v_cache, meta, 0.125, window, *scales)
    err = rel_err(paged_attention_cpu(*args), paged_attention_reference(*args))
    assert err < 1e-5, f"runs of {table}: relative error {err:.2e}"
