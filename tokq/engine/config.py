"""A model's config.json, read into one normalized dataclass the runtime builds from.

HF config files differ by architecture and by transformers version (v4 writes `rope_theta` +
`rope_scaling`, v5 writes `rope_parameters`, possibly one per layer type). Everything the runtime
needs is resolved here once, so the model files never look at raw config keys.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokq.errors import ModelError

# HF architecture name -> tokq model family (one implementation file per family).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Gemma3ForCausalLM": "gemma3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")  # engine.layers.ACTIVATIONS' keys
FULL = "full_attention"
SLIDING = "sliding_attention"
# More layers than any released model has (the largest have ~128). The layer count is the one size checked
# against a cap rather than against the weights: tokq builds one module (and one layer-type entry) per layer
# before it can compare the modules with the checkpoint, so 10^9 layers would exhaust memory first.
MAX_LAYERS = 4096


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass
class ModelConfig:
    architecture: str  # HF name, e.g. "LlamaForCausalLM"
    family: str  # "llama" | "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Gemma stores RMSNorm weights as (w - 1): the norm multiplies by (1 + w).
    norm_weight_offset: float = 0.0
    embed_scale: float = 1.0
    attn_scale: float = 0.0  # softmax scale; set in __post_init__ when 0
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    rope: dict[str, RopeConfig] = field(default_factory=dict)  # per layer type
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.attn_scale:
            self.attn_scale = self.head_dim**-0.5
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_layers

    def layer_window(self, layer: int) -> int | None:
        """Sliding-window size of a layer (None for global attention)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @property
    def window_of_every_layer(self) -> int | None:
        """The window when every layer slides (then K/V older than it are never read again), else None."""
        if self.sliding_window and self.layer_types and all(t == SLIDING for t in self.layer_types):
            return self.sliding_window
        return None

    def layer_rope(self, layer: int) -> RopeConfig:
        return self.rope[self.layer_types[layer]]

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer, at 2 bytes a value (bf16/fp16 cache)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


def _positive_float(value: Any, key: str, where: str) -> float:
    """A finite number > 0: NaN or a negative value would turn every logit into NaN (or a complex scale)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ModelError(f"{where}: {key} = {value!r} must be a positive number; restore config.json from the "
                         "original checkpoint")
    return float(value)


def _optional_positive(cfg: dict[str, Any], key: str, where: str) -> float | None:
    value = cfg.get(key)
    return None if value is None else _positive_float(value, key, where)


def _parse_rope(raw: dict[str, Any], theta_key_default: float, where: str) -> RopeConfig:
    rope_type = raw.get("rope_type", raw.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelError(
            f"{where}: RoPE scaling type '{rope_type}' is not supported; tokq supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=_positive_float(raw.get("rope_theta", theta_key_default), "rope_theta", where),
        rope_type=rope_type,
        # a missing factor is 1; a factor of 0 is an error, not 1 (it was read as 1, silently)
        factor=_positive_float(1.0 if raw.get("factor") is None else raw["factor"], "rope factor", where),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=raw.get("original_max_position_embeddings"),
    )


def _rope_by_layer_type(cfg: dict[str, Any], family: str, where: str) -> dict[str, RopeConfig]:
    """RoPE per layer type, from either the v5 `rope_parameters` or the v4 keys."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return {kind: _parse_rope(p, 10000.0, where) for kind, p in params.items()}
    if isinstance(params, dict) and params:
        one = _parse_rope(params, cfg.get("rope_theta", 10000.0), where)
        ropes = {FULL: one, SLIDING: one}
        if family == "gemma3" and "rope_local_base_freq" in cfg:
            ropes[SLIDING] = RopeConfig(theta=float(cfg["rope_local_base_freq"]))
        return ropes
    # transformers v4 layout
    theta = float(cfg.get("rope_theta", 1_000_000.0 if family == "gemma3" else 10000.0))
    scaling = cfg.get("rope_scaling") or {}
    full = _parse_rope({**scaling, "rope_theta": theta}, theta, where)
    if family == "gemma3":
        # Gemma 3's local (sliding) layers use their own base and never the global scaling.
        return {FULL: full, SLIDING: RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10000.0)))}
    return {FULL: full, SLIDING: full}


def _int_field(cfg: dict[str, Any], key: str, where: str, default: int | None = None, minimum: int = 1) -> int:
    """cfg[key] as a JSON integer >= minimum. A bool, a fraction, NaN or a string is refused rather than
    truncated by int(): `hidden_size: 64.5` or `"64"` means the file was edited or damaged, not a size."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ModelError(f"{where}: {key} is missing; is this a complete HF config.json?")
        value = default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 64.0 is a size some converters write
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelError(f"{where}: {key} = {value!r} is not an integer; restore config.json from the original checkpoint")
    if value < minimum:
        raise ModelError(f"{where}: {key} = {value} must be at least {minimum}; restore config.json from the "
                         "original checkpoint")
    return value


@dataclass(frozen=True)
class _Sizes:
    """The sizes the model's modules are built from, validated before anything is built."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    num_layers: int
    vocab: int
    intermediate: int
    max_positions: int


def _sizes(cfg: dict[str, Any], where: str) -> _Sizes:
    hidden = _int_field(cfg, "hidden_size", where)
    heads = _int_field(cfg, "num_attention_heads", where)
    kv_heads = _int_field(cfg, "num_key_value_heads", where, default=heads)
    num_layers = _int_field(cfg, "num_hidden_layers", where)
    if num_layers > MAX_LAYERS:
        raise ModelError(f"{where}: num_hidden_layers = {num_layers} is more than tokq accepts ({MAX_LAYERS}); "
                         "restore config.json from the original checkpoint")
    if heads % kv_heads:
        raise ModelError(f"{where}: num_attention_heads = {heads} is not a multiple of num_key_value_heads = "
                         f"{kv_heads}; restore config.json from the original checkpoint")
    if cfg.get("head_dim") is None and hidden % heads:
        raise ModelError(f"{where}: hidden_size = {hidden} is not a multiple of num_attention_heads = {heads} and "
                         "no head_dim is given; restore config.json from the original checkpoint")
    head_dim = _int_field(cfg, "head_dim", where, default=hidden // heads)
    if head_dim % 2:
        # RoPE rotates the two halves of every head: an odd head_dim has no halves.
        raise ModelError(f"{where}: head_dim = {head_dim} is odd; RoPE needs an even head size")
    return _Sizes(hidden, heads, kv_heads, head_dim, num_layers, _int_field(cfg, "vocab_size", where),
                  _int_field(cfg, "intermediate_size", where),
                  _int_field(cfg, "max_position_embeddings", where, default=2048))


def _check_layer_types(types: list[str], num_layers: int, where: str) -> None:
    if len(types) != num_layers or any(t not in (FULL, SLIDING) for t in types):
        raise ModelError(f"{where}: layer_types must list {num_layers} entries (num_hidden_layers), each "
                         f"'{FULL}' or '{SLIDING}'; restore config.json from the original checkpoint")


def _layer_types(cfg: dict[str, Any], arch: str, num_layers: int, where: str) -> tuple[list[str], int | None]:
    window = cfg.get("sliding_window")
    if window is not None and window is not False:
        window = _int_field(cfg, "sliding_window", where, minimum=0) or None
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"]) if isinstance(cfg["layer_types"], list) else []
        _check_layer_types(types, num_layers, where)
    elif arch == "Gemma3ForCausalLM":
        key = "sliding_window_pattern" if "sliding_window_pattern" in cfg else "_sliding_window_pattern"
        pattern = _int_field(cfg, key, where, default=6)
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        use = bool(cfg.get("use_sliding_window", False))
        first = _int_field(cfg, "max_window_layers", where, default=num_layers, minimum=0)
        types = [SLIDING if use and window and i >= first else FULL for i in range(num_layers)]
    elif arch == "MistralForCausalLM" and window:
        types = [SLIDING] * num_layers
    else:
        types = [FULL] * num_layers
    if SLIDING not in types:
        window = None
    return types, window


def parse_config(cfg: dict[str, Any], where: str = "config.json") -> ModelConfig:
    """Turn a raw HF config dict into a ModelConfig, or raise ModelError naming what is unsupported."""
    archs = cfg.get("architectures") or []
    if not archs and cfg.get("model_type") == "gemma3_text":
        archs = ["Gemma3ForCausalLM"]
    arch = archs[0] if archs else f"(model_type={cfg.get('model_type')!r})"
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"{where}: architecture {arch} is not supported; tokq runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    # Sizes first, each a positive integer that divides as the modules need: nothing is built from them
    # until they are, and load_model then compares them with the checkpoint's tensor shapes.
    sizes = _sizes(cfg, where)
    hidden, heads, num_layers, head_dim = sizes.hidden, sizes.heads, sizes.num_layers, sizes.head_dim
    layer_types, window = _layer_types(cfg, arch, num_layers, where)
    try:
        common = dict(
            architecture=arch,
            family=family,
            vocab_size=sizes.vocab,
            hidden_size=hidden,
            intermediate_size=sizes.intermediate,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=sizes.kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive_float(cfg.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
            max_position_embeddings=sizes.max_positions,
            hidden_act=str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"),
            sliding_window=int(window) if window else None,
            layer_types=layer_types,
            rope=_rope_by_layer_type(cfg, family, where),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            raw=cfg,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"{where}: missing or invalid field {exc}; is this a complete HF config.json?") from exc
    if common["hidden_act"] not in SUPPORTED_ACTIVATIONS:
        raise ModelError(f"{where}: hidden_act = {common['hidden_act']!r} is not supported; tokq supports "
                         f"{', '.join(SUPPORTED_ACTIVATIONS)} (restore config.json from the original checkpoint)")
    no_rope = sorted(set(layer_types) - set(common["rope"]))
    if no_rope:
        raise ModelError(f"{where}: rope_parameters has no entry for the layer type(s) {', '.join(no_rope)}; "
                         "restore config.json from the original checkpoint")

    if family == "gemma3":
        # attn_logit_softcapping is a Gemma 2 leftover in Gemma 3 configs: Gemma 3 does not apply it
        # (nor does HF's reference), so it is ignored here. The final-logit soft-cap is applied.
        return ModelConfig(
            **common,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            qkv_bias=bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=True,
            norm_weight_offset=1.0,
            embed_scale=math.sqrt(hidden),
            attn_scale=_positive_float(cfg.get("query_pre_attn_scalar", head_dim), "query_pre_attn_scalar",
                                       where) ** -0.5,
            final_logit_softcap=_optional_positive(cfg, "final_logit_softcapping", where),
        )
    is_qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        **common,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if is_qwen2 else attention_bias,
        o_bias=False if is_qwen2 else attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
    )


def checkpoint_file(path: Path) -> bool:
    """Whether a checkpoint file exists (following symlinks, as HF's cache layout needs). A symlink loop, a
    link to nothing or a folder where the file belongs is a ModelError, not an OSError or a 'missing'."""
    try:
        path.stat()
    except FileNotFoundError:
        if path.is_symlink():
            raise ModelError(f"{path} is a symlink to nothing ({os.readlink(path)}): replace it with the file "
                             "from the original checkpoint") from None
        return False
    except OSError as exc:  # ELOOP: a symlink loop; EACCES
        raise ModelError(f"{path} cannot be read ({exc.strerror}; a symlink loop?): replace it with the file from "
                         "the original checkpoint") from None
    if not path.is_file():
        raise ModelError(f"{path} is not a regular file: replace it with the file from the original checkpoint")
    return True


def read_config(checkpoint_dir: Path) -> ModelConfig:
    """Read `<dir>/config.json` with errors that name the file and the fix."""
    checkpoint_dir = Path(checkpoint_dir)
    if checkpoint_dir.is_symlink() and not checkpoint_dir.exists():
        raise ModelError(f"model directory {checkpoint_dir} is a symlink that leads nowhere (a loop or a missing "
                         "target): pass the checkpoint directory itself")
    if not checkpoint_dir.exists():
        raise ModelError(
            f"model directory {checkpoint_dir} does not exist: pass a checkpoint directory "
            "(config.json + *.safetensors) or a zoo name (see `tokq models list`)"
        )
    if not checkpoint_dir.is_dir():
        raise ModelError(f"{checkpoint_dir} is a file: pass the checkpoint directory that holds config.json")
    path = checkpoint_dir / "config.json"
    if not checkpoint_file(path):
        raise ModelError(f"{path} is missing: a checkpoint directory needs config.json beside its safetensors")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ModelError(f"{path} is not valid JSON ({exc}); restore it from the original checkpoint") from exc
    if not isinstance(cfg, dict):
        raise ModelError(f"{path} does not hold a JSON object; restore it from the original checkpoint")
    if "text_config" in cfg and "hidden_size" not in cfg:
        raise ModelError(
            f"{path}: multimodal checkpoints ({(cfg.get('architectures') or ['?'])[0]}) are not supported; "
            f"tokq runs the text models {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return parse_config(cfg, where=str(path))
