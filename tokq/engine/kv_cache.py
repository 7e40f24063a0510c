"""The paged KV cache: its size arithmetic, the memory budget, and the per-layer cache tensors.

Bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per value. GQA shrinks it by
heads / kv_heads; a quantized cache (fp8, int8; scales in engine/kv_scales.py) halves it against 16 bits. The cache is allocated as
one [num_blocks, block_size, kv_heads, head_dim] tensor per layer for K and one for V (the layout
kernels/paged.py defines). Layers are grouped by their sliding window (`layer_groups`: Gemma 3's full
layers, its sliding ones); each group has its own pool of blocks (engine/kv_pools.py), so a layer's
num_blocks is its group's, and block b of every layer in a group holds the same positions of the same
sequence. A sliding group's pool only needs each sequence's window (plus a step's chunk).

The budget: `--kv-memory` when given, else what keeps the process's total use under a fraction
(default 80%) of the device's memory: on a GPU its total memory minus what torch has allocated (the
weights); on a CPU the machine's available memory (MemAvailable) is the ceiling, as other processes
share it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from tokq.dtypes import kv_dtype_of
from tokq.engine import huge_pages
from tokq.engine.config import ModelConfig
from tokq.errors import ConfigError

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MEMORY_FRACTION = 0.8
# The engine's cache dtypes. int8 and fp8 divide by per-layer, per-head scales (engine/kv_scales.py): a
# checkpoint's calibrated ones, or for fp8 without them, 1.
ENGINE_KV_DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """'512MiB', '2g', '1.5GB', '1000000' -> bytes (binary units: KB = KiB)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"--kv-memory {text!r} is not a size: give e.g. 512MiB, 2GiB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def kv_dtype_named(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype for --kv-dtype (None or 'auto': the model's compute dtype)."""
    if name in (None, "auto"):
        return model_dtype
    if name not in ENGINE_KV_DTYPES:
        raise ConfigError(f"--kv-dtype {name}: choose auto, {', '.join(ENGINE_KV_DTYPES)}")
    return kv_dtype_of(name)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = DEFAULT_BLOCK_SIZE

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype, block_size: int = DEFAULT_BLOCK_SIZE) -> KVCacheSpec:
        if block_size < 1:
            raise ConfigError(f"--block-size {block_size}: must be >= 1 (16 is the usual choice)")
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, dtype, block_size)

    @property
    def bytes_per_value(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_value

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def blocks_in(self, budget_bytes: int) -> int:
        return budget_bytes // self.bytes_per_block


@dataclass(frozen=True)
class LayerGroup:
    """Layers that attend within the same window: they share one block pool and one block table per sequence."""

    name: str  # "full" (global attention) or "sliding" ("sliding-W" when a model has several windows)
    window: int | None
    layers: tuple[int, ...]


def layer_groups(config: ModelConfig) -> list[LayerGroup]:
    """The model's layers grouped by window: the global layers first, then each window, smallest first."""
    by_window: dict[int | None, list[int]] = {}
    for layer in range(config.num_layers):
        by_window.setdefault(config.layer_window(layer), []).append(layer)
    windows = sorted(by_window, key=lambda w: (w is not None, w or 0))
    several = sum(w is not None for w in windows) > 1

    def name(w: int | None) -> str:
        return "full" if w is None else f"sliding-{w}" if several else "sliding"
    return [LayerGroup(name(w), w, tuple(by_window[w])) for w in windows]


def group_spec(spec: KVCacheSpec, group: LayerGroup) -> KVCacheSpec:
    """The cache spec of one group's layers (its bytes per token and per block)."""
    return replace(spec, num_layers=len(group.layers))


def split_budget(budget: int, one_seq: Sequence[int], block_bytes: Sequence[int]) -> list[int]:
    """Blocks per group's pool for `budget` bytes, split in proportion to one sequence's need in each group
    (`one_seq[g]` blocks of `block_bytes[g]` bytes), so that whole sequences fit in every pool at once.
    One group: budget // block_bytes. The pools never take more than the budget."""
    need = sum(n * b for n, b in zip(one_seq, block_bytes, strict=True))
    return [budget * n // need for n in one_seq]


def available_memory(device: torch.device) -> tuple[int, int]:
    """(total bytes, bytes the process may still use) of the device's memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, free
    total = available = 0
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        total, available = info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    except (OSError, KeyError, ValueError, IndexError):
        import os

        total = available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, available


def default_kv_budget(device: torch.device, fraction: float = DEFAULT_MEMORY_FRACTION) -> int:
    """Bytes for the KV cache that keep total use under `fraction` of the device's memory."""
    total, available = available_memory(device)
    if device.type == "cuda":
        used = total - available
        return max(0, int(total * fraction) - used)
    # CPU: other processes share the memory; never plan past `fraction` of what is available now.
    return max(0, int(available * fraction))


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int | Sequence[int],
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed K and V caches, one pair per layer (zeros: a never-written slot reads as 0, not NaN).
    `num_blocks`: one count for every layer, or one per layer (its group's pool)."""
    counts = [num_blocks] * spec.num_layers if isinstance(num_blocks, int) else list(num_blocks)
    if len(counts) != spec.num_layers:
        raise ValueError(f"{len(counts)} block counts for {spec.num_layers} layers")
    shapes = [(n, spec.block_size, spec.num_kv_heads, spec.head_dim) for n in counts]
    if torch.device(device).type == "cpu":  # one arena on huge pages: a step's scattered block reads walk fewer pages
        tensors = huge_pages.zeros_many([shape for shape in shapes for _ in (0, 1)], spec.dtype)
        return [(tensors[2 * i], tensors[2 * i + 1]) for i in range(len(shapes))]
    return [(torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
            for shape in shapes]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
