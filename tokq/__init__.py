"""tokq: quantize LLMs, run them on tokq's own engine, gate releases on speed and long-document quality.

The Python API (the CLI is a thin layer over it):

    import tokq
    q = tokq.quantize("smollm2-135m", method="awq", out="smollm2-awq")       # -> QuantizeResult
    r = tokq.compare("smollm2-135m", "smollm2-awq", data="mydocs/", thresholds={"max_kl": {None: 0.05}})
    r.passed, r.exit_code, r.to_json()                                       # CompareResult
    b = tokq.bench(["smollm2-135m", "smollm2-awq"], prompt_len=256, gen_len=64)
    g = tokq.gate("tokq.toml")                                               # GateResult: .passed, .exit_code
    s = tokq.sensitivity("smollm2-135m", data="mydocs/")                     # SensitivityResult: per-Linear costs
    llm = tokq.LLM("smollm2-awq")
    llm.generate(["The capital of France is"], tokq.SamplingParams(max_tokens=16))

Names are imported on first use, so `import tokq` (and the CLI's start) stays light.
"""

from __future__ import annotations

try:  # written by setuptools-scm when tokq is installed: 0.1.devN+g<commit>, from the commit it was built at
    from tokq._version import __version__
except ImportError:  # a source tree that was never installed
    __version__ = "0.1.0+unknown"

# public name -> module that defines it
_API = {
    "quantize": "tokq.api.quantize", "QuantizeResult": "tokq.api.quantize", "QuantizeSettings": "tokq.settings",
    "compare": "tokq.api.compare", "CompareResult": "tokq.api.compare", "CompareSettings": "tokq.settings",
    "bench": "tokq.api.bench", "BenchResult": "tokq.api.bench", "BenchSettings": "tokq.settings",
    "gate": "tokq.api.gate", "GateResult": "tokq.api.gate",
    "sensitivity": "tokq.api.sensitivity", "SensitivityResult": "tokq.mixed.sensitivity",
    "LLM": "tokq.llm", "SamplingParams": "tokq.engine.sampling",
    "TokqError": "tokq.errors",
}
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'tokq' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
