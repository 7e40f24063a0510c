"""Passkey (needle) retrieval probes built from the user's own documents.

A probe is one prompt of exactly `context` tokens:

    [BOS]  instruction  filler[:pos]  needle  filler[pos:]  question

- the instruction says a pass key is hidden in the text that follows;
- the filler is the documents' text, concatenated in an order seeded per probe (documents
  repeat when they hold fewer tokens than the probe needs; `Probe.filler_doc` lists them);
- the needle "The pass key is 48213. Remember it. 48213 is the pass key." sits at `depth` of
  the filler (0.0: right after the instruction, 1.0: right before the question), snapped to
  the nearest line (or sentence/word, for long lines) boundary of the filler text;
- the question "What is the pass key? The pass key is" is left for the model to complete.

The format suits base models (they continue the text); chat models would need their template.
Every piece is encoded on its own and the ids concatenated, so the prompt length is exact.
Keys are 5-digit numbers drawn from a generator seeded by (seed, context, depth, repeat):
the same arguments always give the same probes, and keys differ between probes.

Contexts are taken as given: the caller must refuse contexts the model cannot hold. A probe
needs `context + max_new_tokens` positions, so pass
`default_contexts(max_model_len - max_new_tokens)` (`probe_scoring.run_probes` checks it against the
engine). `probe_grid` is that choice made once: the contexts, depths and repeats `tokq compare` runs,
and the probe count the gate's power check (evalsuite.power) sizes a flip-rate rule by.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokq.errors import ConfigError

from .documents import Document
from .text_encoding import HFTextEncoder, TextEncoder

INSTRUCTION = (
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about it.\n\n"
)
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"
DOCUMENT_SEPARATOR = "\n\n"  # between two documents of the filler
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_MAX_NEW_TOKENS = 8  # " 48213." is 7 tokens for digit-splitting tokenizers
KEY_DIGITS = 5
# Lines longer than this are split at sentence ends (else before a space) so the needle can land
# near any depth even in text without line breaks.
MAX_SEGMENT_CHARS = 120


class ProbeError(ConfigError, ValueError):
    """Probes that cannot be built or run as asked: a ConfigError for the CLI (exit 2) and a
    ValueError for library callers."""


@dataclass(frozen=True)
class Probe:
    """One passkey prompt. `prompt_ids[needle_start : needle_start + needle_tokens]` is the
    needle; the filler occupies `filler_tokens` tokens from `filler_start` (not counting the
    needle), `needle_offset` of them before the needle."""

    context: int  # target prompt length in tokens (len(prompt_ids) == context)
    depth: float  # requested depth 0.0 .. 1.0 of the needle in the filler
    key: str  # the pass key, e.g. "48213"
    prompt_ids: list[int] = field(repr=False)
    answer: str  # what a right answer contains (the key)
    filler_doc: str  # doc_ids the filler came from, in order, comma-separated (repeats listed again)
    repeat: int = 0  # index among probes of the same (context, depth)
    filler_start: int = 0
    filler_tokens: int = 0
    needle_start: int = 0
    needle_tokens: int = 0
    needle_offset: int = 0


def default_contexts(max_context: int, smallest: int = 1024) -> list[int]:
    """Powers of two from `smallest` up to `max_context`, then `max_context` itself when it is
    larger than the last one: 8192 -> [1024, 2048, 4096, 8192], 3000 -> [1024, 2048, 3000].
    A `max_context` below `smallest` gives [max_context]. Pass the model's context minus the
    tokens to generate (a probe of `context` tokens needs `context + max_new_tokens` positions)."""
    if max_context < 1 or smallest < 1:
        raise ProbeError(f"max_context ({max_context}) and smallest ({smallest}) must be positive")
    contexts = []
    n = smallest
    while n <= max_context:
        contexts.append(n)
        n *= 2
    if not contexts or contexts[-1] < max_context:
        contexts.append(max_context)
    return contexts


def evenly_spaced_depths(count: int) -> tuple[float, ...]:
    """`count` needle depths spread evenly over 0.0 .. 1.0 (5 -> 0, 0.25, 0.5, 0.75, 1; 1 -> the middle)."""
    if count < 1:
        raise ProbeError(f"probe depths must be at least 1, got {count}")
    if count == 1:
        return (0.5,)
    return tuple(i / (count - 1) for i in range(count))


@dataclass(frozen=True)
class ProbeGrid:
    """The probes one comparison runs: every (context, depth) `repeats` times, each with its own key."""

    contexts: tuple[int, ...]
    depths: tuple[float, ...]
    repeats: int

    @property
    def size(self) -> int:
        return len(self.contexts) * len(self.depths) * self.repeats


def probe_grid(window: int, probe_max_context: int | None, depths: Sequence[float] | int = DEFAULT_DEPTHS,
               repeats: int = 1, max_model_len: int | None = None,
               max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> ProbeGrid:
    """The probe grid of a comparison: contexts `default_contexts(min(probe_max_context or window,
    max_model_len - max_new_tokens))` (the engine's length unknown, e.g. when a config is checked before
    any model is loaded: the first term alone), `depths` (a count: evenly spaced) and `repeats`."""
    if isinstance(depths, int):
        depths = evenly_spaced_depths(depths)
    if repeats < 1:
        raise ProbeError(f"probe repeats must be at least 1, got {repeats}")
    longest = probe_max_context or window
    if max_model_len is not None:
        longest = min(longest, max_model_len - max_new_tokens)
    contexts = tuple(default_contexts(longest)) if longest >= 1 else ()
    return ProbeGrid(contexts, tuple(float(d) for d in depths), int(repeats))



def build_probes(
    documents: Iterable[Document],
    tokenizer: Any,
    contexts: Sequence[int],
    depths: Sequence[float] = DEFAULT_DEPTHS,
    seed: int = 0,
    *,
    add_bos: bool,
    repeats: int = 1,
) -> list[Probe]:
    """One probe per (context, depth, repeat), in that order, each exactly `context` tokens.

    `tokenizer` is a transformers tokenizer (encoded without special tokens) or a TextEncoder;
    `add_bos` puts its BOS token first (see tokq.engine.tokenizer.model_adds_bos). Contexts are
    used as given: refusing those beyond the model's context is the caller's job. Raises
    ProbeError (a ValueError) for no documents, documents without tokens, a depth outside
    [0, 1], or a context too small to hold the instruction, needle and question.
    """
    docs = list(documents)
    if not docs:
        raise ProbeError("no documents to take the probes' filler from: give at least one document")
    contexts = [int(c) for c in contexts]
    depths = [float(d) for d in depths]
    if not contexts or not depths:
        raise ProbeError(f"give at least one context and one depth (got {contexts} and {depths})")
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad:
        raise ProbeError(f"depths {bad} are outside 0.0 .. 1.0 (0 = start of the filler, 1 = its end)")
    if repeats < 1:
        raise ProbeError(f"repeats must be at least 1, got {repeats}")
    encoder = _as_encoder(tokenizer)
    prefix: list[int] = []
    if add_bos:
        if encoder.bos_token_id is None:
            raise ProbeError("add_bos is set but the tokenizer defines no BOS token: use add_bos=False")
        prefix = [int(encoder.bos_token_id)]
    prefix += _encode(encoder, INSTRUCTION)
    question = _encode(encoder, QUESTION)
    separator = _encode(encoder, DOCUMENT_SEPARATOR)
    sources = [_SegmentedDocument(d, encoder) for d in docs]

    probes: list[Probe] = []
    used_keys: set[str] = set()
    for context in contexts:
        for depth in depths:
            for repeat in range(repeats):
                rng = random.Random(f"tokq-passkey:{seed}:{context}:{depth!r}:{repeat}")
                key = _draw_key(rng, used_keys)
                needle = _encode(encoder, NEEDLE.format(key=key))
                budget = context - len(prefix) - len(needle) - len(question)
                if budget < 1:
                    raise ProbeError(
                        f"context {context} is too small for a probe: the instruction, needle and question "
                        f"alone take {context - budget} tokens; use contexts of at least {context - budget + 64}"
                    )
                order = list(range(len(sources)))
                rng.shuffle(order)
                filler, bounds, used = _filler([sources[i] for i in order], separator, budget)
                target = depth * budget
                pos = min(bounds, key=lambda b: (abs(b - target), b))
                ids = prefix + filler[:pos] + needle + filler[pos:] + question
                assert len(ids) == context
                probes.append(Probe(
                    context=context, depth=depth, key=key, prompt_ids=ids, answer=key,
                    filler_doc=", ".join(used), repeat=repeat, filler_start=len(prefix),
                    filler_tokens=budget, needle_start=len(prefix) + pos, needle_tokens=len(needle),
                    needle_offset=pos,
                ))
    return probes


def _as_encoder(tokenizer: Any) -> TextEncoder:
    """A transformers tokenizer is wrapped (no special tokens); a TextEncoder is used as is."""
    if isinstance(tokenizer, HFTextEncoder):
        return tokenizer
    if hasattr(tokenizer, "convert_ids_to_tokens"):  # a transformers tokenizer
        return HFTextEncoder(tokenizer, add_bos=False)  # BOS is added here, checked above
    if isinstance(tokenizer, TextEncoder):
        return tokenizer
    raise ProbeError(f"{type(tokenizer).__name__} is not a tokenizer: give a transformers tokenizer or a "
                     "TextEncoder (encode(text) -> ids, bos_token_id)")


def _encode(encoder: TextEncoder, text: str) -> list[int]:
    return [int(t) for t in encoder.encode(text)]


def _draw_key(rng: random.Random, used: set[str]) -> str:
    while True:
        key = str(rng.randint(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS - 1))  # no leading zero
        if key not in used:
            used.add(key)
            return key


_LINES = re.compile(r"[^\n]*\n|[^\n]+")
_SENTENCE_END = re.compile(r"[.!?](?=\s)")


def _segments(text: str) -> Iterator[str]:
    """The text cut into lines, and lines longer than MAX_SEGMENT_CHARS into sentences (pieces
    still too long: before a space); the pieces concatenate back to the text. The needle goes
    between two pieces."""
    for line in _LINES.findall(text):
        if len(line) <= MAX_SEGMENT_CHARS:
            yield line
            continue
        cuts = [0, *(m.end() for m in _SENTENCE_END.finditer(line)), len(line)]
        for start, end in zip(cuts, cuts[1:], strict=False):
            piece = line[start:end]
            while len(piece) > MAX_SEGMENT_CHARS:
                cut = piece.rfind(" ", 1, MAX_SEGMENT_CHARS)
                if cut <= 0:
                    cut = MAX_SEGMENT_CHARS
                yield piece[:cut]
                piece = piece[cut:]
            if piece:
                yield piece


class _SegmentedDocument:
    """A document's segments, encoded as far as some probe has needed them (each once)."""

    def __init__(self, doc: Document, encoder: TextEncoder):
        self.doc_id = doc.doc_id
        self._encoder = encoder
        self._pending = _segments(doc.text)
        self._encoded: list[list[int]] = []
        self._done = False

    def __iter__(self) -> Iterator[list[int]]:
        i = 0
        while True:
            if i == len(self._encoded):
                if self._done:
                    return
                piece = next(self._pending, None)
                if piece is None:
                    self._done = True
                    return
                self._encoded.append(_encode(self._encoder, piece))
            yield self._encoded[i]
            i += 1


def _filler(
    sources: list[_SegmentedDocument], separator: list[int], budget: int
) -> tuple[list[int], list[int], list[str]]:
    """`budget` filler tokens from the documents in order (cycling when they run out), the token
    offsets where the needle may go (segment boundaries, 0 and budget included), and the doc_ids
    used."""
    ids: list[int] = []
    bounds = [0]
    used: list[str] = []
    while len(ids) < budget:
        doc_tokens = 0
        for source in sources:
            if len(ids) >= budget:
                break
            if ids:
                ids += separator
                bounds.append(len(ids))
            used.append(source.doc_id)
            for piece in source:
                if len(ids) >= budget:
                    break
                ids += piece
                doc_tokens += len(piece)
                bounds.append(len(ids))
        if doc_tokens == 0 and len(ids) < budget:
            raise ProbeError(f"the documents {[s.doc_id for s in sources]} encode to no tokens: "
                             "give documents with text in them")
    del ids[budget:]
    bounds = sorted({b for b in bounds if b < budget} | {budget})
    return ids, bounds, used
