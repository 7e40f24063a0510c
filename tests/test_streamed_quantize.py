"""The streamed quantization walk (quantization/streamed.py): the same checkpoint as the in-memory path, bit for
bit, with one decoder block's weights in memory at a time, and bad input refused with nothing left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.hostile.conftest import write_word_docs
from tests.test_models_vs_hf import make_hf_checkpoint
from tests.test_quantize_cli import save_word_tokenizer
from tokq.cli import main

CALIB = ["--num-samples", "4", "--seq-len", "64"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for case in ("llama", "gemma3"):  # gemma3: tied embeddings, (1 + w) norms, a pre-feedforward norm AWQ folds into
        make_hf_checkpoint(case, root / case)
        save_word_tokenizer(root / case)
        out[case] = root / case
    return out


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    return write_word_docs(tmp_path_factory.mktemp("docs"), (700, 700, 700))


def _quantize(capsys, model: Path, out: Path, *extra) -> tuple[int, str, dict | None]:
    record = out.parent / f"{out.name}.json"
    code = main([str(a) for a in ("quantize", "--model", model, "--out", out, "--threads", 1, "--json", record,
                                   *extra)])
    captured = capsys.readouterr()
    return code, captured.err + captured.out, json.loads(record.read_text()) if record.exists() else None


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("case,method,extra", [
    ("llama", "rtn", ["--group-size", "32"]),
    ("llama", "gptq", ["--group-size", "16", "--asym", *CALIB]),
    ("llama", "awq", ["--group-size", "32", *CALIB]),
    ("llama", "smoothquant", ["--alpha", "0.6", *CALIB]),
    ("llama", "fp8", []),
    ("gemma3", "gptq", ["--group-size", "32", *CALIB]),
    ("gemma3", "awq", ["--group-size", "32", *CALIB]),
])
def test_streamed_checkpoint_is_identical_to_the_in_memory_one(capsys, tmp_path, checkpoints, docs, case, method,
                                                               extra, monkeypatch):
    from tokq.quantization.streamed import SourceTensors

    monkeypatch.setattr(SourceTensors, "ROWS_BYTES", 1000)  # the embedding and LM head read a few rows at a time
    args = ("--method", method, "--calib", docs, *extra)
    code, text, memory = _quantize(capsys, checkpoints[case], tmp_path / "memory", *args, "--in-memory")
    assert code == 0, text
    code, text, streamed = _quantize(capsys, checkpoints[case], tmp_path / "streamed", *args)
    assert code == 0, text
    assert memory["walk"] == "in-memory" and streamed["walk"] == "streamed"  # the default streams
    a, b = _tensors(tmp_path / "memory"), _tensors(tmp_path / "streamed")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    for fname in ("config.json", "model.safetensors"):  # the same bytes: header, tensor order and all
        assert (tmp_path / "memory" / fname).read_bytes() == (tmp_path / "streamed" / fname).read_bytes(), fname
    assert not list((tmp_path / "streamed").glob(".tokq-scratch*")), "scratch files left in the checkpoint"
    blocks = streamed["result"]["blocks"]
    assert [b["block"] for b in blocks] == list(range(len(blocks))) and all(b["seconds"] >= 0 for b in blocks)
    assert streamed["peak_rss_mib"] > 0


def test_the_walk_holds_one_block_of_weights_at_a_time(tmp_path, checkpoints, docs, monkeypatch):
    from tokq.engine.config import read_config
    from tokq.engine.tokenizer import load_tokenizer, model_adds_bos
    from tokq.quantization.calibration import calibration_samples
    from tokq.quantization.methods import gptq
    from tokq.quantization.methods.options import MethodOptions
    from tokq.quantization.scheme import preset
    from tokq.quantization.streamed import quantize_streamed

    checkpoint = checkpoints["llama"]
    config = read_config(checkpoint)
    tokenizer = load_tokenizer(checkpoint)
    calibration = calibration_samples(docs, tokenizer, model_adds_bos(tokenizer), 4, 64)
    seen: list[tuple[str, int, list[int]]] = []
    model_ref = {}

    def materialized_layers(model) -> list[int]:
        """Layers holding any tensor that is not on the meta device (fp32 weights, or quantized codes)."""
        return [i for i, layer in enumerate(model.model.layers)
                if any(not t.is_meta for t in [*layer.parameters(), *layer.buffers()])]

    def watch(model, i):
        model_ref["model"] = model
        seen.append(("after", i, materialized_layers(model)))
        assert model.model.embed_tokens.weight.is_meta and model.lm_head.weight.is_meta

    real = gptq.quantize_block

    def spy(ctx, scheme, options):  # the peak: block ctx.index's fp32 weights are all live here
        model = model_ref.get("model")
        if model is not None:
            seen.append(("quantizing", ctx.index, materialized_layers(model)))
        fp32 = sum(p.numel() for p in ctx.block.parameters() if p.dtype == torch.float32 and not p.is_meta)
        assert fp32 == sum(p.numel() for p in ctx.block.parameters())
        return real(ctx, scheme, options)

    monkeypatch.setattr(gptq, "quantize_block", spy)
    quantize_streamed(checkpoint, config, "gptq", preset("w4a16").with_weights(group_size=32), calibration,
                      MethodOptions(), tmp_path / "out", watch=watch)
    layers = config.num_layers
    assert [(w, i) for w, i, _ in seen if w == "after"] == [("after", i) for i in range(layers)]
    # while block i is quantized or feeding the next one, no other block holds a tensor
    assert all(held == [i] for _w, i, held in seen), seen
    assert sum(w == "quantizing" for w, _i, _h in seen) == layers - 1  # blocks 1.. (the model is known from block 0)
    assert all(layer_param.is_meta for layer_param in model_ref["model"].model.layers.parameters())  # all released


def _copy(checkpoint: Path, folder: Path) -> Path:
    folder.mkdir()
    for f in checkpoint.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


def test_a_missing_block_tensor_is_one_line_and_leaves_no_folder(capsys, tmp_path, checkpoints, docs):
    broken = _copy(checkpoints["llama"], tmp_path / "broken")
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    code, text, _ = _quantize(capsys, broken, out, "--method", "gptq", "--group-size", 32, "--calib", docs, *CALIB)
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, text
    assert "model.layers.1.mlp.down_proj.weight" in errors[0] and "missing" in errors[0]
    assert not out.exists() and not list(tmp_path.glob(".out*")), "output or temporary folder left behind"


def test_a_failure_half_way_leaves_no_folder_and_no_scratch(capsys, tmp_path, checkpoints, docs):
    # block 2's weights are bad: blocks 0 and 1 were already quantized and written to scratch files
    broken = _copy(checkpoints["llama"], tmp_path / "broken")
    tensors = load_file(str(broken / "model.safetensors"))
    tensors["model.layers.2.mlp.up_proj.weight"][0, 0] = float("inf")
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    code, text, _ = _quantize(capsys, broken, out, "--method", "gptq", "--group-size", 32, "--calib", docs, *CALIB)
    assert code == 2 and "NaN/Inf" in text and "model.layers.2.mlp.gate_up_proj" in text, text
    assert not out.exists() and not list(tmp_path.glob(".out*")), "output or temporary folder left behind"


def test_the_streamed_file_is_what_safetensors_writes(tmp_path):
    from tokq.quantization.formats.streamed_safetensors import StreamedTensor, write_streamed

    tensors = {"b.weight": torch.randn(3, 5), "a.weight_packed": torch.randint(-9, 9, (4, 2), dtype=torch.int32),
               "a.weight_shape": torch.tensor([4, 16]), "norm": torch.randn(7).bfloat16(),
               "fp8": torch.randn(2, 3).to(torch.float8_e4m3fn), "i8": torch.ones(5, dtype=torch.int8)}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    reads = []

    def reader(name):
        def read():
            reads.append(name)
            return tensors[name]
        return read

    write_streamed([StreamedTensor(n, t.dtype, tuple(t.shape), reader(n)) for n, t in tensors.items()],
                   tmp_path / "streamed.safetensors", {"format": "pt"})
    assert (tmp_path / "ref.safetensors").read_bytes() == (tmp_path / "streamed.safetensors").read_bytes()
    assert sorted(reads) == sorted(tensors)  # each read once, when written
    with safe_open(str(tmp_path / "streamed.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("b.weight"), tensors["b.weight"])
