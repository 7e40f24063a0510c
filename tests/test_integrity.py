"""The baseline cache's integrity: an entry is used only for the key and inputs it was computed from; a folder
copied in from another key (a poisoned CI cache) is reported and recomputed, so a damaged candidate is not
compared with its own scores."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from tests.test_compare import compare, docs, models  # noqa: F401 (fixtures)
from tokq.evalsuite import baseline_cache
from tokq.evalsuite.ab import BaselineWindow


def _windows(seed: int) -> list[BaselineWindow]:
    g = torch.Generator().manual_seed(seed)
    return [BaselineWindow(torch.randn(5, generator=g), torch.randint(0, 50, (5, 3), generator=g),
                           torch.randn(5, 3, generator=g)) for _ in range(2)]


def _parts(model: str) -> dict:
    return dict(model=model, data="d" * 64, window=128, probes=[True, None, (0.0, 0.5), 0])


def test_entry_is_used_only_for_its_own_key_and_inputs(caplog):
    mine, theirs = _parts("a" * 64), _parts("b" * 64)
    key, other = baseline_cache.cache_key(**mine), baseline_cache.cache_key(**theirs)
    folder, _ = baseline_cache.store(key, _windows(0), {"floor": None}, key_parts=mine)
    hit = baseline_cache.load(key, key_parts=mine)  # tuples in key_parts compare equal to the JSON lists
    assert hit is not None and torch.equal(hit[0][1].topk_ids, _windows(0)[1].topk_ids)
    assert json.loads((folder / "manifest.json").read_text())["key"] == key

    # Copied under another key's name: the manifest says whose it is.
    shutil.copytree(folder, baseline_cache.cache_dir() / other)
    with caplog.at_level(logging.WARNING, logger="tokq"):
        assert baseline_cache.load(other, key_parts=theirs) is None
    assert str(baseline_cache.cache_dir() / other) in caplog.text and f"written for key {key}" in caplog.text

    # A manifest re-labelled with the other key still records the inputs it was made from.
    manifest = baseline_cache.cache_dir() / other / "manifest.json"
    meta = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**meta, "key": other}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tokq"):
        assert baseline_cache.load(other, key_parts=theirs) is None
    assert "do not hash to its key" in caplog.text

    # Recomputing overwrites the foreign entry with one of its own.
    baseline_cache.store(other, _windows(1), {"floor": None}, key_parts=theirs)
    assert baseline_cache.load(other, key_parts=theirs) is not None
    assert baseline_cache.load(other, key_parts=mine) is None  # same key, different recorded inputs


def test_poisoned_entry_is_recomputed_and_the_damaged_model_still_fails(capsys, models, docs, tmp_path,  # noqa: F811
                                                                        caplog):
    # The poison: the damaged model's own scores, as `tokq compare other other` caches them.
    _, poison, _ = compare(capsys, models["other"], models["other"], docs, tmp_path / "poison")
    code, honest, text = compare(capsys, models["a"], models["other"], docs, tmp_path / "honest", "--max-kl", "0.01")
    assert code == 1, text
    assert poison["cache"]["key"] != honest["cache"]["key"]
    target = baseline_cache.cache_dir() / honest["cache"]["key"]
    shutil.rmtree(target)
    shutil.copytree(baseline_cache.cache_dir() / poison["cache"]["key"], target)

    with caplog.at_level(logging.WARNING, logger="tokq"):
        code, result, text = compare(capsys, models["a"], models["other"], docs, tmp_path / "again", "--max-kl", "0.01")
    assert f"baseline cache entry {target} is not this key's entry" in caplog.text.replace("\n", " ")
    assert code == 1 and not result["cache"]["hit"], text  # used, the poison would give KL 0 and a pass
    kl = result["prefill"]["overall"]["kl"]
    assert kl["value"] == pytest.approx(honest["prefill"]["overall"]["kl"]["value"]) and kl["value"] > 0.01
    manifest = json.loads((target / "manifest.json").read_text())
    assert manifest["key"] == honest["cache"]["key"] and manifest["key_parts"]["model"] == honest["a"]["sha256"]
    assert compare(capsys, models["a"], models["other"], docs, tmp_path / "hit")[1]["cache"]["hit"]
