"""Perplexity scoring on a tiny random model: chunked log-softmax, overlap handling, aggregation."""

from __future__ import annotations

import math

import torch

from tests.test_models_vs_hf import BASE, make_hf_checkpoint
from tokq.engine.checkpoint import load_model
from tokq.evalsuite.perplexity import score_windows, token_nll
from tokq.longctx.documents import Document
from tokq.longctx.windows import build_windows


class IdEncoder:
    """Text of space-separated integers -> those ids (a real, deterministic encoder for tests)."""

    bos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]


def test_chunked_nll_equals_full_log_softmax(tmp_path):
    make_hf_checkpoint("gemma3", tmp_path)
    model = load_model(tmp_path)
    ids = torch.randint(1, BASE["vocab_size"], (50,), generator=torch.Generator().manual_seed(0))
    logits = model.logits(ids[None])[0, :-1]
    expected = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
    torch.testing.assert_close(token_nll(model, ids, chunk=7), expected, rtol=1e-5, atol=1e-5)


def test_overlapping_windows_score_every_token_once(tmp_path):
    make_hf_checkpoint("llama", tmp_path)
    model = load_model(tmp_path)
    gen = torch.Generator().manual_seed(1)
    docs = [Document(f"d{i}.txt", tmp_path / f"d{i}.txt", " ".join(str(int(t)) for t in
                     torch.randint(1, BASE["vocab_size"], (n,), generator=gen))) for i, n in enumerate((130, 77))]
    for add_bos in (False, True):
        windows = build_windows(docs, IdEncoder(), window=48, stride=20, add_bos=add_bos, min_window_tokens=1)
        result = score_windows(model, windows.windows)
        by_doc = {d.doc_id: d for d in result.documents}
        # With BOS every document token is predicted once; without, the very first token has no context.
        assert by_doc["d0.txt"].tokens == 130 - (0 if add_bos else 1)
        assert by_doc["d1.txt"].tokens == 77 - (0 if add_bos else 1)
        assert result.tokens == sum(d.tokens for d in result.documents)
        total = sum(d.nll_sum for d in result.documents)
        assert math.isclose(result.perplexity, math.exp(total / result.tokens))
        assert 1.0 < result.perplexity < 10 * BASE["vocab_size"]


def test_more_context_does_not_change_first_window(tmp_path):
    """A document's first window scores the same whatever the stride: windows are independent forwards."""
    make_hf_checkpoint("qwen2", tmp_path)
    model = load_model(tmp_path)
    text = " ".join(str(i % 200 + 1) for i in range(100))
    doc = [Document("d.txt", tmp_path / "d.txt", text)]
    a = score_windows(model, build_windows(doc, IdEncoder(), window=40, stride=40, max_windows=1).windows)
    b = score_windows(model, build_windows(doc, IdEncoder(), window=40, stride=10, max_windows=1).windows)
    assert a.documents[0].nll_sum == b.documents[0].nll_sum
