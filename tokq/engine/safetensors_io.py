"""Reading safetensors checkpoints into a model: the pieces the dense loader (engine/checkpoint.py) and the
quantized loader (engine/quant_formats/) share.

Files: which safetensors files make up a checkpoint (the shard index's, else the folder's one file; pickles
are refused), their headers validated against the file sizes before torch maps any data, and the tensors
themselves. Targets: where each checkpoint tensor goes in the model (a parameter, or a row range of a
merged Linear), and the copy of a 16/32-bit tensor there with its shape checked.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tokq.dtypes import SAFETENSORS_DTYPE_BYTES
from tokq.engine.config import ModelConfig, checkpoint_file
from tokq.engine.layers import Linear
from tokq.engine.models import CausalLM
from tokq.errors import ModelError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_MAX_HEADER = 100_000_000  # safetensors' own limit: a longer header is damage, not a model


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
    width = SAFETENSORS_DTYPE_BYTES.get(dtype)
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


def sizes_named(config: ModelConfig, expected: tuple[int, ...], actual: tuple[int, ...] | None = None) -> str:
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


def shape_error(config: ModelConfig, checkpoint_dir: Path, name: str, actual: tuple[int, ...],
                 expected: tuple[int, ...]) -> ModelError:
    return ModelError(f"{checkpoint_dir}: tensor {name} has shape {actual} but config.json implies {expected}"
                      f"{sizes_named(config, expected, actual)}; the weights and config.json do not belong together")


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
        raise shape_error(model.config, checkpoint_dir, name, tuple(tensor.shape), tuple(dest.shape))
    dest.copy_(tensor.to(dtype))
    filled.add(name)


def check_tied_copy(model: CausalLM, head: torch.Tensor | None, checkpoint_dir: Path) -> None:
    """With tie_word_embeddings the head is embed_tokens.weight and a saved lm_head.weight is left unread, which is
    right only for the identical copy some exports save: a distinct one would be dropped silently (the model then
    computes other logits than the checkpoint was trained to give)."""
    if head is None or not model.config.tie_word_embeddings:
        return
    embed = model.model.embed_tokens.weight
    if tuple(head.shape) != tuple(embed.shape) or not torch.equal(head.to(embed.dtype).to(embed.device), embed.data):
        raise ModelError(f"{checkpoint_dir}: config.json says tie_word_embeddings = true, but the checkpoint holds an "
                         "lm_head.weight that differs from model.embed_tokens.weight, which tying would drop: set "
                         "tie_word_embeddings to false in config.json to use it (or remove lm_head.weight)")


def check_all_filled(targets: dict[str, TensorTarget], filled: set[str], checkpoint_dir: Path) -> None:
    missing = sorted(set(targets) - filled)
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelError(f"{checkpoint_dir}: weights missing from the safetensors: {', '.join(missing[:3])}{more}")
