"""How busy the machine was while tokq measured speed: load average, CPU steal and busy time, CPU frequency.

Speed verdicts are ratios measured side by side, so a busy machine widens their intervals rather than
biasing them; the report still records the load so a reader can tell a quiet run from a contended one.
Everything is read from /proc and /sys (Linux); where a file is missing the field is None.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError:
        return None


def cpu_times() -> dict[str, int] | None:
    """The aggregate 'cpu' line of /proc/stat, in clock ticks."""
    text = _read("/proc/stat")
    if not text:
        return None
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    values = text.splitlines()[0].split()[1:1 + len(names)]
    return {n: int(v) for n, v in zip(names, values, strict=False)}


def cpu_mhz() -> list[float]:
    """Current frequency per CPU (cpufreq where readable, else /proc/cpuinfo); empty when neither is."""
    out = []
    for cpu in sorted(Path("/sys/devices/system/cpu").glob("cpu[0-9]*")):
        khz = _read(str(cpu / "cpufreq" / "scaling_cur_freq"))
        if khz and khz.strip().isdigit():
            out.append(int(khz) / 1000)
    if out:
        return out
    text = _read("/proc/cpuinfo") or ""
    return [float(line.split(":", 1)[1]) for line in text.splitlines() if line.startswith("cpu MHz")]


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


@dataclass
class LoadMonitor:
    """Started when constructed; `stop()` returns what happened in between."""

    start_s: float = field(default_factory=time.perf_counter)
    start_times: dict[str, int] | None = field(default_factory=cpu_times)
    start_load: list[float] | None = field(default_factory=load_average)
    start_mhz: list[float] = field(default_factory=cpu_mhz)

    def stop(self) -> dict:
        end = cpu_times()
        out = {"seconds": round(time.perf_counter() - self.start_s, 2), "cpus": os.cpu_count(),
               "load_average_start": self.start_load, "load_average_end": load_average(),
               "cpu_mhz_start": _summary(self.start_mhz), "cpu_mhz_end": _summary(cpu_mhz()),
               "steal_fraction": None, "busy_fraction": None}
        if self.start_times and end:
            delta = {k: end[k] - self.start_times.get(k, 0) for k in end}
            total = sum(delta.values())
            if total > 0:
                out["steal_fraction"] = round(delta.get("steal", 0) / total, 4)
                out["busy_fraction"] = round(1 - (delta.get("idle", 0) + delta.get("iowait", 0)) / total, 4)
        return out


def _summary(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"min": round(min(values)), "max": round(max(values)), "mean": round(sum(values) / len(values))}
