"""Reading HF-style checkpoint directories (config.json + safetensors, single or sharded) into a model.

Only safetensors are read: pickle-based files (*.bin, *.pt, *.pth) can run code when loaded and are
refused with a message that says how to convert them. The files, their headers and the copy of a tensor
into its parameter are engine/safetensors_io.py's; quantized checkpoints (a `quantization_config`) load
through engine/quant_formats/. This module checks config.json against the weights and builds the model.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from tokq.dtypes import parse_dtype
from tokq.engine.config import ModelConfig, read_config
from tokq.engine.kv_scales import read_kv_scales
from tokq.engine.layers import rope_inverse_frequencies
from tokq.engine.models import CausalLM, build_model
from tokq.engine.quant_formats.base import QuantFormat
from tokq.engine.quant_formats.loader import load_quantized_weights, quant_format, read_quantization_config
from tokq.engine.safetensors_io import (
    TensorInfo,
    TensorTarget,
    check_all_filled,
    check_tied_copy,
    checkpoint_targets,
    copy_dense_tensor,
    iter_tensors,
    read_checkpoint_header,
    shape_error,
    sizes_named,
)
from tokq.errors import ModelError

# Tensors a checkpoint may hold that no module reads. Any other tensor the model does not use is an error
# (check_checkpoint_matches): it means config.json describes a different model than the weights.
IGNORED_SUFFIXES = (
    "rotary_emb.inv_freq",  # RoPE tables older exports save; the runtime recomputes them from config.json
)
# compressed-tensors' kv_cache_scheme scales: not a module's weights; load_model reads them (engine/kv_scales.py)
# when the quantization_config declares a kv_cache_scheme, and a checkpoint without one keeps them unread.
KV_SCALE_SUFFIXES = ("self_attn.k_scale", "self_attn.v_scale", "self_attn.kv_scale")
MIN_WEIGHT_BITS = 2  # the fewest bits any supported quantized layout stores per weight
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def _target_shape(target: TensorTarget) -> tuple[int, ...]:
    shape = tuple(target.param.shape)
    return shape if target.row_offset is None else (target.rows, *shape[1:])


def _layer_of(name: str) -> int | None:
    match = LAYER_NAME.match(name)
    return int(match.group(1)) if match else None


def _summary(names: set[str], header: dict[str, TensorInfo]) -> str:
    """'model.layers.2.*' for a layer all of whose tensors are named, else the names; three at most."""
    parts: list[str] = []
    for layer in sorted({_layer_of(n) for n in names} - {None}):
        prefix = f"model.layers.{layer}."
        mine = {n for n in names if n.startswith(prefix)}
        whole = mine == {n for n in header if n.startswith(prefix)}
        parts.extend([f"{prefix}*"] if whole else sorted(mine))
    parts.extend(sorted(n for n in names if _layer_of(n) is None))
    more = f" and {len(parts) - 3} more" if len(parts) > 3 else ""
    return ", ".join(parts[:3]) + more


def _layers_hint(config: ModelConfig, names: set[str], header: dict[str, TensorInfo], beyond: int) -> str:
    """Names all in layers >= `beyond`: the layer count disagrees, which the message says."""
    layers = [_layer_of(n) for n in names]
    if not layers or None in layers or min(layers) < beyond:
        return ""
    held = max((i for i in map(_layer_of, header) if i is not None), default=-1) + 1
    return f": config.json num_hidden_layers = {config.num_layers} does not match the {held} layers the safetensors hold"


def _ignored(name: str, config: ModelConfig, quantized: bool) -> bool:
    """Tensors a checkpoint may carry that the model legitimately leaves unread (see IGNORED_SUFFIXES)."""
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return True  # tied: the head is embed_tokens.weight; some exports save the copy anyway
    return name.endswith(IGNORED_SUFFIXES) or (quantized and name.endswith(KV_SCALE_SUFFIXES))


def check_checkpoint_matches(model: CausalLM, header: dict[str, TensorInfo], checkpoint_dir: Path,
                             fmt: QuantFormat | None = None) -> None:
    """config.json against the weights, before anything is allocated: `model` is built on the meta device and
    `header` comes from the safetensors headers (no tensor data read). Every parameter needs its tensor, with
    its shape (a quantized projection: storage for at least MIN_WEIGHT_BITS a weight), and every tensor must
    be used: a config with fewer layers than the weights would otherwise run a truncated model silently."""
    config, keys = model.config, set(header)
    targets = checkpoint_targets(model)
    used: set[str] = set()
    missing: set[str] = set()
    for name, target in targets.items():
        expected, shard = _target_shape(target), name.rpartition(".")[0]
        quantized = fmt is not None and name.endswith(".weight") and fmt.is_quantized(shard, keys)
        if quantized:
            parts = {f"{shard}.{s}" for s in fmt.suffixes} & keys
            used |= parts
            stored = sum(header[p].nbytes for p in parts) * 8
            if name not in header and stored < MIN_WEIGHT_BITS * math.prod(expected):
                raise ModelError(f"{checkpoint_dir}: {shard} holds {stored // 8} bytes of quantized weights but "
                                 f"config.json implies a {list(expected)} matrix{sizes_named(config, expected)}, "
                                 "more than any supported layout fits there; the weights and config.json do not "
                                 "belong together")
        if name in header:
            if header[name].shape != expected:
                raise shape_error(config, checkpoint_dir, name, header[name].shape, expected)
            used.add(name)
        elif not quantized:
            missing.add(name)
    if missing:
        shown = sorted(missing)[:3]
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        held = max((i for i in map(_layer_of, header) if i is not None), default=-1) + 1
        raise ModelError(f"{checkpoint_dir}: weights missing from the safetensors: {', '.join(shown)}{more}"
                         f"{_layers_hint(config, missing, header, held)}")
    # A bias the model has no use for is harmless when it is zero (old GPTQ exports save one for every
    # projection); copy_dense_tensor checks that when it reads the data.
    zero_bias = {n for n in keys if n.endswith(".bias") and f"{n[:-5]}.weight" in targets}
    unused = {n for n in keys - used - zero_bias if not _ignored(n, config, fmt is not None)}
    if unused:
        raise ModelError(f"{checkpoint_dir}: the checkpoint holds {len(unused)} tensor(s) the model does not use "
                         f"({_summary(unused, header)}){_layers_hint(config, unused, header, config.num_layers)}; "
                         "the weights and config.json do not belong together")



def load_weights(model: CausalLM, checkpoint_dir: Path, dtype: torch.dtype) -> None:
    targets = checkpoint_targets(model)
    filled: set[str] = set()
    head = None
    for name, tensor in iter_tensors(checkpoint_dir):
        if name == "lm_head.weight":
            head = tensor
        copy_dense_tensor(model, targets, name, tensor, dtype, checkpoint_dir, filled)
    check_all_filled(targets, filled, checkpoint_dir)
    check_tied_copy(model, head, checkpoint_dir)


def _meta_model(config: ModelConfig) -> CausalLM:
    """The model's modules on the meta device: shapes only, nothing allocated."""
    with torch.device("meta"):
        return build_model(config)


def _materialize(model: CausalLM, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    """A meta model's modules with uninitialized weights on `device` (RoPE tables computed, embeddings tied)."""
    config = model.config
    model = model.to_empty(device=torch.device(device)).to(dtype)
    # Buffers (RoPE inverse frequencies) are recomputed in fp32 after leaving the meta device.
    for kind, rot in model.rotary.items():
        rot.inv_freq = rope_inverse_frequencies(config.rope[kind], config.head_dim).to(device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _empty_model(config: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    """The model's modules with uninitialized weights on `device` (RoPE tables computed, embeddings tied)."""
    return _materialize(_meta_model(config), dtype, device)


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
    # Quantized checkpoints (compressed-tensors, AutoGPTQ, AutoAWQ) load into quantized Linears.
    quantization = read_quantization_config(checkpoint_dir, config.raw)
    fmt = None if quantization is None else quant_format(quantization, str(checkpoint_dir / "config.json"))
    # config.json against the tensor shapes in the safetensors headers before anything is allocated: a
    # damaged hidden_size (10^9) must fail here, not allocate 844 GB.
    header = read_checkpoint_header(checkpoint_dir)
    meta = _meta_model(config)
    check_checkpoint_matches(meta, header, checkpoint_dir, fmt)
    model = _materialize(meta, torch_dtype, device)
    model.name = str(checkpoint_dir)
    if fmt is None:
        load_weights(model, checkpoint_dir, torch_dtype)
    else:
        load_quantized_weights(model, checkpoint_dir, torch_dtype, quantization, fmt)
    model.kv_scales = read_kv_scales(checkpoint_dir, quantization, config.num_layers, config.num_kv_heads)
    return model.eval()
