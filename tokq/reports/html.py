"""A self-contained HTML report (inline CSS, plots as data URIs: one file to attach to a CI run)."""

from __future__ import annotations

import html

from tokq.reports import plots
from tokq.reports.markdown import METRIC_LABELS, probes_line, verdict_word


def _ci(est: dict, pct: bool = False) -> str:
    """value [low, high]; a bound the sample does not give (one document, a maximum) shows as '-'."""
    f = (lambda v: "-" if v is None else f"{v:.2%}") if pct else (lambda v: "-" if v is None else f"{v:.4f}")
    return f"{f(est['value'])} <span class=ci>[{f(est['low'])}, {f(est['high'])}]</span>"


STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1000px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}.ci{color:#777;font-size:90%}
.pass{color:#17692a;font-weight:bold}.fail{color:#b3261e;font-weight:bold}.warn{color:#8a6100;font-weight:bold}img{max-width:100%}"""


def compare_html(result: dict) -> str:
    """The report of one `tokq compare` result (its JSON)."""
    a, b = html.escape(result["a"]["name"]), html.escape(result["b"]["name"])
    verdict = ('<span class="pass">PASS</span>' if result["passed"] else
               f'<span class="fail">{verdict_word(result["thresholds"])}</span>')
    w = result["windows"]
    parts = [f"<!doctype html><html><head><meta charset=utf-8><title>tokq compare {a} → {b}</title>"
             f"<style>{STYLE}</style></head><body>",
             f"<h1>tokq compare: {a} → {b}: {verdict}</h1>",
             f"<p>{w['count']} windows of up to {w['window']} tokens from {w['documents']} documents, "
             f"{w['scored_tokens']} scored tokens. 95% CIs from a paired bootstrap over documents. "
             f"{html.escape(result['kl_method'])}.</p>",
             "<h2>Overall</h2><table><tr><th>metric</th><th>prefill path</th><th>decode path</th></tr>"]
    for m in ("kl", "kl_topk", "top1", "ppl_ratio", "delta_nll", "delta_p", "accept"):
        pct = m in ("top1", "accept")
        pre = result["prefill"]["overall"].get(m)
        dec = (result.get("decode") or {}).get("overall", {}).get(m)
        parts.append(f"<tr><td>{METRIC_LABELS[m]}</td><td>{_ci(pre, pct) if pre else '-'}</td>"
                     f"<td>{_ci(dec, pct) if dec else '-'}</td></tr>")
    parts.append("</table>")
    floor = result.get("noise_floor")
    if floor:
        parts.append(f"<p>Noise floor ({html.escape(floor['what'])}): mean KL {floor['kl_mean']:.2e}, "
                     f"top-1 {floor['top1']:.2%} over {floor['tokens']} tokens.</p>")
    named = {result["b"]["name"]: result}
    parts += ["<h2>By position</h2>",
              f'<img alt="KL by position bucket" src="{plots.metric_by_bucket(named, "kl", "KL(A‖B)")}">',
              f'<img alt="top-1 by position bucket" src="{plots.metric_by_bucket(named, "top1", "top-1 agreement")}">',
              "<h2>Per document</h2>",
              f'<img alt="per-document KL" src="{plots.document_distribution(named)}">']
    probes = result.get("probes")
    if probes:
        parts += ["<h2>Retrieval probes</h2>",
                  f"<p>{html.escape(probes_line(probes))}</p>",
                  f'<img alt="probe grid A" src="{plots.probe_grid(probes, "a")}"> '
                  f'<img alt="probe grid B" src="{plots.probe_grid(probes, "b")}">']
    if result["thresholds"]:
        parts.append("<h2>Thresholds</h2><table><tr><th>rule</th><th>bucket</th><th>result</th><th>why</th></tr>")
        for t in result["thresholds"]:
            cls = "pass" if t["passed"] else "fail"
            outcome = "pass" if t["passed"] else "INCONCLUSIVE" if t.get("inconclusive") else "FAIL"
            parts.append(f"<tr><td>{t['name']} {t['threshold']}</td><td>{t['bucket'] or 'overall'}</td>"
                         f"<td class={cls}>{outcome}</td><td>{html.escape(t['rule'])}</td></tr>")
        parts.append("</table>")
    parts.append(f"<p class=ci>tokq {html.escape(result['tokq_version'])}</p></body></html>")
    return "\n".join(parts) + "\n"
