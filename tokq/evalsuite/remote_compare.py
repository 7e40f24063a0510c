"""`compare A B` when a side is a URL: the remote side's own top-k and actual-token log-probabilities (over HTTP,
tokq.remote.endpoint_scoring), the local side's top-k plus its values at the remote side's ids (one engine
pass), and per token the exact metrics (ΔNLL, Δp, top-1) and the KL's rigorous lower bound and point estimate
(evalsuite.topk_bounds).

`kl` (and `kl_topk`) in the result is the rigorous lower bound, so every KL rule goes through
full_kl.lower_bound_verdict: it can fail (the bound is above the limit) or be inconclusive, never pass;
`kl_estimate` is the point estimate, reported and never used for a verdict. A URL side has no decode path,
no retrieval probes and no noise floor (those need the engine), and no baseline cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tokq import __version__
from tokq.evalsuite.ab import TokenMetrics, scored_rows
from tokq.evalsuite.compare import ScoringPlan, _aggregate, _settings_json
from tokq.evalsuite.quality_rules import evaluate_thresholds, finite_rules
from tokq.evalsuite.topk_bounds import PartialRows, pair_metrics
from tokq.longctx.windows import WindowSet

ESTIMATOR = "remote top-k lower bound"


@dataclass
class Side:
    """One side of a compare with a URL in it: an endpoint (remote) or an engine factory (local)."""

    name: str
    endpoint: object | None = None  # tokq.remote.endpoint_scoring.EndpointScorer
    load: Callable[[], object] | None = None  # -> LLMEngine
    checkpoint: Path | None = None


def _local_rows(engine, windows, topk: int, other: list[PartialRows] | None, progress) -> list[PartialRows]:
    """The local side's top-k plus its values at the other (remote) side's reported ids."""
    gathers = None
    if other is not None:
        gathers = []
        for window, rows in zip(windows, other, strict=True):
            ids = torch.zeros(len(window.tokens) - 1, rows.ids.shape[1], dtype=torch.long)
            ids[scored_rows(window)] = rows.ids.clamp_min(0)  # padding (-1) gathers id 0: harmless, known
            gathers.append(ids)
    scores = engine.score([w.tokens for w in windows], topk=topk, progress=progress, gather_ids=gathers)
    out = []
    for i, (window, score) in enumerate(zip(windows, scores, strict=True)):
        rows = scored_rows(window)
        ids, values = score.topk_ids[rows], score.topk_logprobs[rows]
        if gathers is not None:
            ids = torch.cat([ids, gathers[i][rows]], 1)
            values = torch.cat([values, score.gathered[rows]], 1)
        top_values = score.topk_logprobs[rows]
        out.append(PartialRows(score.logprobs[rows].clone(), ids.clone(), values.clone(), top_values[:, -1].clone(),
                               score.topk_ids[rows, 0].clone(), top_values[:, 0].clone()))
    return out


def _scores(side: Side, windows, topk: int, other: list[PartialRows] | None, tick) -> tuple[list, float, list]:
    start = time.perf_counter()
    if side.endpoint is not None:
        rows = side.endpoint.score(windows, tick(f"{side.name}: over HTTP", len(windows)))
        kernels = []
    else:
        engine = side.load()
        rows = _local_rows(engine, windows, topk, other, tick(f"{side.name}: prefill path", len(windows)))
        kernels = engine.kernel_names
        del engine
    return rows, time.perf_counter() - start, kernels


def run_remote_compare(a: Side, b: Side, windows: WindowSet, doc_ids: list[str], s: ScoringPlan,
                       progress: Callable[[str, int], Callable[[int], None]] | None = None) -> dict:
    """The JSON-ready result of a compare with at least one URL side (the keys of evalsuite.compare.run_compare)."""
    wins = windows.windows
    tick = (lambda label, total: progress(label, total)) if progress else (lambda label, total: None)
    # the remote side(s) first: a local side then gathers its values at the ids they reported
    rows_a = rows_b = None
    seconds = {"a": 0.0, "b": 0.0}
    kernels = {}
    for key, side in (("a", a), ("b", b)):
        if side.endpoint is not None:
            rows, seconds[key], _ = _scores(side, wins, s.topk, None, tick)
            rows_a, rows_b = (rows, rows_b) if key == "a" else (rows_a, rows)
    for key, side, other in (("a", a, rows_b), ("b", b, rows_a)):
        if side.endpoint is None:
            rows, seconds[key], kernels[key] = _scores(side, wins, s.topk, other, tick)
            rows_a, rows_b = (rows, rows_b) if key == "a" else (rows_a, rows)
    metrics = _token_metrics(wins, rows_a, rows_b, doc_ids)
    scored_tokens = sum(len(w.tokens) for w in wins)
    topk_of = {key: (side.endpoint.topk if side.endpoint is not None else s.topk) for key, side in (("a", a), ("b", b))}
    estimator = {"estimator": ESTIMATOR, "topk": min(topk_of.values()), "a_topk": topk_of["a"],
                 "b_topk": topk_of["b"], "vocab": None, "full_kl_rows": 0, "seed": s.seed,
                 "remote": {"a": _remote_json(a), "b": _remote_json(b)},
                 "prefill": {"kind": "lower_bound", "full_rows": 0, "tokens": metrics.tokens,
                             "inclusion_probability": None, "tail_mean": None, "gap_mean_on_full_rows": None},
                 "decode": None}
    result = {
        "tokq_version": __version__,
        "a": _side_json(a), "b": _side_json(b), "data_sha256": None, "settings": _settings_json(s),
        "windows": {"count": len(wins), "tokens": windows.n_tokens, "scored_tokens": metrics.tokens,
                    "documents": len(doc_ids), "window": s.window, "stride": windows.stride,
                    "dropped_documents": windows.dropped_documents, "dropped_tails": windows.dropped_tails,
                    "stopped_by": windows.stopped_by},
        "kl_method": kl_method(topk_of["a"], topk_of["b"], a.endpoint is not None, b.endpoint is not None),
        "kl_estimator": estimator,
        "coverage_mean": float(metrics.coverage.mean()) if metrics.tokens else None,
        "prefill": _aggregate(metrics, doc_ids, s),
        "decode": None, "noise_floor": None, "probes": None,
        "cache": {"key": None, "hit": False, "enabled": False},
        "throughput": {"a_tokens_per_s": scored_tokens / seconds["a"] if seconds["a"] else None,
                       "b_tokens_per_s": scored_tokens / seconds["b"] if seconds["b"] else None,
                       "a_seconds": seconds["a"], "b_seconds": seconds["b"], "scored_tokens": scored_tokens},
        "kernels": {"b": kernels.get("b", [])},
        "non_finite": {"a_tokens": sum(int((~torch.isfinite(r.logprob)).sum()) for r in rows_a),
                       "b_tokens": int(metrics.non_finite.sum()), "scored_tokens": metrics.tokens},
    }
    result["thresholds"] = finite_rules(result) + evaluate_thresholds(result, s.thresholds, s.threshold_on)
    result["passed"] = all(t["passed"] for t in result["thresholds"])
    return result


def _token_metrics(wins, rows_a: list[PartialRows], rows_b: list[PartialRows], doc_ids: list[str]) -> TokenMetrics:
    doc_of = {d: i for i, d in enumerate(doc_ids)}
    parts: dict[str, list[torch.Tensor]] = {}
    for window, ra, rb in zip(wins, rows_a, rows_b, strict=True):
        rows = scored_rows(window)
        targets = torch.tensor(window.tokens[rows.start + 1: rows.stop + 1], dtype=torch.long)
        m = pair_metrics(ra, rb, targets)
        positions = torch.arange(rows.start + 1, rows.stop + 1)
        values = {"kl": m["kl_bound"], "kl_topk": m["kl_bound"], "kl_estimate": m["kl_estimate"],
                  "kl_gap": torch.zeros_like(m["kl_bound"]), "sampled": torch.zeros(len(targets), dtype=torch.bool),
                  "top1": m["top1"], "delta_nll": m["delta_nll"], "delta_p": m["delta_p"], "accept": m["accept"],
                  "coverage": m["coverage"], "position": positions,
                  "doc_index": torch.full_like(positions, doc_of[window.doc_id]),
                  "non_finite": ~torch.isfinite(rb.logprob)}
        for key, value in values.items():
            parts.setdefault(key, []).append(value)
    return TokenMetrics(**{k: torch.cat(v) for k, v in parts.items()})


def kl_method(a_topk: int, b_topk: int, a_remote: bool, b_remote: bool) -> str:
    """Which KL figure is which, in one sentence."""
    sides = " and ".join(f"{n} (URL, its top-{k})" for n, k, r in (("A", a_topk, a_remote), ("B", b_topk, b_remote))
                         if r)
    return (f"{ESTIMATOR}: {sides} reported only its own top-k and the actual token, so kl (and kl_topk, its "
            "tails) is a rigorous lower bound of the full-vocabulary KL(A||B) (the minimum over every completion "
            "consistent with what each side reported, coarse-grained by the log-sum inequality; "
            "evalsuite.topk_bounds): a max_kl rule can fail on it, never pass (inconclusive at best); kl_estimate "
            "is a point estimate (unreported values filled as agreement up to the side's k-th value), not a bound, "
            "and decides no rule; ΔNLL, Δp, top-1 and the perplexity ratio are exact")


def _side_json(side: Side) -> dict:
    if side.endpoint is not None:
        return {"name": side.name, "checkpoint": None, "url": side.endpoint.spec.url, "model": side.endpoint.model,
                "sha256": None}
    from tokq.evalsuite.baseline_cache import model_hash

    return {"name": side.name, "checkpoint": str(side.checkpoint), "sha256": model_hash(side.checkpoint)}


def _remote_json(side: Side) -> dict | None:
    e = side.endpoint
    if e is None:
        return None
    how = ("prompt_logprobs (ids checked against the window)" if e.mode == "prompt_logprobs" else
           "logprobs with echo (token strings mapped back to ids with the local tokenizer, checked against it)")
    return {"url": e.spec.url, "model": e.model, "topk": e.topk, "mode": e.mode, "how": how,
            "max_tokens": e.max_tokens, "max_concurrency": e.max_concurrency}
