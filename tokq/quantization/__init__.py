"""Quantization schemes, calibration and methods (rtn, awq, gptq, smoothquant, fp8). Built in a later issue."""
