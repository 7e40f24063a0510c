"""Markdown summaries of result JSON (short enough for a PR comment; the JSON stays the source of truth)."""

from __future__ import annotations

METRIC_LABELS = {"kl": "KL(A‖B)", "kl_topk": "KL lower bound (top-k + rest)", "top1": "top-1 agreement",
                 "delta_nll": "ΔNLL (B − A)", "ppl_ratio": "PPL ratio B/A",
                 "delta_p": "Δp(actual)", "accept": "expected acceptance"}


def _fmt(value: float | None, metric: str) -> str:
    if value is None:
        return "-"
    if metric in ("top1", "accept", "rms_delta_p"):
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


def probes_line(probes: dict) -> str:
    """The probes' accuracies and flip rate, each with its exact 95% interval (older results: without)."""
    ci = probes.get("intervals") or {}

    def share(name: str, value: float) -> str:
        est = ci.get(name)
        return f"{value:.0%}" + (f" [{est['low']:.0%}, {est['high']:.0%}]" if est else "")

    return (f"Retrieval probes ({probes['n']}): A {share('a_accuracy', probes['a_accuracy'])}, B "
            f"{share('b_accuracy', probes['b_accuracy'])}; A right → B wrong {probes['a_right_b_wrong']} (flip rate "
            f"{share('flip_rate', probes['flip_rate'])}), A wrong → B right {probes['a_wrong_b_right']} "
            f"(exact McNemar p = {probes['mcnemar_p']:.3g}; intervals: exact Clopper-Pearson 95%).")


TAIL_COLUMNS = [("kl_p90", "KL p90"), ("kl_p95", "KL p95"), ("kl_p99", "KL p99"), ("kl_p999", "KL p99.9"),
                ("kl_max", "KL max"), ("rms_delta_p", "RMS Δp")]


def _few_documents(result: dict) -> list[str]:
    """One line naming the intervals that rest on fewer documents than the table's warnings threshold."""
    few = []
    for path in ("prefill", "decode"):
        table = result.get(path) or {}
        if table.get("warnings"):
            scopes = [("overall", table["overall"]), *table["buckets"].items()]
            few += [f"{path} {scope} ({ests['kl']['n_docs']})" for scope, ests in scopes
                    if any(e.get("warning") for e in ests.values())]
    if not few:
        return []
    from tokq.evalsuite.stats.estimate import FEW_DOCUMENTS

    return ["", f"Few documents: the intervals of {', '.join(few)} rest on fewer than {FEW_DOCUMENTS} documents and "
                "may not hold; score more documents for intervals to rely on."]


def kl_tail(result: dict) -> tuple[str, list[list[str]]] | None:
    """Per-token KL quantiles and RMS Δp as llama.cpp's KLD report gives them, per path and prefill bucket:
    (the line above the table, rows of [scope, *cells]); None for results without them. The Markdown and the HTML
    reports both show this."""
    pre = result["prefill"]
    if "kl_p95" not in pre["overall"]:
        return None
    source = "" if pre.get("kl_tails_from", "kl") == "kl" else (
        " The KL here is each token's top-k + rest lower bound (the full KL is only estimated in the mean), so its "
        "quantiles are lower bounds.")
    scopes = [("prefill", pre["overall"]), *((f"prefill {label}", est) for label, est in pre["buckets"].items())]
    if result.get("decode"):
        scopes.insert(1, ("decode", result["decode"]["overall"]))
    rows = []
    for scope, ests in scopes:
        cells = []
        for name, _ in TAIL_COLUMNS:
            est = ests.get(name)
            cells.append("-" if est is None else _fmt(est["value"], name) if name == "kl_max" else _ci(est, name))
        rows.append([scope, *cells])
    return ("KL tail over the scored tokens (95% percentile intervals from the document bootstrap; the maximum has "
            f"none).{source}", rows)


def _kl_tails(result: dict) -> list[str]:
    tail = kl_tail(result)
    if tail is None:
        return []
    line, rows = tail
    return ["", line, "", "| scope | " + " | ".join(label for _, label in TAIL_COLUMNS) + " |",
            "|---" * (len(TAIL_COLUMNS) + 1) + "|", *("| " + " | ".join(row) + " |" for row in rows)]


def noise_floor_line(result: dict) -> str | None:
    floor = result.get("noise_floor")
    if not floor:
        return None
    return (f"Noise floor ({floor['what']}): mean KL {floor['kl_mean']:.2e}, top-1 {floor['top1']:.2%} over "
            f"{floor['tokens']} tokens.")


def kv_cache_lines(result: dict) -> list[str]:
    # only an int8/fp8 cache is worth a line: its scales decide its error
    return [f"{result[side]['name']}'s KV cache: {cache['scales']}."
            for side, cache in (result.get("kv_cache") or {}).items() if cache.get("scales")]


def calibration_distance_lines(result: dict) -> list[str]:
    """A line per side quantized with calibration: how far these documents lie from its calibration documents."""
    lines = []
    for side, d in (result.get("calibration_distance") or {}).items():
        head = f"**Warning:** {d['warning']}" if d.get("warning") else \
            f"{result[side]['name']}: calibrated on {d['calibration_source']}"
        lines += ["", f"{head}; token distance between its {d['calibration_tokens']} calibration tokens and these "
                      f"{d['evaluated_tokens']}: {d['excess_bits']:.3f} bits (unigram Jensen-Shannon {d['js_bits']:.3f}, "
                      f"less {d['same_distribution_bits']:.3f} for samples of these sizes from one distribution; "
                      f"warned above {d['threshold']:.2f})."]
    return lines


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
    if result.get("identical_weights"):
        lines += [f"**Warning:** {result['identical_weights']['warning']}", ""]
    metrics = ["kl", "kl_topk", "top1", "ppl_ratio", "delta_nll", "delta_p", "accept"]
    lines += ["| metric | prefill path | decode path |", "|---|---|---|"]
    for m in metrics:
        pre = result["prefill"]["overall"].get(m)
        dec = (result.get("decode") or {}).get("overall", {}).get(m)
        lines.append(f"| {METRIC_LABELS[m]} | {_ci(pre, m) if pre else '-'} | {_ci(dec, m) if dec else '-'} |")
    for line in kv_cache_lines(result):
        lines += ["", line]
    lines += calibration_distance_lines(result)
    if noise_floor_line(result):
        lines += ["", noise_floor_line(result)]
    lines += ["", "| position bucket | tokens | KL(A‖B) | top-1 | PPL ratio |", "|---|---|---|---|---|"]
    for label, est in result["prefill"]["buckets"].items():
        lines.append(f"| {label} | {est['kl']['n_tokens']} | {_ci(est['kl'], 'kl')} | {_ci(est['top1'], 'top1')} | "
                     f"{_ci(est['ppl_ratio'], 'ppl_ratio')} |")
    lines += _kl_tails(result)
    lines += _few_documents(result)
    probes = result.get("probes")
    if probes:
        lines += ["", probes_line(probes)]
    if result["thresholds"]:
        lines += ["", "| threshold | bucket | result | rule |", "|---|---|---|---|"]
        for t in result["thresholds"]:
            lines.append(f"| {t['name']} {t['threshold']} | {t['bucket'] or 'overall'} | "
                         f"{_outcome(t)} | {t['rule']} |")
    tp = result["throughput"]
    lines += ["", f"Scoring: A {tp['a_tokens_per_s'] or 0:.0f} tokens/s"
                  f"{' (from the baseline cache)' if result['cache']['hit'] else ''}, B {tp['b_tokens_per_s'] or 0:.0f} tokens/s."]
    return "\n".join(lines) + "\n"
