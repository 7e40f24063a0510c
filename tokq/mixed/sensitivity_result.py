"""What a sensitivity run measured (`SensitivityResult`), and its JSON: the source of truth the table, the
report and the mixed-precision search (tokq.mixed.knapsack via `linear_costs`) read.

JSON shape (`to_json`; `from_json` reads it back):

    {"command": "sensitivity", "tokq_version", "model", "checkpoint", "formats": [fmt, ...],
     "schemes": {fmt: QuantScheme.to_json()},
     "units": [{"unit": "model.layers.3.mlp.down_proj" | "model.layers.3", "kind": "linear" | "block", "fmt",
                "alone": {"kl"|"top1"|"delta_nll": EST}, "wide_gain": {...} | null}],
     "bytes": {linear: {fmt or DENSE: bytes}}, "all_quantized": {fmt: {metric: EST}}, "floor": {metric: EST},
     "windows": {...how many, how long, from which documents, topk, full-KL rows...},
     "intervals": {"confidence", "method", "clustered_by": "document", "warning"},
     "seconds", "notes": [...]}

EST = {"value", "low", "high", "n_tokens", "n_docs"} (null: NaN or an unbounded side); the interval's
confidence, method and few-documents warning are the same for every estimate of a run, so they are written
once, under "intervals".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tokq.evalsuite.stats.estimate import DEFAULT_CONFIDENCE, Estimate, json_float
from tokq.quantization.layer_schemes import DENSE
from tokq.quantization.scheme import ActivationArgs, QuantScheme, WeightArgs

METRICS = ("kl", "top1", "delta_nll")


@dataclass
class UnitCost:
    """One unit (a Linear, or a block "model.layers.{i}") at one format.

    `alone`: only this unit quantized to `fmt`, against the dense model (KL(base‖candidate), top-1
    agreement, ΔNLL = NLL_candidate − NLL_base). `wide_gain`: everything quantized to `fmt` except this unit,
    against everything quantized, per token: KL(all) − KL(all but unit), top-1(all but unit) − top-1(all),
    ΔNLL(all) − ΔNLL(all but unit): positive is what keeping the unit wide buys.
    """

    unit: str
    kind: str  # "linear" | "block"
    fmt: str
    alone: dict[str, Estimate]
    wide_gain: dict[str, Estimate] | None = None

    def to_json(self) -> dict:
        return {"unit": self.unit, "kind": self.kind, "fmt": self.fmt, "alone": _ests_json(self.alone),
                "wide_gain": None if self.wide_gain is None else _ests_json(self.wide_gain)}


@dataclass
class SensitivityResult:
    model: str
    checkpoint: str
    formats: list[str]
    schemes: dict[str, QuantScheme]
    units: list[UnitCost]
    bytes: dict[str, dict[str, int]]  # linear name -> fmt (DENSE included) -> bytes on disk
    all_quantized: dict[str, dict[str, Estimate]]  # fmt -> metrics with every candidate Linear at fmt
    windows: dict
    seconds: float
    notes: list[str] = field(default_factory=list)
    # the unquantized model through the same path: KL 0 and top-1 1 exactly (a check of the measurement)
    floor: dict[str, Estimate] | None = None

    def linear_costs(self) -> dict[str, dict[str, float]]:
        """Linear -> fmt -> the alone KL's point estimate (DENSE -> 0.0): the knapsack's costs. The full-KL
        estimate is unbiased, so one a rounding error below 0 (a format that barely changes a Linear) counts 0."""
        out: dict[str, dict[str, float]] = {}
        for u in self.units:
            if u.kind == "linear":
                out.setdefault(u.unit, {DENSE: 0.0})[u.fmt] = max(0.0, u.alone["kl"].value)
        return out

    def unit(self, name: str, fmt: str) -> UnitCost:
        """The cost of unit `name` (a Linear or "model.layers.{i}") at `fmt`."""
        for u in self.units:
            if u.unit == name and u.fmt == fmt:
                return u
        raise KeyError(f"{name} at {fmt}")

    def to_json(self) -> dict:
        from tokq import __version__

        est = next((e for u in self.units for e in u.alone.values()), None)
        return {
            "command": "sensitivity", "tokq_version": __version__, "model": self.model,
            "checkpoint": self.checkpoint, "formats": list(self.formats),
            "schemes": {k: s.to_json() for k, s in self.schemes.items()},
            "units": [u.to_json() for u in self.units], "bytes": self.bytes,
            "all_quantized": {k: _ests_json(v) for k, v in self.all_quantized.items()},
            "floor": None if self.floor is None else _ests_json(self.floor),
            "windows": self.windows,
            "intervals": {"confidence": est.confidence if est else DEFAULT_CONFIDENCE,
                          "method": est.method if est else None, "clustered_by": "document",
                          "warning": est.warning if est else None},
            "seconds": self.seconds, "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, d: dict) -> SensitivityResult:
        iv = d.get("intervals") or {}
        conf, method, warning = iv.get("confidence", DEFAULT_CONFIDENCE), iv.get("method"), iv.get("warning")

        def ests(x: dict | None) -> dict[str, Estimate] | None:
            return None if x is None else {k: _est_from(v, conf, method, warning) for k, v in x.items()}

        units = [UnitCost(u["unit"], u["kind"], u["fmt"], ests(u["alone"]), ests(u["wide_gain"])) for u in d["units"]]
        return cls(model=d["model"], checkpoint=d["checkpoint"], formats=list(d["formats"]),
                   schemes={k: scheme_from_json(s) for k, s in d["schemes"].items()}, units=units,
                   bytes={k: {f: int(b) for f, b in v.items()} for k, v in d["bytes"].items()},
                   all_quantized={k: ests(v) for k, v in d["all_quantized"].items()}, windows=dict(d["windows"]),
                   seconds=float(d["seconds"]), notes=list(d.get("notes", [])), floor=ests(d.get("floor")))

    def write_json(self, path) -> None:
        from tokq.reports.json_io import write_json

        write_json(path, self.to_json())

    def write_report(self, folder) -> object:
        """report.json and report.html (the per-layer plots) in `folder` (replaced only if tokq wrote it)."""
        from tokq.reports.sensitivity_report import write_sensitivity_report

        return write_sensitivity_report(folder, self.to_json())


def scheme_from_json(d: dict) -> QuantScheme:
    act = d.get("activations")
    return QuantScheme(d["name"], WeightArgs(**d["weights"]), ActivationArgs(**act) if act else None,
                       tuple(d.get("ignore", ("lm_head",))))


def _ests_json(ests: dict[str, Estimate]) -> dict:
    return {k: {"value": json_float(e.value), "low": json_float(e.low), "high": json_float(e.high),
                "n_tokens": int(e.n_tokens), "n_docs": int(e.n_docs)} for k, e in ests.items()}


def _est_from(d: dict, confidence: float, method: str | None, warning: str | None) -> Estimate:
    """A JSON estimate back: a null value is NaN (no token), a null bound an unbounded side."""
    value = math.nan if d["value"] is None else float(d["value"])
    low = -math.inf if d["low"] is None else float(d["low"])
    high = math.inf if d["high"] is None else float(d["high"])
    return Estimate(value, low, high, int(d["n_tokens"]), int(d["n_docs"]), confidence, method, warning)
