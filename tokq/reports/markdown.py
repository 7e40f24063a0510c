"""Markdown summaries of result JSON (short enough for a PR comment; the JSON stays the source of truth)."""

from __future__ import annotations

METRIC_LABELS = {"kl": "KL(A‖B)", "kl_topk": "KL lower bound (top-k + rest)", "top1": "top-1 agreement", "delta_nll": "ΔNLL (B − A)", "ppl_ratio": "PPL ratio B/A",
                 "delta_p": "Δp(actual)", "accept": "expected acceptance"}


def _fmt(value: float | None, metric: str) -> str:
    if value is None:
        return "-"
    if metric in ("top1", "accept"):
        return f"{value:.2%}"
    return f"{value:.4f}" if abs(value) < 100 else f"{value:.1f}"


def _ci(est: dict, metric: str) -> str:
    return f"{_fmt(est['value'], metric)} [{_fmt(est['low'], metric)}, {_fmt(est['high'], metric)}]"


def _outcome(t: dict) -> str:
    return "pass" if t["passed"] else "**INCONCLUSIVE**" if t.get("inconclusive") else "**FAIL**"


def verdict_word(thresholds: list[dict]) -> str:
    """A failed compare's headline: REGRESSION when a rule failed, INCONCLUSIVE when the data decided none
    of the unmet rules (a KL lower bound under its limit)."""
    return "INCONCLUSIVE" if all(t["passed"] or t.get("inconclusive") for t in thresholds) else "REGRESSION"


def compare_markdown(result: dict) -> str:
    """`tokq compare`'s summary: verdict, overall metrics with 95% CIs per path, position buckets, probes."""
    a, b = result["a"]["name"], result["b"]["name"]
    verdict = "PASS" if result["passed"] else verdict_word(result["thresholds"])
    w = result["windows"]
    lines = [f"## tokq compare: {a} → {b}: **{verdict}**", "",
             f"{w['count']} windows of up to {w['window']} tokens from {w['documents']} documents, "
             f"{w['scored_tokens']} scored tokens; 95% CIs from a paired bootstrap over documents "
             f"({result['settings']['resamples']} resamples, seed {result['settings']['seed']}). "
             f"{result['kl_method']}; A's top-k covers {result['coverage_mean']:.1%} of its probability mass on average.",
             ""]
    metrics = ["kl", "kl_topk", "top1", "ppl_ratio", "delta_nll", "delta_p", "accept"]
    lines += ["| metric | prefill path | decode path |", "|---|---|---|"]
    for m in metrics:
        pre = result["prefill"]["overall"].get(m)
        dec = (result.get("decode") or {}).get("overall", {}).get(m)
        lines.append(f"| {METRIC_LABELS[m]} | {_ci(pre, m) if pre else '-'} | {_ci(dec, m) if dec else '-'} |")
    floor = result.get("noise_floor")
    if floor:
        lines += ["", f"Noise floor ({floor['what']}): mean KL {floor['kl_mean']:.2e}, top-1 {floor['top1']:.2%} "
                      f"over {floor['tokens']} tokens."]
    lines += ["", "| position bucket | tokens | KL(A‖B) | top-1 | PPL ratio |", "|---|---|---|---|---|"]
    for label, est in result["prefill"]["buckets"].items():
        lines.append(f"| {label} | {est['kl']['n_tokens']} | {_ci(est['kl'], 'kl')} | {_ci(est['top1'], 'top1')} | "
                     f"{_ci(est['ppl_ratio'], 'ppl_ratio')} |")
    probes = result.get("probes")
    if probes:
        lines += ["", f"Retrieval probes ({probes['n']}): A {probes['a_accuracy']:.0%}, B {probes['b_accuracy']:.0%}; "
                      f"A right → B wrong {probes['a_right_b_wrong']}, A wrong → B right {probes['a_wrong_b_right']} "
                      f"(exact McNemar p = {probes['mcnemar_p']:.3g})."]
    if result["thresholds"]:
        lines += ["", "| threshold | bucket | result | rule |", "|---|---|---|---|"]
        for t in result["thresholds"]:
            lines.append(f"| {t['name']} {t['threshold']} | {t['bucket'] or 'overall'} | "
                         f"{_outcome(t)} | {t['rule']} |")
    tp = result["throughput"]
    lines += ["", f"Scoring: A {tp['a_tokens_per_s'] or 0:.0f} tokens/s"
                  f"{' (from the baseline cache)' if result['cache']['hit'] else ''}, B {tp['b_tokens_per_s'] or 0:.0f} tokens/s."]
    return "\n".join(lines) + "\n"
