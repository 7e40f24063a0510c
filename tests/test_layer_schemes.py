"""Mixed precision (issue 17, part A): per-Linear schemes, parsing a mix, exact sizes on disk, quantizing with a
mix (RTN, AWQ, GPTQ), and the mixed compressed-tensors checkpoint read back by tokq and by HF transformers."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tests.test_formats import IDS
from tests.test_methods import CALIB
from tests.test_models_vs_hf import make_hf_checkpoint
from tokq.engine.checkpoint import load_model
from tokq.engine.quant_linear import QuantizedLinearMethod
from tokq.errors import ConfigError, TokqError
from tokq.quantization.calibration import CalibrationSet
from tokq.quantization.formats import save_quantized
from tokq.quantization.layer_schemes import (
    DENSE,
    LayerSchemes,
    candidate_linears,
    linear_bytes,
    parse_mix,
)
from tokq.quantization.methods.options import MethodOptions
from tokq.quantization.pipeline import quantize_model, resolve_scheme
from tokq.quantization.scheme import preset

# SmolLM2-135M's layer sizes: 576 is not a multiple of 128, so its w4a16 resolves to group size 64.
SMOLLM2 = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_heads=9, head_dim=64)
W4 = preset("w4a16").with_weights(group_size=32)  # the tiny llama: hidden 64, intermediate 96
W8 = preset("w8a16")
CALIB_SMALL = CalibrationSet(CALIB.tokens[:8, :32], "random tokens", "-", 1, 8)
FAST = MethodOptions(awq_grid=8, awq_clip_grid=8)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: a second thread only adds synchronisation on 2 shared cores
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "src"
    make_hf_checkpoint("llama", path)
    (path / "tokenizer_config.json").write_text("{}")
    return path


def _dense_weights(model) -> dict[str, torch.Tensor]:
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if n in candidate_linears(model)}


def _cycle(names, formats) -> dict[str, str]:
    return {n: formats[i % len(formats)] for i, n in enumerate(names)}


# --------------------------------------------------------------------------------------------------
# parse_mix


def test_parse_mix_resolves_presets_for_the_model():
    mix = parse_mix(" w4a16 , W8A16,fp16", "awq", SMOLLM2)
    assert list(mix) == ["w4a16", "w8a16", DENSE] and mix[DENSE] is None
    assert mix["w4a16"] == resolve_scheme("awq", SMOLLM2, "w4a16")[0]
    assert mix["w4a16"].weights.group_size == 64 and mix["w8a16"] == W8
    assert set(parse_mix("w8a8-int8,fp8-weight-only,16bit", "rtn", SMOLLM2)) == {"w8a8-int8", "fp8-weight-only", DENSE}


@pytest.mark.parametrize("text,method,message", [
    ("w4a16,w5a16", "awq", r"'w5a16' is not a format; choose from w4a16, w4a16-asym, w3a16, w8a16, bf16, fp16, 16bit"),
    ("w4a16,w8a8-int8", "gptq", r"'w8a8-int8' does not fit --method gptq; choose from w4a16, w4a16-asym, w3a16, w8a16, bf16"),
    ("w4a16,fp8-weight-only", "awq", r"'fp8-weight-only' does not fit --method awq"),
    ("w4a16", "rtn", r"names one format; a mix needs at least two"),
    ("bf16,fp16", "rtn", r"names 'fp16' twice"),
    ("w4a16,w4a16", "rtn", r"names 'w4a16' twice"),
    ("w4a16,,bf16", "rtn", r"empty entry"),
    ("w8a8-int8,bf16", "smoothquant", r"not supported with --method smoothquant"),
])
def test_parse_mix_errors_name_the_entry(text, method, message):
    with pytest.raises(ConfigError, match=message):
        parse_mix(text, method, SMOLLM2)


# --------------------------------------------------------------------------------------------------
# LayerSchemes


def test_layer_schemes_lookup_counts_and_json_round_trip():
    names = [f"model.layers.{i}.{p}" for i in range(2) for p in ("self_attn.qkv_proj", "mlp.down_proj")]
    schemes = {"w4a16": W4, "w8a8-int8": preset("w8a8-int8"), "w4a16-asym": preset("w4a16-asym")}
    ls = LayerSchemes(schemes, _cycle(names, ["w4a16", "w8a8-int8", DENSE]), name="m")
    assert ls.for_layer(names[0]) == W4 and ls.for_layer(names[2]) is None
    assert ls.for_layer("model.layers.9.mlp.down_proj") is None and ls.for_layer("lm_head") is None
    assert ls.counts() == {"w4a16": 2, "w8a8-int8": 1, "w4a16-asym": 0, DENSE: 1}
    assert ls.used() == ["w4a16", "w8a8-int8"]
    again = LayerSchemes.from_json(json.loads(json.dumps(ls.to_json())))
    assert again == ls and again.schemes["w8a8-int8"].activations == preset("w8a8-int8").activations
    assert isinstance(again.schemes["w4a16"].ignore, tuple)


def test_layer_schemes_reject_bad_input():
    with pytest.raises(ConfigError, match=r"uses 'w3a16', which is not one of the schemes \(w4a16, bf16\)"):
        LayerSchemes({"w4a16": W4}, {"model.layers.0.mlp.down_proj": "w3a16"})
    with pytest.raises(ConfigError, match=r"'bf16' means 16-bit"):
        LayerSchemes({DENSE: W4}, {})
    with pytest.raises(ConfigError, match=r"layer schemes JSON is malformed"):
        LayerSchemes.from_json({"assignment": {}})


# --------------------------------------------------------------------------------------------------
# Quantizing with a mix


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
def test_quantize_model_gives_each_linear_its_scheme(method, src):
    model = load_model(src)
    before = _dense_weights(model)
    names = list(candidate_linears(model))
    # Layer 0 all dense (AWQ must leave the whole block alone); layer 1: qkv int4, o int8, gate_up int4,
    # down dense (AWQ's up -> down mapping must be skipped: down's columns unscaled); layer 2 int8/int4 mixed.
    assignment = dict.fromkeys(names[:4], DENSE)
    assignment.update(zip(names[4:8], ["w4a16", "w8a16", "w4a16", DENSE], strict=True))
    assignment.update(zip(names[8:], ["w8a16", "w4a16", "w8a16", "w4a16"], strict=True))
    ls = LayerSchemes({"w4a16": W4, "w8a16": W8}, assignment)
    run = quantize_model(model, method, ls, None if method == "rtn" else CALIB_SMALL, FAST)
    assert run.to_json()["scheme"] == ls.to_json()
    for name, key in assignment.items():
        layer = model.get_submodule(name)
        if key == DENSE:
            assert not isinstance(layer.method, QuantizedLinearMethod), name
            assert torch.equal(layer.weight, before[name]), f"{method} changed dense {name}"
        else:
            want = ls.schemes[key].weights
            assert (layer.method.bits, layer.method.group_size) == (want.bits, want.group_size or layer.in_features)
            assert layer.method.name.startswith("int4-g32" if key == "w4a16" else "int8:"), layer.method.name


@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_uniform_layer_schemes_equal_the_plain_scheme(method, src):
    plain, mixed = load_model(src), load_model(src)
    calib = None if method == "rtn" else CALIB_SMALL
    quantize_model(plain, method, W4, calib, FAST)
    quantize_model(mixed, method, LayerSchemes({"w4a16": W4}, dict.fromkeys(candidate_linears(mixed), "w4a16")),
                   calib, FAST)
    for name, module in plain.named_modules():
        if isinstance(module, QuantizedLinearMethod):
            other = mixed.get_submodule(name)
            assert torch.equal(module.q, other.q) and torch.equal(module.scale, other.scale), name
    assert torch.equal(plain.logits(IDS), mixed.logits(IDS))


def test_mix_refused_where_it_does_not_fit(src):
    model = load_model(src)
    names = list(candidate_linears(model))
    with pytest.raises(ConfigError, match=r"smoothquant does not take a per-layer mix"):
        quantize_model(model, "smoothquant", LayerSchemes({"w8a8-int8": preset("w8a8-int8")}, {names[0]: "w8a8-int8"}),
                       CALIB_SMALL)
    with pytest.raises(ConfigError, match=r"awq quantizes integer weights.*w8a8-int8"):
        quantize_model(model, "awq", LayerSchemes({"w8a8-int8": preset("w8a8-int8")}, {names[0]: "w8a8-int8"}),
                       CALIB_SMALL)
    with pytest.raises(ConfigError, match=r"assigns model\.layers\.7\.mlp\.down_proj, not a decoder Linear"):
        quantize_model(model, "rtn", LayerSchemes({"w4a16": W4}, {"model.layers.7.mlp.down_proj": "w4a16"}))
    assert all(not isinstance(m, QuantizedLinearMethod) for m in model.modules())


# --------------------------------------------------------------------------------------------------
# The checkpoint: exact sizes, tokq and HF transformers reading it


def test_linear_bytes_equals_the_written_tensors(src, tmp_path):
    """Every format a mix can hold, written in bf16: linear_bytes matches the file's tensors to the byte."""
    model = load_model(src)
    schemes = {"w4a16": W4, "w4a16-asym": preset("w4a16-asym").with_weights(group_size=32), "w8a16": W8,
               "w8a8-int8": preset("w8a8-int8"), "fp8-weight-only": preset("fp8-weight-only")}
    linears = candidate_linears(model)
    ls = LayerSchemes(schemes, _cycle(linears, [*schemes, DENSE]))
    quantize_model(model, "rtn", ls)
    out = save_quantized(model, ls, tmp_path / "out", source_dir=src, dtype=torch.bfloat16)
    tensors = load_file(str(out / "model.safetensors"))
    for name, (n, k) in linears.items():
        layer = model.get_submodule(name)
        prefix = name.rpartition(".")[0]
        projections = [f"{prefix}.{s.name}." for s in layer.shards]
        written = sum(t.numel() * t.element_size() for key, t in tensors.items()
                      if key.startswith(tuple(projections)) and not key.endswith(".bias"))
        scheme = ls.for_layer(name)
        shards = [s.size for s in layer.shards]
        assert linear_bytes(n, k, scheme, 2, shards=shards) == written, (name, scheme and scheme.name)
        # Without the shard sizes a merged Linear counts one int64 weight_shape [2] for all its projections.
        packed = scheme is not None and scheme.activations is None and scheme.weights.kind == "int"
        assert linear_bytes(n, k, scheme) == written - (16 * (len(shards) - 1) if packed else 0)
    assert linear_bytes(96, 64, None, dense_bytes=4) == 96 * 64 * 4


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("method", ["rtn", "awq"])
def test_mixed_checkpoint_loads_in_tokq_and_hf(method, src, tmp_path):
    """w4a16 g32, w8a16 and 16-bit Linears in one compressed-tensors checkpoint: tokq runs each Linear on its own
    kernel, HF transformers + compressed-tensors dequantizes the same codes. Bound: max |Δlogit| between them
    <= 1e-4 x max |logit| (fp32 scales: both compute with the same integer codes and scales, only the summation
    order differs), while quantizing moved the logits by far more than that (so the check is not vacuous)."""
    pytest.importorskip("compressed_tensors", reason="HF interop needs the compressed-tensors package")
    import transformers

    model = load_model(src)
    dense_logits = model.logits(IDS)
    names = list(candidate_linears(model))
    ls = LayerSchemes({"w4a16": W4, "w8a16": W8}, _cycle(names, ["w4a16", "w8a16", DENSE]))
    quantize_model(model, method, ls, None if method == "rtn" else CALIB_SMALL, FAST)
    out = save_quantized(model, ls, tmp_path / "out", source_dir=src, dtype=torch.float32)

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    groups = {g["weights"]["num_bits"]: g for g in qc["config_groups"].values()}
    assert set(groups) == {4, 8} and all(g["format"] == "pack-quantized" for g in groups.values())
    assert "model.layers.0.self_attn.q_proj" in groups[4]["targets"]  # explicit HF projection names
    assert "model.layers.0.self_attn.o_proj" in groups[8]["targets"]
    assert qc["ignore"][0] == "lm_head" and "model.layers.0.mlp.gate_proj" in qc["ignore"]
    record = json.loads((out / "tokq_quantization.json").read_text())
    assert LayerSchemes.from_json(record["layer_schemes"]) == ls and record["format"] == "mixed-precision"

    ours = load_model(out)
    for name in names:
        method_ = ours.get_submodule(name).method
        key = ls.assignment[name]
        if key == DENSE:
            assert not isinstance(method_, QuantizedLinearMethod), name
        else:
            assert method_.name.split(":")[0] == ("int4-g32" if key == "w4a16" else "int8"), method_.name
    ours_logits = ours.logits(IDS)
    assert torch.equal(ours_logits, model.logits(IDS))

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(IDS).logits
    scale = theirs.abs().max().item()
    diff = (ours_logits - theirs).abs().max().item()
    print(f"{method} mixed: HF vs tokq max |dlogit| = {diff:.2e} (max |logit| {scale:.2f})")
    assert diff <= 1e-4 * scale
    assert (ours_logits - dense_logits).abs().max().item() > 100 * max(diff, 1e-6)


def test_save_refuses_layer_schemes_that_do_not_describe_the_model(src, tmp_path):
    model = load_model(src)
    names = list(candidate_linears(model))
    ls = LayerSchemes({"w4a16": W4, "w8a16": W8}, _cycle(names, ["w4a16", "w8a16"]))
    quantize_model(model, "rtn", ls)
    with pytest.raises(TokqError, match=r"model\.layers\.0\.self_attn\.qkv_proj is quantized but the layer schemes"):
        save_quantized(model, LayerSchemes(ls.schemes, {**ls.assignment, names[0]: DENSE}), tmp_path / "a")
    with pytest.raises(TokqError, match=r"quantized differently from scheme w8a16"):
        save_quantized(model, LayerSchemes(ls.schemes, {**ls.assignment, names[0]: "w8a16"}), tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
