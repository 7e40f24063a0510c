"""One file per architecture family, each written once on the engine's two seams."""

from __future__ import annotations

from tokq.engine.config import ModelConfig
from tokq.engine.models.base import CausalLM
from tokq.engine.models.gemma3 import Gemma3DecoderLayer
from tokq.engine.models.llama import LlamaDecoderLayer

DECODER_LAYERS = {"llama": LlamaDecoderLayer, "gemma3": Gemma3DecoderLayer}


def build_model(config: ModelConfig) -> CausalLM:
    """An uninitialized model of the config's family (weights are filled in by the loader)."""
    return CausalLM(config, DECODER_LAYERS[config.family])


__all__ = ["CausalLM", "build_model", "DECODER_LAYERS"]
