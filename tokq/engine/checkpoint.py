"""Reading HF-style checkpoint directories (config.json + safetensors, single or sharded) into a model.

Only safetensors are read: pickle-based files (*.bin, *.pt, *.pth) can run code when loaded and are
refused with a message that says how to convert them.
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tokq.engine.config import ModelConfig, read_config
from tokq.engine.layers import Linear, rope_inverse_frequencies
from tokq.engine.models import CausalLM, build_model
from tokq.errors import ModelError

log = logging.getLogger("tokq")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Tensors some checkpoints carry that the runtime recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ModelError(f"dtype {name!r} is not supported: use one of fp32, bf16, fp16") from None


def safetensors_files(checkpoint_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files, from the shard index when there is one."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
            raise ModelError(f"{index} is not a valid shard index ({exc}); restore it from the original checkpoint") from exc
        files = [checkpoint_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelError(f"{checkpoint_dir}: shard(s) {', '.join(missing)} named in {index.name} are missing; download them again")
        return files
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in checkpoint_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelError(
            f"{checkpoint_dir} holds only pickle weights ({', '.join(pickles)}); tokq never loads pickles: "
            "convert them to safetensors first (e.g. save_pretrained(..., safe_serialization=True))"
        )
    raise ModelError(f"{checkpoint_dir} has no *.safetensors weights: a checkpoint directory needs config.json and model.safetensors")


def _check_safetensors_file(path: Path) -> None:
    """Reject truncated or corrupt files before torch maps them (the header says how long the file must be)."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            header_len = struct.unpack("<Q", f.read(8))[0]
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError("header length exceeds file size")
            header = json.loads(f.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path} is not a valid safetensors file ({exc}); download or convert it again") from exc
    if 8 + header_len + end != size:
        raise ModelError(
            f"{path} is truncated or corrupt: its header needs {8 + header_len + end} bytes, the file has {size}; "
            "download or convert it again"
        )


def iter_tensors(checkpoint_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(checkpoint_dir):
        _check_safetensors_file(path)
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except ModelError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt data
            raise ModelError(f"{path} could not be read ({exc}); download or convert it again") from exc


@dataclass
class TensorTarget:
    """Where a checkpoint tensor goes: a parameter, optionally a row range of a merged Linear."""

    param: torch.nn.Parameter
    row_offset: int | None = None
    rows: int | None = None


def checkpoint_targets(model: CausalLM) -> dict[str, TensorTarget]:
    """Checkpoint tensor name -> destination, derived from module names and Linear shards."""
    targets: dict[str, TensorTarget] = {}
    for module_name, module in model.named_modules():
        parent = module_name.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        if isinstance(module, Linear):
            for shard in module.shards:
                targets[f"{prefix}{shard.name}.weight"] = TensorTarget(module.weight, shard.offset, shard.size)
                if module.bias is not None:
                    targets[f"{prefix}{shard.name}.bias"] = TensorTarget(module.bias, shard.offset, shard.size)
        else:
            for pname, param in module.named_parameters(recurse=False):
                targets[f"{module_name}.{pname}"] = TensorTarget(param)
    if model.config.tie_word_embeddings:
        targets.pop("lm_head.weight", None)  # shares embed_tokens.weight
    return targets


def copy_dense_tensor(model: CausalLM, targets: dict[str, TensorTarget], name: str, tensor: torch.Tensor,
                      dtype: torch.dtype, checkpoint_dir: Path, filled: set[str]) -> None:
    """Copy one 16/32-bit checkpoint tensor into its parameter (or merged-Linear rows), checking its shape."""
    target = targets.get(name)
    if target is None:
        if not (name == "lm_head.weight" and model.config.tie_word_embeddings) and not name.endswith(IGNORED_SUFFIXES):
            log.warning("%s: tensor %s is not used by the %s runtime", checkpoint_dir, name, model.config.architecture)
        return
    dest = target.param.data if target.row_offset is None else target.param.data.narrow(0, target.row_offset, target.rows)
    if tuple(tensor.shape) != tuple(dest.shape):
        raise ModelError(
            f"{checkpoint_dir}: tensor {name} has shape {tuple(tensor.shape)} but config.json implies "
            f"{tuple(dest.shape)}; the weights and config.json do not belong together"
        )
    dest.copy_(tensor.to(dtype))
    filled.add(name)


def check_all_filled(targets: dict[str, TensorTarget], filled: set[str], checkpoint_dir: Path) -> None:
    missing = sorted(set(targets) - filled)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelError(f"{checkpoint_dir}: weights missing from the safetensors: {', '.join(missing[:3])}{more}")


def load_weights(model: CausalLM, checkpoint_dir: Path, dtype: torch.dtype) -> None:
    targets = checkpoint_targets(model)
    filled: set[str] = set()
    for name, tensor in iter_tensors(checkpoint_dir):
        copy_dense_tensor(model, targets, name, tensor, dtype, checkpoint_dir, filled)
    check_all_filled(targets, filled, checkpoint_dir)


def _empty_model(config: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    """The model's modules with uninitialized weights on `device` (RoPE tables computed, embeddings tied)."""
    with torch.device("meta"):
        model = build_model(config)
    model = model.to_empty(device=torch.device(device)).to(dtype)
    # Buffers (RoPE inverse frequencies) are recomputed in fp32 after leaving the meta device.
    for kind, rot in model.rotary.items():
        rot.inv_freq = rope_inverse_frequencies(config.rope[kind], config.head_dim).to(device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def random_model(config: ModelConfig, dtype: str | torch.dtype = "fp32", device: str | torch.device = "cpu",
                 seed: int = 0) -> CausalLM:
    """A model of `config` with random weights (N(0, 0.02), norms at their neutral value): for speed
    benchmarks on machines the checkpoint cannot reach; its outputs mean nothing, its costs are real."""
    model = _empty_model(config, parse_dtype(dtype), device)
    g = torch.Generator(device=torch.device(device)).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0 - config.norm_weight_offset)
            else:
                param.normal_(0.0, 0.02, generator=g)
    return model.eval()


def load_model(
    checkpoint_dir: str | Path, dtype: str | torch.dtype = "fp32", device: str | torch.device = "cpu"
) -> CausalLM:
    """Build tokq's runtime model for a checkpoint directory and load its weights."""
    checkpoint_dir = Path(checkpoint_dir)
    config: ModelConfig = read_config(checkpoint_dir)
    torch_dtype = parse_dtype(dtype)
    model = _empty_model(config, torch_dtype, device)
    # Quantized checkpoints (compressed-tensors, AutoGPTQ, AutoAWQ) load into quantized Linears;
    # quant_checkpoint builds on this module, hence the import here.
    from tokq.engine.quant_checkpoint import load_quantized_weights, read_quantization_config

    quantization = read_quantization_config(checkpoint_dir, config.raw)
    if quantization is None:
        load_weights(model, checkpoint_dir, torch_dtype)
    else:
        load_quantized_weights(model, checkpoint_dir, torch_dtype, quantization)
    return model.eval()
