"""longctx.windows: windows cover each document token exactly once, BOS and budgets behave."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokq.errors import ConfigError, ModelError
from tokq.longctx.documents import Document
from tokq.longctx.text_encoding import (
    HFTextEncoder,
    TextEncoder,
    as_text_encoder,
    count_tokens,
    tokenize_documents,
)
from tokq.longctx.windows import WindowConfigError, build_windows

BOS = 1


class ByteEncoder:
    """One token per UTF-8 byte, shifted past the special ids: real, deterministic, invertible."""

    def __init__(self, bos_token_id: int | None = BOS, add_bos: bool | None = None):
        self.bos_token_id = bos_token_id
        if add_bos is not None:
            self.add_bos = add_bos

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]


def doc(doc_id: str, n_tokens: int) -> Document:
    # Distinct bytes per position (cycling a-z) so misplaced windows cannot pass by accident.
    return Document(doc_id, Path(doc_id), "".join(chr(97 + i % 26) for i in range(n_tokens)))


def covered(windows, doc_id: str) -> list[int]:
    """The document tokens the windows of `doc_id` add, concatenated in order."""
    return [t for w in windows if w.doc_id == doc_id for t in w.tokens[w.score_from :]]


@pytest.mark.parametrize("add_bos", [False, True])
@pytest.mark.parametrize(("window", "stride"), [(8, None), (8, 4), (8, 1), (8, 7), (9, 3), (2, 1)])
def test_windows_cover_every_token_exactly_once(window: int, stride: int | None, add_bos: bool) -> None:
    enc = ByteEncoder()
    docs = [doc("a", 1), doc("b", 7), doc("c", 8), doc("d", 50), doc("e", 123)]
    ws = build_windows(docs, enc, window=window, stride=stride, add_bos=add_bos, min_window_tokens=0)
    for d in docs:
        assert covered(ws.windows, d.doc_id) == enc.encode(d.text)
    assert ws.n_new_tokens == sum(len(d.text) for d in docs)
    assert ws.n_tokens == sum(len(w.tokens) for w in ws.windows)
    assert ws.n_documents == len(docs)
    assert all(len(w.tokens) <= window for w in ws.windows)


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=120), min_size=1, max_size=4),
    window=st.integers(min_value=2, max_value=40),
    stride_frac=st.floats(min_value=0.01, max_value=1.0),
    add_bos=st.booleans(),
)
def test_coverage_property(lengths: list[int], window: int, stride_frac: float, add_bos: bool) -> None:
    enc = ByteEncoder()
    capacity = window - int(add_bos)
    stride = max(1, min(capacity, round(capacity * stride_frac)))
    docs = [doc(f"d{i}", n) for i, n in enumerate(lengths)]
    ws = build_windows(docs, enc, window=window, stride=stride, add_bos=add_bos, min_window_tokens=0)
    for d in docs:
        ids = enc.encode(d.text)
        assert covered(ws.windows, d.doc_id) == ids
        mine = [w for w in ws.windows if w.doc_id == d.doc_id]
        assert [w.window_index for w in mine] == list(range(len(mine)))
        for w in mine:
            # doc_positions maps window indices back to the document's token stream.
            assert [ids[p] for p in w.doc_positions] == [w.tokens[i] for i in w.positions]
            assert w.tokens[int(add_bos) :] == ids[w.start : w.start + len(w.tokens) - int(add_bos)]
            assert 0 <= w.score_from < len(w.tokens)


def test_score_from_values() -> None:
    enc = ByteEncoder()
    ws = build_windows([doc("a", 20)], enc, window=8, stride=5, add_bos=False, min_window_tokens=0)
    assert [(w.start, w.score_from, len(w.tokens)) for w in ws.windows] == [
        (0, 0, 8),
        (5, 3, 8),  # tokens 5..7 were in the first window
        (10, 3, 8),
        (15, 3, 5),  # the last window reaches the end of the document
    ]
    ws = build_windows([doc("a", 20)], enc, window=8, stride=5, add_bos=True, min_window_tokens=0)
    assert [(w.start, w.score_from, len(w.tokens)) for w in ws.windows] == [
        (0, 1, 8),
        (5, 3, 8),  # BOS + doc tokens 5,6 already seen
        (10, 3, 8),
        (15, 3, 6),
    ]


def test_bos_occupies_position_zero() -> None:
    enc = ByteEncoder()
    d = doc("a", 30)
    ws = build_windows([d], enc, window=10, add_bos=True, min_window_tokens=0)
    assert ws.stride == 9  # default: no overlap, window minus BOS
    assert all(w.tokens[0] == BOS and w.has_bos for w in ws.windows)
    assert [w.start for w in ws.windows] == [0, 9, 18, 27]
    assert all(w.score_from == 1 for w in ws.windows)
    assert [len(w.tokens) for w in ws.windows] == [10, 10, 10, 4]
    assert ws.n_tokens == 30 + 4  # one BOS per window
    assert ws.windows[0].scored_positions == range(1, 10)


def test_without_bos_first_position_is_not_scored() -> None:
    ws = build_windows([doc("a", 12)], ByteEncoder(), window=6, add_bos=False, min_window_tokens=0)
    first, second = ws.windows
    assert first.positions == range(0, 6)
    assert first.scored_positions == range(1, 6)  # token 0 has no context
    assert second.scored_positions == range(1, 6)
    assert not first.has_bos and first.tokens[0] != BOS


def test_add_bos_defaults_to_the_encoder() -> None:
    d = [doc("a", 20)]
    assert build_windows(d, ByteEncoder(add_bos=True), window=8).add_bos is True
    assert build_windows(d, ByteEncoder(add_bos=False), window=8).add_bos is False
    assert build_windows(d, ByteEncoder(), window=8).add_bos is False  # no attribute: no BOS


def test_bos_requested_without_a_bos_token_is_a_model_error() -> None:
    with pytest.raises(ModelError, match="no BOS token"):
        build_windows([doc("a", 20)], ByteEncoder(bos_token_id=None), window=8, add_bos=True)


@pytest.mark.parametrize(
    ("window", "stride", "add_bos", "match"),
    [
        (1, None, False, "window must be at least 2"),
        (8, 0, False, r"stride must be in 1\.\.8"),
        (8, 9, False, r"stride must be in 1\.\.8"),
        (8, 8, True, r"stride must be in 1\.\.7 \(window minus the BOS token\)"),
        (8, -2, True, "got -2"),
    ],
)
def test_bad_window_or_stride(window: int, stride: int | None, add_bos: bool, match: str) -> None:
    with pytest.raises(WindowConfigError, match=match) as err:
        build_windows([doc("a", 20)], ByteEncoder(), window=window, stride=stride, add_bos=add_bos)
    assert isinstance(err.value, ValueError) and isinstance(err.value, ConfigError)


def test_max_tokens_budget_stops_at_a_prefix() -> None:
    enc = ByteEncoder()
    docs = [doc("a", 50), doc("b", 50), doc("c", 50)]
    full = build_windows(docs, enc, window=16, add_bos=True, min_window_tokens=0)
    capped = build_windows(docs, enc, window=16, add_bos=True, min_window_tokens=0, max_tokens=70)
    assert capped.n_tokens <= 70
    assert capped.stopped_by == "max_tokens"
    assert capped.windows == full.windows[: len(capped.windows)]
    # The next window would have gone over: the budget was used as far as whole windows allow.
    assert capped.n_tokens + len(full.windows[len(capped.windows)].tokens) > 70
    again = build_windows(docs, enc, window=16, add_bos=True, min_window_tokens=0, max_tokens=70)
    assert again.windows == capped.windows
    assert full.stopped_by is None


def test_max_tokens_stops_tokenizing_later_documents() -> None:
    class CountingEncoder(ByteEncoder):
        calls: list[str] = []

        def encode(self, text: str) -> list[int]:
            self.calls.append(text)
            return super().encode(text)

    enc = CountingEncoder()
    build_windows([doc("a", 40), doc("b", 40), doc("c", 40)], enc, window=16, max_tokens=30)
    assert len(enc.calls) == 1


def test_max_windows() -> None:
    ws = build_windows([doc("a", 100), doc("b", 100)], ByteEncoder(), window=10, max_windows=12)
    assert len(ws) == 12
    assert ws.stopped_by == "max_windows"
    assert [w.doc_id for w in ws.windows].count("b") == 2
    assert ws.n_documents == 2


def test_short_tails_and_short_documents_are_dropped() -> None:
    enc = ByteEncoder()
    # 40 tokens, no overlap, window 16: windows of 16, 16 and an 8-token tail.
    ws = build_windows([doc("long", 40), doc("tiny", 5)], enc, window=16, min_window_tokens=10)
    assert [len(w.tokens) for w in ws.windows] == [16, 16]
    assert ws.dropped_tails == 1
    assert ws.dropped_documents == ["tiny"]
    assert ws.n_documents == 1
    assert ws.n_new_tokens == 32
    text = ws.summary()
    assert "dropped 1 tail windows under 10 tokens" in text
    assert "dropped 1 documents under 10 tokens" in text
    # With overlap the tail carries earlier tokens for context and is long enough to keep.
    ws = build_windows([doc("long", 40)], enc, window=16, stride=12, min_window_tokens=10)
    assert ws.dropped_tails == 0 and covered(ws.windows, "long") == enc.encode(doc("long", 40).text)


def test_encoded_tokens_are_used_instead_of_encoding_again() -> None:
    class RefusingEncoder(ByteEncoder):
        def encode(self, text: str) -> list[int]:
            raise AssertionError("should not encode")

    docs = [doc("a", 30)]
    encoded = tokenize_documents(docs, ByteEncoder())
    ws = build_windows(docs, RefusingEncoder(), window=8, encoded=encoded, min_window_tokens=0)
    assert covered(ws.windows, "a") == encoded["a"]


def test_count_tokens() -> None:
    docs = [doc("a", 3), Document("b", Path("b"), "héllo")]
    assert count_tokens(docs, ByteEncoder()) == {"a": 3, "b": 6}


def test_window_set_summary_and_dict() -> None:
    ws = build_windows([doc("a", 100)], ByteEncoder(), window=32, stride=16, add_bos=True, max_windows=3)
    text = ws.summary()
    assert text.startswith("3 windows of up to 32 tokens (stride 16, overlap 15, BOS first) from 1 documents")
    assert "stopped early at max_windows" in text
    d = ws.to_dict()
    assert d["n_windows"] == 3 and d["n_tokens"] == 96 and d["n_new_tokens"] == 31 + 16 + 16


# --- the transformers adapter, on a tokenizer built here (no files, no network) -----------------


def tiny_hf_tokenizer(with_bos: bool = True):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "the": 2, "cat": 3, "sat": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    kwargs = {"bos_token": "<s>"} if with_bos else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", **kwargs)


def test_hf_text_encoder_encodes_without_special_tokens() -> None:
    enc = as_text_encoder(tiny_hf_tokenizer(), add_bos=True)
    assert isinstance(enc, HFTextEncoder) and isinstance(enc, TextEncoder)
    assert enc.bos_token_id == 1 and enc.add_bos is True
    assert enc.encode("the cat sat on") == [2, 3, 4, 0]
    ws = build_windows([Document("x", Path("x"), "the cat sat the cat")], enc, window=4, min_window_tokens=0)
    assert [w.tokens for w in ws.windows] == [[1, 2, 3, 4], [1, 2, 3]]


def test_hf_text_encoder_without_bos_token() -> None:
    enc = as_text_encoder(tiny_hf_tokenizer(with_bos=False), add_bos=False)
    assert enc.bos_token_id is None
    with pytest.raises(ModelError, match="needs a BOS token"):
        as_text_encoder(tiny_hf_tokenizer(with_bos=False), add_bos=True)


def test_sample_spreads_over_documents_deterministically():
    docs = [Document(f"d{i}.txt", Path(f"d{i}.txt"), " ".join(["w"] * 100)) for i in range(10)]

    class Words:
        bos_token_id = 0

        def encode(self, text: str) -> list[int]:
            return [len(w) for w in text.split()]

    full = build_windows(docs, Words(), window=20)
    assert len(full) == 50
    sampled = full.sample(5)
    assert len(sampled) == 5 and sampled.n_documents == 5
    assert [w.doc_id for w in sampled.windows] == [w.doc_id for w in full.sample(5).windows]
    assert sampled.n_tokens == sum(len(w.tokens) for w in sampled.windows)
    assert "sampled 5 of 50" in sampled.summary()
    assert full.sample(500) is full
