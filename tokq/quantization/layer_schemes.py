"""Mixed precision: a quantization scheme per decoder Linear, and what each choice costs on disk.

The unit of choice is one engine Linear (`model.layers.{i}.self_attn.qkv_proj`, `...o_proj`,
`...mlp.gate_up_proj`, `...mlp.down_proj`): the shards merged into one Linear run as one matrix, so they
share one scheme. lm_head and the embeddings are never candidates; they stay 16-bit.

A mix names its formats by preset ("w4a16", "w8a16", ...; resolved for the model, so SmolLM2's w4a16 gets
group size 64) plus DENSE ("bf16", aliases "fp16" and "16bit"): left in the checkpoint's 16-bit dtype.
`LayerSchemes` maps each Linear to one of them; `quantization.pipeline.quantize_model` and
`quantization.formats.compressed_tensors.save_quantized` take it wherever they take a `QuantScheme`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokq.errors import ConfigError
from tokq.quantization.resolve import check_method_scheme, resolve_scheme
from tokq.quantization.scheme import CHANNEL, PRESETS, ActivationArgs, QuantScheme, WeightArgs

DENSE = "bf16"
DENSE_ALIASES = (DENSE, "fp16", "16bit")
SHAPE_BYTES = 2 * 8  # compressed-tensors' int64 weight_shape [2], written once per HF projection


@dataclass(frozen=True)
class LayerSchemes:
    """Which scheme each decoder Linear gets: `assignment` maps an engine Linear name to a key of `schemes`
    (format name -> resolved scheme) or to DENSE. A Linear it does not name stays 16-bit."""

    schemes: dict[str, QuantScheme]
    assignment: dict[str, str]
    name: str = "mixed"

    def __post_init__(self) -> None:
        if DENSE in self.schemes:
            raise ConfigError(f"layer schemes: {DENSE!r} means 16-bit and cannot name a quantization scheme")
        bad = sorted({v for v in self.assignment.values() if v != DENSE and v not in self.schemes})
        if bad:
            raise ConfigError(f"layer schemes: the assignment uses {', '.join(map(repr, bad))}, which is not one of "
                              f"the schemes ({', '.join([*self.schemes, DENSE])})")
        # Copies: the dataclass is frozen, its dicts should not change under it either.
        object.__setattr__(self, "schemes", dict(self.schemes))
        object.__setattr__(self, "assignment", dict(self.assignment))

    def for_layer(self, linear_name: str) -> QuantScheme | None:
        """The scheme of engine Linear `linear_name`; None when it stays 16-bit (DENSE or not assigned)."""
        key = self.assignment.get(linear_name, DENSE)
        return None if key == DENSE else self.schemes[key]

    def used(self) -> list[str]:
        """The scheme keys some Linear is assigned, in `schemes` order (one checkpoint config group each)."""
        assigned = set(self.assignment.values())
        return [k for k in self.schemes if k in assigned]

    def counts(self) -> dict[str, int]:
        """Linears per format: every scheme key and DENSE, 0 when unused."""
        out = dict.fromkeys([*self.schemes, DENSE], 0)
        for key in self.assignment.values():
            out[key] += 1
        return out

    def to_json(self) -> dict:
        return {"name": self.name, "dense": DENSE, "schemes": {k: s.to_json() for k, s in self.schemes.items()},
                "assignment": dict(self.assignment)}

    @classmethod
    def from_json(cls, d: dict) -> LayerSchemes:
        try:
            schemes = {k: _scheme_from_json(s) for k, s in d["schemes"].items()}
            return cls(schemes, {str(k): str(v) for k, v in d["assignment"].items()}, str(d.get("name", "mixed")))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"layer schemes JSON is malformed ({type(exc).__name__}: {exc}); it needs 'schemes' "
                              "(name -> scheme) and 'assignment' (Linear -> name), as LayerSchemes.to_json writes") from None


def _scheme_from_json(d: dict) -> QuantScheme:
    act = d.get("activations")
    return QuantScheme(d["name"], WeightArgs(**d["weights"]), ActivationArgs(**act) if act else None,
                       tuple(d.get("ignore", ("lm_head",))))


def parse_mix(text: str, method: str, config) -> dict[str, QuantScheme | None]:
    """"w4a16,w8a16,bf16" -> {"w4a16": <resolved w4a16>, "w8a16": ..., "bf16": None} for `method` on a model
    with engine config `config`. DENSE aliases become the key DENSE."""
    if method == "smoothquant":
        raise ConfigError("--mix is not supported with --method smoothquant (its smoothing is per block, for one "
                          "W8A8 scheme): use --method rtn, awq or gptq")
    valid = [name for name in PRESETS if _fits(method, PRESETS[name])] + list(DENSE_ALIASES)
    out: dict[str, QuantScheme | None] = {}
    for raw in text.split(","):
        entry = raw.strip().lower()
        if not entry:
            raise ConfigError(f"--mix {text!r} has an empty entry; write formats separated by commas, e.g. "
                              "w4a16,w8a16,bf16")
        if entry not in valid:
            why = (f"{entry!r} is not a format" if entry not in PRESETS
                   else f"{entry!r} does not fit --method {method}")
            raise ConfigError(f"--mix entry {why}; choose from {', '.join(valid)}")
        key = DENSE if entry in DENSE_ALIASES else entry
        if key in out:
            raise ConfigError(f"--mix names {entry!r} twice ({', '.join(DENSE_ALIASES)} all mean 16-bit); "
                              "name each format once")
        out[key] = None if key == DENSE else resolve_scheme(method, config, key)[0]
    if len(out) < 2:
        raise ConfigError(f"--mix {text!r} names one format; a mix needs at least two (e.g. w4a16,w8a16,bf16), "
                          "or use --scheme for one scheme everywhere")
    return out


def _fits(method: str, scheme: QuantScheme) -> bool:
    try:
        check_method_scheme(method, scheme)
    except ConfigError:
        return False
    return True


def linear_bytes(out_features: int, in_features: int, scheme: QuantScheme | None, dense_bytes: int = 2,
                 shards: Sequence[int] | None = None) -> int:
    """Bytes `save_quantized` writes for one Linear's weight tensors (biases not counted), scales in the
    checkpoint's dtype of `dense_bytes` bytes.

    `shards`: the output sizes of the HF projections merged into this Linear (q, k, v). Each projection gets
    its own int64 weight_shape [2] (16 bytes) and its asymmetric zero points packed along its own rows; without
    `shards` the Linear counts as one projection, which undercounts a merged Linear by 16 bytes per extra
    projection (plus at most one int32 word per group and projection for asymmetric zero points).
    """
    if scheme is None:
        return out_features * in_features * dense_bytes
    rows = list(shards) if shards is not None else [out_features]
    if sum(rows) != out_features:
        raise ConfigError(f"linear_bytes: shard sizes {rows} do not add up to {out_features} outputs")
    w = scheme.weights
    groups = 1 if w.strategy == CHANNEL or w.kind == "float" else w.groups_for(in_features)
    scales = out_features * groups * dense_bytes
    if w.kind == "float" or scheme.activations is not None:  # float-/naive-/int-quantized: one byte per code
        zeros = 0 if w.symmetric or w.kind == "float" else out_features * groups
        return out_features * in_features + scales + zeros
    packed = out_features * _words(in_features, w.bits) * 4
    zeros = 0 if w.symmetric else sum(_words(n, w.bits) for n in rows) * groups * 4
    return packed + scales + zeros + SHAPE_BYTES * len(rows)


def _words(values: int, bits: int) -> int:
    return -(-values * bits // 32)


def candidate_linears(model) -> dict[str, tuple[int, int]]:
    """Engine Linear name -> (out_features, in_features) for every decoder Linear (model.layers.*): the units
    a mix chooses a format for. lm_head and the embeddings are not candidates."""
    from tokq.engine.layers import Linear  # torch: imported on use, `import tokq` stays light

    return {name: (m.out_features, m.in_features) for name, m in model.named_modules()
            if isinstance(m, Linear) and name.startswith("model.layers.")}
