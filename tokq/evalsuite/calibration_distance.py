"""How far the documents a build is judged on lie from the documents it was calibrated on.

A calibrated method (GPTQ, AWQ, SmoothQuant) fits the statistics of its calibration tokens; judged on
documents of another kind its gain over RTN shrinks (benchmarks/calibration_shift.py measures by how
much). The distance used here is the Jensen-Shannon divergence, in bits (0: the same distribution, 1:
disjoint vocabularies), between the unigram token distributions of the two samples: cheap, needs no
model, and `tokq quantize` can record its side as a histogram of the calibration token ids.

Finite samples of one distribution are not at distance 0 (rare tokens fall in one sample only), so the
warning threshold is set from measured pairs, not from 0: see `FAR_JS` and the calibration-shift results.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Between the in-domain and the cross-domain distances that benchmarks/calibration_shift.py measured on
# both zoo models (the default set's code / manuals / prose domains, 32 x 512 calibration tokens against
# 16 x 512 evaluation tokens): in-domain pairs stay below it, every cross-domain pair lies above it.
FAR_JS = 0.30


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


def distance_record(quantization: dict, evaluated: TokenHistogram) -> dict | None:
    """How far `evaluated` lies from the calibration tokens a build's tokq_quantization.json (`quantization`)
    recorded, or None when it recorded none (an RTN/FP8 build, a checkpoint from elsewhere, an older tokq)."""
    recorded = quantization.get("calibration_tokens")
    if not recorded:
        return None
    calibration = TokenHistogram.from_json(recorded)
    js = unigram_js(calibration, evaluated)
    used = (quantization.get("result") or {}).get("calibration") or {}
    return {"js_bits": js, "far": js > FAR_JS, "threshold": FAR_JS, "calibration_source": used.get("source"),
            "source_tokens": used.get("source_tokens"), "calibration_tokens": calibration.tokens,
            "evaluated_tokens": evaluated.tokens, "method": quantization.get("method")}


def far_warning(name: str, distance: dict) -> str:
    """The one-line warning for a build judged on documents far from its calibration documents."""
    return (f"{name} was calibrated on documents far from these (token distance {distance['js_bits']:.2f} > "
            f"{distance['threshold']:.2f} bits, calibrated on {distance['calibration_source']}): its "
            f"{distance['method'] or 'calibrated'} gain over RTN can shrink on text unlike its calibration; "
            "re-quantize with --calib on documents like these (or a mix of them) before trusting this verdict")
