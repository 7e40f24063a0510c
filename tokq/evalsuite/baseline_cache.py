"""The baseline cache: A's top-k scores per window, kept under $TOKQ_HOME so a CI rerun scores only B.
With them, per window, what the full-vocabulary KL needs of A at the positions sampled for it (evalsuite.full_kl):
the rows, A's tail probabilities there (bf16, vocabulary wide), two float64 scalars per row, and the
inclusion probability.

Key: sha256 of (model hash, data hash, window, stride, max tokens, top-k, full-KL rows and seed, path, dtype,
KV dtype, tokq version). The model hash covers the checkpoint's config, weights and quantization files (content, so a
re-quantized checkpoint at the same path misses); the data hash covers the windows' token ids (documents
and tokenizer together). Any change gives a new key; old entries stay until `--clear-cache` or deletion.

An entry is a safetensors file (no pickle) plus a JSON manifest holding its sha256, its key and the inputs
the key was computed from (`key_parts`: model sha256, data sha256, settings). `load` uses an entry only when
the manifest's key is the requested key, its key_parts hash to that key and equal the requested key_parts:
a folder copied or renamed from another key (a CI cache of $TOKQ_HOME is writable by any job) is reported
and recomputed, as is a file whose checksum does not match (corrupted, truncated) or a manifest whose own
checksum does not (`manifest_sha256` covers every field, the probe results in `extra` too). Entries are written
atomically. This catches copied or stale entries, not a forger who writes a consistent manifest.
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
from tokq.evalsuite.full_kl import ATail
from tokq.longctx.windows import TokenWindow
from tokq.paths import atomic_write_text, plain_mode, tokq_home

log = logging.getLogger("tokq")
_CHUNK = 1 << 20
FORMAT = 5  # bump when what an entry holds or means changes (2: top-1 ties; 3: key and key_parts in the manifest;
# 4: A's tail at the full-KL sample; 5: the manifest's own checksum, over its extra part too)


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


def _plain(parts: dict) -> dict:
    """key_parts as the manifest reads them back (tuples become lists), so a stored copy compares equal."""
    return json.loads(json.dumps(parts, sort_keys=True))


def _foreign(meta: object, key: str, key_parts: dict | None) -> str | None:
    """Why the manifest does not vouch for an entry of `key` made from `key_parts`; None when it does."""
    if not isinstance(meta, dict):
        return "its manifest is not a JSON object"
    if meta.get("key") != key:
        return f"its manifest was written for key {meta.get('key')}"
    stored = meta.get("key_parts")
    if stored is None and key_parts is None:
        return None  # a caller that keys by name only: the key check above is all there is
    if not isinstance(stored, dict) or cache_key(**stored) != key:
        return "its recorded inputs do not hash to its key"
    if key_parts is not None and stored != _plain(key_parts):
        return "its recorded inputs differ from this run's"
    return None


def _full_of(tensors: dict[str, torch.Tensor], i: int) -> tuple:
    """(full_rows, A's tail, full_prob) of window i, or nothing kept."""
    if f"{i}.full_rows" not in tensors:
        return None, None, 0.0
    tail = ATail(tensors[f"{i}.tail_probs"], tensors[f"{i}.tail_plogp"], tensors[f"{i}.tail_lognorm"])
    return tensors[f"{i}.full_rows"].long(), tail, float(tensors[f"{i}.full_prob"][0])


def load(key: str, *, key_parts: dict | None = None) -> tuple[list[BaselineWindow], dict] | None:
    """The cached windows for `key` and the entry's extra data (what `store` was given as `describe`), or
    None (missing, failing its checksum, or not this key's entry: then it is recomputed). With `key_parts`
    (what `cache_key` was given) the manifest's recorded inputs must equal them."""
    folder = cache_dir() / key
    manifest, data = folder / "manifest.json", folder / "scores.safetensors"
    if not manifest.is_file() or not data.is_file():
        return None
    try:
        meta = json.loads(manifest.read_text())
        why = _foreign(meta, key, key_parts)
        if why:
            log.warning("baseline cache entry %s is not this key's entry (%s; copied from another key's folder?); "
                        "recomputing it", folder, why)
            return None
        if _file_sha(data) != meta["sha256"] or _manifest_sha(meta) != meta.get("manifest_sha256"):
            log.warning("baseline cache entry %s fails its checksum (corrupted or edited); recomputing it", folder)
            return None
        tensors = load_file(str(data))
        windows = [BaselineWindow(tensors[f"{i}.logprob"], tensors[f"{i}.topk_ids"].long(),
                                  tensors[f"{i}.topk_logprobs"], *_full_of(tensors, i)) for i in range(meta["windows"])]
        return windows, meta.get("extra", {})
    except (OSError, KeyError, ValueError, RuntimeError) as exc:
        log.warning("baseline cache entry %s cannot be read (%s); recomputing it", folder, exc)
        return None


def store(key: str, windows: Sequence[BaselineWindow], describe: dict, *,
          key_parts: dict | None = None) -> tuple[Path, int]:
    """Write an entry (atomically: data first, then the manifest that vouches for it); (path, bytes).
    The manifest records `key` and `key_parts` (the inputs it was computed from) for `load` to check;
    an existing entry in the folder (e.g. a foreign one `load` refused) is overwritten."""
    folder = cache_dir() / key
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, w in enumerate(windows):
        tensors[f"{i}.logprob"] = w.logprob.float().contiguous()
        tensors[f"{i}.topk_ids"] = w.topk_ids.to(torch.int32).contiguous()
        tensors[f"{i}.topk_logprobs"] = w.topk_logprobs.float().contiguous()
        if w.full_rows is not None:  # what the full KL needs of A at its sampled rows
            tensors[f"{i}.full_rows"] = w.full_rows.to(torch.int32).contiguous()
            tensors[f"{i}.tail_probs"] = w.tail.probs.contiguous()
            tensors[f"{i}.tail_plogp"] = w.tail.plogp.double().contiguous()
            tensors[f"{i}.tail_lognorm"] = w.tail.lognorm.double().contiguous()
            tensors[f"{i}.full_prob"] = torch.tensor([w.full_prob], dtype=torch.float64)
    tmp = folder / "scores.safetensors.tmp"
    save_file(tensors, str(tmp))
    plain_mode(tmp)  # safetensors writes 0600: the cache may be shared
    tmp.replace(folder / "scores.safetensors")
    data = folder / "scores.safetensors"
    meta = {"windows": len(windows), "sha256": _file_sha(data), "bytes": data.stat().st_size,
            "extra": _plain(describe), "key": key, "key_parts": _plain(key_parts) if key_parts is not None else None}
    atomic_write_text(folder / "manifest.json", json.dumps({**meta, "manifest_sha256": _manifest_sha(meta)}, indent=2))
    return folder, data.stat().st_size


def _manifest_sha(meta: dict) -> str:
    """sha256 over everything the manifest says (the data's checksum, the extra part with the probe results, the
    key and its inputs): a flipped probe or an edited count fails it as a corrupted file fails the data's."""
    fields = {k: v for k, v in meta.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
