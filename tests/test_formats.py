"""Quantized checkpoint formats: compressed-tensors written by tokq, and compressed-tensors, AutoGPTQ and
AutoAWQ checkpoints read by tokq's engine, checked against exact integer codes and reference logits."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from tests.formats_writers import write_awq_checkpoint, write_gptq_checkpoint
from tests.test_models_vs_hf import BASE, make_hf_checkpoint
from tokq.engine.checkpoint import load_model
from tokq.engine.quant_formats.compressed_tensors import compressed_tensors_weight
from tokq.engine.quant_formats.packing import unpack_int32_dense
from tokq.engine.quant_linear import InputPermutedLinearMethod, QuantizedLinearMethod
from tokq.errors import ModelError, TokqError
from tokq.kernels.reference import FP8Weight, IntWeight
from tokq.quantization.formats import compress_weight, compression_format, save_quantized
from tokq.quantization.formats.compressed_tensors import _weight_args, pack_int32_dense
from tokq.quantization.pipeline import quantize_model
from tokq.quantization.rounding import quantize_fp8, quantize_rtn
from tokq.quantization.scheme import CHANNEL, GROUP, QuantScheme, WeightArgs, preset

IDS = torch.randint(0, BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(7))


def _scheme_args(args: WeightArgs, act=None) -> dict:
    return _weight_args(QuantScheme("t", args, act))


# --------------------------------------------------------------------------------------------------
# Tensor-level round trips: tokq layout -> compressed-tensors tensors -> tokq layout


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    symmetric=st.booleans(),
    grouping=st.sampled_from([32, 64, None]),
    n=st.integers(1, 40),
    groups=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_int_roundtrip_exact(bits, symmetric, grouping, n, groups, seed):
    k = (grouping or 48) * groups
    args = WeightArgs(bits=bits, symmetric=symmetric, strategy=GROUP if grouping else CHANNEL, group_size=grouping)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    original = quantize_rtn(w, args)
    tensors = compress_weight(original, "pack-quantized", torch.float32)
    assert tensors["weight_packed"].dtype == torch.int32
    assert tensors["weight_packed"].shape == (n, -(-k * bits // 32))
    assert tensors["weight_shape"].tolist() == [n, k]
    if symmetric:
        assert "weight_zero_point" not in tensors
    else:
        assert tensors["weight_zero_point"].shape == (-(-n * bits // 32), k // original.group_size)
    back = compressed_tensors_weight(tensors, _scheme_args(args)).weight
    assert torch.equal(back.q, original.q)
    assert torch.equal(back.scale, original.scale)
    assert (back.zero is None) == (original.zero is None)
    if original.zero is not None:
        assert torch.equal(back.zero, original.zero)
    assert back.group_size == original.group_size and back.bits == bits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int_roundtrip_scales_in_model_dtype(dtype):
    args = WeightArgs(bits=4, symmetric=False, group_size=32)
    original = quantize_rtn(torch.randn(24, 64), args)
    tensors = compress_weight(original, "pack-quantized", dtype)
    assert tensors["weight_scale"].dtype == dtype and tensors["weight_scale"].shape == (24, 2)
    back = compressed_tensors_weight(tensors, _scheme_args(args)).weight
    assert torch.equal(back.q, original.q) and torch.equal(back.zero, original.zero)
    assert torch.equal(back.scale, original.scale.to(dtype).float())


def test_int8_per_channel_naive_roundtrip():
    """W8A8 int8 (int-quantized): plain int8 weight [N, K] and scale [N, 1]."""
    args = WeightArgs(bits=8, strategy=CHANNEL, group_size=None)
    original = quantize_rtn(torch.randn(40, 96), args)
    scheme = preset("w8a8-int8")
    assert compression_format(scheme) == "int-quantized"
    tensors = compress_weight(original, "int-quantized", torch.float32)
    assert tensors["weight"].dtype == torch.int8 and tensors["weight_scale"].shape == (40, 1)
    shard = compressed_tensors_weight(tensors, _scheme_args(args), act="int8")
    assert torch.equal(shard.weight.q, original.q) and torch.equal(shard.weight.scale, original.scale)
    assert shard.weight.group_size == 96 and shard.act == "int8"


def test_fp8_roundtrip():
    original = quantize_fp8(torch.randn(33, 80))
    for scheme in ("w8a8-fp8", "fp8-weight-only"):
        fmt = compression_format(preset(scheme))
        tensors = compress_weight(original, fmt, torch.float32)
        assert tensors["weight"].dtype == torch.float8_e4m3fn and tensors["weight_scale"].shape == (33, 1)
        back = compressed_tensors_weight(tensors, {"num_bits": 8, "type": "float", "strategy": "channel"}).weight
        assert isinstance(back, FP8Weight)
        assert torch.equal(back.q.view(torch.uint8), original.q.view(torch.uint8))
        assert torch.equal(back.scale, original.scale)
    assert compression_format(preset("w8a8-fp8")) == "float-quantized"
    assert compression_format(preset("fp8-weight-only")) == "naive-quantized"


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_packing_matches_compressed_tensors_library(bits):
    """Our packer and unpacker against compressed-tensors' own (weights along K, zero points along N)."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1)
    codes = torch.randint(lo, hi, (13, 75), dtype=torch.int8, generator=torch.Generator().manual_seed(bits))
    theirs = helpers.pack_to_int32(codes, bits)
    assert torch.equal(pack_int32_dense(codes.long() - lo, bits), theirs)
    assert torch.equal(unpack_int32_dense(theirs, bits, 75) + lo, codes.long())
    theirs_dim0 = helpers.pack_to_int32(codes, bits, packed_dim=0)
    assert torch.equal(pack_int32_dense(codes.long().t() - lo, bits).t(), theirs_dim0)


# --------------------------------------------------------------------------------------------------
# Whole models: tokq quantizes and saves; tokq (and HF transformers) load it back


def _quantized_model(case, tmp_path, scheme_name, **weight_changes):
    src = tmp_path / "src"
    make_hf_checkpoint(case, src)
    (src / "tokenizer_config.json").write_text("{}")
    model = load_model(src)
    scheme = preset(scheme_name)
    if weight_changes:
        scheme = scheme.with_weights(**weight_changes)
    method = "fp8" if scheme.weights.kind == "float" else "rtn"
    quantize_model(model, method, scheme)
    return src, model, scheme


@pytest.mark.parametrize("case,scheme_name,changes", [
    ("llama", "w4a16", dict(group_size=32)),
    ("llama", "w4a16-asym", dict(group_size=32)),
    ("qwen3", "w4a16-asym", dict(group_size=32)),
    ("gemma3", "w4a16", dict(group_size=32)),
    ("qwen2", "w8a16", {}),
    ("llama", "w8a8-int8", {}),
    ("llama", "w8a8-fp8", {}),
    ("gemma3", "fp8-weight-only", {}),
])
def test_saved_model_reloads_with_identical_logits(case, scheme_name, changes, tmp_path):
    src, model, scheme = _quantized_model(case, tmp_path, scheme_name, **changes)
    out = save_quantized(model, scheme, tmp_path / "out", source_dir=src, dtype=torch.float32)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["quantization_status"] == "compressed"
    assert qc["format"] == compression_format(scheme) and qc["ignore"] == ["lm_head"]
    assert (out / "tokenizer_config.json").is_file() and (out / "tokq_quantization.json").is_file()
    tensors = load_file(str(out / "model.safetensors"))
    assert not any(name.endswith(("qkv_proj.weight", "gate_up_proj.weight_packed")) for name in tensors)
    if qc["format"] == "pack-quantized":
        assert tensors["model.layers.0.self_attn.k_proj.weight_packed"].dtype == torch.int32
    reloaded = load_model(out)
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinearMethod):
            again = reloaded.get_submodule(name)
            assert type(again) is QuantizedLinearMethod and again.name == module.name
            assert torch.equal(again.q.view(torch.uint8), module.q.view(torch.uint8))
    expected, got = model.logits(IDS), reloaded.logits(IDS)
    assert torch.equal(got, expected), f"max |dlogit| {(got - expected).abs().max().item()}"


def test_saved_model_bf16_scales(tmp_path):
    """The default dtype is the source's; bf16 rounds the scales only, the integer codes stay exact."""
    src, model, scheme = _quantized_model("llama", tmp_path, "w4a16-asym", group_size=32)
    out = save_quantized(model, scheme, tmp_path / "out", source_dir=src, dtype=torch.bfloat16)
    tensors = load_file(str(out / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"].dtype == torch.bfloat16
    assert tensors["model.norm.weight"].dtype == torch.bfloat16
    reloaded = load_model(out)
    mine = model.model.layers[1].mlp.gate_up_proj.method
    theirs = reloaded.model.layers[1].mlp.gate_up_proj.method
    assert torch.equal(mine.q, theirs.q) and torch.equal(mine.zero, theirs.zero)
    assert torch.equal(theirs.scale, mine.scale.to(torch.bfloat16).float())


def test_save_refuses_existing_dir_unless_forced(tmp_path):
    src, model, scheme = _quantized_model("llama", tmp_path, "w4a16", group_size=32)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(TokqError, match=r"already exists.*--force"):
        save_quantized(model, scheme, out, source_dir=src)
    save_quantized(model, scheme, out, source_dir=src, force=True)
    assert (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no temp dirs left


def test_save_rejects_scheme_mismatch(tmp_path):
    src, model, scheme = _quantized_model("llama", tmp_path, "w4a16", group_size=32)
    with pytest.raises(TokqError, match=r"quantized differently from scheme"):
        save_quantized(model, scheme.with_weights(group_size=64), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("case,scheme_name", [
    ("llama", "w4a16"), ("llama", "w4a16-asym"), ("qwen3", "w4a16"), ("gemma3", "w4a16-asym"), ("llama", "fp8-weight-only"),
])
def test_hf_transformers_reads_our_checkpoint(case, scheme_name, tmp_path):
    """HF transformers + the compressed-tensors package load the checkpoint (they dequantize it) and agree."""
    pytest.importorskip("compressed_tensors", reason="HF interop needs the compressed-tensors package")
    import transformers

    src, model, scheme = _quantized_model(case, tmp_path, scheme_name, **({} if "fp8" in scheme_name else dict(group_size=32)))
    out = save_quantized(model, scheme, tmp_path / "out", source_dir=src, dtype=torch.float32)
    # compressed-tensors 0.20's compressed-module path sizes asymmetric zero points unpacked; the
    # dequantize path reads the packed layout that its own compressor (and vLLM) writes.
    config = transformers.CompressedTensorsConfig(dequantize=True) if not scheme.weights.symmetric else None
    kwargs = {"quantization_config": config} if config else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        theirs = hf(IDS).logits
    ours = load_model(out).logits(IDS)
    diff = (ours - theirs).abs().max().item()
    print(f"{case} {scheme_name}: HF vs tokq max |dlogit| = {diff:.2e}")
    assert diff < 1e-4


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_ignored_layers_stay_dense_for_hf_too(tmp_path):
    pytest.importorskip("compressed_tensors", reason="HF interop needs the compressed-tensors package")
    import transformers

    src = tmp_path / "src"
    make_hf_checkpoint("llama", src)
    model = load_model(src)
    scheme = replace(preset("w4a16").with_weights(group_size=32), ignore=("lm_head", "*down_proj"))
    quantize_model(model, "rtn", scheme)
    out = save_quantized(model, scheme, tmp_path / "out", dtype=torch.float32)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head"] + [f"model.layers.{i}.mlp.down_proj" for i in range(BASE["num_hidden_layers"])]
    reloaded = load_model(out)
    assert not isinstance(reloaded.model.layers[0].mlp.down_proj.method, QuantizedLinearMethod)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(IDS).logits
    ours = reloaded.logits(IDS)
    assert torch.equal(ours, model.logits(IDS))
    assert (ours - theirs).abs().max().item() < 1e-4


def test_compressed_tensors_g_idx_is_read():
    args = WeightArgs(bits=4, symmetric=False, group_size=32)
    tensors = compress_weight(quantize_rtn(torch.randn(8, 64), args), "pack-quantized", torch.float32)
    g_idx = torch.randperm(64, generator=torch.Generator().manual_seed(0)) // 32
    tensors["weight_g_idx"] = g_idx.to(torch.int32)
    assert torch.equal(compressed_tensors_weight(tensors, _scheme_args(args)).g_idx, g_idx)


# --------------------------------------------------------------------------------------------------
# AutoGPTQ / AutoAWQ layouts written by the independent packers


def _reference_logits(reference) -> torch.Tensor:
    with torch.no_grad():
        return reference.eval()(IDS).logits


@pytest.mark.parametrize("case,kw", [
    ("llama", dict(bits=4, sym=True, checkpoint_format="gptq")),
    ("qwen2", dict(bits=4, sym=False, act_order=True, checkpoint_format="gptq")),
    ("llama", dict(bits=4, sym=False, act_order=True, checkpoint_format="gptq_v2")),
    ("qwen3", dict(bits=2, sym=False, group_size=32, checkpoint_format="gptq_v2")),
    ("gemma3", dict(bits=8, sym=True, group_size=-1, checkpoint_format="gptq_v2")),
])
def test_gptq_checkpoint_matches_dequantized_reference(case, kw, tmp_path):
    hf = make_hf_checkpoint(case, tmp_path / "hf")
    reference = write_gptq_checkpoint(hf, tmp_path / "gptq", **kw)
    model = load_model(tmp_path / "gptq")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, QuantizedLinearMethod)
    assert isinstance(qkv.method, InputPermutedLinearMethod) == kw.get("act_order", False)
    assert (qkv.method.zero is None) == kw["sym"]
    got, expected = model.logits(IDS), _reference_logits(reference)
    diff = (got - expected).abs().max().item()
    print(f"gptq {case} {kw}: max |dlogit| vs dequantized HF reference = {diff:.2e}")
    assert diff < 1e-4, f"max |dlogit| {diff}"


def test_gptq_act_order_mismatched_shards_falls_back_to_dense(tmp_path, caplog):
    hf = make_hf_checkpoint("llama", tmp_path / "hf")
    reference = write_gptq_checkpoint(hf, tmp_path / "gptq", sym=False, act_order=True, shared_order=False)
    model = load_model(tmp_path / "gptq")
    assert "different activation orders" in caplog.text
    assert not isinstance(model.model.layers[0].self_attn.qkv_proj.method, QuantizedLinearMethod)
    assert isinstance(model.model.layers[0].self_attn.o_proj.method, InputPermutedLinearMethod)
    diff = (model.logits(IDS) - _reference_logits(reference)).abs().max().item()
    assert diff < 1e-4, f"max |dlogit| {diff}"


@pytest.mark.parametrize("case", ["llama", "qwen3", "gemma3"])
def test_awq_checkpoint_matches_dequantized_reference(case, tmp_path):
    hf = make_hf_checkpoint(case, tmp_path / "hf")
    reference = write_awq_checkpoint(hf, tmp_path / "awq", group_size=32)
    model = load_model(tmp_path / "awq")
    method = model.model.layers[0].mlp.gate_up_proj.method
    assert isinstance(method, QuantizedLinearMethod) and method.zero is not None and method.group_size == 32
    diff = (model.logits(IDS) - _reference_logits(reference)).abs().max().item()
    print(f"awq {case}: max |dlogit| vs dequantized HF reference = {diff:.2e}")
    assert diff < 1e-4, f"max |dlogit| {diff}"


# --------------------------------------------------------------------------------------------------
# Bad inputs


def _set_quant_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture
def awq_dir(tmp_path):
    write_awq_checkpoint(make_hf_checkpoint("llama", tmp_path / "hf"), tmp_path / "awq", group_size=32)
    return tmp_path / "awq"


def test_unsupported_quant_method_lists_supported(awq_dir):
    _set_quant_config(awq_dir, quant_method="bitsandbytes")
    with pytest.raises(ModelError, match=r"'bitsandbytes' is not supported.*compressed-tensors, gptq, awq"):
        load_model(awq_dir)


def test_unsupported_awq_version(awq_dir):
    _set_quant_config(awq_dir, version="gemv")
    with pytest.raises(ModelError, match=r"AWQ version 'gemv' is not supported.*gemm"):
        load_model(awq_dir)


def test_missing_qzeros_names_tensor(awq_dir):
    _edit_tensors(awq_dir, lambda t: t.pop("model.layers.1.self_attn.k_proj.qzeros"))
    with pytest.raises(ModelError, match=r"model\.layers\.1\.self_attn\.k_proj\.qzeros is missing"):
        load_model(awq_dir)


def test_wrong_scales_shape(awq_dir):
    def shrink(t):
        t["model.layers.0.mlp.down_proj.scales"] = t["model.layers.0.mlp.down_proj.scales"][:, :32].contiguous()
    _edit_tensors(awq_dir, shrink)
    with pytest.raises(ModelError, match=r"down_proj\.qweight has shape .* inconsistent"):
        load_model(awq_dir)


def test_partly_quantized_merged_layer(awq_dir):
    def dense_v(t):
        for suffix in ("qweight", "qzeros", "scales"):
            t.pop(f"model.layers.0.self_attn.v_proj.{suffix}")
        t["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(32, 64)
    _edit_tensors(awq_dir, dense_v)
    with pytest.raises(ModelError, match=r"v_proj not quantized while .*q_proj.*must all be quantized"):
        load_model(awq_dir)


def test_gptq_wrong_qweight_shape(tmp_path):
    write_gptq_checkpoint(make_hf_checkpoint("llama", tmp_path / "hf"), tmp_path / "g")
    def cut(t):
        t["model.layers.2.mlp.up_proj.qweight"] = t["model.layers.2.mlp.up_proj.qweight"][:4].contiguous()
    _edit_tensors(tmp_path / "g", cut)
    with pytest.raises(ModelError, match=r"up_proj"):
        load_model(tmp_path / "g")


def test_gptq_act_order_without_g_idx(tmp_path):
    write_gptq_checkpoint(make_hf_checkpoint("llama", tmp_path / "hf"), tmp_path / "g", act_order=True)
    _edit_tensors(tmp_path / "g", lambda t: t.pop("model.layers.0.mlp.down_proj.g_idx"))
    with pytest.raises(ModelError, match=r"down_proj\.g_idx is missing"):
        load_model(tmp_path / "g")


def test_compressed_tensors_unsupported_format(tmp_path):
    src, model, scheme = _quantized_model("llama", tmp_path, "w4a16", group_size=32)
    out = save_quantized(model, scheme, tmp_path / "out", dtype=torch.float32)
    _set_quant_config(out, format="marlin-24")
    with pytest.raises(ModelError, match=r"format 'marlin-24' is not supported; tokq reads pack-quantized"):
        load_model(out)


def test_compressed_tensors_static_activations_rejected(tmp_path):
    src, model, scheme = _quantized_model("llama", tmp_path, "w8a8-int8")
    out = save_quantized(model, scheme, tmp_path / "out", dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"].update(dynamic=False, strategy="tensor")
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"strategy='tensor', dynamic=False.*dynamic symmetric per-token"):
        load_model(out)


def test_act_order_model_cannot_be_saved_as_compressed_tensors(tmp_path):
    write_gptq_checkpoint(make_hf_checkpoint("llama", tmp_path / "hf"), tmp_path / "g", sym=False, act_order=True)
    model = load_model(tmp_path / "g")
    scheme = preset("w4a16-asym").with_weights(group_size=32)
    with pytest.raises(TokqError, match=r"activation-ordered GPTQ"):
        save_quantized(model, scheme, tmp_path / "out")


def test_intweight_zero_layout_unchanged():
    """Guard the shared in-memory layout the formats assume (signed codes, fp32 scales [N, G])."""
    w = quantize_rtn(torch.randn(8, 64), WeightArgs(bits=4, symmetric=False, group_size=32))
    assert isinstance(w, IntWeight) and w.q.dtype == torch.int8 and w.scale.shape == (8, 2)
    assert w.zero.dtype == torch.int8 and -8 <= int(w.zero.min()) and int(w.zero.max()) <= 7


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_v1_wrapped_zero_point(bits):
    """GPTQ v1 stores zero - 1, so a zero of 0 is stored as 2^b - 1 and reads back as 2^b. At 4 bits that zero
    (signed 8) is kept exactly, as AutoGPTQ's kernels compute it; at 8 bits it does not fit tokq's int8 zero
    points, which is refused with the fix rather than silently changed."""
    from tests.formats_writers import pack_along_cols, pack_along_rows
    from tokq.engine.quant_formats.gptq import gptq_weight

    n, k, group = 16, 64, 32
    g = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 1 << bits, (k, n), generator=g)
    stored_zero = torch.randint(0, (1 << bits) - 1, (k // group, n), generator=g)
    stored_zero[0, 3] = (1 << bits) - 1  # the wrapped 0 - 1
    tensors = {"qweight": pack_along_rows(q, bits), "qzeros": pack_along_cols(stored_zero, bits),
               "scales": torch.rand(k // group, n, generator=g).half() + 0.01}
    if bits == 8:
        with pytest.raises(ModelError, match=r"proj\.qzeros: an 8-bit GPTQ v1 zero point of 256.*gptq_v2"):
            gptq_weight(tensors, bits, version=1, name="proj")
        return
    weight = gptq_weight(tensors, bits, version=1, name="proj").weight
    assert weight.zero[3, 0].item() == 1 << (bits - 1)  # 2^b unsigned -> signed 2^(b-1)
    expected = (q.t().float() - (stored_zero + 1).t().repeat_interleave(group, 1)) \
        * tensors["scales"].float().t().repeat_interleave(group, 1)
    assert torch.equal(weight.dequantize(), expected)
