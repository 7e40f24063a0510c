"""The int8 output layer (quantization/lm_head.py): in memory, written, read back by tokq and by HF transformers, and
through `tokq quantize --lm-head`, on tiny random models (llama: its own head; gemma3: head tied to the embedding)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.test_models_vs_hf import make_hf_checkpoint
from tests.test_quantize_cli import run, save_word_tokenizer
from tokq.engine.checkpoint import load_model
from tokq.engine.quant_linear import QuantizedLinearMethod
from tokq.errors import ConfigError
from tokq.quantization.formats.compressed_tensors import save_quantized
from tokq.quantization.lm_head import check_lm_head_format, quantize_lm_head_
from tokq.quantization.pipeline import quantize_model
from tokq.quantization.scheme import preset

IDS = torch.tensor([[1, 5, 9, 33, 2, 17, 60, 4, 8, 100, 3, 7]])


def build(case: str, tmp_path):
    src = tmp_path / case
    make_hf_checkpoint(case, src)
    model = load_model(src)
    quantize_model(model, "rtn", preset("w4a16").with_weights(group_size=32))
    return src, model


@pytest.mark.parametrize("case", ["llama", "gemma3"])
def test_int8_head_in_memory(case, tmp_path):
    src, model = build(case, tmp_path)
    tied = model.config.tie_word_embeddings
    embedding = model.model.embed_tokens.weight.detach().clone()
    before = model.logits(IDS)
    assert quantize_lm_head_(model, "int8")
    assert isinstance(model.lm_head.method, QuantizedLinearMethod) and model.lm_head.method.bits == 8
    assert not model.config.tie_word_embeddings and model.config.raw["tie_word_embeddings"] is False
    assert torch.equal(model.model.embed_tokens.weight, embedding), "the embedding must stay 16-bit and unchanged"
    after = model.logits(IDS)
    err = ((after - before).abs().max() / before.abs().max()).item()
    assert 0 < err < 0.02, f"int8 head moved the logits by {err:.3%} of the largest (tied={tied})"
    assert not quantize_lm_head_(model, "int8"), "a quantized head is left as it is"


@pytest.mark.parametrize("case", ["llama", "gemma3"])
def test_int8_head_written_and_read_back(case, tmp_path):
    src, model = build(case, tmp_path)
    quantize_lm_head_(model, "int8")
    out = save_quantized(model, preset("w4a16").with_weights(group_size=32), tmp_path / "out", source_dir=src,
                         dtype=torch.float32)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert config["tie_word_embeddings"] is False and "lm_head" not in qc["ignore"]
    assert qc["config_groups"]["group_0"]["targets"] == ["lm_head"]
    assert qc["config_groups"]["group_0"]["weights"]["num_bits"] == 8
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    tensors = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight_packed" in tensors and "lm_head.weight" not in tensors
    assert "model.embed_tokens.weight" in tensors
    reloaded = load_model(out)
    assert isinstance(reloaded.lm_head.method, QuantizedLinearMethod) and reloaded.lm_head.method.bits == 8
    assert torch.equal(reloaded.logits(IDS), model.logits(IDS))


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_hf_transformers_reads_the_int8_head(tmp_path):
    pytest.importorskip("compressed_tensors", reason="HF interop needs the compressed-tensors package")
    import transformers

    src, model = build("gemma3", tmp_path)  # the tied case: HF must read an untied, quantized head
    quantize_lm_head_(model, "int8")
    out = save_quantized(model, preset("w4a16").with_weights(group_size=32), tmp_path / "out", source_dir=src,
                         dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(IDS).logits
    diff = (load_model(out).logits(IDS) - theirs).abs().max().item()
    assert diff < 1e-4, f"HF vs tokq max |dlogit| = {diff:.2e}"


def test_bad_format_is_refused():
    with pytest.raises(ConfigError, match="lm_head = 'int4'.*16bit or int8"):
        check_lm_head_format("int4")


def test_quantize_cli_lm_head(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    src = tmp_path / "llama"
    make_hf_checkpoint("llama", src)
    save_word_tokenizer(src)
    code, out = run(capsys, "quantize", "--model", src, "--method", "rtn", "--group-size", "32", "--lm-head", "int8",
                    "--out", tmp_path / "q")
    assert code == 0, out
    record = json.loads((tmp_path / "q" / "tokq_quantization.json").read_text())
    assert record["lm_head"]["format"] == "int8"
    assert isinstance(load_model(tmp_path / "q").lm_head.method, QuantizedLinearMethod)
    code, out = run(capsys, "quantize", "--model", src, "--method", "rtn", "--lm-head", "int4", "--out", tmp_path / "q2")
    assert code == 2 and "16bit or int8" in out and not (tmp_path / "q2").exists()
