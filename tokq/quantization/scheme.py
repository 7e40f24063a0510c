"""Quantization schemes: what is quantized, to what, at which granularity, and what is skipped.

A scheme is data (a recipe): weights (int4/int8/fp8-e4m3; symmetric or not; per-channel or
per-group), activations (none, or dynamic per-token int8/fp8) and the modules left in 16-bit.
The presets name the common ones; the names match compressed-tensors' preset schemes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from tokq.errors import ConfigError

CHANNEL = "channel"
GROUP = "group"


@dataclass(frozen=True)
class WeightArgs:
    bits: int = 4
    kind: str = "int"  # "int" | "float" (fp8 e4m3)
    symmetric: bool = True
    strategy: str = GROUP  # "group" | "channel"
    group_size: int | None = 128  # None for per-channel

    def __post_init__(self) -> None:
        if self.kind == "int" and self.bits not in (2, 3, 4, 8):
            raise ConfigError(f"integer weights of {self.bits} bits are not supported: use 2, 3, 4 or 8")
        if self.kind == "float" and self.bits != 8:
            raise ConfigError("float weights are fp8 (e4m3): bits must be 8")
        if self.kind not in ("int", "float"):
            raise ConfigError(f"weight kind {self.kind!r} is not supported: use int or float")
        if self.strategy == GROUP and (self.group_size is None or self.group_size < 1):
            raise ConfigError("group quantization needs a positive group size (e.g. --group-size 64)")
        if self.strategy not in (GROUP, CHANNEL):
            raise ConfigError(f"weight strategy {self.strategy!r} is not supported: use group or channel")

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def groups_for(self, in_features: int) -> int:
        return 1 if self.strategy == CHANNEL else in_features // self.group_size

    def check_divides(self, in_features: int, layer: str) -> None:
        """Group size must divide a layer's input size; the error names the layer and valid sizes."""
        if self.strategy != GROUP or in_features % self.group_size == 0:
            return
        valid = [g for g in (32, 64, 128, 256) if in_features % g == 0]
        hint = f"valid group sizes: {', '.join(map(str, valid))}" if valid else "use per-channel (--group-size -1)"
        raise ConfigError(
            f"group size {self.group_size} does not divide {layer}'s input size {in_features}; {hint}"
        )


@dataclass(frozen=True)
class ActivationArgs:
    kind: str = "int"  # "int" (int8) | "float" (fp8 e4m3)
    dynamic: bool = True  # per-token scales computed at run time
    static_scale: float | None = None  # optional calibrated per-tensor scale

    @property
    def name(self) -> str:
        return "int8" if self.kind == "int" else "fp8"


@dataclass(frozen=True)
class QuantScheme:
    name: str
    weights: WeightArgs
    activations: ActivationArgs | None = None
    # Module name patterns left unquantized (fnmatch against module names like "lm_head").
    ignore: tuple[str, ...] = field(default=("lm_head",))

    def with_weights(self, **changes) -> QuantScheme:
        return replace(self, weights=replace(self.weights, **changes))

    def to_json(self) -> dict:
        return asdict(self)


PRESETS: dict[str, QuantScheme] = {
    "w4a16": QuantScheme("w4a16", WeightArgs(bits=4, symmetric=True, strategy=GROUP, group_size=128)),
    "w4a16-asym": QuantScheme("w4a16-asym", WeightArgs(bits=4, symmetric=False, strategy=GROUP, group_size=128)),
    # 3-bit groups: for the Linears a mix finds least sensitive (the bytes they free go to the sensitive ones);
    # the engine runs them through the reference kernel (no fused int3 kernel), vLLM not at all
    "w3a16": QuantScheme("w3a16", WeightArgs(bits=3, symmetric=True, strategy=GROUP, group_size=128)),
    "w8a16": QuantScheme("w8a16", WeightArgs(bits=8, symmetric=True, strategy=CHANNEL, group_size=None)),
    "w8a8-int8": QuantScheme(
        "w8a8-int8", WeightArgs(bits=8, symmetric=True, strategy=CHANNEL, group_size=None), ActivationArgs("int")
    ),
    "w8a8-fp8": QuantScheme(
        "w8a8-fp8", WeightArgs(bits=8, kind="float", strategy=CHANNEL, group_size=None), ActivationArgs("float")
    ),
    "fp8-weight-only": QuantScheme(
        "fp8-weight-only", WeightArgs(bits=8, kind="float", strategy=CHANNEL, group_size=None)
    ),
}


def preset(name: str) -> QuantScheme:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown scheme {name!r}: choose one of {', '.join(PRESETS)}") from None
