"""Bad checkpoints get one clear error naming the file and the fix; good sharded ones load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.test_models_vs_hf import BASE, make_hf_checkpoint
from tokq.engine.checkpoint import load_model
from tokq.engine.config import parse_config, read_config
from tokq.errors import ModelError


def test_missing_directory_names_it(tmp_path):
    with pytest.raises(ModelError, match=r"nowhere does not exist.*tokq models list"):
        load_model(tmp_path / "nowhere")


def test_missing_config(tmp_path):
    with pytest.raises(ModelError, match=r"config.json is missing"):
        read_config(tmp_path)


def test_invalid_json_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"not valid JSON"):
        read_config(tmp_path)


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8}))
    with pytest.raises(ModelError) as err:
        read_config(tmp_path)
    msg = str(err.value)
    assert "GPT2LMHeadModel is not supported" in msg
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"):
        assert arch in msg


def test_unsupported_rope_type(tmp_path):
    cfg = {**BASE, "architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ModelError, match=r"RoPE scaling type 'yarn' is not supported"):
        parse_config(cfg)


def test_truncated_safetensors(tmp_path):
    make_hf_checkpoint("llama", tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match=r"model.safetensors is truncated or corrupt.*download or convert it again"):
        load_model(tmp_path)


def test_garbage_safetensors(tmp_path):
    make_hf_checkpoint("llama", tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ModelError, match=r"not a valid safetensors file"):
        load_model(tmp_path)


def test_pickle_only_checkpoint_is_refused(tmp_path):
    make_hf_checkpoint("llama", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(ModelError, match=r"only pickle weights \(pytorch_model.bin\).*never loads pickles"):
        load_model(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    make_hf_checkpoint("llama", tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelError, match=r"weights missing.*model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path)


def test_shape_mismatch_is_named(tmp_path):
    make_hf_checkpoint("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"mlp.(gate|down)_proj.weight has shape .* do not belong together"):
        load_model(tmp_path)


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    hf = make_hf_checkpoint("qwen3", single)
    hf.save_pretrained(sharded, safe_serialization=True, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, BASE["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
    a = load_model(single).logits(ids)
    b = load_model(sharded).logits(ids)
    assert torch.equal(a, b)


def test_missing_shard_is_named(tmp_path):
    hf = make_hf_checkpoint("llama", tmp_path / "a")
    hf.save_pretrained(tmp_path / "b", safe_serialization=True, max_shard_size="20KB")
    shards = sorted((tmp_path / "b").glob("model-*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(ModelError, match=rf"{shards[-1].name}.*missing"):
        load_model(tmp_path / "b")


def test_transformers_v4_config_layout():
    """Older config.json files: rope_theta + rope_scaling, Gemma 3's rope_local_base_freq and window pattern."""
    llama = parse_config({**BASE, "architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0,
                          "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})
    assert llama.rope["full_attention"].rope_type == "llama3" and llama.rope["full_attention"].theta == 500000.0
    gemma = parse_config({**BASE, "architectures": ["Gemma3ForCausalLM"], "head_dim": 32, "sliding_window": 512,
                          "sliding_window_pattern": 6, "num_hidden_layers": 12, "rope_theta": 1e6,
                          "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                          "query_pre_attn_scalar": 256})
    assert gemma.layer_types.count("full_attention") == 2 and gemma.layer_types[5] == "full_attention"
    assert gemma.rope["sliding_attention"].theta == 1e4 and gemma.rope["sliding_attention"].rope_type == "default"
    assert gemma.rope["full_attention"].factor == 8.0
    assert gemma.attn_scale == pytest.approx(256**-0.5)
    assert gemma.layer_window(0) == 512 and gemma.layer_window(5) is None


def test_multimodal_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                       "text_config": {"hidden_size": 8}}))
    with pytest.raises(ModelError, match=r"multimodal checkpoints"):
        read_config(tmp_path)
