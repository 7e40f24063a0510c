"""KV-cache scales per layer and KV head: what a quantized cache divides K and V by before storing them.

tokq keeps the calibrated absolute maximum (amax) of K (after QK-norm and RoPE, what the cache holds) and V per
layer and KV head; a cache dtype turns it into its scale, amax / qmax (127 for int8, 448 for fp8 e4m3), so one
calibration serves both dtypes and no calibrated value is clipped.

On disk the scales take compressed-tensors' layout, the one vLLM loads: config.json's
`quantization_config.kv_cache_scheme` = {num_bits: 8, type: "float" (fp8) or "int" (int8), strategy:
"attn_head" or "tensor", symmetric: true, dynamic: false}, and per layer `model.layers.N.self_attn.k_scale` and
`v_scale` in the safetensors, shape [kv_heads, 1, 1] (attn_head) or [1] (tensor), with stored = x / scale.
vLLM reads fp8 only (type "float"); an int8 cache with these scales is tokq's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tokq.dtypes import dtype_name
from tokq.errors import ModelError
from tokq.kernels.paged import FP8_E4M3_MAX, INT8_KV_MAX

KV_CACHE_TYPES = {"fp8": ("float", FP8_E4M3_MAX), "int8": ("int", INT8_KV_MAX)}  # --kv-cache -> (type, qmax)
STRATEGIES = ("attn_head", "tensor")


def qmax_of(dtype: torch.dtype) -> float:
    """The largest stored magnitude of a quantized cache dtype (what amax maps to)."""
    if dtype == torch.int8:
        return INT8_KV_MAX
    if dtype == torch.float8_e4m3fn:
        return FP8_E4M3_MAX
    raise ValueError(f"a {dtype_name(dtype)} KV cache takes no scales (int8 and fp8 do)")


@dataclass(frozen=True)
class KVScales:
    """Calibrated |K| and |V| maxima, fp32 [layers, kv_heads]; `strategy` "tensor" holds one value per layer
    repeated over its heads (what a per-tensor checkpoint gives)."""

    k_amax: torch.Tensor
    v_amax: torch.Tensor
    strategy: str = "attn_head"
    source: str = "calibrated"
    kv_cache: str | None = None  # the cache dtype they were written for ("fp8"/"int8"): `--kv-dtype auto` uses it

    def __post_init__(self) -> None:
        if self.k_amax.shape != self.v_amax.shape or self.k_amax.dim() != 2:
            raise ValueError(f"k_amax {tuple(self.k_amax.shape)} and v_amax {tuple(self.v_amax.shape)} must both be "
                             "[layers, kv_heads]")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"KV scale strategy {self.strategy!r}: choose {' or '.join(STRATEGIES)}")

    @property
    def num_layers(self) -> int:
        return int(self.k_amax.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self.k_amax.shape[1])

    def per_tensor(self) -> KVScales:
        """One scale per layer (the largest head's): what a reader without per-head scales loads."""
        def widest(a: torch.Tensor) -> torch.Tensor:
            return a.amax(dim=1, keepdim=True).expand_as(a).clone()
        return KVScales(widest(self.k_amax), widest(self.v_amax), "tensor", self.source, self.kv_cache)

    def scales_for(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, (k_scale, v_scale) fp32 [kv_heads] for a `dtype` cache; an all-zero head (never seen)
        keeps a tiny positive scale so the kernels' division stays finite."""
        qmax = qmax_of(dtype)
        k = (self.k_amax / qmax).clamp_min(1e-8).to(device, torch.float32)
        v = (self.v_amax / qmax).clamp_min(1e-8).to(device, torch.float32)
        return [(k[i].contiguous(), v[i].contiguous()) for i in range(self.num_layers)]

    def to_json(self) -> dict:
        return {"strategy": self.strategy, "source": self.source, "kv_cache": self.kv_cache,
                "k_amax": {"min": float(self.k_amax.min()), "median": float(self.k_amax.median()),
                           "max": float(self.k_amax.max())},
                "v_amax": {"min": float(self.v_amax.min()), "median": float(self.v_amax.median()),
                           "max": float(self.v_amax.max())}}


def kv_cache_scheme(kv_cache: str, strategy: str = "attn_head") -> dict:
    """config.json's quantization_config.kv_cache_scheme for `--kv-cache` fp8 or int8."""
    if kv_cache not in KV_CACHE_TYPES:
        raise ValueError(f"--kv-cache {kv_cache!r}: choose {' or '.join(KV_CACHE_TYPES)}")
    return {"num_bits": 8, "type": KV_CACHE_TYPES[kv_cache][0], "strategy": strategy, "symmetric": True,
            "dynamic": False, "group_size": None, "observer": "minmax"}


def kv_scale_tensors(scales: KVScales, kv_cache: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of `scales` for a `kv_cache` (fp8/int8) cache, HF-named, fp32."""
    from tokq.dtypes import kv_dtype_of

    out: dict[str, torch.Tensor] = {}
    for layer, pair in enumerate(scales.scales_for(kv_dtype_of(kv_cache))):  # the scales the engine divides by
        for name, scale in zip(("k_scale", "v_scale"), pair, strict=True):
            scale = scale.view(-1, 1, 1) if scales.strategy == "attn_head" else scale.max().view(1)
            out[f"model.layers.{layer}.self_attn.{name}"] = scale.contiguous()
    return out


def _scheme_qmax(scheme: object, where: str) -> tuple[float, str, str]:
    """(qmax, kv cache name, strategy) of a kv_cache_scheme, or a one-line error naming what tokq reads."""
    if not isinstance(scheme, dict):
        raise ModelError(f"{where}: kv_cache_scheme must be a table, got {type(scheme).__name__}")
    kind, bits, strategy = scheme.get("type", "float"), scheme.get("num_bits"), scheme.get("strategy", "tensor")
    names = {t: name for name, (t, _) in KV_CACHE_TYPES.items()}
    if bits != 8 or kind not in names:
        raise ModelError(f"{where}: kv_cache_scheme is {bits}-bit {kind}; tokq reads 8-bit float (fp8) or int (int8) "
                         "KV scales: requantize with `tokq quantize --kv-cache fp8`")
    if strategy not in STRATEGIES:
        raise ModelError(f"{where}: kv_cache_scheme strategy {strategy!r} is not supported; tokq reads "
                         f"{' or '.join(STRATEGIES)}")
    if scheme.get("symmetric") is False or scheme.get("dynamic") is True:
        raise ModelError(f"{where}: kv_cache_scheme must be static and symmetric (one fixed scale, no zero point)")
    name = names[kind]
    return KV_CACHE_TYPES[name][1], name, strategy


def read_kv_scales(checkpoint_dir: Path, quantization: dict | None, num_layers: int,
                   num_kv_heads: int) -> KVScales | None:
    """The KV scales a checkpoint carries (None when its quantization_config has no kv_cache_scheme)."""
    from tokq.engine.safetensors_io import read_checkpoint_header

    scheme = (quantization or {}).get("kv_cache_scheme")
    if not scheme:
        return None
    where = str(Path(checkpoint_dir) / "config.json")
    qmax, kv_cache, strategy = _scheme_qmax(scheme, where)
    header = read_checkpoint_header(Path(checkpoint_dir))
    amax = {"k_scale": torch.zeros(num_layers, num_kv_heads), "v_scale": torch.zeros(num_layers, num_kv_heads)}
    from safetensors import safe_open

    for layer in range(num_layers):
        prefix = f"model.layers.{layer}.self_attn."
        for name in ("k_scale", "v_scale"):
            # older fp8 exports keep one kv_scale for both K and V
            full = prefix + name if prefix + name in header else prefix + "kv_scale"
            if full not in header:
                raise ModelError(f"{checkpoint_dir}: config.json declares a kv_cache_scheme but {prefix}{name} is not "
                                 "in the safetensors: requantize with `tokq quantize --kv-cache ...` or remove "
                                 "kv_cache_scheme from config.json")
            with safe_open(str(header[full].file), framework="pt") as f:
                value = f.get_tensor(full).float().flatten()
            if value.numel() not in (1, num_kv_heads):
                raise ModelError(f"{checkpoint_dir}: {full} holds {value.numel()} values; a KV scale has 1 (tensor) "
                                 f"or {num_kv_heads} (one per KV head)")
            if not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
                raise ModelError(f"{checkpoint_dir}: {full} holds a scale that is not a positive finite number "
                                 f"({value.tolist()[:4]}); requantize with `tokq quantize --kv-cache {kv_cache}`")
            amax[name][layer] = value.expand(num_kv_heads) * qmax
    where_from = f"calibrated {kv_cache} scales ({strategy}) from the checkpoint"
    return KVScales(amax["k_scale"], amax["v_scale"], strategy, where_from, kv_cache)


@dataclass(frozen=True)
class KVCachePlan:
    """What the engine's cache stores: its dtype, per-layer (k_scale, v_scale) for int8/fp8, and in words where
    the scales came from (reports print it: a unit-scale fp8 cache is not a calibrated one)."""

    dtype: torch.dtype
    scales: list[tuple[torch.Tensor, torch.Tensor]] | None
    scales_note: str | None


KV_SCALE_CHOICES = ("auto", "unit")


def plan_kv_cache(kv_dtype: str | None, model_dtype: torch.dtype, scales: KVScales | None, num_layers: int,
                  num_kv_heads: int, use_scales: str = "auto", device: torch.device | str = "cpu") -> KVCachePlan:
    """The cache for `--kv-dtype` (None/"auto": the checkpoint's calibrated cache dtype when it has one, else the
    model's dtype). An int8/fp8 cache takes the checkpoint's scales (`use_scales` "auto"), or scale 1 per head
    ("unit", fp8 only: vLLM's default without calibration, kept for comparing against it)."""
    from tokq.engine.kv_cache import kv_dtype_named
    from tokq.errors import ConfigError
    from tokq.kernels.paged import QUANT_KV_DTYPES

    if use_scales not in KV_SCALE_CHOICES:
        raise ConfigError(f"--kv-scales {use_scales!r}: choose {' or '.join(KV_SCALE_CHOICES)}")
    if kv_dtype in (None, "auto"):
        if scales is None or scales.kv_cache is None:
            return KVCachePlan(model_dtype, None, None)
        kv_dtype = scales.kv_cache
    dtype = kv_dtype_named(kv_dtype, model_dtype)
    if dtype not in QUANT_KV_DTYPES:
        return KVCachePlan(dtype, None, None)
    if scales is not None and use_scales == "auto":
        if scales.num_layers != num_layers or scales.num_kv_heads != num_kv_heads:
            raise ConfigError(f"the KV scales are [{scales.num_layers} layers, {scales.num_kv_heads} heads] but the "
                              f"model has [{num_layers}, {num_kv_heads}]: they belong to another model")
        return KVCachePlan(dtype, scales.scales_for(dtype, device), f"{kv_dtype} KV, {scales.source}")
    if dtype == torch.int8:
        if scales is not None:
            raise ConfigError("--kv-scales unit applies to an fp8 cache; an int8 cache needs its calibrated scales: "
                              "use --kv-scales auto or --kv-dtype fp8")
        raise ConfigError("--kv-dtype int8 needs calibrated KV scales and this checkpoint has none: quantize it with "
                          "`tokq quantize ... --kv-cache int8` (or use --kv-dtype fp8)")
    ones = torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    # Scale 1 (vLLM's default without calibration): values up to 448 stay in range, small ones lose precision.
    return KVCachePlan(dtype, [(ones, ones) for _ in range(num_layers)],
                       "fp8 KV with scale 1 per head (uncalibrated: quantize with --kv-cache fp8 to calibrate)")

