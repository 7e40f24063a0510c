"""The baseline cache: A's top-k scores per window, kept under $TOKQ_HOME so a CI rerun scores only B.

Key: sha256 of (model hash, data hash, window, stride, max tokens, top-k, path, dtype, KV dtype, tokq
version). The model hash covers the checkpoint's config, weights and quantization files (content, so a
re-quantized checkpoint at the same path misses); the data hash covers the windows' token ids (documents
and tokenizer together). Any change gives a new key; old entries stay until `--clear-cache` or deletion.

An entry is a safetensors file (no pickle) plus a JSON manifest holding its sha256; a file whose checksum
does not match (corrupted, truncated) is reported and recomputed. Entries are written atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tokq import __version__
from tokq.evalsuite.ab import BaselineWindow
from tokq.longctx.windows import TokenWindow
from tokq.paths import atomic_write_text, tokq_home

log = logging.getLogger("tokq")
_CHUNK = 1 << 20
FORMAT = 2  # bump when what an entry holds or means changes (2: top-1 agreement counts ties)


def cache_dir() -> Path:
    return tokq_home() / "cache" / "baseline"


def _update_file(h, path: Path) -> None:
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)


def model_hash(checkpoint: Path) -> str:
    """sha256 over the checkpoint's config, quantization and weight files (names and contents)."""
    h = hashlib.sha256()
    checkpoint = Path(checkpoint)
    files = sorted(p for p in checkpoint.iterdir() if p.is_file() and (
        p.suffix == ".safetensors" or p.name in ("config.json", "quantize_config.json", "quant_config.json")))
    for path in files:
        h.update(path.name.encode())
        _update_file(h, path)
    return h.hexdigest()


def data_hash(windows: Sequence[TokenWindow]) -> str:
    """sha256 of every window's document id, start and token ids (the documents as this tokenizer reads them)."""
    h = hashlib.sha256()
    for w in windows:
        h.update(f"{w.doc_id}\0{w.start}\0{w.score_from}\0".encode())
        h.update(torch.tensor(w.tokens, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


def cache_key(**parts) -> str:
    text = json.dumps({**parts, "tokq_version": __version__, "format": FORMAT}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    _update_file(h, path)
    return h.hexdigest()


def load(key: str) -> tuple[list[BaselineWindow], dict] | None:
    """The cached windows for `key` and the entry's extra data (what `store` was given as `describe`), or
    None (missing, or failing its checksum: then it is recomputed)."""
    folder = cache_dir() / key
    manifest, data = folder / "manifest.json", folder / "scores.safetensors"
    if not manifest.is_file() or not data.is_file():
        return None
    try:
        meta = json.loads(manifest.read_text())
        if _file_sha(data) != meta["sha256"]:
            log.warning("baseline cache entry %s fails its checksum (corrupted); recomputing it", folder)
            return None
        tensors = load_file(str(data))
        windows = [BaselineWindow(tensors[f"{i}.logprob"], tensors[f"{i}.topk_ids"].long(),
                                  tensors[f"{i}.topk_logprobs"]) for i in range(meta["windows"])]
        return windows, meta.get("extra", {})
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        log.warning("baseline cache entry %s cannot be read (%s); recomputing it", folder, exc)
        return None


def store(key: str, windows: Sequence[BaselineWindow], describe: dict) -> tuple[Path, int]:
    """Write an entry (atomically: data first, then the manifest that vouches for it); (path, bytes)."""
    folder = cache_dir() / key
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, w in enumerate(windows):
        tensors[f"{i}.logprob"] = w.logprob.float().contiguous()
        tensors[f"{i}.topk_ids"] = w.topk_ids.to(torch.int32).contiguous()
        tensors[f"{i}.topk_logprobs"] = w.topk_logprobs.float().contiguous()
    tmp = folder / "scores.safetensors.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(folder / "scores.safetensors")
    data = folder / "scores.safetensors"
    atomic_write_text(folder / "manifest.json", json.dumps(
        {"windows": len(windows), "sha256": _file_sha(data), "bytes": data.stat().st_size, "extra": describe},
        indent=2))
    return folder, data.stat().st_size
