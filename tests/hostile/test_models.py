"""Hostile or broken model checkpoints and configs: each is one clear ModelError (exit 2 on the CLI) naming
the file and the fix, raised before anything large is allocated; never a traceback, a huge allocation, or a
silently different model."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hostile.conftest import write_word_docs
from tests.test_models_vs_hf import BASE, make_hf_checkpoint
from tokq.cli import main
from tokq.engine.checkpoint import load_model
from tokq.engine.config import read_config
from tokq.engine.llm_engine import EngineConfig, EngineError, LLMEngine
from tokq.errors import ModelError


@pytest.fixture(scope="module")
def pristine(checkpoint) -> Path:
    return checkpoint


@pytest.fixture()
def ckpt(pristine, tmp_path) -> Path:
    """A fresh copy of the tiny 3-layer llama checkpoint (vocab 211, hidden 64) to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "m"))


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    return write_word_docs(tmp_path_factory.mktemp("hostile_docs"), (300, 300))


@pytest.fixture()
def no_allocation(monkeypatch):
    """Materializing the model's modules (to_empty) is where weights are allocated: it must not be reached."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("the model was allocated before config.json was checked against the weights")
    monkeypatch.setattr(torch.nn.Module, "to_empty", refuse)


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def score(capsys, model: Path, docs: Path) -> tuple[int, str]:
    code = main(["score", str(model), "--data", str(docs), "--window", "64", "--max-tokens", "128",
                 "--threads", "1"])
    return code, capsys.readouterr().err


def rewrite_header(path: Path, edit) -> None:
    """Replace a safetensors file's header JSON by edit(header) (data bytes unchanged)."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = edit(json.loads(data[8:8 + n]))
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def first_entry(header: dict) -> str:
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


# Config sizes, checked before anything is allocated -----------------------------------------------

def test_score_huge_hidden_size_fails_before_allocating(capsys, ckpt, docs, no_allocation):
    """Hostile: hidden_size 10^9 with a real 64-wide checkpoint tried to allocate 844 GB."""
    edit_config(ckpt, hidden_size=10**9, head_dim=16)
    code, err = score(capsys, ckpt, docs)
    assert code == 2, err
    assert "model.embed_tokens.weight has shape (211, 64)" in err and "hidden_size = 1000000000" in err
    assert "do not belong together" in err


def test_huge_intermediate_size_of_a_quantized_checkpoint_fails_before_allocating(tmp_path, no_allocation):
    """Hostile: intermediate_size 10^7 in a GPTQ checkpoint allocated the dense [10^7, 64] matrices first."""
    from tests.formats_writers import write_gptq_checkpoint

    hf = make_hf_checkpoint("llama", tmp_path / "dense")
    write_gptq_checkpoint(hf, tmp_path / "gptq")
    edit_config(tmp_path / "gptq", intermediate_size=10**7)
    with pytest.raises(ModelError, match=r"mlp.gate_proj holds \d+ bytes of quantized weights.*"
                                         r"intermediate_size = 10000000"):
        load_model(tmp_path / "gptq")


@pytest.mark.parametrize("field,value,message", [
    ("num_attention_heads", 0, r"num_attention_heads = 0 must be at least 1"),
    ("vocab_size", -5, r"vocab_size = -5 must be at least 1"),
    ("num_hidden_layers", 0, r"num_hidden_layers = 0 must be at least 1"),
    ("intermediate_size", -1, r"intermediate_size = -1 must be at least 1"),
    ("max_position_embeddings", 0, r"max_position_embeddings = 0 must be at least 1"),
    ("num_key_value_heads", 3, r"num_attention_heads = 4 is not a multiple of num_key_value_heads = 3"),
    ("head_dim", 15, r"head_dim = 15 is odd"),
    ("num_hidden_layers", 10**7, r"num_hidden_layers = 10000000 is more than tokq accepts"),
])
def test_config_size_out_of_range(ckpt, field, value, message):
    """Hostile: zero heads (a (64, 0) o_proj), a negative vocabulary (RuntimeError from torch), zero layers
    (a model of embeddings only), kv heads that do not divide the heads, 10^7 layers (a 10^7-entry list, then 10^7 modules)."""
    edit_config(ckpt, **{field: value})
    with pytest.raises(ModelError, match=rf"config.json: {message}"):
        read_config(ckpt)


def test_hidden_size_not_divisible_by_heads(ckpt):
    """Hostile: hidden_size 66 over 4 heads, no head_dim: the head size was silently floored to 16."""
    config = json.loads((ckpt / "config.json").read_text())
    del config["head_dim"]
    (ckpt / "config.json").write_text(json.dumps({**config, "hidden_size": 66}))
    with pytest.raises(ModelError, match=r"hidden_size = 66 is not a multiple of num_attention_heads = 4"):
        read_config(ckpt)


@pytest.mark.parametrize("raw", ["64.5", "true", '"64"', "NaN", "null", "[64]"])
def test_config_size_not_an_integer(ckpt, raw):
    """Hostile: hidden_size 64.5 or "64" was truncated by int() and loaded; true became a width of 1."""
    text = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(text.replace('"hidden_size": 64', f'"hidden_size": {raw}'))
    with pytest.raises(ModelError, match=r"config.json: hidden_size (= .* is not an integer|is missing)"):
        load_model(ckpt)


@pytest.mark.parametrize("field,value", [("rms_norm_eps", -1e-5), ("rope_theta", "NaN"), ("rms_norm_eps", 0)])
def test_config_float_out_of_range(ckpt, field, value):
    """Hostile: a negative or NaN rms_norm_eps / rope_theta loaded and turned every logit into NaN."""
    config = json.loads((ckpt / "config.json").read_text())
    (config["rope_parameters"] if field == "rope_theta" else config)[field] = value
    (ckpt / "config.json").write_text(json.dumps(config).replace('"NaN"', "NaN"))
    with pytest.raises(ModelError, match=rf"{field} = .* must be a positive number"):
        read_config(ckpt)


# Unused and missing tensors ----------------------------------------------------------------------

@pytest.mark.parametrize("layers", [1, 2])
def test_fewer_layers_than_the_weights_is_refused(ckpt, layers):
    """Hostile (silent wrong result): num_hidden_layers 2 with weights for 3 ran a truncated model."""
    edit_config(ckpt, num_hidden_layers=layers)
    dropped = ", ".join(f"model.layers.{i}.*" for i in range(layers, 3))
    with pytest.raises(ModelError, match=rf"holds {9 * (3 - layers)} tensor\(s\) the model does not use "
                                         rf"\({dropped}\): config.json num_hidden_layers = {layers} does not "
                                         r"match the 3 layers"):
        load_model(ckpt)


def test_more_layers_than_the_weights_is_refused_before_allocating(ckpt, no_allocation):
    """Hostile: num_hidden_layers 4000 with weights for 3 allocated 4000 layers before noticing."""
    edit_config(ckpt, num_hidden_layers=4000)
    with pytest.raises(ModelError, match=r"weights missing from the safetensors: model.layers.10.*: config.json "
                                         r"num_hidden_layers = 4000 does not match the 3 layers"):
        load_model(ckpt)


def test_stray_tensor_is_refused_and_legitimate_extras_are_not(ckpt):
    """Hostile (silent wrong result): a tensor no module reads was logged and dropped. Legitimately unread:
    RoPE inv_freq buffers and a zero bias where the config has none; a non-zero one changes the outputs."""
    weights = ckpt / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, weights)
    load_model(ckpt)  # both are fine

    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.full((64,), 0.5)
    save_file(tensors, weights)
    with pytest.raises(ModelError, match=r"q_proj.bias is a non-zero bias but config.json gives that layer none"):
        load_model(ckpt)

    del tensors["model.layers.0.self_attn.q_proj.bias"]
    tensors["model.vision_tower.proj.weight"] = torch.ones(4, 4)
    save_file(tensors, weights)
    with pytest.raises(ModelError, match=r"holds 1 tensor\(s\) the model does not use \(model.vision_tower.proj"):
        load_model(ckpt)


# Safetensors files -------------------------------------------------------------------------------

@pytest.mark.parametrize("header", [b"[]", b"5", b'"x"', b"null", b"[" * 100_000 + b"]" * 100_000])
def test_safetensors_header_not_an_object(ckpt, header):
    """Hostile: a header of valid JSON that is not an object: AttributeError ('list' object has no attribute
    'items'); a deeply nested one: RecursionError."""
    rewrite_header(ckpt / "model.safetensors", lambda _: header)
    with pytest.raises(ModelError, match=r"model.safetensors is not a valid safetensors file"):
        load_model(ckpt)


@pytest.mark.parametrize("offsets", ["negative", "overlapping", "beyond u64", "not a list"])
def test_safetensors_bad_data_offsets(ckpt, offsets):
    """Hostile: negative or overlapping data offsets reached safetensors' own parser, whose SafetensorError
    the quantized loader let through as a traceback; now the header is checked as safetensors checks it,
    before any loader opens the file, naming the file and the entry."""
    edit_config(ckpt, quantization_config={"quant_method": "gptq", "bits": 4})
    def edit(header: dict) -> dict:
        first = first_entry(header)
        begin, end = header[first]["data_offsets"]
        header[first]["data_offsets"] = {"negative": [-8, end], "overlapping": [begin, end + 4],
                                         "beyond u64": [begin, 2**64 + 1], "not a list": 7}[offsets]
        return header

    rewrite_header(ckpt / "model.safetensors", edit)
    with pytest.raises(ModelError, match=r"model.safetensors is not a valid safetensors file \(entry"):
        load_model(ckpt)


def test_score_stray_safetensors_does_not_override(capsys, ckpt, docs):
    """Hostile (silent wrong result): a stray model2.safetensors next to model.safetensors silently overrode
    its tensors (every *.safetensors was read, in name order)."""
    tensors = load_file(ckpt / "model.safetensors")
    save_file({"model.norm.weight": torch.zeros_like(tensors["model.norm.weight"])}, ckpt / "model2.safetensors")
    code, err = score(capsys, ckpt, docs)
    assert code == 2, err
    assert "2 safetensors files (model.safetensors, model2.safetensors)" in err and "remove the stray" in err


@pytest.fixture()
def sharded(tmp_path) -> Path:
    hf = make_hf_checkpoint("llama", tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="20KB")
    return tmp_path / "sharded"


def _index(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())


def test_index_naming_a_file_outside_the_folder_is_refused(sharded, tmp_path):
    """Hostile: an index whose weight_map names '../outside.safetensors' read a file outside the checkpoint."""
    index = _index(sharded)
    name, shard = next(iter(index["weight_map"].items()))
    shutil.copy(sharded / shard, tmp_path / "outside.safetensors")
    index["weight_map"][name] = "../outside.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match=r"weight_map names '../outside.safetensors', not a safetensors file in"):
        load_model(sharded)


def test_tensor_in_two_shards_is_refused(sharded):
    """Hostile (silent wrong result): a tensor present in two shards: the later file silently won."""
    index = _index(sharded)
    shards = sorted(set(index["weight_map"].values()))
    first, last = load_file(sharded / shards[0]), load_file(sharded / shards[-1])
    name = next(iter(first))
    save_file({**last, name: torch.zeros_like(first[name])}, sharded / shards[-1])
    with pytest.raises(ModelError, match=rf"tensor {name} is in both {shards[0]} and {shards[-1]}"):
        load_model(sharded)


def test_index_listing_a_tensor_its_shard_lacks_is_refused(sharded):
    """Hostile: an index mapping a tensor to the wrong shard was not noticed (the tensor was found elsewhere)."""
    index = _index(sharded)
    files = list(index["weight_map"].values())
    crowded = max(set(files), key=files.count)  # it stays listed after one of its tensors is moved
    name = next(n for n, s in index["weight_map"].items() if s == crowded)
    other = next(s for s in files if s != crowded)
    index["weight_map"][name] = other
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match=rf"lists tensor {name} in {other} but it is in {crowded}"):
        load_model(sharded)


# Symlinks ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "model.safetensors.index.json"])
def test_symlink_loop_in_the_checkpoint(ckpt, name):
    """Hostile: model.safetensors -> itself was an OSError traceback; config.json -> itself said 'missing';
    an index looping on itself was ignored and the folder's safetensors read instead."""
    (ckpt / name).unlink(missing_ok=True)
    os.symlink(name, ckpt / name)
    with pytest.raises(ModelError, match=rf"{name} cannot be read \(.*a symlink loop\?\)"):
        load_model(ckpt)


def test_symlink_loop_as_the_checkpoint_folder(capsys, tmp_path, docs):
    """Hostile: a checkpoint folder that is a symlink to itself was reported as not existing."""
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    code, err = score(capsys, tmp_path / "loop", docs)
    assert code == 2 and "is a symlink that leads nowhere (a loop or a missing target)" in err, err


def test_dangling_symlink_weights(ckpt):
    """Hostile: model.safetensors -> a file that is gone was reported as 'no *.safetensors weights'."""
    (ckpt / "model.safetensors").unlink()
    os.symlink(ckpt / "gone.safetensors", ckpt / "model.safetensors")
    with pytest.raises(ModelError, match=r"model.safetensors is a symlink to nothing"):
        load_model(ckpt)


# Token ids beyond the vocabulary -----------------------------------------------------------------

def test_score_tokenizer_bigger_than_the_embedding(capsys, ckpt, docs, tmp_path):
    """Hostile: a tokenizer of 301 tokens with a model of 211 embedding rows: IndexError deep in torch."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"v{i}" for i in range(300)]
    tok = Tokenizer(models.WordLevel({"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(ckpt))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "doc.txt").write_text(" ".join(words[::-1]) + "\n")
    code, err = score(capsys, ckpt, tmp_path / "d")
    assert code == 2, err
    assert "token id 300 is outside the vocabulary of" in err and str(ckpt) in err.replace("\n", "")
    assert "the tokenizer holds 301 tokens, its embedding has 211 rows" in err


def test_ids_given_directly_beyond_the_vocabulary(pristine):
    """Hostile: ids >= vocab_size given to the model (logits) or to the engine: IndexError deep in torch, or
    an engine error that named neither the model nor the embedding size."""
    model = load_model(pristine)
    vocab = BASE["vocab_size"]
    with pytest.raises(ModelError, match=rf"token id {vocab} is outside the vocabulary of {pristine} \(its "
                                         rf"embedding has {vocab} rows"):
        model.logits(torch.tensor([[1, 2, vocab]]))
    with pytest.raises(ModelError, match=r"token id -1 is outside the vocabulary"):
        model.logits(torch.tensor([[1, -1]]))
    engine = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=64))
    with pytest.raises(EngineError, match=rf"the prompt's token id {vocab + 5} is outside the vocabulary of "
                                          rf"{pristine} \(its embedding has {vocab} rows"):
        engine.add_request([1, vocab + 5])
    with pytest.raises(EngineError, match=rf"gather_ids: token id {vocab} is outside the vocabulary"):
        engine.score([[1, 2, 3]], gather_ids=[torch.tensor([[1], [vocab]])])
