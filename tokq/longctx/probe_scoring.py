"""Running passkey probes (`probes.build_probes`) on an engine and scoring the answers.

`run_probes` answers all probes greedily in one batched `engine.generate`; an answer is right when the
first 5-digit number in the output (`extract_key`) equals the key.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokq.engine.sampling import SamplingParams

from .probes import DEFAULT_MAX_NEW_TOKENS, KEY_DIGITS, Probe, ProbeError

# The first run of exactly five digits: "482130" is not an answer of 48213.
KEY_PATTERN = re.compile(rf"(?<!\d)\d{{{KEY_DIGITS}}}(?!\d)")


@dataclass(frozen=True)
class ProbeResult:
    """One probe's greedy answer and whether it was right."""

    context: int
    depth: float
    key: str
    answer: str
    output_text: str
    predicted: str | None  # the first 5-digit number in output_text, or None
    correct: bool
    repeat: int = 0
    filler_doc: str = ""


def extract_key(text: str) -> str | None:
    """The first 5-digit number in `text` (not part of a longer number), or None."""
    match = KEY_PATTERN.search(text)
    return match.group(0) if match else None


def run_probes(
    engine: Any,
    probes: Sequence[Probe],
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    *,
    tokenizer: Any = None,
    progress: Callable[[int], None] | None = None,
) -> list[ProbeResult]:
    """Greedy answers to every probe through one batched `engine.generate`, scored by exact
    match. The output text is the engine's (it needs a tokenizer) or, when it has none,
    `tokenizer.decode` of the generated ids. Raises ProbeError before running anything when a
    probe does not fit the engine's context with `max_new_tokens` after it."""
    probes = list(probes)
    if not probes:
        return []
    if max_new_tokens < 1:
        raise ProbeError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    limit = getattr(engine, "max_model_len", None)
    if limit is not None:
        too_long = sorted({p.context for p in probes if len(p.prompt_ids) + max_new_tokens > limit})
        if too_long:
            raise ProbeError(
                f"contexts {too_long} do not fit the engine's max_model_len {limit} with {max_new_tokens} "
                f"tokens to generate: use contexts up to {limit - max_new_tokens}"
            )
    decoder = tokenizer if tokenizer is not None else getattr(engine, "tokenizer", None)
    if decoder is None:
        raise ProbeError("run_probes reads the answers as text: give the engine a tokenizer or pass tokenizer=")
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    outputs = engine.generate([p.prompt_ids for p in probes], params, progress=progress)
    results = []
    for probe, out in zip(probes, outputs, strict=True):
        text = out.text
        if not text and out.token_ids and tokenizer is not None:
            text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        predicted = extract_key(text)
        results.append(ProbeResult(
            context=probe.context, depth=probe.depth, key=probe.key, answer=probe.answer,
            output_text=text, predicted=predicted, correct=predicted == probe.answer,
            repeat=probe.repeat, filler_doc=probe.filler_doc,
        ))
    return results
