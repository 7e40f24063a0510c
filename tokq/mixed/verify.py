"""The check a mixed build must pass: teacher-forced KL(base ‖ build) on held-out windows, over the whole
vocabulary, with a document-clustered 95% interval.

Both models run in fp32 on the same windows (the base: the dense model the build was quantized from; the
build: its checkpoint loaded back by tokq), so the difference is the quantization alone, as written to disk.
Per scored token: KL over every vocabulary entry (exact, not a top-k bound), top-1 agreement and
ΔNLL = NLL_build − NLL_base; means and intervals from the paired document bootstrap
(evalsuite.stats.bootstrap.paired_bootstrap: documents are the clusters, as in `tokq compare`). The base's final
hidden states are computed once and kept (scored rows x hidden size floats); each build costs one forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokq.engine.models import CausalLM
from tokq.evalsuite.ab import scored_rows
from tokq.evalsuite.stats.aggregation import METRIC_RANGES
from tokq.evalsuite.stats.bootstrap import paired_bootstrap
from tokq.evalsuite.stats.estimate import Estimate
from tokq.longctx.windows import TokenWindow

_LOGIT_ELEMENTS = 1 << 24  # logits computed this many at a time (64 MB fp32)


def spread_windows(windows: Sequence[TokenWindow], count: int) -> list[TokenWindow]:
    """Up to `count` windows taken round-robin over documents (every document's first window, then every
    second one, ...): as many documents as possible, which is what a document-clustered interval needs."""
    by_doc: dict[str, list[TokenWindow]] = {}
    for w in windows:
        by_doc.setdefault(w.doc_id, []).append(w)
    picked: list[TokenWindow] = []
    depth = 0
    while len(picked) < count and any(depth < len(ws) for ws in by_doc.values()):
        picked.extend(ws[depth] for ws in by_doc.values() if depth < len(ws))
        depth += 1
    return picked[:count]


class HeldOutKL:
    """`HeldOutKL(base, windows)(build)` -> {"kl", "top1", "delta_nll"} Estimates of the build against the base."""

    def __init__(self, base: CausalLM, windows: Sequence[TokenWindow], resamples: int = 1000, seed: int = 0):
        if not windows:
            raise ValueError("HeldOutKL needs at least one window")
        self.windows = list(windows)
        self.base, self.resamples, self.seed = base, resamples, seed
        docs = list(dict.fromkeys(w.doc_id for w in self.windows))
        self.num_docs = len(docs)
        self.rows = [scored_rows(w) for w in self.windows]
        self.doc_index = torch.cat([torch.full((r.stop - r.start,), docs.index(w.doc_id), dtype=torch.long)
                                    for w, r in zip(self.windows, self.rows, strict=True)])
        self.base_hidden = [self._hidden(base, w, r) for w, r in zip(self.windows, self.rows, strict=True)]

    @staticmethod
    @torch.inference_mode()
    def _hidden(model: CausalLM, window: TokenWindow, rows: slice) -> torch.Tensor:
        ids = torch.tensor([window.tokens], dtype=torch.long, device=model.device)
        return model(ids)[0, rows]

    @torch.inference_mode()
    def __call__(self, build: CausalLM) -> dict[str, Estimate]:
        kl, top1, dnll = [], [], []
        step = max(1, _LOGIT_ELEMENTS // self.base.config.vocab_size)
        for w, rows, base_hidden in zip(self.windows, self.rows, self.base_hidden, strict=True):
            hidden = self._hidden(build, w, rows).to(base_hidden.device)
            targets = torch.tensor(w.tokens[rows.start + 1: rows.stop + 1], device=base_hidden.device)
            for lo in range(0, hidden.shape[0], step):
                lp_a = torch.log_softmax(self.base.compute_logits(base_hidden[lo: lo + step]).float(), dim=-1)
                lp_b = torch.log_softmax(build.compute_logits(hidden[lo: lo + step]).float(), dim=-1)
                # KL(a‖b) = sum p_a (log p_a - log p_b); clamped at 0 against rounding
                kl.append((lp_a.exp() * (lp_a - lp_b)).sum(-1).clamp_min(0.0).double().cpu())
                top1.append((lp_a.argmax(-1) == lp_b.argmax(-1)).cpu())
                t = targets[lo: lo + step, None]
                dnll.append((lp_a.gather(1, t) - lp_b.gather(1, t))[:, 0].double().cpu())
        metrics = {"kl": torch.cat(kl), "top1": torch.cat(top1), "delta_nll": torch.cat(dnll)}
        return paired_bootstrap(metrics, self.doc_index, self.num_docs, None, self.resamples, self.seed,
                                ranges={k: METRIC_RANGES[k] for k in metrics})

    def describe(self) -> dict:
        return {"windows": len(self.windows), "documents": self.num_docs,
                "scored_tokens": int(self.doc_index.numel()), "window": max(len(w.tokens) for w in self.windows),
                "kl": "full vocabulary, fp32, teacher-forced", "interval": "95%, paired bootstrap over documents"}
