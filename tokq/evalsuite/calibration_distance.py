"""How far the documents a build is judged on lie from the documents it was calibrated on.

A calibrated method (GPTQ, AWQ, SmoothQuant) fits the statistics of its calibration tokens; judged on
documents of another kind its gain over RTN shrinks (benchmarks/calibration_shift.py measures by how
much). The distance used here needs no model: the Jensen-Shannon divergence, in bits, between the
unigram token distributions of the two samples, less what two samples of the same sizes drawn from
one distribution (the pooled tokens, shuffled and split) already show. Without that correction the
divergence of finite samples depends on their sizes more than on their text (measured on SmolLM2's
tokenizer: one source against itself reads 0.38 bits at 2K evaluation tokens and 0.18 at 32K, while
the excess stays within 0.09-0.17). `tokq quantize` records its side as a histogram of the calibration
token ids, so the distance can be taken from any later comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Warn above this excess (bits). Measured on the default set's domains with 32 x 512 calibration tokens and
# 2K-32K evaluation tokens (benchmarks/calibration_shift.py records the pairs): a source against itself
# 0.03-0.17; the default mix of all sources against any of them 0.12-0.24; code against manuals or prose
# 0.29-0.43, where GPTQ with min/max scales kept barely half of its gain over RTN.
FAR_EXCESS = 0.25
NULL_SPLITS = 4  # shuffled splits averaged for the same-distribution baseline


@dataclass(frozen=True)
class TokenHistogram:
    """Counts of each token id in a sample (ids ascending)."""

    ids: tuple[int, ...]
    counts: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(self.counts)

    def to_json(self) -> dict:
        return {"tokens": self.tokens, "ids": list(self.ids), "counts": list(self.counts)}

    @classmethod
    def from_json(cls, data: dict) -> TokenHistogram:
        ids, counts = data.get("ids"), data.get("counts")
        if not isinstance(ids, list) or not isinstance(counts, list) or len(ids) != len(counts):
            raise ValueError("a token histogram needs lists 'ids' and 'counts' of one length")
        return cls(tuple(int(i) for i in ids), tuple(int(c) for c in counts))


def token_histogram(tokens: torch.Tensor) -> TokenHistogram:
    """The histogram of the token ids in `tokens` (any shape)."""
    ids, counts = torch.unique(torch.as_tensor(tokens).reshape(-1).long(), return_counts=True)
    return TokenHistogram(tuple(ids.tolist()), tuple(counts.tolist()))


def unigram_js(a: TokenHistogram, b: TokenHistogram) -> float:
    """Jensen-Shannon divergence (bits, in [0, 1]) between the unigram distributions of two samples."""
    if not a.tokens or not b.tokens:
        raise ValueError("the Jensen-Shannon divergence needs two non-empty samples")
    vocab = sorted(set(a.ids) | set(b.ids))
    index = {t: i for i, t in enumerate(vocab)}

    def dist(h: TokenHistogram) -> torch.Tensor:
        p = torch.zeros(len(vocab), dtype=torch.float64)
        p[[index[t] for t in h.ids]] = torch.tensor(h.counts, dtype=torch.float64)
        return p / p.sum()

    p, q = dist(a), dist(b)
    m = (p + q) / 2

    def kl(x: torch.Tensor) -> float:
        mask = x > 0
        return float((x[mask] * torch.log2(x[mask] / m[mask])).sum())

    return max(0.0, min(1.0, (kl(p) + kl(q)) / 2))


def _expand(h: TokenHistogram) -> torch.Tensor:
    return torch.repeat_interleave(torch.tensor(h.ids, dtype=torch.long), torch.tensor(h.counts, dtype=torch.long))


def token_distance(calibration: TokenHistogram, evaluated: TokenHistogram, seed: int = 0) -> dict:
    """`js_bits` between the two samples, `same_distribution_bits` (the mean JS of NULL_SPLITS shuffled splits of
    their pooled tokens into parts of the same sizes) and `excess_bits`, the first less the second."""
    observed = unigram_js(calibration, evaluated)
    pooled = torch.cat([_expand(calibration), _expand(evaluated)])
    generator = torch.Generator().manual_seed(seed)
    split = calibration.tokens
    null = []
    for _ in range(NULL_SPLITS):
        shuffled = pooled[torch.randperm(pooled.numel(), generator=generator)]
        null.append(unigram_js(token_histogram(shuffled[:split]), token_histogram(shuffled[split:])))
    baseline = sum(null) / len(null)
    return {"js_bits": observed, "same_distribution_bits": baseline, "excess_bits": observed - baseline}


def distance_record(quantization: dict, evaluated: TokenHistogram) -> dict | None:
    """How far `evaluated` lies from the calibration tokens a build's tokq_quantization.json (`quantization`)
    recorded, or None when it recorded none (an RTN/FP8 build, a checkpoint from elsewhere, an older tokq)."""
    recorded = quantization.get("calibration_tokens")
    if not recorded:
        return None
    calibration = TokenHistogram.from_json(recorded)
    distance = token_distance(calibration, evaluated)
    used = (quantization.get("result") or {}).get("calibration") or {}
    return {**distance, "far": distance["excess_bits"] > FAR_EXCESS, "threshold": FAR_EXCESS,
            "calibration_source": used.get("source"), "source_tokens": used.get("source_tokens"),
            "calibration_tokens": calibration.tokens, "evaluated_tokens": evaluated.tokens,
            "method": quantization.get("method")}


def far_warning(name: str, distance: dict) -> str:
    """The one-line warning for a build judged on documents far from its calibration documents."""
    return (f"{name} was calibrated on documents far from these (token distance {distance['excess_bits']:.2f} > "
            f"{distance['threshold']:.2f} bits, calibrated on {distance['calibration_source']}): its "
            f"{distance['method'] or 'calibrated'} gain over RTN can shrink on text unlike its calibration; "
            "re-quantize with --calib on documents like these (or a mix of them) before trusting this verdict")
