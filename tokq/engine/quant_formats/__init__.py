"""Reading quantized checkpoints: compressed-tensors, AutoGPTQ and AutoAWQ layouts, one reader per format.

- `loader`: the checkpoint's quantization config, the reader chosen for it, and its projections
  unpacked, merged (q/k/v, gate/up) and installed as quantized Linears (`load_quantized_weights`,
  which engine/checkpoint.py's `load_model` calls);
- `compressed_tensors`, `gptq`, `awq`: one reader each (`<format>_weight` for one projection's tensors,
  a `QuantFormat` subclass for the config), each module describing the layout it reads;
- `packing`: int32 bit packing (dense and per word) and signed zero points;
- `base`: `ShardWeight` (one projection in tokq's layout), the `QuantFormat` interface, shared checks.

Files and dense tensors go through engine/safetensors_io.py, as for a 16-bit checkpoint.
"""
