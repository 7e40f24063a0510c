"""MethodOptions: every method's tuning knobs (the `tokq quantize` flags and tokq.toml recipe keys of the same names)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class MethodOptions:
    # AWQ
    awq_grid: int = 20  # scale exponents tried in [0, 1)
    # 1: every grid point (the paper); 2: coarse-to-fine, 12 of the 20 points (awq.grid_points), measured
    # against the exhaustive grid by benchmarks/awq_search.py (results/awq-search-*.json)
    awq_grid_stride: int = 1
    awq_clip_grid: int = 20  # clip ratios tried in (0.5, 1]
    awq_search_samples: int = 16  # calibration sequences used by the searches (of all captured)
    awq_clip_tokens: int = 4096  # tokens used by the clipping search (its cost is one Gram matrix)
    # GPTQ
    # Static-group act-order by default (as llm-compressor does): better columns first, and the
    # stored layout stays group-contiguous, so kernels and checkpoints are unaffected.
    act_order: bool = True
    damp: float = 0.01
    gptq_block_size: int = 128
    true_sequential: bool = True
    # How each group's grid range is chosen before the GPTQ pass: "mse" searches a clip ratio per group
    # (rounding.mse_qparams); "minmax" takes the group's full range (the paper's, and llm-compressor's
    # default). benchmarks/calibration_shift.py measures the difference across calibration domains.
    gptq_scale_search: str = "mse"
    # SmoothQuant
    alpha: float | None = 0.5  # None: search alpha per block
    alpha_grid: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)

    def to_json(self) -> dict:
        return asdict(self)
