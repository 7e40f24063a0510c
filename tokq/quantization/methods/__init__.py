"""Quantization methods, one module each: rtn, awq, gptq, smoothquant (fp8 uses rtn on an fp8 scheme)."""
