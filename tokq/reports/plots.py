"""Plots for the HTML report, rendered by matplotlib (Agg, no display) to inline PNG data URIs."""

from __future__ import annotations

import base64
import functools
import io
import math
from collections.abc import Callable
from typing import TypeVar

import matplotlib

matplotlib.use("Agg")  # reports are rendered headless (CI), never to a window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402

F = TypeVar("F", bound=Callable[..., str])


def _plain_text(plot: F) -> F:
    """Draw every text of the figure as written: variant, model and folder names reach legends, tick labels and
    titles, and matplotlib would read `a$b$c` as math (drawn 'abc') and fail on `v$_$1` after all the scoring.
    The whole function runs in the rc context (tick labels are only made when the figure is drawn); a figure
    left open by a failure (a malformed report.json) is closed."""

    @functools.wraps(plot)
    def draw(*args, **kwargs) -> str:
        before = set(plt.get_fignums())
        try:
            with matplotlib.rc_context({"text.parse_math": False}):
                return plot(*args, **kwargs)
        except BaseException:
            for number in set(plt.get_fignums()) - before:
                plt.close(number)
            raise

    return draw  # type: ignore[return-value]


def _data_uri(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@_plain_text
def metric_by_bucket(results: dict[str, dict], metric: str, label: str, path: str = "prefill",
                     thresholds: dict[str | None, float] | None = None) -> str:
    """One line per variant: the metric per position bucket with its 95% CI as error bars; a rule's threshold
    (overall: a dashed line across; per bucket: a short line over that bucket) in red."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels: list[str] = []
    for i, (name, result) in enumerate(results.items()):
        buckets = result[path]["buckets"]
        labels = list(buckets)
        # a value that is not a number (null in the JSON: a model with NaN scores) draws no point
        values = [math.nan if buckets[b][metric]["value"] is None else buckets[b][metric]["value"] for b in labels]
        # a bound the sample does not give (null in the JSON: one document) draws no bar on that side
        low = [0.0 if buckets[b][metric]["low"] is None or math.isnan(v) else v - buckets[b][metric]["low"]
               for v, b in zip(values, labels, strict=True)]
        high = [0.0 if buckets[b][metric]["high"] is None or math.isnan(v) else buckets[b][metric]["high"] - v
                for v, b in zip(values, labels, strict=True)]
        xs = [x + 0.06 * (i - (len(results) - 1) / 2) for x in range(len(labels))]
        ax.errorbar(xs, values, yerr=[low, high], marker="o", capsize=3, label=name)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlim(-0.5, len(labels) - 0.5)  # one bucket would otherwise zoom onto the variants' tiny offsets
    for bucket, value in (thresholds or {}).items():
        if bucket is None:
            ax.axhline(value, color="tab:red", ls="--", lw=1, label="threshold")
        elif bucket in labels:
            x = labels.index(bucket)
            ax.plot([x - 0.3, x + 0.3], [value, value], color="tab:red", lw=2)
    ax.set_xlabel("position in window")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _data_uri(fig)


@_plain_text
def document_distribution(results: dict[str, dict], metric: str = "kl", label: str = "mean KL per document") -> str:
    """Per-document means of a metric, one box per variant (documents are the bootstrap's unit)."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    data = [[d[metric] for d in r["prefill"]["documents"] if d.get(metric) is not None] for r in results.values()]
    ax.boxplot(data, showmeans=True)
    ax.set_xticks(range(1, len(results) + 1), list(results))
    ax.set_ylabel(label)
    ax.grid(alpha=0.3, axis="y")
    return _data_uri(fig)


@_plain_text
def probe_grid(probes: dict, side: str, title: str | None = None) -> str:
    """Passkey accuracy by context (rows) and depth (columns) for one side ('a' or 'b')."""
    grid = probes[f"{side}_grid"]
    contexts = sorted(grid, key=int)
    depths = sorted({d for row in grid.values() for d in row}, key=float)
    values = [[float(grid[c].get(d, float("nan"))) for d in depths] for c in contexts]
    fig, ax = plt.subplots(figsize=(4.2, 0.5 + 0.45 * len(contexts)))
    ax.imshow(values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(depths)), [f"{float(d):.0%}" for d in depths])
    ax.set_yticks(range(len(contexts)), contexts)
    ax.set_xlabel("needle depth")
    ax.set_ylabel("context")
    ax.set_title(title or side.upper(), fontsize=10)
    for r, row in enumerate(values):
        for c, v in enumerate(row):
            ax.text(c, r, "✓" if v >= 0.5 else "✗", ha="center", va="center", fontsize=9)
    return _data_uri(fig)


@_plain_text
def tbt_distribution(tbts_ms: dict[str, list[float]]) -> str:
    """Time between tokens or decode step times (ms), one histogram per variant/mode."""
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for name, values in tbts_ms.items():
        if values:
            ax.hist(values, bins=40, alpha=0.5, label=name)
    ax.set_xlabel("time between tokens (ms)")
    ax.set_ylabel("tokens")
    ax.legend(fontsize=8)
    return _data_uri(fig)


@_plain_text
def speed_ratios(rules_by_variant: dict[str, list[dict]]) -> str:
    """Each speed rule's ratio (dot) with its 95% interval (line) per variant, and its threshold (black tick)."""
    entries = [(name, r) for name, rules in rules_by_variant.items() for r in rules]
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.5 * max(1, len(entries))))
    for y, (_, r) in enumerate(entries):
        color = {"pass": "tab:green", "inconclusive": "tab:olive", "fail": "tab:red"}[r["result"]]
        if r.get("low") is not None:
            ax.plot([r["low"], r["high"]], [y, y], color=color, lw=3, alpha=0.6)
        if r.get("value") is not None:
            ax.plot([r["value"]], [y], "o", color=color, ms=6)
        ax.plot([r["threshold"]] * 2, [y - 0.4, y + 0.4], color="black", lw=2)
    ax.set_yticks(range(len(entries)), [f"{name}: {r['metric']}" for name, r in entries])
    ax.axvline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("variant vs base (dot: estimate, line: 95% interval, black tick: threshold)")
    ax.invert_yaxis()
    ax.grid(alpha=0.3, axis="x")
    return _data_uri(fig)


@_plain_text
def mix_frontier(search: dict) -> str:
    """The gate's mixed-precision search: the knapsack frontier (bytes vs predicted KL, grey line), the uniform
    schemes on it (squares), each build judged on the held-out documents (measured KL with its 95% interval,
    coloured by the gate's verdict on it) and the chosen point (star)."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    mib = 2.0**20
    frontier = search["frontier"]
    ax.plot([p["bytes"] / mib for p in frontier], [max(p["predicted_kl"], 1e-6) for p in frontier], "-",
            color="grey", lw=1, label="frontier (predicted KL)")
    for fmt, p in search.get("uniform", {}).items():
        if p["predicted_kl"] <= 0:
            continue  # all 16-bit: the base itself, no KL to draw on a log axis
        ax.plot([p["bytes"] / mib], [max(p["predicted_kl"], 1e-6)], "s", color="black", ms=6)
        ax.annotate(f"uniform {fmt}", (p["bytes"] / mib, max(p["predicted_kl"], 1e-6)), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    labelled: set[str] = set()
    for e in search.get("evaluations", []):
        point = frontier[e["index"]]
        kl = e.get("kl") or {}
        color = {"pass": "tab:green", "inconclusive": "tab:olive", "fail": "tab:red"}.get(e["result"], "tab:grey")
        value = kl.get("value")
        if value is None:
            continue
        x = point["bytes"] / mib
        if kl.get("low") is not None and kl.get("high") is not None:
            ax.plot([x, x], [max(kl["low"], 1e-6), max(kl["high"], 1e-6)], color=color, lw=3, alpha=0.6)
        label = f"held-out KL, {e['result']}" if e["result"] not in labelled else None
        labelled.add(e["result"])
        ax.plot([x], [max(value, 1e-6)], "o", color=color, ms=6, label=label)
    if search.get("chosen") is not None:
        p = frontier[search["chosen"]]
        ax.plot([p["bytes"] / mib], [max(p["predicted_kl"], 1e-6)], "*", color="tab:blue", ms=14, label="chosen")
    ax.set_yscale("log")
    # plain tick labels: the figure's text is drawn as written (_plain_text), so the log axis' mathtext would
    # show as source
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("candidate Linear weights (MiB)")
    ax.set_ylabel("mean KL (nats/token)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _data_uri(fig)
