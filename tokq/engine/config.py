"""A model's config.json, read into one normalized dataclass the runtime builds from.

HF config files differ by architecture and by transformers version (v4 writes `rope_theta` +
`rope_scaling`, v5 writes `rope_parameters`, possibly one per layer type). Everything the runtime
needs is resolved here once, so the model files never look at raw config keys.
"""

from __future__ import annotations

import json
import math
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
FULL = "full_attention"
SLIDING = "sliding_attention"


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


def _parse_rope(raw: dict[str, Any], theta_key_default: float, where: str) -> RopeConfig:
    rope_type = raw.get("rope_type", raw.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelError(
            f"{where}: RoPE scaling type '{rope_type}' is not supported; tokq supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        theta=float(raw.get("rope_theta", theta_key_default)),
        rope_type=rope_type,
        factor=float(raw.get("factor", 1.0) or 1.0),
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


def _layer_types(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[list[str], int | None]:
    window = cfg.get("sliding_window")
    if cfg.get("layer_types"):
        types = list(cfg["layer_types"])
    elif arch == "Gemma3ForCausalLM":
        pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        use = bool(cfg.get("use_sliding_window", False))
        first = int(cfg.get("max_window_layers", num_layers))
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
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        layer_types, window = _layer_types(cfg, arch, num_layers)
        common = dict(
            architecture=arch,
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
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
            attn_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5,
            final_logit_softcap=cfg.get("final_logit_softcapping"),
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


def read_config(checkpoint_dir: Path) -> ModelConfig:
    """Read `<dir>/config.json` with errors that name the file and the fix."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.exists():
        raise ModelError(
            f"model directory {checkpoint_dir} does not exist: pass a checkpoint directory "
            "(config.json + *.safetensors) or a zoo name (see `tokq models list`)"
        )
    if not checkpoint_dir.is_dir():
        raise ModelError(f"{checkpoint_dir} is a file: pass the checkpoint directory that holds config.json")
    path = checkpoint_dir / "config.json"
    if not path.is_file():
        raise ModelError(f"{path} is missing: a checkpoint directory needs config.json beside its safetensors")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path} is not valid JSON ({exc}); restore it from the original checkpoint") from exc
    if not isinstance(cfg, dict):
        raise ModelError(f"{path} does not hold a JSON object; restore it from the original checkpoint")
    if "text_config" in cfg and "hidden_size" not in cfg:
        raise ModelError(
            f"{path}: multimodal checkpoints ({(cfg.get('architectures') or ['?'])[0]}) are not supported; "
            f"tokq runs the text models {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return parse_config(cfg, where=str(path))
