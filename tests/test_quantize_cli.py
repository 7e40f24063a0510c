"""`tokq quantize` end to end on a tiny checkpoint (with a real, tiny tokenizer), and its bad-input errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.test_models_vs_hf import BASE, make_hf_checkpoint
from tokq.cli import main
from tokq.config import find_variant
from tokq.engine.checkpoint import load_model
from tokq.engine.quant_linear import QuantizedLinearMethod

WORDS = [f"w{i}" for i in range(180)]


def save_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer over WORDS (ids < the tiny model's vocab), saved as tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    assert len(vocab) <= BASE["vocab_size"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(path))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "llama"
    make_hf_checkpoint("llama", path)
    save_word_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("docs")
    rng = random.Random(0)
    for i in range(3):
        (folder / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(700)) + "\n")
    return folder


@pytest.fixture()
def project(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TOKQ_CONFIG", raising=False)
    return tmp_path


def run(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.err + captured.out


def quantize(capsys, checkpoint, out, *extra) -> tuple[int, str]:
    return run(capsys, "quantize", "--model", checkpoint, "--out", out, "--threads", 1, *extra)


@pytest.mark.parametrize("method,extra,scheme", [
    ("rtn", ["--group-size", "32"], "w4a16-g32"),
    ("awq", ["--group-size", "32", "--num-samples", "4", "--seq-len", "64"], "w4a16-g32"),
    ("gptq", ["--group-size", "16", "--asym", "--num-samples", "4", "--seq-len", "64"], "w4a16-asym-g16"),
    ("smoothquant", ["--num-samples", "4", "--seq-len", "64", "--alpha", "0.6"], "w8a8-int8"),
    ("fp8", [], "w8a8-fp8"),
])
def test_quantize_writes_a_loadable_checkpoint_and_variant(capsys, project, checkpoint, docs, method, extra, scheme):
    out = project / f"out-{method}"
    code, text = quantize(capsys, checkpoint, out, "--method", method, "--calib", docs, "--name", "q",
                          "--json", project / "run.json", *extra)
    assert code == 0, text
    assert "size on disk" in text and "peak RSS" in text
    record = json.loads((out / "tokq_quantization.json").read_text())
    assert record["method"] == method and record["scheme"]["name"] == scheme
    run_json = json.loads((project / "run.json").read_text())
    assert len(run_json["result"]["blocks"]) == BASE["num_hidden_layers"]
    if method in ("awq", "gptq", "smoothquant"):
        assert run_json["result"]["calibration"]["num_samples"] == 4
        assert run_json["result"]["calibration"]["seq_len"] == 64
    # The variant points at the checkpoint, and the checkpoint loads with quantized Linears.
    assert find_variant("q") == out
    model = load_model(out)
    assert sum(isinstance(m, QuantizedLinearMethod) for m in model.modules()) == 4 * BASE["num_hidden_layers"]  # qkv, o, gate_up, down
    ids = torch.randint(0, BASE["vocab_size"], (1, 16))
    assert torch.isfinite(model.logits(ids)).all()
    # `tokq score VARIANT` resolves through tokq.toml.
    code, text = run(capsys, "score", "q", "--data", docs, "--window", 64, "--max-tokens", 128)
    assert code == 0, text


def test_second_variant_is_added_and_same_name_replaced(capsys, project, checkpoint):
    (project / "tokq.toml").write_text("# my project\n[variants]\nbase = \"models/base\"\n\n[gate]\nx = 1\n")
    assert quantize(capsys, checkpoint, project / "a", "--method", "rtn", "--group-size", 32, "--name", "int4")[0] == 0
    assert quantize(capsys, checkpoint, project / "b", "--method", "rtn", "--group-size", 16, "--name", "int4")[0] == 0
    text = (project / "tokq.toml").read_text()
    assert text.startswith("# my project\n") and "[gate]\nx = 1" in text
    assert text.count("int4 =") == 1 and find_variant("int4") == project / "b"
    assert find_variant("base") == project / "models/base"


def test_default_group_size_falls_back_with_a_note(capsys, project, tmp_path_factory):
    # hidden 96 is not a multiple of 128 (nor is 96 % 64 == 0): the largest valid default is 32.
    path = tmp_path_factory.mktemp("odd") / "m"
    make_hf_checkpoint("llama", path)
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["intermediate_size"] == 96
    code, text = quantize(capsys, path, project / "out", "--method", "rtn")
    assert code == 0, text
    assert "group size 128 does not divide" in text and "using 32" in text
    assert json.loads((project / "out" / "tokq_quantization.json").read_text())["scheme"]["weights"]["group_size"] == 32


def test_existing_output_is_refused_then_replaced_with_force(capsys, project, checkpoint):
    out = project / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, text = quantize(capsys, checkpoint, out, "--method", "rtn", "--group-size", 32)
    assert code == 2 and f"{out} already exists" in text and "--force" in text
    assert (out / "keep.txt").read_text() == "mine"
    # --force replaces only a checkpoint tokq wrote: never the user's folder
    code, text = quantize(capsys, checkpoint, out, "--method", "rtn", "--group-size", 32, "--force")
    assert code == 2 and "is not a tokq checkpoint folder" in text and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    assert quantize(capsys, checkpoint, out, "--method", "rtn", "--group-size", 32, "--force")[0] == 0
    code, text = quantize(capsys, checkpoint, out, "--method", "rtn", "--group-size", 16, "--force")
    assert code == 0 and (out / "config.json").is_file()


def test_group_size_that_does_not_divide_names_layer_and_sizes(capsys, project, checkpoint):
    code, text = quantize(capsys, checkpoint, project / "out", "--method", "rtn", "--group-size", 48)
    assert code == 2
    assert "group size 48 does not divide" in text and "model.layers.*.{q,k,v,gate,up}_proj's input size 64" in text and "valid group sizes: 32, 64" in text
    assert not (project / "out").exists()


@pytest.mark.parametrize("args,message", [
    (["--method", "magic"], "unknown --method 'magic'"),
    (["--method", "awq", "--scheme", "w8a8-fp8"], "awq quantizes integer weights"),
    (["--method", "smoothquant", "--scheme", "w4a16"], "smoothquant is for W8A8"),
    (["--method", "fp8", "--scheme", "w4a16"], "fp8 needs an fp8 scheme"),
    (["--method", "fp8", "--group-size", "32"], "--group-size"),
    (["--method", "rtn", "--act-order"], "--act-order is a GPTQ option"),
    (["--method", "awq", "--alpha", "0.5"], "--alpha is SmoothQuant's migration strength"),
    (["--method", "smoothquant", "--alpha", "1.5"], "--alpha 1.5 is outside [0, 1]"),
    (["--method", "fp8", "--scheme", "fp8-weight-only", "--alpha", "0.5"], "nothing to smooth"),
    (["--method", "smoothquant", "--alpha", "lots"], "give a number in [0, 1]"),
    (["--method", "rtn", "--scheme", "w5"], "unknown scheme 'w5'"),
    (["--method", "rtn", "--bits", "5"], "integer weights of 5 bits are not supported"),
])
def test_bad_options_fail_before_any_work(capsys, project, checkpoint, args, message):
    code, text = quantize(capsys, checkpoint, project / "out", *args)
    assert code == 2 and message in text, text
    assert not (project / "out").exists()


def test_small_calibration_set_warns_and_continues(capsys, project, checkpoint, docs, caplog):
    code, text = quantize(capsys, checkpoint, project / "out", "--method", "gptq", "--group-size", 32,
                          "--calib", docs, "--num-samples", 500, "--seq-len", 256)
    assert code == 0, text
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "asked for 500 samples of 256 tokens" in warning and "continuing with" in warning


def test_calibration_longer_than_context(capsys, project, checkpoint, docs):
    code, text = quantize(capsys, checkpoint, project / "out", "--method", "awq", "--group-size", 32,
                          "--calib", docs, "--seq-len", 4096)
    assert code == 2 and "--seq-len 4096 exceeds the context" in text


def test_missing_calibration_folder(capsys, project, checkpoint):
    code, text = quantize(capsys, checkpoint, project / "out", "--method", "awq", "--group-size", 32,
                          "--calib", project / "nope")
    assert code == 2 and "nope" in text and not (project / "out").exists()


def test_nan_weight_names_the_layer(capsys, project, checkpoint, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in checkpoint.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    code, text = quantize(capsys, broken, project / "out", "--method", "rtn", "--group-size", 32)
    assert code == 2 and "NaN/Inf" in text and "model.layers.1.mlp.gate_up_proj" in text
    assert not (project / "out").exists()


def test_interrupted_write_leaves_nothing_that_looks_complete(capsys, project, checkpoint, monkeypatch):
    import tokq.quantization.formats.compressed_tensors as ct
    import tokq.quantization.streamed as streamed

    def interrupting(real):  # the in-memory writer, and the streamed walk's (the default)
        def write_then_interrupt(tensors, out):
            real(tensors, out)
            raise KeyboardInterrupt
        return write_then_interrupt

    monkeypatch.setattr(ct, "_write_safetensors", interrupting(ct._write_safetensors))
    monkeypatch.setattr(streamed, "_write_assembled", interrupting(streamed._write_assembled))
    code, _ = quantize(capsys, checkpoint, project / "out", "--method", "rtn", "--group-size", 32, "--name", "q")
    assert code == 130
    assert not (project / "out").exists()
    assert not list(project.glob(".out*")), "temporary directory left behind"
    assert not (project / "tokq.toml").exists(), "variant recorded for a checkpoint that was never written"


def test_fp8_with_alpha_smooths_before_fp8(capsys, project, checkpoint, docs):
    out = project / "fp8s"
    code, text = quantize(capsys, checkpoint, out, "--method", "fp8", "--alpha", "0.5", "--calib", docs,
                          "--num-samples", 4, "--seq-len", 64, "--json", project / "run.json")
    assert code == 0, text
    record = json.loads((project / "run.json").read_text())
    assert record["method"] == "fp8" and record["result"]["method"] == "smoothquant"
    assert record["result"]["options"]["alpha"] == 0.5 and record["result"]["calibration"]["num_samples"] == 4
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["weights"]["type"] == "float"
    assert config["config_groups"]["group_0"]["input_activations"]["dynamic"] is True
