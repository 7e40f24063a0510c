"""tokq's native CPU GEMVs (kernels/cpu/native) against the reference path, on fresh random inputs.

Both kernels quantize the activations to int8 per block, so they are held to a relative tolerance of the largest
output (the error is printed); the rest of their contract (layouts, fallbacks above NATIVE_MAX_M / NATIVE_INT4_MAX_M rows, the registry
and torch.compile seeing them, what happens without them) is checked exactly.
"""

from __future__ import annotations

import pytest
import torch

from tokq.kernels.cpu import native
from tokq.kernels.cpu.native_linear import NATIVE_INT4_MAX_M, NATIVE_MAX_M, native_int8_supports
from tokq.kernels.linear import LINEAR_KERNELS
from tokq.kernels.problem import LinearProblem
from tokq.kernels.reference import IntWeight, linear_reference
from tokq.kernels.registry import prepare_linear_kernel

pytestmark = pytest.mark.skipif(native.unavailable() is not None,
                                reason=f"native kernels unavailable here: {native.unavailable()}")

TOLERANCE = 0.02  # of the largest |output|; measured ~0.005 (int8 activations per block)


def random_int_weight(n: int, k: int, bits: int, group: int, symmetric: bool, seed: int) -> IntWeight:
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 0.05 + 0.001
    zero = None if symmetric else torch.randint(lo, hi, (n, k // group), generator=g, dtype=torch.int8)
    return IntWeight(q, scale, zero, bits, group)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("n,k,group,symmetric,m", [
    (96, 128, 32, True, 1), (64, 576, 64, False, 1), (48, 512, 128, False, 3), (36, 256, 64, True, 16),
    (1539, 576, 64, False, 2),  # N not a multiple of 4: the tail rows
    (40, 1536, 64, False, 1), (32, 1024, 128, True, 4),  # more than 16 groups (a masked second block of them)
    (40, 96, 32, False, 3),  # K not a multiple of 64: the 256-bit row loop
    (20, 576, 576, False, 11),  # one group per row (per-channel), N padded to a tile of 16, 8 + 3 activation rows
])
def test_int4_gemv_matches_reference(n, k, group, symmetric, m):
    weight = random_int_weight(n, k, 4, group, symmetric, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m), dtype=torch.float32).to(torch.bfloat16)
    kernel = prepare_linear_kernel(weight, None, torch.bfloat16, "cpu_native_int4")
    assert kernel.name == "cpu_native_int4"
    # AVX-512 VNNI builds take the tiled layout where K and the group are multiples of 64, the row-major one elsewhere
    assert kernel.state.tiled == (native.isa() == "avx512+vnni" and k % 64 == 0 and group % 64 == 0)
    got, want = kernel(x, None, None), linear_reference(x, weight, None, None)
    err = relative_error(got, want)
    print(f"int4 [{n}x{k}] g{group} {'sym' if symmetric else 'asym'} M={m}: max error {err:.4f} of max |y|")
    assert got.dtype == x.dtype and got.shape == (m, n) and err < TOLERANCE


@pytest.mark.parametrize("n,k,m", [(128, 576, 1), (49152 // 64, 640, 4), (77, 64, 2)])
def test_int8_gemv_matches_reference(n, k, m):
    weight = random_int_weight(n, k, 8, k, True, seed=n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n), dtype=torch.float32).to(torch.bfloat16)
    kernel = prepare_linear_kernel(weight, None, torch.bfloat16, "cpu_native_int8")  # forced: N below its minimum
    assert kernel.name == "cpu_native_int8"
    got, want = kernel(x, None, None), linear_reference(x, weight, None, None)
    err = relative_error(got, want)
    print(f"int8 [{n}x{k}] M={m}: max error {err:.4f} of max |y|")
    assert err < TOLERANCE


@pytest.mark.parametrize("name,bits,group", [("cpu_native_int4", 4, 64), ("cpu_native_int8", 8, 128)])
def test_more_rows_than_the_gemv_takes_go_to_torch_paths(name, bits, group):
    weight = random_int_weight(64, 128, bits, group, True, seed=3)
    x = torch.randn((NATIVE_INT4_MAX_M if bits == 4 else NATIVE_MAX_M) + 5, 128).to(torch.bfloat16)
    kernel = prepare_linear_kernel(weight, None, torch.bfloat16, name)
    err = relative_error(kernel(x, None, None), linear_reference(x, weight, None, None))
    assert err < 0.01  # bf16 GEMMs, no activation quantization


def test_torch_compile_traces_the_native_ops():
    weight = random_int_weight(64, 256, 4, 64, False, seed=5)
    kernel = prepare_linear_kernel(weight, None, torch.bfloat16, "cpu_native_int4")
    x = torch.randn(1, 256).to(torch.bfloat16)
    compiled = torch.compile(lambda t: kernel(t * 2, None, None) + 1, fullgraph=True)
    assert torch.allclose(compiled(x).float(), (kernel(x * 2, None, None) + 1).float(), rtol=1e-2, atol=1e-2)


def test_int4_packing_layout():
    codes = torch.arange(64, dtype=torch.int8).remainder(16).sub(8).view(1, 64)
    packed = native.pack_int4(codes)
    assert packed.shape == (1, 32) and packed.dtype == torch.uint8
    u = codes.to(torch.int16) + 8
    assert int(packed[0, 0]) == int(u[0, 0]) | int(u[0, 16]) << 4  # chunk 0, byte 0: elements 0 and 16
    assert int(packed[0, 16]) == int(u[0, 32]) | int(u[0, 48]) << 4  # chunk 1, byte 0: elements 32 and 48


@pytest.mark.parametrize("bf16_scales", [True, False])
def test_int4_tiled_packing_layout(bf16_scales):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (32, 256), generator=g, dtype=torch.int8)
    scale = torch.rand(32, 2, generator=g) + 0.5
    if bf16_scales:  # a loaded checkpoint's scales: bf16 values, stored as bf16
        scale = scale.to(torch.bfloat16).float()
    zero = torch.randint(-8, 8, (32, 2), generator=g, dtype=torch.int8)
    packed = native.pack_int4_tiled(codes, scale, zero, 128)
    scale_bytes = 2 if bf16_scales else 4
    assert packed.shape == (2, 2, 2 * 512 + 16 * scale_bytes + 16) and packed.dtype == torch.uint8
    u = codes.to(torch.int16) + 8
    for t, b, q, n, i in ((0, 0, 0, 0, 0), (1, 1, 3, 5, 2), (0, 3, 7, 15, 3), (1, 2, 12, 9, 1)):
        row, col = 16 * t + n, 64 * b + 4 * q + i  # quad q of row n in block b: k = 64 b + 4 q + i
        byte = int(packed[t, b // 2, (b % 2) * 512 + (q % 8) * 64 + n * 4 + i])  # group b // 2 holds blocks 2g, 2g+1
        assert (byte >> 4 if q >= 8 else byte & 15) == int(u[row, col])
    header = packed[1, 1, 1024:]  # tile 1, group 1: its 16 rows' scales, then their offsets
    stored = header[: 16 * scale_bytes].clone().view(torch.bfloat16 if bf16_scales else torch.float32).float()
    assert torch.equal(stored, scale[16:, 1])
    assert torch.equal(header[16 * scale_bytes:].to(torch.int16), zero[16:, 1].to(torch.int16) + 8)


@pytest.mark.skipif(native.unavailable() is not None or native.isa() != "avx512+vnni",
                    reason="the tiled int4 GEMV needs an AVX-512 VNNI build")
@pytest.mark.parametrize("bf16_scales,symmetric,group", [(True, False, 128), (False, False, 64), (True, True, 64)])
def test_int4_tiled_and_row_major_kernels_agree(bf16_scales, symmetric, group):
    """The two layouts' kernels quantize the activations alike and sum exactly in int32: only fp32 order differs
    (scales stored as bf16 only where that is exact)."""
    weight = random_int_weight(48, 640, 4, group, symmetric, seed=9)
    scale = weight.scale.float()
    if bf16_scales:
        scale = scale.to(torch.bfloat16).float()
    zero = torch.zeros_like(scale) if symmetric else -weight.zero.float() * scale
    x = torch.randn(5, 640, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    packed = native.pack_int4_tiled(weight.q, scale, weight.zero, group)
    assert packed.shape[2] == (group // 64) * 512 + 16 * (2 if bf16_scales else 4) + 16
    tiled = torch.ops.tokq_native.int4_gemv_tiled(x, packed, group)
    rows = torch.ops.tokq_native.int4_gemv(x, native.pack_int4(weight.q), scale.contiguous(), zero.contiguous(), group)
    err = relative_error(tiled, rows)
    print(f"tiled vs row-major int4, {'bf16' if bf16_scales else 'fp32'} scales: max error {err:.2e} of max |y|")
    assert err < 1e-5


@pytest.mark.skipif(native.unavailable() is not None or native.isa() != "avx512+vnni",
                    reason="the tiled int4 GEMV needs an AVX-512 VNNI build")
def test_int4_tiled_refuses_a_unit_of_another_size():
    packed = torch.zeros(2, 1, 512 + 16 * 3 + 16, dtype=torch.uint8)  # 3-byte "scales": neither layout
    with pytest.raises(RuntimeError, match="neither bf16"):
        torch.ops.tokq_native.int4_gemv_tiled(torch.zeros(1, 64, dtype=torch.bfloat16), packed, 64)


def test_refusals_say_why(monkeypatch):
    ok, why = native_int8_supports(LinearProblem("cpu", "int", 8, 100, True, None, 32768, 100, torch.bfloat16))
    assert not ok and "multiple of 64" in why
    candidate = next(c for c in LINEAR_KERNELS if c.name == "cpu_native_int8")
    ok, why = candidate.verdict(LinearProblem("cpu", "int", 8, 128, True, None, 576, 128, torch.bfloat16))
    assert not ok and "output layers" in why and "TOKQ_KERNELS=cpu_native_int8" in why
    head = random_int_weight(16384, 128, 8, 128, True, seed=1)  # a vocabulary-sized output layer: chosen unforced
    assert prepare_linear_kernel(head, None, torch.bfloat16).name == "cpu_native_int8"
    monkeypatch.setenv(native.ENV, "0")
    assert "TOKQ_NATIVE=0" in native._load()


CHECK_ANOTHER_BUILD = """
import torch
from tokq.kernels.cpu import native
from tokq.kernels.reference import IntWeight, linear_reference
from tokq.kernels.registry import prepare_linear_kernel
assert native.unavailable() is None, native.unavailable()
g = torch.Generator().manual_seed(0)
x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
for bits, group, name in ((8, 256, "cpu_native_int8"), (4, 64, "cpu_native_int4")):
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q = torch.randint(lo, hi, (40, 256), generator=g, dtype=torch.int8)
    q[0, :8] = lo  # the most negative code (-128 for int8) is where a sign trick breaks
    zero = None if bits == 8 else torch.randint(lo, hi, (40, 256 // group), generator=g, dtype=torch.int8)
    w = IntWeight(q, torch.rand(40, 256 // group, generator=g) * 0.05 + 0.001, zero, bits, group)
    got = prepare_linear_kernel(w, None, torch.bfloat16, name)(x, None, None).float()
    want = linear_reference(x, w, None, None).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 0.02, (name, err)
from tokq.kernels.paged import PagedAttentionMetadata, paged_attention_reference
kc, vc = torch.randn(20, 16, 2, 40, generator=g), torch.randn(20, 16, 2, 40, generator=g)
meta = PagedAttentionMetadata.from_lists([[3, 9, 1, 4, 7], [0, 2]], [70, 19], [1, 1])
q = torch.randn(2, 6, 40, generator=g)
got = torch.ops.tokq_native.paged_decode(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.2, 30)
want = paged_attention_reference(q, kc, vc, meta, 0.2, 30)
err = ((got - want).abs().max() / want.abs().max()).item()
assert err < 1e-5, ("paged_decode", err)
for m, n, k in ((1, 37, 100), (2, 64, 576)):  # a K and an N the vector loops do not divide
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    want = x.float() @ w.float().t()
    err = ((torch.ops.tokq_native.bf16_gemv(x, w).float() - want).abs().max() / want.abs().max()).item()
    assert err < 1e-2, ("bf16_gemv", m, n, k, err)
# the native decode step (decode_step.cpp's scalar or vector pointwise code): the eager step's greedy tokens
import os, tempfile
from tests.test_models_vs_hf import make_hf_checkpoint
from tokq.engine.checkpoint import load_model
from tokq.engine.llm_engine import EngineConfig, LLMEngine
from tokq.engine.sampling import SamplingParams
folder = tempfile.mkdtemp()
make_hf_checkpoint("qwen2", folder)  # qkv biases
model = load_model(folder, dtype="bf16")
prompts = [[5, 17, 33, 2, 9], list(range(3, 40))]
tokens = {}
for native_on in (False, True):
    engine = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=96, compile_decode=native_on))
    assert (engine.runner.native_step is not None) == native_on, engine.runner.native_step_why
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    tokens[native_on] = [o.token_ids for o in outs]
assert tokens[True] == tokens[False], tokens
print(native.isa())
"""


@pytest.mark.parametrize("march,isa", [("x86-64-v3", "avx2"), ("x86-64", "scalar")])
def test_other_instruction_sets_match_reference(march, isa, tmp_path):
    """The AVX2 and plain-C paths (GEMVs, decode attention and the decode step's pointwise code), built for those
    instruction sets on this CPU (CI's CPU may be any of them)."""
    import os
    import platform
    import subprocess
    import sys

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 instruction sets")
    env = {**os.environ, "TOKQ_NATIVE_MARCH": march, "TOKQ_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", CHECK_ANOTHER_BUILD], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == isa


# decode attention (native/attention.cpp) -----------------------------------------------------------------

def _paged(seq_lens, heads, kv_heads, dim, dtype, seed=0):
    """Random caches and a decode step's metadata (kernels/paged.py's layout: blocks scattered over the cache)."""
    from tokq.kernels.paged import random_paged_layout

    lay = random_paged_layout(seq_lens, [1] * len(seq_lens), 16, num_kv_heads=kv_heads, head_dim=dim, dtype=dtype,
                              seed=seed)
    q = torch.randn(len(seq_lens), heads, dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return q, lay.k_cache, lay.v_cache, lay.meta


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype,seq_lens,heads,kv_heads,dim,window", [
    (torch.bfloat16, [600], 9, 3, 64, None),  # SmolLM2, batch 1: several 128-key chunks merged
    (torch.bfloat16, [1, 129, 300, 17], 9, 3, 64, None),  # one key; a chunk of exactly one key past 128
    (torch.bfloat16, [257, 3, 40], 14, 2, 64, 100),  # the AVX-512 BF16 path with GQA 7 (head groups of 4 and 3)
    (torch.bfloat16, [70, 500], 8, 8, 128, None),  # ... with two 64-dim halves per head, no GQA
    (torch.float16, [700, 45], 4, 1, 256, 512),  # Gemma-3 shaped with its window
    (torch.float32, [257, 3], 14, 2, 64, 100),  # Qwen2.5 0.5B shaped, GQA 7
    (torch.float32, [33], 2, 2, 80, None),  # no GQA, head dim not a multiple of 16
])
def test_native_decode_attention_matches_reference(dtype, seq_lens, heads, kv_heads, dim, window, threads):
    from tokq.kernels.cpu.native_attention import paged_attention_native
    from tokq.kernels.paged import paged_attention_reference

    q, kc, vc, meta = _paged(seq_lens, heads, kv_heads, dim, dtype, seed=len(seq_lens) + dim)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = paged_attention_native(q, kc, vc, meta, dim ** -0.5, window)
    finally:
        torch.set_num_threads(saved)
    want = paged_attention_reference(q, kc, vc, meta, dim ** -0.5, window)
    err = relative_error(got, want)
    print(f"paged_decode {dtype} {seq_lens} {heads}/{kv_heads}x{dim} window {window} threads {threads}: "
          f"relative error {err:.2e}")
    assert got.dtype == dtype and err < {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


def test_native_decode_checks_trusted_metadata_and_writes():
    """Metadata marked trusted skips the Python checks; the op still refuses a block outside the cache, and a write
    with one bad slot leaves the cache as it was."""
    from tokq.kernels.cpu.native_attention import paged_attention_native, write_kv_native
    from tokq.kernels.paged import PagedAttentionMetadata

    q, kc, vc, meta = _paged([40, 9], 6, 2, 32, torch.float32)
    bad = meta.block_tables.clone()
    bad[1, 0] = kc.shape[0]
    trusted = PagedAttentionMetadata(bad, meta.seq_lens, meta.query_start_loc, 1, 40, trusted=True)
    with pytest.raises(ValueError, match=f"sequence 1 names block {kc.shape[0]}, outside the cache"):
        paged_attention_native(q, kc, vc, trusted, 0.2)
    long = PagedAttentionMetadata(meta.block_tables, torch.tensor([40, 9000], dtype=torch.int32),
                                  meta.query_start_loc, 1, 9000, trusted=True)
    with pytest.raises(ValueError, match="seq_len 9000, outside"):
        paged_attention_native(q, kc, vc, long, 0.2)
    before = kc.clone(), vc.clone()
    k = torch.randn(3, 2, 32)
    with pytest.raises(ValueError, match="slot 9999 is outside the cache"):
        write_kv_native(k, k, kc, vc, torch.tensor([0, 9999, -1]))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


def test_engine_greedy_output_with_native_attention(tmp_path):
    """A small fp32 model decodes the same tokens through the native decode attention as through the torch-op
    path, with sequences joining and leaving (continuous batching) and prefill chunks mixed with decodes."""
    from tests.test_models_vs_hf import make_hf_checkpoint
    from tokq.engine.checkpoint import load_model
    from tokq.engine.llm_engine import EngineConfig, LLMEngine
    from tokq.engine.sampling import SamplingParams

    make_hf_checkpoint("llama", tmp_path)
    model = load_model(tmp_path, dtype="fp32")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 40, 11, 23)]
    outputs = {}
    for kernel in ("cpu_native_paged", "cpu_paged_sdpa"):
        engine = LLMEngine(model, EngineConfig(max_model_len=128, max_num_seqs=3, max_num_batched_tokens=16,
                                               block_size=4, attention_kernels=kernel, compile_decode=False))
        assert engine.runner.kernel_names == [kernel]
        outs = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
        outputs[kernel] = [o.token_ids for o in outs]
    assert outputs["cpu_native_paged"] == outputs["cpu_paged_sdpa"]


# dense bf16 GEMV (gemv.cpp bf16_gemv, DenseLinearMethod) --------------------------------------------------

@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (2, 49152 // 16, 576), (1, 37, 100), (2, 6, 33), (3, 64, 128),
                                   (17, 96, 64)])
def test_native_bf16_gemv_matches_fp32(m, n, k):
    """One and two rows through the native loop (N and K that the 4-row and 32-wide steps do not divide
    included), more through at::linear inside the same op."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    got = torch.ops.tokq_native.bf16_gemv(x, w)
    want = x.float() @ w.float().t()
    err = relative_error(got, want)
    print(f"bf16_gemv M={m} N={n} K={k}: relative error {err:.2e} against fp32")
    assert got.dtype == torch.bfloat16 and got.shape == (m, n) and err < 1e-2


def test_dense_linear_uses_the_native_gemv_and_matches_f_linear(monkeypatch):
    import torch.nn.functional as F

    from tokq.engine.layers import DenseLinearMethod, Linear, use_native_gemv

    layer = Linear(96, [("a", 40), ("b", 24)], bias=True).bfloat16()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(64, 96, generator=g))
        layer.bias.copy_(torch.randn(64, generator=g))
    calls = []
    real = torch.ops.tokq_native.bf16_gemv
    monkeypatch.setattr(DenseLinearMethod, "native_gemv", False)
    assert use_native_gemv() and DenseLinearMethod.native_gemv
    monkeypatch.setattr(torch.ops.tokq_native, "bf16_gemv", lambda x, w: calls.append(x.shape) or real(x, w))
    for shape in ((1, 1, 96), (2, 96), (1, 5, 96)):
        x = torch.randn(*shape, generator=g).bfloat16()
        err = relative_error(layer(x), F.linear(x, layer.weight, layer.bias))
        assert err < 1e-2, (shape, err)
    assert calls == [(1, 96), (2, 96), (5, 96)]
    monkeypatch.setenv("TOKQ_NATIVE", "0")
    monkeypatch.setattr(native, "_state", {})
    assert not use_native_gemv()
