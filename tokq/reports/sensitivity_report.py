"""The report folder of `tokq sensitivity --report-dir`: report.json (the result's JSON, the source of truth) and
report.html with the per-layer plots: each Linear's KL alone in layer order, one line per format on a log scale
with its 95% interval, the gain of keeping it wide beside it, and the same per block.

Written atomically into a folder tokq owns (reports.folder); rendered with autoescaping (reports.html).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from matplotlib.ticker import FuncFormatter, NullFormatter

from tokq.reports.folder import write_report_folder
from tokq.reports.html import _ci, render_page
from tokq.reports.plots import _data_uri, _plain_text, plt

SENSITIVITY_PAGE = """\
<!doctype html><html><head>{{ head }}<title>tokq sensitivity {{ model }}</title><style>{{ style }}</style>\
</head><body>
<h1>tokq sensitivity: {{ model }}</h1>
<p>{{ w["count"] }} windows of up to {{ w["window"] }} tokens from {{ w["documents"] }} documents, \
{{ w["scored_tokens"] }} scored tokens; {{ units }} measurements in {{ seconds }} s. Each unit is rounded to the \
format (RTN) and run against the 16-bit model: KL(base‖candidate), top-1 agreement and ΔNLL per token, means with \
95% intervals from a bootstrap over documents.</p>
<h2>Every Linear at every format</h2>
<table><tr><th>format</th><th>KL</th><th>top-1</th><th>ΔNLL</th><th>bytes (all Linears)</th></tr>
{% for row in everything %}
<tr><td>{{ row.fmt }}</td><td>{{ row.kl }}</td><td>{{ row.top1 }}</td><td>{{ row.nll }}</td><td>{{ row.bytes }}</td></tr>
{% endfor %}
</table>
<h2>Per Linear, in layer order</h2>
<img alt="KL of quantizing each Linear alone" src="{{ alone_plot }}">
{% if gain_plot %}<img alt="gain of keeping each Linear wide" src="{{ gain_plot }}">{% endif %}
{% if block_plot %}<h2>Per block</h2><img alt="KL per block" src="{{ block_plot }}">{% endif %}
<h2>Most sensitive units ({{ first }})</h2>
<table><tr><th>unit</th><th>KL alone</th><th>top-1 alone</th><th>ΔNLL alone</th><th>keep-wide gain (KL)</th></tr>
{% for r in ranked %}
<tr><td>{{ r.unit }}</td><td>{{ r.kl }}</td><td>{{ r.top1 }}</td><td>{{ r.nll }}</td><td>{{ r.gain }}</td></tr>
{% endfor %}
</table>
{% if notes %}<h2>Notes</h2><ul>{% for n in notes %}<li>{{ n }}</li>{% endfor %}</ul>{% endif %}
<p class=ci>tokq {{ version }}</p></body></html>
"""


def _bar(est: dict | None, floor: float | None) -> tuple[float, float, float]:
    """(value, distance down, distance up) of an error bar; a missing value draws no point, a missing bound no bar
    on that side; with `floor` (a log axis has no 0) the point and its bar are clipped at it."""
    if not est or est["value"] is None:
        return math.nan, 0.0, 0.0
    v = est["value"]
    lo = v if est["low"] is None else est["low"]
    hi = v if est["high"] is None else est["high"]
    if floor is not None:
        v, lo, hi = max(v, floor), max(lo, floor), max(hi, floor)
    return v, max(0.0, v - lo), max(0.0, hi - v)


@_plain_text
def layer_plot(result: dict, kind: str, part: str, label: str) -> str:
    """`part` ("alone" or "wide_gain") KL of every unit of `kind` in layer order, one line per format with its
    95% interval. Alone KLs are on a log scale (clipped at a floor: a log axis has no 0); gains, which a
    rounding error can make negative, on a symmetric log scale."""
    fig, ax = plt.subplots(figsize=(9, 3.8))
    names = list(dict.fromkeys(u["unit"] for u in result["units"] if u["kind"] == kind))
    floor = 1e-9 if part == "alone" else None
    smallest = math.inf
    for fmt in result["formats"]:
        by_name = {u["unit"]: u[part] for u in result["units"] if u["kind"] == kind and u["fmt"] == fmt}
        points = [_bar((by_name.get(n) or {}).get("kl"), floor) for n in names]
        ax.errorbar(range(len(names)), [p[0] for p in points], yerr=[[p[1] for p in points], [p[2] for p in points]],
                    marker="o", ms=3, lw=1, capsize=2, label=fmt)
        smallest = min([smallest, *(abs(p[0]) for p in points if p[0] and math.isfinite(p[0]))])
    if part == "alone":
        ax.set_yscale("log")
    else:  # linear within the smallest gain measured, so every format's gains are told apart from 0
        ax.set_yscale("symlog", linthresh=smallest if math.isfinite(smallest) else 1e-9)
        ax.axhline(0.0, color="grey", lw=0.8)
    # plain tick labels: the report draws text as written (no mathtext), so matplotlib's 10^{-4} would show raw
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: "0" if v == 0 else f"{v:.0e}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    layers = [n.split(".")[2] for n in names]
    starts = [i for i, layer in enumerate(layers) if i == 0 or layers[i - 1] != layer]
    step = max(1, len(starts) // 15)
    ax.set_xticks(starts[::step], [f"L{layers[i]}" for i in starts[::step]])
    ax.set_xlabel("decoder layer (each Linear in order: qkv, o, gate_up, down)" if kind == "linear" else "block")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _data_uri(fig)


def sensitivity_html(result: dict) -> str:
    """The report page of one sensitivity result (its JSON)."""
    kinds = {u["kind"] for u in result["units"]}
    has_gain = any(u["wide_gain"] is not None for u in result["units"])
    everything = []
    for fmt in result["formats"]:
        est = result["all_quantized"][fmt]
        size = sum(b[fmt] for b in result["bytes"].values())
        everything.append({"fmt": fmt, "kl": _ci(est["kl"]), "top1": _ci(est["top1"], True),
                           "nll": _ci(est["delta_nll"]), "bytes": f"{size:,}"})
    dense = sum(b[d] for b in result["bytes"].values() for d in b if d not in result["formats"])
    everything.append({"fmt": "16-bit", "kl": "0", "top1": "100%", "nll": "0", "bytes": f"{dense:,}"})
    first = result["formats"][0]
    ranked = sorted((u for u in result["units"] if u["fmt"] == first),
                    key=lambda u: -(u["alone"]["kl"]["value"] if u["alone"]["kl"]["value"] is not None else -1))
    rows = [{"unit": u["unit"], "kl": _ci(u["alone"]["kl"]), "top1": _ci(u["alone"]["top1"], True),
             "nll": _ci(u["alone"]["delta_nll"]), "gain": _ci((u["wide_gain"] or {}).get("kl"))} for u in ranked[:20]]
    return render_page(
        SENSITIVITY_PAGE, model=result["model"], w=result["windows"], units=len(result["units"]),
        seconds=f"{result['seconds']:.0f}", everything=everything,
        alone_plot=layer_plot(result, "linear", "alone", "KL alone (log)"),
        gain_plot=layer_plot(result, "linear", "wide_gain", "keep-wide gain in KL (symlog)") if has_gain else None,
        block_plot=layer_plot(result, "block", "alone", "KL alone, whole block (log)") if "block" in kinds else None,
        first=first, ranked=rows, notes=result.get("notes", []), version=result["tokq_version"])


def write_sensitivity_report(folder: Path, result: dict, step_summary: bool = True) -> Path:
    return write_report_folder(Path(folder), {
        "report.json": lambda: json.dumps(result, indent=2, default=str) + "\n",
        "report.html": lambda: sensitivity_html(result)}, step_summary, "tokq sensitivity")
