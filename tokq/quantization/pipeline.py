"""`quantize_model`: run a method block by block over a loaded model, in place.

The model must be loaded in fp32 (or the dtype the method should search in); every quantized
Linear is swapped for its quantized form, so the same object can be scored right away or written
out by `quantization.formats`. `recipe_sha256` identifies a tokq.toml recipe applied to one base model: the gate
records it in the checkpoint it builds and rebuilds when it changes.
"""

from __future__ import annotations

import hashlib
import json
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType

from tokq.engine.models import CausalLM
from tokq.errors import ConfigError
from tokq.quantization.calibration import BlockContext, BlockwiseRunner, CalibrationSet
from tokq.quantization.methods import awq, gptq, rtn, smoothquant
from tokq.quantization.methods.options import MethodOptions
from tokq.quantization.scheme import CHANNEL, GROUP, QuantScheme, preset

METHODS: dict[str, ModuleType] = {"rtn": rtn, "awq": awq, "gptq": gptq, "smoothquant": smoothquant, "fp8": rtn}
DEFAULT_SCHEMES = {"rtn": "w4a16", "awq": "w4a16", "gptq": "w4a16", "smoothquant": "w8a8-int8", "fp8": "w8a8-fp8"}
NEEDS_CALIBRATION = {"awq", "gptq", "smoothquant"}


@dataclass
class MethodRun:
    method: str
    scheme: QuantScheme
    options: MethodOptions
    calibration: dict | None
    seconds: float
    peak_rss_mib: float
    blocks: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "method": self.method, "scheme": self.scheme.to_json(), "options": self.options.to_json(),
            "calibration": self.calibration, "seconds": self.seconds, "peak_rss_mib": self.peak_rss_mib,
            "blocks": self.blocks,
        }


def check_method_scheme(method: str, scheme: QuantScheme) -> None:
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}: choose one of {', '.join(METHODS)}")
    if method in ("awq", "gptq") and (scheme.weights.kind != "int" or scheme.activations is not None):
        raise ConfigError(f"{method} quantizes integer weights with 16-bit activations (w4a16, w8a16); "
                          f"scheme {scheme.name} does not fit it")
    if method == "smoothquant" and scheme.activations is None:
        raise ConfigError(f"smoothquant is for W8A8 schemes (w8a8-int8, w8a8-fp8); scheme {scheme.name} has "
                          "16-bit activations")
    if method == "fp8" and scheme.weights.kind != "float":
        raise ConfigError(f"fp8 needs an fp8 scheme (w8a8-fp8, fp8-weight-only), not {scheme.name}")


def linear_input_sizes(config) -> dict[str, int]:
    """Input size of each kind of decoder Linear (what a weight group size must divide)."""
    q_out = config.num_heads * config.head_dim
    return {"model.layers.*.{q,k,v,gate,up}_proj": config.hidden_size, "model.layers.*.self_attn.o_proj": q_out,
            "model.layers.*.mlp.down_proj": config.intermediate_size}


def resolve_scheme(
    method: str,
    config,
    scheme: str | None = None,
    bits: int | None = None,
    group_size: int | None = None,
    symmetric: bool | None = None,
) -> tuple[QuantScheme, list[str]]:
    """The scheme a `tokq quantize` call asks for, checked against the model; plus notes for the user.

    `group_size=-1` means per-channel. Without an explicit group size, a preset's 128 that does not
    divide a layer falls back to the largest of 128/64/32 that divides every layer (noted), since
    small models (SmolLM2's hidden 576) cannot use 128; an explicit size that does not divide is an error.
    """
    base = preset(scheme or DEFAULT_SCHEMES.get(method, "w4a16"))
    check_method_scheme(method, base)
    changes: dict = {}
    if bits is not None:
        changes["bits"] = bits
    if symmetric is not None:
        changes["symmetric"] = symmetric
    if group_size is not None:
        changes.update(strategy=CHANNEL, group_size=None) if group_size == -1 else changes.update(
            strategy=GROUP, group_size=group_size)
    if base.weights.kind == "float" and (bits not in (None, 8) or group_size not in (None, -1) or symmetric is False):
        raise ConfigError(f"scheme {base.name} is fp8 e4m3 with per-channel scales: --bits, --group-size and "
                          "--asym do not apply")
    resolved = base.with_weights(**changes) if changes else base
    notes: list[str] = []
    sizes = linear_input_sizes(config)
    w = resolved.weights
    if w.strategy == GROUP and any(k % w.group_size for k in sizes.values()):
        if group_size is not None:
            layer, k = next((n, k) for n, k in sizes.items() if k % w.group_size)
            w.check_divides(k, layer)  # raises, naming the layers and the valid sizes
        fallback = next((g for g in (128, 64, 32) if all(k % g == 0 for k in sizes.values())), None)
        if fallback is None:
            raise ConfigError(f"no group size of 128, 64 or 32 divides this model's layer input sizes "
                              f"({', '.join(f'{n}: {k}' for n, k in sizes.items())}); use --group-size -1 (per-channel)")
        notes.append(f"group size {w.group_size} does not divide this model's layers "
                     f"({', '.join(f'{n}: {k}' for n, k in sizes.items())}); using {fallback}")
        resolved = resolved.with_weights(group_size=fallback)
    if resolved != base:
        w = resolved.weights
        suffix = [f"w{w.bits}" if w.bits != base.weights.bits else "",
                  ("sym" if w.symmetric else "asym") if w.symmetric != base.weights.symmetric else "",
                  ("g" + str(w.group_size)) if w.strategy == GROUP else "channel"]
        resolved = replace(resolved, name=f"{base.name}-" + "-".join(x for x in suffix if x))
    return resolved, notes


def quantize_model(
    model: CausalLM,
    method: str,
    scheme: QuantScheme | str | None = None,
    calibration: CalibrationSet | None = None,
    options: MethodOptions | None = None,
    on_block: Callable[[int], None] | None = None,
    batch_size: int = 8,
) -> MethodRun:
    scheme = preset(scheme or DEFAULT_SCHEMES.get(method, "w4a16")) if not isinstance(scheme, QuantScheme) else scheme
    check_method_scheme(method, scheme)
    options = options or MethodOptions()
    module = METHODS[method]
    if method in NEEDS_CALIBRATION and calibration is None:
        raise ConfigError(f"{method} needs calibration data (--calib DIR)")
    started = time.perf_counter()
    stats: list[dict] = []

    def quantize_block(ctx: BlockContext) -> None:
        stats.append({"block": ctx.index, **module.quantize_block(ctx, scheme, options)})

    if calibration is None:  # RTN / fp8: no activations needed, visit blocks directly
        for i, block in enumerate(model.model.layers):
            quantize_block(BlockContext(i, block, None, None, batch_size))
            if on_block:
                on_block(i)
    else:
        BlockwiseRunner(model, calibration, batch_size).run(quantize_block, on_block)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return MethodRun(method, scheme, options, calibration.to_json() if calibration else None,
                          time.perf_counter() - started, peak, stats)


def recipe_sha256(recipe: dict, base_sha256: str) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces) of a tokq.toml recipe table and the content hash of
    the base model it is applied to: an edited recipe or a changed base gives another hash."""
    text = json.dumps({"recipe": recipe, "base_sha256": base_sha256}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def recorded_recipe_sha256(checkpoint: Path) -> str | None:
    """The recipe hash a checkpoint's tokq_quantization.json records; None when it records none (not built by
    the gate from a recipe) or cannot be read."""
    try:
        record = json.loads((Path(checkpoint) / "tokq_quantization.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = record.get("recipe_sha256") if isinstance(record, dict) else None
    return value if isinstance(value, str) else None
