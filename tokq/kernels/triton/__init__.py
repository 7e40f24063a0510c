"""Triton kernels for CUDA GPUs: w4a16 dequant-fused GEMM, W8A8 int8 and fp8 GEMMs, paged attention.

Each module is importable without a GPU (Triton's CPU interpreter, `TRITON_INTERPRET=1`, runs the
same kernels in tests) but not without triton; the registry only offers these kernels for layers on
a CUDA device when triton is installed, and reaches them through `TritonFunction`, which imports a
module on first call. This file itself imports no triton.
"""

from __future__ import annotations

import importlib.util
import os


def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (tests); autotuning is skipped then."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


AUTOTUNE_ENV = "TOKQ_TRITON_AUTOTUNE"


def autotune_enabled() -> bool:
    """False under the interpreter, or when TOKQ_TRITON_AUTOTUNE=0 asks every kernel for one fixed tile
    config (GPU tests and quick checks skip the tuning's compile time; results are the same, only speed
    differs)."""
    return not interpreting() and os.environ.get(AUTOTUNE_ENV, "1") != "0"


class TritonFunction:
    """One function of a module of this package, imported on first call (triton is optional and slow to import)."""

    def __init__(self, module: str, attr: str):
        self.module, self.attr, self._fn = module, attr, None

    def __call__(self, *args, **kwargs):
        if self._fn is None:
            self._fn = getattr(importlib.import_module(f".{self.module}", __name__), self.attr)
        return self._fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"TritonFunction({self.module}.{self.attr})"


def unavailable_reason(device: str) -> str | None:
    """Why a Triton kernel cannot run on `device` here (None when it can)."""
    if device != "cuda":
        return f"Triton kernels run on CUDA GPUs (the layer is on {device})"
    if not triton_importable():
        return "triton is not installed (pip install 'tokq[gpu]')"
    return None
