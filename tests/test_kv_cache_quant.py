"""KV-cache quantization with calibrated scales: the calibration's maxima, the engine's int8/fp8 cache against a
dense forward that fake-quantizes K and V with the same scales, the checkpoint layout `tokq quantize --kv-cache`
writes (compressed-tensors' kv_cache_scheme) and reads back, and the errors for bad scales."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_models_vs_hf import BASE, make_hf_checkpoint
from tests.test_quantize_cli import WORDS, run, save_word_tokenizer
from tokq.engine.attention import DenseCausalAttention
from tokq.engine.checkpoint import load_model
from tokq.engine.kv_scales import KVScales, kv_scale_tensors, plan_kv_cache, read_kv_scales
from tokq.engine.llm_engine import EngineConfig, LLMEngine
from tokq.errors import ConfigError, ModelError
from tokq.kernels.paged import dequantize_kv, quantize_kv
from tokq.quantization.kv_calibration import calibrate_kv_scales

VOCAB = BASE["vocab_size"]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_hf_checkpoint(request.param, path)
    return load_model(path)


def tokens(n: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


class KVCapture:
    """Dense attention that keeps every layer's K and V (the test's own view of what the cache stores)."""

    def __init__(self):
        self.dense, self.k, self.v = DenseCausalAttention(), {}, {}

    def attend(self, q, k, v, spec):
        self.k.setdefault(spec.layer, []).append(k.detach().clone())
        self.v.setdefault(spec.layer, []).append(v.detach().clone())
        return self.dense.attend(q, k, v, spec)


class FakeQuantKV:
    """Dense attention over K and V rounded through the cache dtype with per-head scales: the reference the
    paged int8/fp8 cache must equal."""

    def __init__(self, scales, dtype):
        self.dense, self.scales, self.dtype = DenseCausalAttention(), scales, dtype

    def attend(self, q, k, v, spec):
        k_scale, v_scale = self.scales[spec.layer]
        k = dequantize_kv(quantize_kv(k, k_scale, self.dtype), k_scale).to(q.dtype)
        v = dequantize_kv(quantize_kv(v, v_scale, self.dtype), v_scale).to(q.dtype)
        return self.dense.attend(q, k, v, spec)


def test_calibrated_scales_cover_each_head_exactly(model):
    """Every layer's and head's largest |K| and |V| over the calibration windows maps to the cache's qmax: no
    calibrated value clips, and no head wastes range."""
    calib = tokens(3, 24, seed=1)
    scales = calibrate_kv_scales(model, calib, batch_size=2)
    capture = KVCapture()
    with torch.inference_mode():
        model(calib, backend=capture)
    layers, heads = model.config.num_layers, model.config.num_kv_heads
    assert scales.k_amax.shape == (layers, heads)
    for layer in range(layers):
        k = torch.cat(capture.k[layer]).abs().amax(dim=(0, 1, 3))
        v = torch.cat(capture.v[layer]).abs().amax(dim=(0, 1, 3))
        torch.testing.assert_close(scales.k_amax[layer], k, rtol=0, atol=0)
        torch.testing.assert_close(scales.v_amax[layer], v, rtol=0, atol=0)
    k_scale, _ = scales.scales_for(torch.int8)[0]
    stored = quantize_kv(torch.cat(capture.k[0]), k_scale, torch.int8)  # [B, T, Hkv, D]
    assert bool((stored.abs().amax(dim=(0, 1, 3)) == 127).all())
    tensor = scales.per_tensor()
    assert bool((tensor.k_amax == scales.k_amax.amax(dim=1, keepdim=True)).all())


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_engine_quantized_cache_equals_fake_quantized_reference(model, kv_dtype):
    """The paged engine with a calibrated int8/fp8 cache scores a window exactly as a dense forward whose K and V
    are rounded through the same dtype and scales (fresh windows, not the calibration ones)."""
    scales = calibrate_kv_scales(model, tokens(2, 32, seed=2))
    model.kv_scales = KVScales(scales.k_amax, scales.v_amax, "attn_head", "test", kv_dtype)
    try:
        engine = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=64, block_size=4,
                                               max_num_batched_tokens=16))
        assert engine.kv_spec.dtype == (torch.int8 if kv_dtype == "int8" else torch.float8_e4m3fn)
        assert engine.kv_plan.scales_note == f"{kv_dtype} KV, test"
        window = tokens(1, 40, seed=3)[0].tolist()
        got = engine.score([window])[0].logprobs
    finally:
        model.kv_scales = None
    reference = FakeQuantKV(scales.scales_for(engine.kv_spec.dtype), engine.kv_spec.dtype)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor([window]), backend=reference))[0].float()
    want = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(window[1:])[:, None])[:, 0]
    err = (got - want).abs().max().item()
    print(f"{kv_dtype}: max |dlogprob| engine vs fake-quantized reference {err:.2e}")
    assert err < 1e-4
    # and the rounding is real: the same window through a 16-bit-free fp32 cache differs
    exact = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=64, kv_dtype="fp32")).score([window])[0]
    assert (exact.logprobs - got).abs().max().item() > 10 * err


def test_plan_kv_cache_choices():
    layers, heads = 3, 2
    scales = KVScales(torch.full((layers, heads), 4.48), torch.full((layers, heads), 1.27), "attn_head", "t", "fp8")
    auto = plan_kv_cache("auto", torch.float32, scales, layers, heads)
    assert auto.dtype == torch.float8_e4m3fn and torch.allclose(auto.scales[0][0], torch.full((heads,), 0.01))
    as_int8 = plan_kv_cache("int8", torch.float32, scales, layers, heads)  # same maxima, int8's qmax
    assert torch.allclose(as_int8.scales[2][1], torch.full((heads,), 0.01))
    unit = plan_kv_cache("fp8", torch.float32, scales, layers, heads, use_scales="unit")
    assert bool((unit.scales[1][0] == 1).all()) and "scale 1" in unit.scales_note
    unit_auto = plan_kv_cache("auto", torch.bfloat16, scales, layers, heads, use_scales="unit")
    assert unit_auto.dtype == torch.float8_e4m3fn and bool((unit_auto.scales[0][1] == 1).all())
    with pytest.raises(ConfigError, match="--kv-scales unit applies to an fp8 cache"):
        plan_kv_cache("int8", torch.bfloat16, scales, layers, heads, use_scales="unit")
    assert plan_kv_cache("auto", torch.bfloat16, None, layers, heads).scales is None
    assert plan_kv_cache("fp8", torch.float32, None, layers, heads).scales_note.startswith("fp8 KV with scale 1")
    with pytest.raises(ConfigError, match="int8 needs calibrated KV scales"):
        plan_kv_cache("int8", torch.float32, None, layers, heads)
    with pytest.raises(ConfigError, match="belong to another model"):
        plan_kv_cache("fp8", torch.float32, scales, layers + 1, heads)
    with pytest.raises(ConfigError, match="--kv-scales"):
        plan_kv_cache("fp8", torch.float32, scales, layers, heads, use_scales="calibrated")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("kvq")
    path = root / "llama"
    make_hf_checkpoint("llama", path)
    save_word_tokenizer(path)
    docs = root / "docs"
    docs.mkdir()
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        picks = torch.randint(0, len(WORDS), (600,), generator=g).tolist()
        (docs / f"doc{i}.txt").write_text(" ".join(WORDS[j] for j in picks) + "\n")
    return path, docs


@pytest.mark.parametrize("kv_cache,strategy", [("int8", "attn_head"), ("fp8", "tensor")])
def test_quantize_writes_kv_scales_the_engine_reads(tiny, tmp_path, capsys, kv_cache, strategy):
    checkpoint, docs = tiny
    out = tmp_path / "q"
    code, text = run(capsys, "quantize", "--method", "rtn", "--model", checkpoint, "--out", out, "--calib", docs,
                     "--num-samples", 4, "--seq-len", 64, "--kv-cache", kv_cache, "--kv-cache-strategy", strategy)
    assert code == 0, text
    config = json.loads((out / "config.json").read_text())
    scheme = config["quantization_config"]["kv_cache_scheme"]
    assert scheme["type"] == ("int" if kv_cache == "int8" else "float") and scheme["num_bits"] == 8
    assert scheme["strategy"] == strategy and scheme["symmetric"] and not scheme["dynamic"]
    tensors = load_file(str(out / "model.safetensors"))
    layers, heads = BASE["num_hidden_layers"], BASE["num_key_value_heads"]
    k0 = tensors["model.layers.0.self_attn.k_scale"]
    assert k0.shape == ((heads, 1, 1) if strategy == "attn_head" else (1,)) and k0.dtype == torch.float32
    assert all(f"model.layers.{i}.self_attn.v_scale" in tensors for i in range(layers))
    record = json.loads((out / "tokq_quantization.json").read_text())
    assert record["kv_cache"]["dtype"] == kv_cache and record["kv_cache"]["calibration"]["num_samples"] == 4

    lm = load_model(out)
    assert lm.kv_scales is not None and lm.kv_scales.kv_cache == kv_cache and lm.kv_scales.strategy == strategy
    qmax = 127.0 if kv_cache == "int8" else 448.0
    torch.testing.assert_close(lm.kv_scales.k_amax[0], (k0.flatten() * qmax).expand(heads))
    engine = LLMEngine(lm, EngineConfig(kv_memory=1 << 20, max_model_len=64))
    assert engine.kv_spec.dtype == (torch.int8 if kv_cache == "int8" else torch.float8_e4m3fn)
    assert "from the checkpoint" in engine.kv_plan.scales_note
    # the scales are the quantized model's own: calibrating it again on the same windows gives them back
    if strategy == "attn_head":
        from tokq.engine.tokenizer import load_tokenizer, model_adds_bos
        from tokq.quantization.calibration import calibration_samples

        tok = load_tokenizer(out)
        calib = calibration_samples(docs, tok, model_adds_bos(tok), 4, 64, 0)
        again = calibrate_kv_scales(lm, calib.tokens)
        torch.testing.assert_close(again.k_amax, lm.kv_scales.k_amax, rtol=1e-5, atol=1e-6)


def test_kv_scale_errors(tiny, tmp_path, capsys):
    checkpoint, docs = tiny
    code, text = run(capsys, "quantize", "--method", "rtn", "--model", checkpoint, "--out", tmp_path / "a",
                     "--kv-cache", "int4")
    assert code != 0 and "--kv-cache 'int4': choose fp8 or int8" in text and not (tmp_path / "a").exists()
    code, text = run(capsys, "quantize", "--method", "rtn", "--model", checkpoint, "--out", tmp_path / "b",
                     "--kv-cache-strategy", "channel")
    assert code != 0 and "--kv-cache-strategy" in text
    code, text = run(capsys, "quantize", "--method", "rtn", "--model", checkpoint, "--out", tmp_path / "c",
                     "--kv-cache", "fp8", "--mix", "w4a16,w8a16", "--target-kl", "0.1")
    assert code != 0 and "--kv-cache with --mix" in text

    out = tmp_path / "q"
    assert run(capsys, "quantize", "--method", "rtn", "--model", checkpoint, "--out", out, "--calib", docs,
               "--num-samples", 2, "--seq-len", 32, "--kv-cache", "fp8")[0] == 0
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    layers, heads = BASE["num_hidden_layers"], BASE["num_key_value_heads"]
    tensors = load_file(str(out / "model.safetensors"))

    def rewrite(**changes):
        save_file({**{k: v for k, v in tensors.items() if changes.get(k, 0) is not None},
                   **{k: v for k, v in changes.items() if v is not None}}, str(out / "model.safetensors"))

    rewrite(**{"model.layers.1.self_attn.v_scale": torch.tensor([[[-1.0]], [[0.5]]])})
    with pytest.raises(ModelError, match=r"v_scale holds a scale that is not a positive finite number"):
        read_kv_scales(out, qc, layers, heads)
    rewrite(**{"model.layers.1.self_attn.v_scale": None})
    with pytest.raises(ModelError, match=r"model.layers.1.self_attn.v_scale is not in the safetensors"):
        load_model(out)
    rewrite(**{"model.layers.1.self_attn.v_scale": torch.ones(3)})
    with pytest.raises(ModelError, match="holds 3 values"):
        read_kv_scales(out, qc, layers, heads)
    for bad, message in ((dict(num_bits=4), "4-bit"), (dict(strategy="channel"), "strategy 'channel'"),
                         (dict(dynamic=True), "static and symmetric")):
        with pytest.raises(ModelError, match=message):
            read_kv_scales(out, {"kv_cache_scheme": {**qc["kv_cache_scheme"], **bad}}, layers, heads)
    assert read_kv_scales(out, {"kv_cache_scheme": None}, layers, heads) is None


def test_int8_kv_without_scales_is_refused(tiny):
    lm = load_model(tiny[0])
    with pytest.raises(ConfigError, match="quantize it with `tokq quantize ... --kv-cache int8`"):
        LLMEngine(lm, EngineConfig(kv_memory=1 << 20, max_model_len=64, kv_dtype="int8"))


def test_kv_scale_tensors_layout():
    scales = KVScales(torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 0.0]]))
    head = kv_scale_tensors(scales, "int8")
    torch.testing.assert_close(head["model.layers.0.self_attn.k_scale"].flatten(), torch.tensor([1 / 127, 2 / 127]))
    assert float(head["model.layers.0.self_attn.v_scale"].flatten()[1]) > 0  # a never-seen head keeps a positive scale
    tensor = kv_scale_tensors(scales.per_tensor(), "fp8")
    torch.testing.assert_close(tensor["model.layers.0.self_attn.k_scale"], torch.tensor([2 / 448]))


def test_compare_uses_the_checkpoints_scales_and_says_so(tiny, tmp_path, capsys):
    """`tokq compare base kvq` runs B on its calibrated fp8 cache (kv-dtype auto) and names the scales; with
    --b-kv-scales unit the same checkpoint runs on scale 1 and the report says that instead."""
    checkpoint, docs = tiny
    out = tmp_path / "kvq"
    assert run(capsys, "quantize", "--method", "rtn", "--scheme", "w8a16", "--model", checkpoint, "--out", out,
               "--calib", docs, "--num-samples", 4, "--seq-len", 64, "--kv-cache", "fp8")[0] == 0
    results = {}
    for scales in ("auto", "unit"):
        path = tmp_path / f"{scales}.json"
        code, text = run(capsys, "compare", checkpoint, out, "--data", docs, "--window", 64, "--threads", 1,
                         "--dtype", "fp32", "--no-probes", "--decode-windows", 1, "--decode-tokens", 8,
                         "--resamples", 50, "--b-kv-scales", scales, "--json", path)
        assert code == 0, text
        results[scales] = json.loads(path.read_text())
        assert results[scales]["kv_cache"]["b"]["dtype"] == "fp8_e4m3fn"
    assert "calibrated fp8 scales (attn_head) from the checkpoint" in results["auto"]["kv_cache"]["b"]["scales"]
    assert "scale 1" in results["unit"]["kv_cache"]["b"]["scales"]
    kl = {k: r["prefill"]["overall"]["kl"]["value"] for k, r in results.items()}
    assert kl["auto"] != kl["unit"]


def test_kv_only_build_keeps_the_weights(tiny, tmp_path, capsys):
    """--method none --kv-cache fp8: the weights are the base model's, bit for bit; only the KV scales are new,
    and the engine runs the build on its calibrated fp8 cache."""
    checkpoint, docs = tiny
    out = tmp_path / "kv-only"
    code, text = run(capsys, "quantize", "--method", "none", "--kv-cache", "fp8", "--model", checkpoint, "--out", out,
                     "--calib", docs, "--num-samples", 3, "--seq-len", 48, "--save-dtype", "fp32")
    assert code == 0, text
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"] == {} and qc["format"] == "dense" and qc["kv_cache_scheme"]["type"] == "float"
    base, built = load_model(checkpoint), load_model(out)
    for (name, p), (name2, q) in zip(base.state_dict().items(), built.state_dict().items(), strict=True):
        assert name == name2 and torch.equal(p, q), name
    assert base.kv_scales is None and built.kv_scales.kv_cache == "fp8"
    assert LLMEngine(built, EngineConfig(kv_memory=1 << 20, max_model_len=64)).kv_spec.dtype == torch.float8_e4m3fn
    record = json.loads((out / "tokq_quantization.json").read_text())
    assert record["method"] == "none" and record["scheme"] is None and record["kv_cache"]["dtype"] == "fp8"

    for args, message in (([], "add --kv-cache fp8 or int8"),
                          (["--kv-cache", "fp8", "--scheme", "w4a16"], "--scheme quantizes weights; --method none")):
        code, text = run(capsys, "quantize", "--method", "none", "--model", checkpoint, "--out", tmp_path / "x", *args)
        assert code != 0 and message in text and not (tmp_path / "x").exists()


def test_calibration_rescues_fp8_when_values_are_small(tmp_path):
    """Where calibration matters for fp8: e4m3's relative precision is the same at any scale in its normal range,
    but values below 2^-6 fall into subnormals. Shrink every V by 1000 (and grow o_proj by 1000: the model computes
    the same function), and scale 1 stores most of V as subnormals or zero, while calibrated scales (amax / 448)
    keep it in the normal range: its log-probabilities stay far closer to an fp32 cache's."""
    make_hf_checkpoint("llama", tmp_path)
    lm = load_model(tmp_path)
    attn0 = lm.model.layers[0].self_attn
    with torch.no_grad():
        for layer in lm.model.layers:
            attn = layer.self_attn
            v = slice(attn.q_size + attn.kv_size, attn.q_size + 2 * attn.kv_size)
            attn.qkv_proj.weight[v] *= 1e-3
            attn.o_proj.weight *= 1e3
    assert attn0.kv_size > 0
    window = tokens(1, 48, seed=5)[0].tolist()
    exact = LLMEngine(lm, EngineConfig(kv_memory=1 << 20, max_model_len=64, kv_dtype="fp32")).score([window])[0]
    calibrated = calibrate_kv_scales(lm, tokens(2, 32, seed=6))
    lm.kv_scales = KVScales(calibrated.k_amax, calibrated.v_amax, "attn_head", "test", "fp8")
    err = {}
    for scales in ("unit", "auto"):
        got = LLMEngine(lm, EngineConfig(kv_memory=1 << 20, max_model_len=64, kv_dtype="fp8",
                                         kv_scales=scales)).score([window])[0]
        err[scales] = (exact.logprobs - got.logprobs).abs().mean().item()
    print(f"mean |dlogprob| vs an fp32 cache: unit {err['unit']:.2e}, calibrated {err['auto']:.2e}")
    assert err["auto"] * 10 < err["unit"]
