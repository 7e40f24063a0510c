"""CPU kernels against the reference (the oracle) on fresh random inputs, and the registry's choices.

Errors are relative, ‖out − ref‖ / ‖ref‖, and reported in every assertion. bf16 paths are compared
with the reference fed the same bf16-rounded x and computed in fp32, so the tolerance covers only
what the kernel itself rounds: bf16 scales/zeros and the bf16 output (each about 2^-9 relative).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokq.engine.layers import Linear
from tokq.engine.quant_linear import QuantizedLinearMethod, quantize_linear_
from tokq.errors import ConfigError
from tokq.kernels.cpu import native
from tokq.kernels.problem import LinearProblem
from tokq.kernels.reference import FP8_E4M3_MAX, FP8Weight, IntWeight, linear_reference
from tokq.kernels.registry import (
    ENV,
    KERNELS_BY_NAME,
    KernelError,
    Selection,
    choose,
    explain,
    prepare_linear_kernel,
)

# Tolerances: bf16 rounding of scales/zeros/output gives ~2-3e-3 (measured); fp32 paths differ only by summation order.
TOL = {torch.bfloat16: 8e-3, torch.float32: 1e-5}
# tokq's native int4 GEMV (after torch's kernels in the walk) takes what they cannot, where it could be built
NATIVE_OR_REFERENCE = "cpu_native_int4" if native.unavailable() is None else "reference"
# on AVX-512 VNNI builds it comes first for the int4 it runs (measured faster than aten's int4 op there)
NATIVE_FIRST = native.unavailable() is None and native.isa() == "avx512+vnni"
INT4_DEFAULT = "cpu_native_int4" if NATIVE_FIRST else "cpu_int4"
NAME = {torch.bfloat16: "bf16", torch.float32: "fp32"}

# The real models' layer shapes (N, K) as tokq runs them (q/k/v and gate/up merged), plus the unmerged kv.
SMOLLM2 = [(960, 576), (576, 576), (3072, 576), (576, 1536), (192, 576)]  # hidden 576, GQA 9/3 x 64, mlp 1536
GEMMA3_270M = [(1536, 640), (640, 1024), (4096, 640), (640, 2048), (256, 640)]  # hidden 640, q 1024, kv 256, mlp 2048
REAL_SHAPES = [("smollm2", *s) for s in SMOLLM2] + [("gemma3", *s) for s in GEMMA3_270M]


@pytest.fixture(autouse=True)
def _no_kernel_env(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)


def int_weight(n: int, k: int, bits: int, group_size: int, sym: bool, seed: int = 0) -> IntWeight:
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, k // group_size, generator=g) + 0.5) * 0.02
    zero = None if sym else torch.randint(lo, hi + 1, (n, k // group_size), generator=g, dtype=torch.int8)
    return IntWeight(q, scale, zero, bits, group_size)


def fp8_weight(n: int, k: int, seed: int = 0) -> FP8Weight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    scale = w.abs().amax(1, keepdim=True) / FP8_E4M3_MAX
    return FP8Weight((w / scale).to(torch.float8_e4m3fn), scale)


def inputs(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 1, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = (0.1 * torch.randn(n, generator=g)).to(dtype) if bias else None
    return x, b


def check(kernel_name: str, x, weight, bias, act, dtype, forced: str | None = None, what: str = "") -> float:
    """Run the kernel the registry picks (or `forced`) and compare with the fp32 reference on the same x."""
    kernel = prepare_linear_kernel(weight, act, dtype, forced)
    assert kernel.name == kernel_name, f"{what}: the registry chose {kernel.name}, not {kernel_name}"
    out = kernel(x, bias, act)
    assert out.dtype == x.dtype and out.shape == (*x.shape[:-1], weight.q.shape[0])
    ref = linear_reference(x.float(), weight, None if bias is None else bias.float(), act)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], f"{kernel_name} {what} {NAME[dtype]}: relative error {err:.2e} > {TOL[dtype]:.0e}"
    return err


odd_m = st.integers(0, 4).map(lambda i: 2 * i + 1)  # 1, 3, 5, 7, 9
n_not_16 = st.integers(17, 200).filter(lambda n: n % 16)


# --------------------------------------------------------------------------------------------------
# Each CPU path against the reference


@settings(max_examples=20, deadline=None)
@given(m=odd_m, n=n_not_16, groups=st.integers(1, 3), group_size=st.sampled_from([32, 64, 128, 256]),
       bits=st.sampled_from([4, 4, 3, 2]), sym=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_cpu_int4_matches_reference(m, n, groups, group_size, bits, sym, bias, seed):
    k = groups * group_size
    weight = int_weight(n, k, bits, group_size, sym, seed)
    x, b = inputs(m, k, n, torch.bfloat16, seed + 1, bias)
    check("cpu_int4", x, weight, b, None, torch.bfloat16, "cpu_int4", what=f"M={m} N={n} K={k} g{group_size} int{bits} sym={sym}")


@pytest.mark.parametrize("sym", [True, False])
def test_cpu_int4_prefill_rows_dequantize_and_agree_with_the_int4_op(sym):
    """Above INT4PACK_MAX_M rows the call dequantizes to bf16 and runs F.linear: same answer as the int4 op."""
    from tokq.kernels.cpu.linear import INT4PACK_MAX_M

    weight = int_weight(40, 128, 4, 64, sym, seed=3)
    m = INT4PACK_MAX_M + 5
    x, b = inputs(m, 128, 40, torch.bfloat16, seed=4, bias=True)
    err = check("cpu_int4", x, weight, b, None, torch.bfloat16, "cpu_int4", what=f"prefill M={m} sym={sym}")
    kernel = prepare_linear_kernel(weight, None, torch.bfloat16, "cpu_int4")
    through_op = torch.cat([kernel(x[i:i + INT4PACK_MAX_M], b, None) for i in range(0, m, INT4PACK_MAX_M)])
    dequantized = kernel(x, b, None)
    gap = ((dequantized.float() - through_op.float()).norm() / through_op.float().norm()).item()
    assert gap < TOL[torch.bfloat16], f"dequantize-then-matmul vs int4 op: relative gap {gap:.2e} (vs reference {err:.2e})"


def test_cpu_int4_fp32_activations_when_forced():
    """Forced for an fp32 layer, the bf16 kernel casts x to bf16 and its result back to fp32."""
    weight = int_weight(40, 128, 4, 64, sym=False)
    x, _ = inputs(3, 128, 40, torch.float32)
    out = prepare_linear_kernel(weight, None, torch.float32, "cpu_int4")(x, None, None)
    assert out.dtype == torch.float32
    ref = linear_reference(x.bfloat16().float(), weight)
    err = ((out - ref).norm() / ref.norm()).item()
    assert err < TOL[torch.bfloat16], f"cpu_int4 forced, fp32 x: relative error {err:.2e}"


@settings(max_examples=15, deadline=None)
@given(m=odd_m, n=st.integers(1, 150), k16=st.integers(1, 24), bits=st.sampled_from([8, 4]), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_cpu_int8_weight_only_matches_reference(m, n, k16, bits, bias, seed):
    k = 16 * k16
    weight = int_weight(n, k, bits, k, True, seed)
    x, b = inputs(m, k, n, torch.bfloat16, seed + 1, bias)
    expected = ("cpu_native_int4" if NATIVE_FIRST and bits == 4 and k % 32 == 0
                else "cpu_int4" if bits == 4 and k in (32, 64, 128, 256) else "cpu_int8")
    check(expected, x, weight, b, None, torch.bfloat16, what=f"M={m} N={n} K={k} int{bits}")


@settings(max_examples=20, deadline=None)
@given(m=odd_m, n=st.integers(1, 150), k=st.integers(1, 300), sym=st.booleans(), bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_cpu_w8a8_int8_matches_reference(m, n, k, sym, bias, dtype, seed):
    weight = int_weight(n, k, 8, k, sym, seed)
    x, b = inputs(m, k, n, dtype, seed + 1, bias)
    expected = "reference" if k == 1 else "cpu_w8a8_int8"  # torch._int_mm is wrong for K=1
    check(expected, x, weight, b, "int8", dtype, what=f"M={m} N={n} K={k} sym={sym}")


@settings(max_examples=10, deadline=None)
@given(m=odd_m, n=st.integers(16, 100), k=st.integers(1, 200), act=st.sampled_from([None, "fp8"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_cpu_fp8_dequant_matches_reference(m, n, k, act, dtype, seed):
    weight = fp8_weight(n, k, seed)
    x, b = inputs(m, k, n, dtype, seed + 1, True)
    check("cpu_fp8_dequant", x, weight, b, act, dtype, what=f"M={m} N={n} K={k} act={act}")


@pytest.mark.parametrize("model,n,k", REAL_SHAPES)
def test_real_layer_shapes(model, n, k):
    errors = {}
    g = 64 if model == "smollm2" else 128  # SmolLM2: hidden 576 does not divide by 128, so g64 everywhere
    for m in (1, 7):
        x, b = inputs(m, k, n, torch.bfloat16, seed=m)
        int4 = int_weight(n, k, 4, g, sym=m == 1)
        errors[f"int4-g{g} M={m}"] = check(INT4_DEFAULT, x, int4, None, None, torch.bfloat16, what=f"{model} {n}x{k}")
        if NATIVE_FIRST:  # aten's int4 op too, forced
            errors[f"aten int4-g{g} M={m}"] = check("cpu_int4", x, int4, None, None, torch.bfloat16, "cpu_int4",
                                                    what=f"{model} {n}x{k}")
        errors[f"int8 M={m}"] = check("cpu_int8", x, int_weight(n, k, 8, k, True), b, None, torch.bfloat16,
                                      what=f"{model} {n}x{k}")
        for dtype in (torch.bfloat16, torch.float32):
            errors[f"w8a8 {NAME[dtype]} M={m}"] = check("cpu_w8a8_int8", x.to(dtype), int_weight(n, k, 8, k, False), b,
                                                        "int8", dtype, what=f"{model} {n}x{k}")
    print(f"{model} {n}x{k}: " + ", ".join(f"{key} {e:.1e}" for key, e in errors.items()))


def test_leading_dims_and_empty_batch():
    weight = int_weight(40, 128, 4, 64, sym=True)
    kernel = prepare_linear_kernel(weight, None, torch.bfloat16)
    x = torch.randn(2, 3, 128).bfloat16()
    out = kernel(x, None, None)
    assert out.shape == (2, 3, 40)
    assert torch.equal(out, kernel(x.reshape(6, 128), None, None).reshape(2, 3, 40))
    assert kernel(torch.randn(0, 128).bfloat16(), None, None).shape == (0, 40)


# --------------------------------------------------------------------------------------------------
# The registry


def problem(weight, act=None, dtype=torch.bfloat16) -> LinearProblem:
    return LinearProblem.of(weight, act, dtype, "cpu")


@pytest.mark.parametrize("weight,act,dtype,expected", [
    (int_weight(48, 128, 4, 64, True), None, torch.bfloat16, INT4_DEFAULT),
    (int_weight(48, 128, 4, 64, False), None, torch.bfloat16, INT4_DEFAULT),
    (int_weight(48, 128, 4, 16, True), None, torch.bfloat16, "reference"),  # group 16: int4pack takes 32..256
    (int_weight(48, 576, 4, 576, True), None, torch.bfloat16,  # per-channel int4 over K=576: int8pack (or native)
     "cpu_native_int4" if NATIVE_FIRST else "cpu_int8"),
    (int_weight(48, 576, 4, 576, False), None, torch.bfloat16, NATIVE_OR_REFERENCE),  # asym per-channel int4
    (int_weight(48, 128, 8, 128, True), None, torch.bfloat16, "cpu_int8"),
    (int_weight(48, 100, 8, 100, True), None, torch.bfloat16, "reference"),  # K % 16: int8pack is wrong there
    (int_weight(48, 128, 8, 32, True), None, torch.bfloat16, "reference"),
    (int_weight(48, 128, 8, 128, False), "int8", torch.bfloat16, "cpu_w8a8_int8"),
    (int_weight(48, 128, 8, 128, True), "int8", torch.float32, "cpu_w8a8_int8"),
    (int_weight(48, 1, 8, 1, True), "int8", torch.float32, "reference"),  # K=1: torch._int_mm is wrong there
    (int_weight(48, 128, 4, 64, True), None, torch.float32, "reference"),  # bf16 kernels are not chosen for fp32
    (fp8_weight(48, 128), None, torch.bfloat16, "cpu_fp8_dequant"),
    (fp8_weight(48, 128), "fp8", torch.float32, "cpu_fp8_dequant"),
])
def test_registry_priority(weight, act, dtype, expected):
    p = problem(weight, act, dtype)
    chosen, _ = choose(p, "")
    assert chosen.name == expected
    verdicts = explain(p, "")
    names = [v.name for v in verdicts]
    assert names[-1] == "reference" and all(v.usable for v in verdicts if v.name == "reference")
    # every kernel before the chosen one says why it cannot run this layer
    before = verdicts[: names.index(expected)]
    assert all(not v.usable and v.reason for v in before), before


def test_registry_explains_skips():
    verdicts = {v.name: v for v in explain(problem(int_weight(48, 128, 4, 16, True)), "")}
    assert "group size 16" in verdicts["cpu_int4"].reason
    verdicts = {v.name: v for v in explain(problem(int_weight(48, 128, 4, 64, True), dtype=torch.float32), "")}
    assert "computes in bf16" in verdicts["cpu_int4"].reason and "TOKQ_KERNELS=cpu_int4" in verdicts["cpu_int4"].reason
    on_gpu = LinearProblem.of(int_weight(48, 128, 4, 64, True), None, torch.bfloat16, "cuda")
    assert choose(on_gpu, "")[0].name == "triton_w4a16"  # triton is installed with the dev extra
    assert "CPU only" in {v.name: v for v in explain(on_gpu, "")}["cpu_int4"].reason


def test_tokq_kernels_forces_and_disables(monkeypatch):
    weight = int_weight(48, 128, 4, 64, True)
    assert prepare_linear_kernel(weight, None, torch.bfloat16).name == INT4_DEFAULT
    monkeypatch.setenv(ENV, "reference")
    assert prepare_linear_kernel(weight, None, torch.bfloat16).name == "reference"
    monkeypatch.setenv(ENV, "-cpu_int4,-cpu_native_int4")
    assert prepare_linear_kernel(weight, None, torch.bfloat16).name == "reference"
    monkeypatch.setenv(ENV, "-cpu_int4")
    assert prepare_linear_kernel(weight, None, torch.bfloat16).name == NATIVE_OR_REFERENCE
    per_channel = int_weight(48, 128, 4, 128, True)  # int4pack, int8pack (and native int4) can run it
    assert prepare_linear_kernel(per_channel, None, torch.bfloat16).name == ("cpu_native_int4" if NATIVE_FIRST
                                                                            else "cpu_int8")
    monkeypatch.setenv(ENV, " cpu_int8 , reference")  # forced in the order given; the first that can run it
    assert prepare_linear_kernel(weight, None, torch.bfloat16).name == "reference"
    assert prepare_linear_kernel(per_channel, None, torch.bfloat16).name == "cpu_int8"
    monkeypatch.setenv(ENV, "cpu_int4")  # forcing allows the bf16 kernel for fp32 activations
    assert prepare_linear_kernel(weight, None, torch.float32).name == "cpu_int4"
    assert Selection.parse("cpu_int4,-reference") == Selection(("cpu_int4",), frozenset({"reference"}), "cpu_int4,-reference")


def test_impossible_or_unknown_selection_is_a_clear_error(monkeypatch):
    with pytest.raises(KernelError, match=r"cpu_int4: takes integer weights, not fp8.*kernels that can: "
                                          r"cpu_fp8_dequant, reference"):
        prepare_linear_kernel(fp8_weight(48, 128), None, torch.bfloat16, "cpu_int4")
    with pytest.raises(KernelError, match=r"cpu_int4: group size 16.*kernels that can: reference"):
        prepare_linear_kernel(int_weight(48, 128, 4, 16, True), None, torch.bfloat16, "cpu_int4")
    with pytest.raises(KernelError, match=r"'marlin', which is not a kernel; known kernels: triton_w4a16, "):
        Selection.parse("reference,marlin")
    with pytest.raises(KernelError, match="disables every kernel"):
        prepare_linear_kernel(fp8_weight(48, 128), None, torch.bfloat16, ",".join(f"-{k}" for k in KERNELS_BY_NAME))
    # through the engine it is a ConfigError: one line for the user, exit code 2
    monkeypatch.setenv(ENV, "cpu_w8a8_int8")
    layer = Linear(128, [("proj", 48)]).bfloat16()
    with pytest.raises(ConfigError, match="TOKQ_KERNELS=cpu_w8a8_int8 leaves no kernel"):
        quantize_linear_(layer, int_weight(48, 128, 4, 64, True))


def test_quantized_linear_resolves_once_and_follows_moves():
    layer = Linear(128, [("q", 30), ("k", 10)], bias=True).bfloat16()
    torch.nn.init.normal_(layer.bias)
    weight = int_weight(40, 128, 4, 64, sym=False)
    quantize_linear_(layer, weight)
    method = layer.method
    assert isinstance(method, QuantizedLinearMethod) and method.name == f"int4-asym-g64:{INT4_DEFAULT}"
    x = torch.randn(5, 128).bfloat16()
    ref = linear_reference(x.float(), weight, layer.bias.float())
    out = layer(x)
    assert ((out.float() - ref).norm() / ref.norm()).item() < TOL[torch.bfloat16]
    packed = method.kernel.state.packed
    layer(x)
    assert method.kernel.state.packed is packed  # packing happened once, not per call
    assert "q" in method.state_dict() and not any("packed" in k for k in method.state_dict())
    moved = copy.deepcopy(layer).to("cpu")
    assert torch.equal(moved(x), out)
    fp32 = Linear(128, [("proj", 40)])
    quantize_linear_(fp32, weight)
    assert fp32.method.name == "int4-asym-g64:reference"
    # activation order: the kernel sees x permuted like the weight's columns
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(0))
    permuted = quantize_linear_(Linear(128, [("proj", 40)]).bfloat16(), weight, input_perm=perm)
    assert permuted.method.name == f"int4-asym-g64:{INT4_DEFAULT}+actorder"
    ref = linear_reference(x.float()[:, perm], weight)
    err = ((permuted(x).float() - ref).norm() / ref.norm()).item()
    assert err < TOL[torch.bfloat16], f"act-order cpu_int4: relative error {err:.2e}"


# --------------------------------------------------------------------------------------------------
# tokq kernels list


def test_kernels_list_cli(tmp_path, capsys):
    from tests.test_models_vs_hf import make_hf_checkpoint
    from tokq.cli import main
    from tokq.engine.checkpoint import load_model
    from tokq.quantization.formats import save_quantized
    from tokq.quantization.pipeline import quantize_model
    from tokq.quantization.scheme import preset

    src = tmp_path / "src"
    make_hf_checkpoint("llama", src)
    (src / "tokenizer_config.json").write_text("{}")
    model = load_model(src)
    scheme = preset("w4a16").with_weights(group_size=32)
    quantize_model(model, "rtn", scheme)
    out = save_quantized(model, scheme, tmp_path / "int4", source_dir=src, dtype=torch.float32)
    assert main(["kernels", "list", str(out), "--device", "cpu", "--json", str(tmp_path / "k.json")]) == 0
    text = capsys.readouterr().out
    assert INT4_DEFAULT in text and "gate_up_proj" in text
    rows = {r["layer"]: r for r in json.loads((tmp_path / "k.json").read_text())["layers"]}
    assert rows["down_proj"]["kernel"] == INT4_DEFAULT and rows["down_proj"]["k"] == 96
    assert rows["qkv_proj"]["count"] == 3 and [s["kernel"] for s in rows["qkv_proj"]["skipped"]] == [
        "triton_w4a16", "triton_w8a8_int8", "triton_fp8", "cpu_native_int8"] + ([] if NATIVE_FIRST else ["cpu_native_int4"])
    assert rows["lm_head"]["kernel"] == "dense"
    attention = json.loads((tmp_path / "k.json").read_text())["attention"]
    from tokq.kernels.cpu import native
    cpu_attention = "cpu_native_paged" if native.unavailable() is None else "cpu_paged_sdpa"
    assert [(a["kernel"], a["count"]) for a in attention] == [(cpu_attention, 3)]
    assert "CUDA" in attention[0]["skipped"][0]["reason"] and "bf16 KV" in attention[0]["format"]
    assert main(["kernels", "list", str(out), "--device", "cpu", "--dtype", "fp32", "--json", str(tmp_path / "f.json")]) == 0
    rows = {r["layer"]: r for r in json.loads((tmp_path / "f.json").read_text())["layers"]}
    assert rows["down_proj"]["kernel"] == "reference"
    assert [s["kernel"] for s in rows["down_proj"]["skipped"]] == [
        "triton_w4a16", "triton_w8a8_int8", "triton_fp8", "cpu_native_int8", "cpu_native_int4", "cpu_int4", "cpu_int8",
        "cpu_w8a8_int8", "cpu_fp8_dequant"]
