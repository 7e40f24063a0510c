"""The settings of each tokq operation, as dataclasses whose field names are the CLI flags (`--group-size` is
`group_size`) and the tokq.toml keys (a recipe's `group_size`, a `[data.NAME]` table's `window`).

The CLI builds these from its options, the gate from tokq.toml, a script from keyword arguments: one name per
concept everywhere. Imports nothing heavy, so tokq.toml can be checked against them without loading torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from tokq.longctx.read_limits import DEFAULT_MAX_DOC_MB, DEFAULT_MAX_FILE_MB


@dataclass
class QuantizeSettings:
    """`tokq quantize` options; also the keys of a tokq.toml recipe (`recipe = { method = "awq", ... }`)."""

    method: str
    scheme: str | None = None  # default: the method's (quantization.pipeline.DEFAULT_SCHEMES)
    bits: int | None = None
    group_size: int | None = None  # -1: per-channel
    sym: bool | None = None
    act_order: bool | None = None  # GPTQ only (default: on)
    damp: float = 0.01  # GPTQ
    gptq_scales: str = "mse"  # GPTQ: each group's grid range, "mse" (searched clip) or "minmax"
    alpha: str | float | None = None  # SmoothQuant (or fp8's optional smoothing): a number in [0, 1] or "search"
    calib: Path | None = None  # calibration documents (default: the default long-document set)
    num_samples: int = 32
    seq_len: int = 512
    max_doc_mb: float = DEFAULT_MAX_DOC_MB
    max_file_mb: float = DEFAULT_MAX_FILE_MB
    save_dtype: str = "auto"
    seed: int = 0
    # mixed precision (tokq.api.quantize_mix): formats to choose from per Linear, e.g. "w4a16,w8a16,bf16", and
    # exactly one goal: the smallest build whose held-out KL bound meets target_kl, or the least KL within
    # max_size_ratio x the model's 16-bit size
    mix: str | None = None
    target_kl: float | None = None
    max_size_ratio: float | None = None
    # KV-cache quantization (engine/kv_scales.py): "fp8" or "int8" calibrates per-layer K/V scales on the
    # calibration windows and writes them (kv_cache_scheme); "attn_head" (one per KV head) or "tensor" (one per layer)
    kv_cache: str | None = None
    kv_cache_strategy: str = "attn_head"
    # the output layer: "16bit" (as the source has it; what vLLM loads) or "int8" (per output row, untied from the
    # embedding: quantization/lm_head.py; decodes faster, HF transformers loads it, vLLM's compressed-tensors
    # path quantizes Linear layers only)
    lm_head: str = "16bit"


@dataclass
class CompareSettings:
    """`tokq compare` options; the data-set keys are also a `[data.NAME]` table's keys."""

    window: int = 2048
    stride: int | None = None  # document tokens between window starts (None: no overlap)
    max_tokens: int | None = None
    sample_windows: int | None = None
    topk: int = 256  # A's top-k kept per position (benchmarks/kl_topk.py)
    full_kl_rows: int = 256  # positions per path scored over the whole vocabulary (0: the top-k lower bound only)
    decode_windows: int = 2
    decode_tokens: int = 128
    probes: bool = True
    probe_max_context: int | None = None  # None: the window
    probe_depths: int = 5
    probe_repeats: int = 1
    # rule name -> {bucket or None (overall): threshold}; e.g. {"max_kl": {None: 0.05, "4K-8K": 0.1}}
    thresholds: dict[str, dict[str | None, float]] = field(default_factory=dict)
    threshold_on: str = "bound"  # "bound": the 95% CI's unfavourable bound decides; "point": the estimate
    resamples: int = 1000
    use_cache: bool = True
    dtype: str = "auto"
    kv_dtype: str = "auto"  # "auto": a checkpoint's calibrated int8/fp8 cache when it has one, else the compute dtype
    b_kv_dtype: str | None = None
    b_kv_scales: str = "auto"  # B's int8/fp8 cache: "auto" (its checkpoint's calibrated scales) or "unit" (scale 1)
    kv_memory: str | None = None
    strict: bool = False
    max_doc_mb: float = DEFAULT_MAX_DOC_MB
    max_file_mb: float = DEFAULT_MAX_FILE_MB
    seed: int = 0
    max_concurrency: int = 8  # requests in flight to a URL side (tokq.remote.endpoint_scoring)
    timeout: float = 600.0  # seconds a URL side's request may take in all, retries included (remote/http.py)


@dataclass
class BenchSettings:
    """`tokq bench` options; the workload keys are also tokq.toml's `[bench]` keys."""

    prompt_len: int = 512
    gen_len: int = 256
    gen_len_range: float = 0.0
    concurrency: int = 16
    num_prompts: int | None = None  # default: concurrency
    arrival_rate: float = math.inf  # requests per second (inf: all at once)
    burstiness: float = 1.0  # gamma shape of the arrival gaps (1: Poisson), as vLLM's --burstiness
    static: bool = False
    draft: str | None = None
    num_speculative: int = 4
    dtype: str = "auto"
    kv_dtype: str = "auto"
    kv_memory: str | None = None
    max_num_batched_tokens: int = 2048
    data: Path | None = None  # take prompts from these documents instead of random tokens
    seed: int = 0


def settings_from(cls, options: dict, what: str):
    """`cls(**options)` with an unknown name refused by name (a typo must not be silently ignored)."""
    from tokq.errors import ConfigError

    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"{what}: unknown setting {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return cls(**options)
