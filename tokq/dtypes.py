"""dtype names, one table each: the names tokq accepts for a dtype and the names it prints for one.

- `DTYPES` / `parse_dtype`: compute dtypes by the names --dtype, project files and `load_model` accept;
  `compute_dtype_name`: the name "auto" stands for on a device.
- `DTYPE_NAMES`: the compute dtypes' short names (fp32, bf16, fp16), as kernel choices and reports print them;
  `dtype_name` names any dtype (int8, fp8_e4m3fn, ... too) in messages.
- `FLOAT_DTYPES`: the floating-point dtypes activations, scales and float KV caches come in.
- `KV_DTYPE_NAMES` / `kv_dtype_of`: KV cache dtypes by name (kernels/paged.py's contract).
- `HF_DTYPE_NAMES`: the names config.json's `dtype` / `torch_dtype` uses.
- `SAFETENSORS_DTYPE_BYTES`: bytes per element of each safetensors header dtype string.

Kernels import this module: it imports nothing of tokq but tokq.errors.
"""

from __future__ import annotations

import torch

from tokq.errors import ModelError

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_SHORT_NAMES = {**DTYPE_NAMES, torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3fn", torch.int32: "int32",
                torch.int64: "int64"}
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KV_DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8,
                  "fp8": torch.float8_e4m3fn, "fp8_e4m3fn": torch.float8_e4m3fn}
HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
HF_DTYPES = {name: dtype for dtype, name in HF_DTYPE_NAMES.items()}
SAFETENSORS_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                           "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A compute dtype from a torch dtype or a name of `DTYPES` (any case)."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ModelError(f"dtype {name!r} is not supported: use one of fp32, bf16, fp16") from None


def dtype_name(dtype: torch.dtype) -> str:
    return _SHORT_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def kv_dtype_of(name: str | torch.dtype) -> torch.dtype:
    """A KV cache dtype from a torch dtype or a name (fp32, fp16, bf16, int8, fp8)."""
    if isinstance(name, torch.dtype):
        return name
    if name not in KV_DTYPE_NAMES:
        raise ValueError(f"KV cache dtype {name!r} is not known ({', '.join(KV_DTYPE_NAMES)})")
    return KV_DTYPE_NAMES[name]


def compute_dtype_name(dtype: str, device: str) -> str:
    """The compute dtype a run uses: "auto" is fp16 on CUDA (tensor cores, the serving default) and bf16 on CPU
    (fp16 matmuls there are slow and overflow-prone); any other name as given."""
    return dtype if dtype != "auto" else ("fp16" if str(device).startswith("cuda") else "bf16")
