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


# Every generator tokq seeds takes a non-negative 64-bit seed (torch.manual_seed, torch.Generator, numpy's
# default_rng, random); some add small offsets to it (workload prompts: seed + 2), so the top bit stays free.
MAX_SEED = 2**63 - 1


def max_threads() -> int:
    """More threads than 4 per CPU only slow torch down, and a huge count crashes OpenMP (a segfault, not an
    error): the bound --threads is checked against."""
    return 4 * (os.cpu_count() or 1)


def check_threads(threads: int | None) -> None:
    if threads is not None and not 1 <= threads <= max_threads():
        raise ConfigError(f"--threads {threads}: give 1 to {max_threads()} (this machine has {os.cpu_count()} "
                          "CPUs), or leave it out for torch's choice")


def check_seed(seed: int) -> None:
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"--seed {seed}: give an integer from 0 to 2**63 - 1 ({MAX_SEED})")


def setup_runtime(threads: int | None = None, device: str = "auto", seed: int = 0) -> RuntimeInfo:
    check_threads(threads)  # both before torch sees them: an out-of-range count can crash the process
    check_seed(seed)
    if threads is not None:
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
