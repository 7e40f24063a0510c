"""What the hostile tests share: one tiny llama checkpoint with a word tokenizer (built once per session; a
test that damages a checkpoint copies it first) and folders of random-word documents."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.test_models_vs_hf import make_hf_checkpoint
from tests.test_quantize_cli import WORDS, save_word_tokenizer


def write_word_docs(folder: Path, lengths: tuple[int, ...], seed: int = 0) -> Path:
    """doc0.txt, doc1.txt, ... of `lengths[i]` random words each, in `folder` (created)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i, n in enumerate(lengths):
        (folder / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(n)) + "\n")
    return folder


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny 3-layer llama (vocab 211, hidden 64) with its word tokenizer: read it, never change it."""
    path = tmp_path_factory.mktemp("tiny") / "llama"
    make_hf_checkpoint("llama", path)
    save_word_tokenizer(path)
    return path
