"""How far a quantized model's next-token distributions sit from its base model's, token by token.

Both models run the same windows; at every scored position we take the full-vocabulary
distributions p (base) and q (quantized) in fp32 and record KL(p‖q) = Σ p (log p − log q), whether
the argmax agrees, and each model's NLL of the true next token. Per-token arrays are kept (not
only means) so callers can take tails (p99) and position profiles. Logits are processed in chunks
of positions so a 262K vocabulary never needs a whole window's logits at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tokq.engine.models import CausalLM


@dataclass
class TokenDivergence:
    """Per scored token (concatenated over windows): KL, top-1 agreement, both NLLs, position."""

    kl: torch.Tensor  # fp32 [N]
    top1_agree: torch.Tensor  # bool [N]
    nll_base: torch.Tensor  # fp32 [N]
    nll_quant: torch.Tensor  # fp32 [N]
    position: torch.Tensor  # int64 [N]: position of the predicted token in its window
    seconds: float

    @property
    def tokens(self) -> int:
        return int(self.kl.shape[0])

    def summary(self) -> dict:
        kl = self.kl.double()
        ppl_base = math.exp(float(self.nll_base.double().mean()))
        ppl_quant = math.exp(float(self.nll_quant.double().mean()))
        return {
            "tokens": self.tokens,
            "kl_mean": float(kl.mean()),
            "kl_p50": float(torch.quantile(kl, 0.5)),
            "kl_p99": float(torch.quantile(kl, 0.99)),
            "kl_max": float(kl.max()),
            "top1_agreement": float(self.top1_agree.double().mean()),
            "ppl_base": ppl_base,
            "ppl_quant": ppl_quant,
            "ppl_ratio": ppl_quant / ppl_base,
            "delta_nll_mean": float((self.nll_quant.double() - self.nll_base.double()).mean()),
            "seconds": self.seconds,
        }


def final_hidden(model: CausalLM, tokens: torch.Tensor) -> torch.Tensor:
    """The model's last hidden states for a window [T] -> [T, H] (what compute_logits takes)."""
    with torch.inference_mode():
        return model(tokens.to(model.device).unsqueeze(0))[0]


def window_divergence(
    base: CausalLM, quant: CausalLM, tokens: torch.Tensor, score_from: int = 1, chunk: int = 256,
    base_hidden: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """KL, top-1 agreement and NLLs for predicting tokens[score_from:] of one window [T].

    `base_hidden`: the base model's `final_hidden` for this window, when the caller compares several
    quantized models against one base and runs the base once.
    """
    first = max(score_from, 1) - 1  # hidden state at p - 1 predicts token p
    with torch.inference_mode():
        if base_hidden is None:
            base_hidden = final_hidden(base, tokens)
        h_base = base_hidden.to(base.device)[first:-1]
        h_quant = quant(tokens.to(quant.device).unsqueeze(0))[0, first:-1]
        targets = tokens[first + 1 :]
        parts: list[list[torch.Tensor]] = [[], [], [], []]
        for start in range(0, targets.shape[0], chunk):
            lp = torch.log_softmax(base.compute_logits(h_base[start : start + chunk]).float(), -1).cpu()
            lq = torch.log_softmax(quant.compute_logits(h_quant[start : start + chunk]).float(), -1).cpu()
            tgt = targets[start : start + chunk, None].cpu()
            parts[0].append((lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0))  # tiny negatives are rounding
            parts[1].append(lp.argmax(-1) == lq.argmax(-1))
            parts[2].append(-lp.gather(-1, tgt)[:, 0])
            parts[3].append(-lq.gather(-1, tgt)[:, 0])
    return (*(torch.cat(p) for p in parts), torch.arange(first + 1, tokens.shape[0]))


def divergence(
    base: CausalLM, quant: CausalLM, windows: Sequence, on_window: Callable[[int], None] | None = None,
    base_hidden: Sequence[torch.Tensor] | None = None,
) -> TokenDivergence:
    """Per-token divergence of `quant` from `base` over longctx TokenWindows (doc_id, tokens, score_from).

    `base_hidden`: optional precomputed `final_hidden(base, window)` per window (same order).
    """
    started = time.perf_counter()
    parts: list[list[torch.Tensor]] = [[], [], [], [], []]
    for i, window in enumerate(windows):
        ids = torch.tensor(window.tokens, dtype=torch.long)
        cached = base_hidden[i] if base_hidden is not None else None
        result = window_divergence(base, quant, ids, int(window.score_from), base_hidden=cached)
        for bucket, value in zip(parts, result, strict=True):
            bucket.append(value)
        if on_window:
            on_window(len(window.tokens))
    if not parts[0]:
        raise ValueError("divergence needs at least one window")
    return TokenDivergence(*(torch.cat(p) for p in parts), seconds=time.perf_counter() - started)
