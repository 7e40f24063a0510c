"""Which scheme a method runs: method/scheme compatibility, and a preset fitted to a model's layer sizes.

Apart from `quantization.pipeline` (which re-exports these names) so that `quantization.layer_schemes` can
resolve the presets of a mix while the pipeline and the methods take its `LayerSchemes` (no import cycle).
"""

from __future__ import annotations

from dataclasses import replace

from tokq.errors import ConfigError
from tokq.quantization.recipe import METHOD_NAMES
from tokq.quantization.scheme import CHANNEL, GROUP, QuantScheme, preset

DEFAULT_SCHEMES = {"rtn": "w4a16", "awq": "w4a16", "gptq": "w4a16", "smoothquant": "w8a8-int8", "fp8": "w8a8-fp8"}


def check_method_scheme(method: str, scheme: QuantScheme) -> None:
    if method not in METHOD_NAMES:
        raise ConfigError(f"unknown method {method!r}: choose one of {', '.join(METHOD_NAMES)}")
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
