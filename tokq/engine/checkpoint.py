"""Reading HF-style checkpoint directories (config.json + safetensors, single or sharded) into a model.

Only safetensors are read: pickle-based files (*.bin, *.pt, *.pth) can run code when loaded and are
refused with a message that says how to convert them.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from tokq.engine.config import ModelConfig, checkpoint_file, read_config
from tokq.engine.layers import Linear, rope_inverse_frequencies
from tokq.engine.models import CausalLM, build_model
from tokq.errors import ModelError

if TYPE_CHECKING:
    from tokq.engine.quant_checkpoint import QuantFormat

log = logging.getLogger("tokq")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_MAX_HEADER = 100_000_000  # safetensors' own limit: a longer header is damage, not a model
# Tensors a checkpoint may hold that no module reads. Any other tensor the model does not use is an error
# (check_checkpoint_matches): it means config.json describes a different model than the weights.
IGNORED_SUFFIXES = (
    "rotary_emb.inv_freq",  # RoPE tables older exports save; the runtime recomputes them from config.json
)
# compressed-tensors' kv_cache_scheme scales: tokq keeps a 16-bit KV cache (the loader warns), so they go unread.
KV_SCALE_SUFFIXES = ("self_attn.k_scale", "self_attn.v_scale", "self_attn.kv_scale")
MIN_WEIGHT_BITS = 2  # the fewest bits any supported quantized layout stores per weight
LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ModelError(f"dtype {name!r} is not supported: use one of fp32, bf16, fp16") from None


def _index_weight_map(index: Path) -> dict[str, str]:
    """The shard index's tensor name -> file name map, each file a plain name inside the checkpoint folder."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise ModelError(f"{index} is not a valid shard index ({exc!r}); restore it from the original checkpoint") from exc
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ModelError(f"{index}: weight_map is not an object of tensor name -> file name; restore it from the "
                         "original checkpoint")
    # A name with a folder in it ("../x.safetensors", "/etc/...") would read a file from outside the checkpoint.
    bad = sorted({v for v in weight_map.values() if Path(v).name != v or v in (".", "..") or not v.endswith(".safetensors")})
    if bad:
        raise ModelError(f"{index}: weight_map names {', '.join(map(repr, bad[:3]))}, not a safetensors file in the "
                         "checkpoint folder; restore the index from the original checkpoint")
    return weight_map


def safetensors_files(checkpoint_dir: Path) -> list[Path]:
    """The files to read: exactly those the shard index lists, else the folder's one safetensors file.

    Never every *.safetensors in the folder: a stray copy (model2.safetensors, an old export) would
    silently override the tensors of the real one.
    """
    checkpoint_dir = Path(checkpoint_dir)
    index = checkpoint_dir / INDEX_NAME
    if checkpoint_file(index):
        files = [checkpoint_dir / name for name in sorted(set(_index_weight_map(index).values()))]
        missing = [f.name for f in files if not checkpoint_file(f)]
        if missing:
            raise ModelError(f"{checkpoint_dir}: shard(s) {', '.join(missing)} named in {index.name} are missing; download them again")
        return files
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if len(files) > 1:
        raise ModelError(
            f"{checkpoint_dir} holds {len(files)} safetensors files ({', '.join(f.name for f in files)}) and no "
            f"{INDEX_NAME} saying which tensor is in which: remove the stray file(s), keeping model.safetensors, "
            "or restore the index from the original checkpoint")
    if files and checkpoint_file(files[0]):
        return files
    pickles = sorted(p.name for p in checkpoint_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelError(
            f"{checkpoint_dir} holds only pickle weights ({', '.join(pickles)}); tokq never loads pickles: "
            "convert them to safetensors first (e.g. save_pretrained(..., safe_serialization=True))"
        )
    raise ModelError(f"{checkpoint_dir} has no *.safetensors weights: a checkpoint directory needs config.json and model.safetensors")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it (no data read)."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: Path


def _header_entry(name: str, entry: object, start: int) -> tuple[int, int, str, tuple[int, ...]]:
    """One header entry's (begin, end, dtype, shape), checked as safetensors itself checks it."""
    if not isinstance(entry, dict):
        raise ValueError(f"entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
        raise ValueError(f"entry {name!r} needs dtype, shape and data_offsets [begin, end]")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in (*shape, *offsets)):
        raise ValueError(f"entry {name!r} has a shape or data offset that is not a non-negative integer")
    begin, end = offsets
    if begin != start or end < begin:
        raise ValueError(f"entry {name!r} has data_offsets {offsets}; the data must follow on from byte {start}")
    width = DTYPE_BYTES.get(dtype)
    if width is not None and end - begin != math.prod(shape) * width:
        raise ValueError(f"entry {name!r} ({dtype} {shape}) needs {math.prod(shape) * width} bytes, its offsets "
                         f"give {end - begin}")
    return begin, end, dtype, tuple(shape)


def _offsets_of(item: tuple[str, object]) -> list:
    """Sort key: an entry's data_offsets (entries are checked in file order; malformed ones sort first)."""
    entry = item[1]
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    return offsets if isinstance(offsets, list) and all(isinstance(o, int) for o in offsets) else []


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """The file's tensors from its header, validated against the file's size before torch maps any data."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            header_len = struct.unpack("<Q", f.read(8))[0]
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError(f"header length {header_len} exceeds the file size {size}")
            if header_len > SAFETENSORS_MAX_HEADER:
                raise ValueError(f"header length {header_len} exceeds safetensors' limit of {SAFETENSORS_MAX_HEADER}")
            header = json.loads(f.read(header_len))
        if not isinstance(header, dict):
            raise ValueError(f"the header is JSON {type(header).__name__}, not an object")
        entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=_offsets_of)
        tensors: dict[str, TensorInfo] = {}
        end = 0
        for name, entry in entries:
            begin, end, dtype, shape = _header_entry(name, entry, end)
            tensors[name] = TensorInfo(dtype, shape, end - begin, path)
    except (struct.error, ValueError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise ModelError(f"{path} is not a valid safetensors file ({exc}); download or convert it again") from exc
    if 8 + header_len + end != size:
        raise ModelError(
            f"{path} is truncated or corrupt: its header needs {8 + header_len + end} bytes, the file has {size}; "
            "download or convert it again"
        )
    return tensors


def read_checkpoint_header(checkpoint_dir: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint by name, from the headers of exactly the files it consists of."""
    checkpoint_dir = Path(checkpoint_dir)
    tensors: dict[str, TensorInfo] = {}
    for path in safetensors_files(checkpoint_dir):
        for name, info in read_safetensors_header(path).items():
            if name in tensors:
                raise ModelError(f"{checkpoint_dir}: tensor {name} is in both {tensors[name].file.name} and {path.name}, "
                                 "so one would silently override the other: remove the stray copy")
            tensors[name] = info
    index = checkpoint_dir / INDEX_NAME
    if checkpoint_file(index):
        for name, fname in _index_weight_map(index).items():
            if name not in tensors or tensors[name].file.name != fname:
                where = f"it is in {tensors[name].file.name}" if name in tensors else "no file the index lists holds it"
                raise ModelError(f"{index} lists tensor {name} in {fname} but {where}; restore the index (or the "
                                 "shards) from the original checkpoint")
    return tensors


def iter_tensors(checkpoint_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(checkpoint_dir):
        read_safetensors_header(path)
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


def _target_shape(target: TensorTarget) -> tuple[int, ...]:
    shape = tuple(target.param.shape)
    return shape if target.row_offset is None else (target.rows, *shape[1:])


def _sizes_named(config: ModelConfig, expected: tuple[int, ...], actual: tuple[int, ...] | None = None) -> str:
    """The config.json sizes behind the dimensions that differ (all of them when `actual` is None), e.g.
    ' (hidden_size = 1000000000)'."""
    sizes = {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
             "intermediate_size": config.intermediate_size, "head_dim": config.head_dim,
             "num_attention_heads x head_dim": config.num_heads * config.head_dim,
             "num_key_value_heads x head_dim": config.num_kv_heads * config.head_dim}
    if actual is None:
        differ = set(expected)
    else:
        differ = {e for e, a in zip(expected, actual, strict=False) if e != a} if len(expected) == len(actual) else set()
    named = [f"{k} = {v}" for k, v in sizes.items() if v in differ]
    return f" ({', '.join(named)})" if named else ""


def _shape_error(config: ModelConfig, checkpoint_dir: Path, name: str, actual: tuple[int, ...],
                 expected: tuple[int, ...]) -> ModelError:
    return ModelError(f"{checkpoint_dir}: tensor {name} has shape {actual} but config.json implies {expected}"
                      f"{_sizes_named(config, expected, actual)}; the weights and config.json do not belong together")


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
                                 f"config.json implies a {list(expected)} matrix{_sizes_named(config, expected)}, "
                                 "more than any supported layout fits there; the weights and config.json do not "
                                 "belong together")
        if name in header:
            if header[name].shape != expected:
                raise _shape_error(config, checkpoint_dir, name, header[name].shape, expected)
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


def copy_dense_tensor(model: CausalLM, targets: dict[str, TensorTarget], name: str, tensor: torch.Tensor,
                      dtype: torch.dtype, checkpoint_dir: Path, filled: set[str]) -> None:
    """Copy one 16/32-bit checkpoint tensor into its parameter (or merged-Linear rows), checking its shape.

    A tensor without a target was vetted by check_checkpoint_matches: ignorable, or a bias the model lacks,
    which must then be zero (a non-zero one would change the outputs the checkpoint was made to give).
    """
    target = targets.get(name)
    if target is None:
        if name.endswith(".bias") and bool(tensor.any()):
            raise ModelError(f"{checkpoint_dir}: tensor {name} is a non-zero bias but config.json gives that layer "
                             "none (attention_bias / mlp_bias); the weights and config.json do not belong together")
        return
    dest = target.param.data if target.row_offset is None else target.param.data.narrow(0, target.row_offset, target.rows)
    if tuple(tensor.shape) != tuple(dest.shape):
        raise _shape_error(model.config, checkpoint_dir, name, tuple(tensor.shape), tuple(dest.shape))
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
    # Quantized checkpoints (compressed-tensors, AutoGPTQ, AutoAWQ) load into quantized Linears;
    # quant_checkpoint builds on this module, hence the import here.
    from tokq.engine.quant_checkpoint import load_quantized_weights, quant_format, read_quantization_config

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
    return model.eval()
