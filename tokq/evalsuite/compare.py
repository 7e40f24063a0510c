"""`compare A B`: both models score the same windows of the user's documents through the engine's paged
path; per-token metrics, per-document / per-position-bucket / overall aggregates with paired-bootstrap
CIs, a decode-path check, retrieval probes, and thresholds.

The flow: windows (longctx) -> A's scores (baseline cache or one engine pass: chunked prefill, plus the
decode path on a sample of windows) -> B scored at A's top-k ids -> metrics (evalsuite.ab) -> aggregates
(evalsuite.stats) -> thresholds. A and B are never loaded at the same time.

KL: on each path both models also score `full_kl_rows` sampled positions over the whole vocabulary (what
the KL needs of A's rows goes into the baseline cache, bf16), so `kl` is the full-vocabulary KL, exact or
estimated with its interval, and `kl_topk` its top-k lower bound (evalsuite.full_kl; `kl_estimator` in the
JSON says which).

Decode-path check: on `decode_windows` windows, the last `decode_tokens` positions are scored one token
per step through the decode kernels and the KV cache, for both models, and reported separately (a
quantized or fp8 KV cache, or a decode-kernel difference, only shows there). The noise floor is A's own
decode path against A's prefill path on those tokens: differences below it are kernel noise, not damage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tokq import __version__
from tokq.engine.config import read_config
from tokq.errors import DataError
from tokq.evalsuite import baseline_cache
from tokq.evalsuite.ab import BaselineWindow, TokenMetrics, non_finite_rows, score_baseline, score_candidate
from tokq.evalsuite.full_kl import A_TAIL_DTYPE, kind_of, systematic_sample
from tokq.evalsuite.quality_rules import evaluate_thresholds, finite_rules
from tokq.evalsuite.stats.aggregation import aggregate
from tokq.evalsuite.stats.exact import mcnemar_exact, proportion
from tokq.longctx.windows import TokenWindow, WindowSet

log = logging.getLogger("tokq")

# per-token KL quantiles: a lower bound unless every token's KL is exact (see _kl_tails_from)


@dataclass
class ScoringPlan:
    """The compare settings resolved for one run (stride, depths, dtype, KV budget decided): what scoring uses."""

    window: int = 2048
    stride: int | None = None
    max_tokens: int | None = None
    # k = 256 with 256 full rows: the estimate within 1% of the exact KL on SmolLM2 (benchmarks/kl_topk.py)
    topk: int = 256
    full_kl_rows: int = 256  # per path: positions both models score over the whole vocabulary (0: lower bound only)
    decode_windows: int = 2
    decode_tokens: int = 128
    probes: bool = True
    probe_max_context: int | None = None  # None: the window
    probe_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    probe_repeats: int = 1  # probes per (context, depth), each with its own key
    resamples: int = 1000
    seed: int = 0
    use_cache: bool = True
    dtype: str = "bf16"
    kv_dtype: str | None = None
    kv_memory: int | None = None
    thresholds: dict[str, dict[str | None, float]] = field(default_factory=dict)  # name -> {bucket|None: value}
    threshold_on: str = "bound"  # stats.check_threshold: the CI's unfavourable bound, or the point estimate


@dataclass
class ModelRun:
    """What compare needs of one model: its engine factory and identity."""

    name: str
    checkpoint: Path
    load: Callable[[], object]  # -> LLMEngine (built lazily: A is not loaded on a cache hit)
    tokenizer: object


def decode_sample(windows: list[TokenWindow], count: int, decode_tokens: int) -> tuple[list[TokenWindow], int]:
    """`count` windows spread evenly over the set, each scored from `decode_from` on through the decode path."""
    if count <= 0 or not windows:
        return [], 0
    picks = sorted({round(i * (len(windows) - 1) / max(count - 1, 1)) for i in range(count)})
    chosen = [windows[i] for i in picks]
    shortest = min(len(w.tokens) for w in chosen)
    decode_from = max(1, shortest - decode_tokens)
    return [replace(w, score_from=max(w.score_from, decode_from)) for w in chosen], decode_from


def run_compare(a: ModelRun, b: ModelRun, windows: WindowSet, doc_ids: list[str], settings: ScoringPlan,
                probe_documents=None, progress: Callable[[str, int], Callable[[int], None]] | None = None) -> dict:
    """Everything `tokq compare` reports, as a JSON-ready dict (the source of truth)."""
    s = settings
    wins = windows.windows
    doc_of = {d: i for i, d in enumerate(doc_ids)}
    doc_index = [doc_of[w.doc_id] for w in wins]
    dwins, decode_from = decode_sample(wins, s.decode_windows, s.decode_tokens)
    ddoc_index = [doc_of[w.doc_id] for w in dwins]
    key_parts = dict(model=baseline_cache.model_hash(a.checkpoint), data=baseline_cache.data_hash(wins),
                     decode=baseline_cache.data_hash(dwins), window=s.window, stride=windows.stride,
                     max_tokens=s.max_tokens, topk=s.topk, decode_from=decode_from, dtype=s.dtype, kv_dtype=s.kv_dtype,
                     probes=[s.probes, s.probe_max_context, list(s.probe_depths), s.probe_repeats, s.seed],
                     full_kl=[s.full_kl_rows, s.seed])
    vocab = read_config(a.checkpoint).vocab_size
    sample, dsample = (None, None) if s.topk >= vocab else (
        systematic_sample([_scored(w) for w in wins], s.full_kl_rows, s.seed),
        systematic_sample([_scored(w) for w in dwins], s.full_kl_rows, s.seed))
    key = baseline_cache.cache_key(**key_parts)
    tick = (lambda label, total: progress(label, total)) if progress else (lambda label, total: None)
    cached = baseline_cache.load(key, key_parts=key_parts) if s.use_cache else None
    cache_info = {"key": key, "hit": cached is not None, "enabled": s.use_cache}
    engine_a = None
    if cached is not None:
        base_prefill, base_decode = cached[0][: len(wins)], cached[0][len(wins):]
        a_extra = cached[1]
        a_seconds = 0.0
    else:
        engine_a = a.load()
        start = time.perf_counter()
        base_prefill = score_baseline(engine_a, wins, s.topk, progress=tick(f"{a.name}: prefill path", len(wins)),
                                      sample=sample)
        base_decode = score_baseline(engine_a, dwins, s.topk, decode_from, tick(f"{a.name}: decode path", len(dwins)),
                                     sample=dsample) if dwins else []
        floor = _floor(engine_a, dwins, wins, base_prefill, ddoc_index, decode_from, s)
        a_probes = _probes(engine_a, a.tokenizer, probe_documents, s) if s.probes else None
        a_seconds = time.perf_counter() - start
        a_extra = {"floor": floor, "probes": a_probes, "seconds": a_seconds}
        if s.use_cache:
            folder, size = baseline_cache.store(key, [*base_prefill, *base_decode], a_extra, key_parts=key_parts)
            cache_info.update(path=str(folder), bytes=size)
        del engine_a
    if cached is not None:
        cache_info.update(path=str(baseline_cache.cache_dir() / key),
                          bytes=(baseline_cache.cache_dir() / key / "scores.safetensors").stat().st_size)
    engine_b = b.load()
    start = time.perf_counter()
    prefill = score_candidate(engine_b, wins, base_prefill, doc_index, progress=tick(f"{b.name}: prefill path",
                                                                                     len(wins)))
    decode = score_candidate(engine_b, dwins, base_decode, ddoc_index, decode_from,
                             tick(f"{b.name}: decode path", len(dwins))) if dwins else None
    b_probes = _probes(engine_b, b.tokenizer, probe_documents, s) if s.probes else None
    b_seconds = time.perf_counter() - start
    scored_tokens = sum(len(w.tokens) for w in wins) + sum(len(w.tokens) for w in dwins)
    kl_estimator = {"topk": s.topk, "vocab": vocab, "full_kl_rows": s.full_kl_rows, "seed": s.seed,
                    "a_tail_dtype": str(A_TAIL_DTYPE).removeprefix("torch."),
                    "prefill": _kl_path(prefill, s.topk, vocab),
                    "decode": _kl_path(decode, s.topk, vocab) if decode is not None else None}

    result = {
        "tokq_version": __version__,
        "a": {"name": a.name, "checkpoint": str(a.checkpoint), "sha256": key_parts["model"]},
        "b": {"name": b.name, "checkpoint": str(b.checkpoint), "sha256": baseline_cache.model_hash(b.checkpoint)},
        "data_sha256": key_parts["data"], "settings": _settings_json(s),
        "windows": {"count": len(wins), "tokens": windows.n_tokens, "scored_tokens": prefill.tokens,
                    "documents": len(doc_ids), "window": s.window, "stride": windows.stride,
                    "dropped_documents": windows.dropped_documents, "dropped_tails": windows.dropped_tails,
                    "stopped_by": windows.stopped_by},
        "kl_method": _kl_method(kl_estimator),
        "kl_estimator": kl_estimator,
        "coverage_mean": float(prefill.coverage.mean()) if prefill.tokens else None,
        "prefill": _aggregate(prefill, doc_ids, s),
        "decode": ({**_aggregate(decode, doc_ids, s), "decode_from": decode_from, "windows": len(dwins)}
                   if decode is not None else None),
        "noise_floor": a_extra["floor"],
        "probes": _probe_comparison(a_extra["probes"], b_probes) if s.probes else None,
        "cache": cache_info,
        "throughput": {"a_tokens_per_s": scored_tokens / a_extra["seconds"] if a_extra["seconds"] else None,
                       "b_tokens_per_s": scored_tokens / b_seconds if b_seconds else None,
                       "a_seconds": a_seconds, "b_seconds": b_seconds, "scored_tokens": scored_tokens},
        "kernels": {"b": engine_b.kernel_names},
        "non_finite": _non_finite([*base_prefill, *base_decode], [prefill, decode]),
    }
    result["thresholds"] = finite_rules(result) + evaluate_thresholds(result, s.thresholds, s.threshold_on)
    result["passed"] = all(t["passed"] for t in result["thresholds"])
    return result


def _non_finite(baseline: list[BaselineWindow], paths: list[TokenMetrics | None]) -> dict:
    """Scored tokens (prefill and decode paths) where A's or B's scores are NaN or inf (ab.non_finite_rows)."""
    return {"a_tokens": sum(int(non_finite_rows(w.logprob, w.topk_logprobs).sum()) for w in baseline),
            "b_tokens": sum(int(m.non_finite.sum()) for m in paths if m is not None),
            "scored_tokens": sum(m.tokens for m in paths if m is not None)}


def _aggregate(metrics: TokenMetrics, doc_ids: list[str], s: ScoringPlan) -> dict:
    if metrics.tokens == 0:
        raise DataError("no token was scored: the documents give no window with a token to predict")
    return aggregate(metrics.as_dict(), metrics.doc_index, metrics.position, doc_ids, s.window, resamples=s.resamples,
                     seed=s.seed, kl_tails_from=_kl_tails_from(metrics))


def _kl_tails_from(metrics: TokenMetrics) -> str:
    """Which per-token KL the tail quantiles are taken from. A quantile needs each token's own KL: `kl` is that
    when every token's whole distribution was scored, or none was (then it is the top-k bound itself). With a
    sample of positions, `kl` adds the sampled tokens' tail gap / π (right in a mean, meaningless in a quantile):
    the tails then come from `kl_topk`, each token's lower bound, and are lower bounds themselves."""
    sampled = getattr(metrics, "sampled", None)
    if sampled is None or bool(sampled.all()) or not bool(sampled.any()):
        return "kl"
    return "kl_topk"


def _scored(window: TokenWindow) -> int:
    """How many of the window's positions are scored (ab.scored_rows)."""
    return len(window.tokens) - max(window.score_from, 1)


def _kl_path(metrics: TokenMetrics, topk: int, vocab: int) -> dict:
    """How one path's `kl` was obtained, and how much of it the top-k bound misses."""
    rows = int(metrics.sampled.sum())
    prob = rows / metrics.tokens if rows and metrics.tokens else None
    kind = kind_of(topk, vocab, prob)
    tail = float((metrics.kl.double() - metrics.kl_topk.double()).mean()) if metrics.tokens else None
    return {"kind": kind, "full_rows": rows, "tokens": metrics.tokens, "inclusion_probability": prob,
            "tail_mean": tail, "gap_mean_on_full_rows": float(metrics.kl_gap[metrics.sampled].mean()) if rows else None}


def _kl_method(est: dict) -> str:
    """One sentence per path kind: which KL figure is exact, which estimated, and how."""
    k = est["topk"]
    kinds = {name: est[name]["kind"] for name in ("prefill", "decode") if est[name]}
    parts = []
    for kind in dict.fromkeys(kinds.values()):
        where = " and ".join(name for name, value in kinds.items() if value == kind) + " path"
        rows = " / ".join(f"{est[n]['full_rows']} of {est[n]['tokens']}" for n, v in kinds.items() if v == kind)
        if kind == "exact" and k >= est["vocab"]:
            parts.append(f"{where}: KL(A||B) exact over the whole vocabulary (top-k = the vocabulary of "
                         f"{est['vocab']})")
        elif kind == "exact":
            parts.append(f"{where}: KL(A||B) exact over the whole vocabulary (both models scored every position in "
                         f"full, A's tail probabilities kept in {est['a_tail_dtype']}; kl_topk: its top-{k} + rest "
                         "lower bound)")
        elif kind == "estimated":
            parts.append(f"{where}: KL(A||B) over the whole vocabulary estimated: A's top-{k} + one bucket for the "
                         f"rest at every position (kl_topk, a lower bound) plus the exact tail it misses on {rows} "
                         f"positions scored in full by both models (systematic sample, seed {est['seed']}), weighted "
                         "by 1/π (unbiased); its CI from the same document bootstrap")
        else:
            parts.append(f"{where}: KL(A||B) over A's top-{k} + one bucket for the rest only, a lower bound of the "
                         "full-vocabulary KL (no whole distribution kept): a max_kl rule under it is inconclusive")
    return "; ".join(parts)


def _floor(engine, dwins: list[TokenWindow], wins: list[TokenWindow], base_prefill: list[BaselineWindow],
           ddoc_index: list[int], decode_from: int, s: ScoringPlan) -> dict | None:
    """A's decode path against A's prefill path on the decode sample: the kernels' own noise."""
    if not dwins:
        return None
    rows = []
    for dw in dwins:
        full = next(i for i, w in enumerate(wins) if w.doc_id == dw.doc_id and w.start == dw.start)
        skip = dw.score_from - max(wins[full].score_from, 1)
        base = base_prefill[full]
        rows.append(base.rows_from(skip))
    metrics = score_candidate(engine, dwins, rows, ddoc_index, decode_from)
    return {"tokens": metrics.tokens, "kl_mean": float(metrics.kl.mean()), "kl_max": float(metrics.kl.max()),
            "top1": float(metrics.top1.mean()), "delta_nll_mean": float(metrics.delta_nll.mean()),
            "what": "A's decode path vs A's prefill path on the decode sample (kernel noise, not damage)"}


def _probes(engine, tokenizer, documents, s: ScoringPlan) -> list[dict] | None:
    from tokq.engine.tokenizer import model_adds_bos
    from tokq.longctx.probe_scoring import run_probes
    from tokq.longctx.probes import build_probes, probe_grid

    if not documents:
        return None
    # the same grid the config's power check counts (evalsuite.power)
    grid = probe_grid(s.window, s.probe_max_context, s.probe_depths, s.probe_repeats, engine.max_model_len)
    if not grid.size:
        return None
    probes = build_probes(documents, tokenizer, grid.contexts, grid.depths, seed=s.seed,
                          add_bos=model_adds_bos(tokenizer), repeats=grid.repeats)
    return [{"context": r.context, "depth": r.depth, "repeat": r.repeat, "correct": bool(r.correct),
             "answer": r.answer, "output": r.output_text} for r in run_probes(engine, probes, tokenizer=tokenizer)]


def _probe_comparison(a: list[dict] | None, b: list[dict] | None) -> dict | None:
    """Flips both ways with McNemar's exact test; every proportion (flip rate, A's and B's accuracy) with its
    exact Clopper-Pearson 95% interval under "intervals" (the probes are the sample: n of them)."""
    if not a or not b:
        return None
    pairs = list(zip(a, b, strict=True))
    a_only = [(x["context"], x["depth"]) for x, y in pairs if x["correct"] and not y["correct"]]
    b_only = [(x["context"], x["depth"]) for x, y in pairs if y["correct"] and not x["correct"]]
    n = len(pairs)
    a_right, b_right = sum(x["correct"] for x in a), sum(y["correct"] for y in b)

    def grid(results: list[dict]) -> dict:
        """context -> depth -> right (bool), or the fraction right when a cell holds several probes."""
        cells: dict[str, dict[str, list[bool]]] = {}
        for r in results:
            cells.setdefault(str(r["context"]), {}).setdefault(f"{r['depth']:.2f}", []).append(bool(r["correct"]))
        return {c: {d: v[0] if len(v) == 1 else sum(v) / len(v) for d, v in row.items()} for c, row in cells.items()}

    return {"n": n, "a_accuracy": a_right / n, "b_accuracy": b_right / n,
            "a_right_b_wrong": len(a_only), "a_wrong_b_right": len(b_only), "flip_rate": len(a_only) / n,
            "intervals": {name: proportion(k, n).to_json() for name, k in
                          (("flip_rate", len(a_only)), ("a_accuracy", a_right), ("b_accuracy", b_right))},
            "flipped": a_only, "recovered": b_only, "mcnemar_p": mcnemar_exact(len(a_only), len(b_only)),
            "a_grid": grid(a), "b_grid": grid(b)}


def _settings_json(s: ScoringPlan) -> dict:
    out = asdict(s)
    out["thresholds"] = {k: {str(b): v for b, v in per.items()} for k, per in s.thresholds.items()}
    return out


def token_window_docs(windows: WindowSet) -> list[str]:
    """Document ids in the order their first window appears."""
    return list(dict.fromkeys(w.doc_id for w in windows.windows))
