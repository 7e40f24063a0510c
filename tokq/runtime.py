"""Process-wide settings every command accepts: threads, device, seed."""

from __future__ import annotations

import os
import platform
import random
from dataclasses import asdict, dataclass

import torch

from tokq.errors import ConfigError


@dataclass
class RuntimeInfo:
    device: str
    threads: int
    seed: int
    torch: str
    python: str
    machine: str
    cpu_count: int | None
    hardware: str = ""  # the CPU model, and the GPU's name when running on CUDA

    def to_json(self) -> dict:
        return asdict(self)


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; an unavailable device is an input error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"--device {device!r} is not a device: use auto, cpu or cuda[:N]") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA GPU is visible here; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device}: tokq runs on cpu and cuda")
    return dev


def setup_runtime(threads: int | None = None, device: str = "auto", seed: int = 0) -> RuntimeInfo:
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"--threads {threads}: give a positive number of threads")
        torch.set_num_threads(threads)
    random.seed(seed)
    torch.manual_seed(seed)
    dev = resolve_device(device)
    return RuntimeInfo(
        device=str(dev),
        threads=torch.get_num_threads(),
        seed=seed,
        torch=torch.__version__,
        python=platform.python_version(),
        machine=platform.machine(),
        cpu_count=os.cpu_count(),
        hardware=_hardware(dev),
    )


def _hardware(dev: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)}; host {cpu}"
    return cpu
