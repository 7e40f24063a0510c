"""Checkpoint formats tokq writes. compressed-tensors is the one vLLM, SGLang and HF transformers all load.

Reading (compressed-tensors, AutoGPTQ, AutoAWQ) lives in `tokq.engine.quant_formats`: the engine
loads checkpoints and never imports quantize.
"""

from tokq.quantization.formats.compressed_tensors import compress_weight, compression_format, save_quantized

__all__ = ["compress_weight", "compression_format", "save_quantized"]
