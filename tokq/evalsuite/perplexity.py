"""Perplexity of a model on tokenized document windows: per document and overall.

Each window is scored by one forward of the runtime. Token p of a window (p >= 1) is predicted from
the hidden state at p - 1; positions before a window's `score_from` were already scored by the
previous overlapping window of the same document and are skipped, so every document token is
counted exactly once. Log-softmax runs in fp32 over chunks of positions, so a 262K vocabulary
never needs the whole window's logits in memory at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tokq.engine.models import CausalLM


@dataclass
class DocumentScore:
    doc_id: str
    tokens: int = 0  # scored (predicted) tokens
    nll_sum: float = 0.0
    windows: int = 0
    non_finite: int = 0  # scored tokens whose NLL is NaN or inf: a broken model, not a number to report

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll) if self.tokens else float("nan")


@dataclass
class ScoreResult:
    documents: list[DocumentScore]
    seconds: float
    window_tokens: int  # tokens run through the model (including overlap and BOS)
    extra: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(d.tokens for d in self.documents)

    @property
    def mean_nll(self) -> float:
        return sum(d.nll_sum for d in self.documents) / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        """Token-weighted perplexity over all documents: exp(total NLL / total scored tokens)."""
        return math.exp(self.mean_nll)

    @property
    def non_finite(self) -> int:
        return sum(d.non_finite for d in self.documents)

    @property
    def tokens_per_second(self) -> float:
        return self.window_tokens / self.seconds if self.seconds else float("nan")

    def to_json(self) -> dict:
        return {
            "perplexity": self.perplexity,
            "mean_nll": self.mean_nll,
            "scored_tokens": self.tokens,
            "non_finite_tokens": self.non_finite,
            "window_tokens": self.window_tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "documents": [
                {"doc_id": d.doc_id, "tokens": d.tokens, "windows": d.windows, "mean_nll": d.mean_nll,
                 "perplexity": d.perplexity}
                for d in self.documents
            ],
            **self.extra,
        }


def token_nll(model: CausalLM, tokens: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """NLL (fp32) of tokens[1:] given their prefixes, one full forward; tokens is [T] -> [T - 1]."""
    with torch.inference_mode():
        hidden = model(tokens.unsqueeze(0))[0, :-1]
        targets = tokens[1:]
        out = torch.empty(targets.shape[0], dtype=torch.float32)
        for start in range(0, targets.shape[0], chunk):
            logits = model.compute_logits(hidden[start : start + chunk]).float()
            logprobs = torch.log_softmax(logits, dim=-1)
            out[start : start + chunk] = -logprobs.gather(-1, targets[start : start + chunk, None])[:, 0].cpu()
    return out


def score_windows(
    model: CausalLM,
    windows: Sequence,
    on_window: Callable[[int], None] | None = None,
) -> ScoreResult:
    """Score `longctx` TokenWindows (doc_id, tokens, score_from) and aggregate per document."""
    by_doc: dict[str, DocumentScore] = {}
    run_tokens = 0
    started = time.perf_counter()
    for window in windows:
        ids = torch.tensor(window.tokens, dtype=torch.long, device=model.device)
        nll = token_nll(model, ids)
        first = max(int(window.score_from), 1) - 1  # nll[i] is the NLL of token i + 1
        doc = by_doc.setdefault(window.doc_id, DocumentScore(window.doc_id))
        doc.tokens += int(nll.shape[0] - first)
        doc.nll_sum += float(nll[first:].double().sum())
        doc.non_finite += int((~torch.isfinite(nll[first:])).sum())
        doc.windows += 1
        run_tokens += len(window.tokens)
        if on_window:
            on_window(len(window.tokens))
    return ScoreResult(list(by_doc.values()), time.perf_counter() - started, run_tokens)
