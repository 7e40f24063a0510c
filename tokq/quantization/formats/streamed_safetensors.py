"""Writing a safetensors file one tensor at a time, so a checkpoint larger than memory can be assembled.

`safetensors.torch.save_file` needs every tensor in memory at once. `write_streamed` writes the same bytes
(checked against save_file in tests/test_streamed_quantize.py): the header first, computed from names, dtypes
and shapes alone, then each tensor's data as its `read` callable produces it, released before the next one.
The order of the tensors in the file is safetensors' own (by dtype, then name); rather than copy that rule,
it is read back from what safetensors writes for one-element stand-ins of the same names and dtypes.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save

# torch dtype -> safetensors' dtype name (the ones a compressed-tensors checkpoint holds)
SAFETENSORS_NAMES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@dataclass
class StreamedTensor:
    """A tensor to write: its name, dtype and shape now, its data when `read()` is called: the tensor, or pieces
    of it along dim 0 in order (a large embedding is converted a slice of rows at a time)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor | Iterable[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _file_order(entries: list[StreamedTensor], metadata: dict[str, str] | None) -> list[str]:
    """The order safetensors lays these names out in (it sorts by dtype, then name)."""
    probe = save({e.name: torch.zeros(1, dtype=e.dtype) for e in entries}, metadata=metadata)
    length = struct.unpack("<Q", probe[:8])[0]
    header = json.loads(probe[8: 8 + length])
    return [name for name in header if name != "__metadata__"]


def write_streamed(entries: list[StreamedTensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write `entries` as one safetensors file at `path`, holding one tensor's data at a time."""
    by_name = {e.name: e for e in entries}
    if len(by_name) != len(entries):
        raise ValueError("duplicate tensor names in a safetensors file")
    order = _file_order(entries, metadata)
    header: dict = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name in order:
        e = by_name[name]
        header[name] = {"dtype": SAFETENSORS_NAMES[e.dtype], "shape": list(e.shape),
                        "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes with spaces
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name in order:
            e = by_name[name]
            data = e.read()
            written = 0
            for t in [data] if isinstance(data, torch.Tensor) else data:
                if t.dtype != e.dtype or tuple(t.shape[1:]) != tuple(e.shape[1:]):
                    raise ValueError(f"{name}: read {t.dtype} {tuple(t.shape)}, announced {e.dtype} {e.shape}")
                t = t.detach().to("cpu").contiguous()
                # raw little-endian bytes (what safetensors stores); a view as uint8 copies nothing
                if t.numel():
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data)
                written += t.numel() * t.element_size()
                del t
            if written != e.nbytes:
                raise ValueError(f"{name}: read {written} bytes, announced {e.nbytes}")
