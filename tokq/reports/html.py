"""A self-contained HTML report (inline CSS, plots as data URIs: one file to attach to a CI run).

Every page is rendered by jinja2 with autoescaping on: model and variant names, paths, bucket labels, rule texts
and config values come from the user (a PR's tokq.toml, a folder name, a hand-edited report.json) and the page
is a CI artifact someone opens in a browser, so none of it may become markup. Only tokq's own markup is marked
safe (the head with its Content-Security-Policy, the stylesheet, the CI cells built with Markup.format, which
escapes its arguments); the plots' data URIs need no exemption (base64 holds no character HTML escapes).
"""

from __future__ import annotations

from functools import cache

from jinja2 import Environment, StrictUndefined, Template
from markupsafe import Markup

from tokq.reports import plots
from tokq.reports.markdown import (
    METRIC_LABELS,
    TAIL_COLUMNS,
    calibration_distance_lines,
    kl_tail,
    kv_cache_lines,
    noise_floor_line,
    probes_line,
    verdict_word,
)

STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1000px;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}.ci{color:#777;font-size:90%}
.pass{color:#17692a;font-weight:bold}.fail{color:#b3261e;font-weight:bold}.warn{color:#8a6100;font-weight:bold}
.inconclusive{color:#fff;background:#a35200;font-weight:bold;padding:0 4px}img{max-width:100%}"""

# Every page forbids scripts and any load but its inline CSS and data: URI images: should markup ever slip
# through, it can neither run nor call out, in the screenshot browser or in whatever opens the CI artifact.
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
HEAD = Markup(f'<meta charset=utf-8><meta http-equiv="Content-Security-Policy" content="{CSP}">')

# StrictUndefined: a key missing from a (hand-edited) report.json is an error, never a silently empty cell.
_ENV = Environment(autoescape=True, undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                   keep_trailing_newline=True)


@cache
def _template(source: str) -> Template:
    return _ENV.from_string(source)


def render_page(source: str, **context) -> str:
    """`source` (a jinja2 template string) rendered with autoescaping; `head` is the charset and the CSP,
    `style` tokq's stylesheet."""
    return _template(source).render(head=HEAD, style=Markup(STYLE), **context)


def _ci(est: dict | None, pct: bool = False) -> Markup | str:
    """value [low, high]; a bound the sample does not give (one document, a maximum) shows as '-'."""
    if not est:
        return "-"
    f = (lambda v: "-" if v is None else f"{v:.2%}") if pct else (lambda v: "-" if v is None else f"{v:.4f}")
    return Markup("{} <span class=ci>[{}, {}]</span>").format(f(est["value"]), f(est["low"]), f(est["high"]))


COMPARE_PAGE = """\
<!doctype html><html><head>{{ head }}<title>tokq compare {{ a }} → {{ b }}</title><style>{{ style }}</style>\
</head><body>
<h1>tokq compare: {{ a }} → {{ b }}: <span class="{{ verdict_css }}">{{ verdict }}</span></h1>
<p>{{ w["count"] }} windows of up to {{ w["window"] }} tokens from {{ w["documents"] }} documents, \
{{ w["scored_tokens"] }} scored tokens. 95% CIs from a paired bootstrap over documents. {{ kl_method }}.</p>
<h2>Overall</h2>
{{ details }}
<h2>By position</h2>
<img alt="KL by position bucket" src="{{ kl_plot }}">
<img alt="top-1 by position bucket" src="{{ top1_plot }}">
<h2>Per document</h2>
<img alt="per-document KL" src="{{ documents_plot }}">
{% if probes %}
<h2>Retrieval probes</h2>
<p>{{ probes.line }}</p>
<img alt="probe grid A" src="{{ probes.grid_a }}"> <img alt="probe grid B" src="{{ probes.grid_b }}">
{% endif %}
{% if thresholds %}
<h2>Thresholds</h2><table><tr><th>rule</th><th>bucket</th><th>result</th><th>why</th></tr>
{% for t in thresholds %}
<tr><td>{{ t.name }} {{ t.threshold }}</td><td>{{ t.bucket }}</td><td class={{ t.css }}>{{ t.outcome }}</td>\
<td>{{ t.rule }}</td></tr>
{% endfor %}
</table>
{% endif %}
<p class=ci>tokq {{ version }}</p></body></html>
"""


QUALITY_DETAILS = """\
<table><tr><th>metric</th><th>prefill path</th><th>decode path</th></tr>
{% for label, prefill, decode in overall %}
<tr><td>{{ label }}</td><td>{{ prefill }}</td><td>{{ decode }}</td></tr>
{% endfor %}
</table>
<p class=ci>{{ decode_note }}</p>
{% for line in warnings %}<p class=warn>{{ line }}</p>
{% endfor %}
{% for line in lines %}<p>{{ line }}</p>
{% endfor %}
{% if tail %}
<p>{{ tail.line }}</p>
<table><tr><th>scope</th>{% for c in tail.columns %}<th>{{ c }}</th>{% endfor %}</tr>
{% for row in tail.rows %}<tr>{% for cell in row %}<td>{{ cell }}</td>{% endfor %}</tr>
{% endfor %}
</table>
{% endif %}
"""


def quality_details(result: dict) -> Markup:
    """What a compare result says beyond its plots, as the Markdown report says it: the overall metrics on the
    prefill and the decode path, warnings (identical weights, calibration far from these documents), the KV
    cache's scales, the calibration distance, the noise floor and the KL tail."""
    overall = []
    for m in ("kl", "kl_topk", "top1", "ppl_ratio", "delta_nll", "delta_p", "accept"):
        pct = m in ("top1", "accept")
        dec = (result.get("decode") or {}).get("overall", {}).get(m)
        overall.append((METRIC_LABELS[m], _ci(result["prefill"]["overall"].get(m), pct), _ci(dec, pct)))
    decode_note = ("decode path: the last positions of some windows scored again one token per step through the "
                   "decode kernels and KV cache, the path serving runs" if result.get("decode")
                   else "decode path: not scored in this run")
    warnings = [result["identical_weights"]["warning"]] if result.get("identical_weights") else []
    calibration = [line.replace("**", "").strip() for line in calibration_distance_lines(result) if line.strip()]
    warnings += [line for line in calibration if line.startswith("Warning:")]
    lines = [*kv_cache_lines(result), *(line for line in calibration if not line.startswith("Warning:"))]
    if noise_floor_line(result):
        lines.append(noise_floor_line(result))
    tail = kl_tail(result)
    if tail is not None:
        tail = {"line": tail[0], "columns": [label for _, label in TAIL_COLUMNS], "rows": tail[1]}
    return Markup(_template(QUALITY_DETAILS).render(overall=overall, decode_note=decode_note, warnings=warnings,
                                                    lines=lines, tail=tail))


def _threshold_row(t: dict) -> dict:
    outcome = "pass" if t["passed"] else "INCONCLUSIVE" if t.get("inconclusive") else "FAIL"
    css = "pass" if t["passed"] else "inconclusive" if t.get("inconclusive") else "fail"
    return {"name": t["name"], "threshold": t["threshold"], "bucket": t["bucket"] or "overall",
            "css": css, "outcome": outcome, "rule": t["rule"]}


def compare_html(result: dict) -> str:
    """The report of one `tokq compare` result (its JSON)."""
    named = {result["b"]["name"]: result}
    probes = result.get("probes")
    if probes:
        probes = {"line": probes_line(probes), "grid_a": plots.probe_grid(probes, "a"),
                  "grid_b": plots.probe_grid(probes, "b")}
    verdict = "PASS" if result["passed"] else verdict_word(result["thresholds"])
    return render_page(
        COMPARE_PAGE, a=result["a"]["name"], b=result["b"]["name"], verdict=verdict,
        verdict_css={"PASS": "pass", "INCONCLUSIVE": "inconclusive"}.get(verdict, "fail"), w=result["windows"],
        kl_method=result["kl_method"], details=quality_details(result),
        kl_plot=plots.metric_by_bucket(named, "kl", "KL(A‖B)"),
        top1_plot=plots.metric_by_bucket(named, "top1", "top-1 agreement"),
        documents_plot=plots.document_distribution(named), probes=probes,
        thresholds=[_threshold_row(t) for t in result["thresholds"]], version=result["tokq_version"])
