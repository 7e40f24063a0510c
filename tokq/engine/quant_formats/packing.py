"""Bit packing of quantized checkpoints: integer codes and zero points packed into int32 words.

Two packings are read:

- dense (compressed-tensors): values of b bits laid end to end along the last dim, element i at bit i*b
  of the little-endian word stream, so a value may straddle two words (`unpack_int32_dense`);
- per word (AutoGPTQ, AutoAWQ): 32/b values per int32 word, slot p at bit p*b, no value straddling a
  word; AWQ interleaves the values of a word, which `order` undoes (`unpack_int32_words`).

Checkpoints store unsigned codes and zero points (code + 2^(b-1)); tokq keeps both signed
(`signed_zero` turns stored zero points into tokq's int8 ones).
"""

from __future__ import annotations

import torch

from tokq.errors import ModelError


def unpack_int32_dense(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """compressed-tensors' packing: values of `bits` bits laid end to end along the last dim of int32 words.

    Returns the unsigned values, int64 [..., count]. Element i starts at bit i*bits of the word stream
    (word i*bits // 32, bit i*bits % 32) and may continue in the next word.
    """
    words = packed.to(torch.int64) & 0xFFFFFFFF
    words = torch.cat([words, torch.zeros_like(words[..., :1])], dim=-1)  # a spill word for the last element
    start = torch.arange(count, device=packed.device, dtype=torch.int64) * bits
    word, offset = start // 32, start % 32
    window = words[..., word] | ((words[..., word + 1] & 0xFF) << 32)  # bits <= 8: the spill fits in 8 bits
    return (window >> offset) & ((1 << bits) - 1)


def unpack_int32_words(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """GPTQ/AWQ packing: 32/bits values per int32 word along `dim`, value j of a word at bit j*bits.

    `order[p]` is the position (within the word's run of 32/bits values) of the value stored at slot p
    (AWQ's interleave); None means slot p holds value p. Returns unsigned int64 values.
    """
    per_word = 32 // bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, device=packed.device, dtype=torch.int64) * bits
    moved = words.movedim(dim, -1)
    slots = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, slot]
    if order is not None:
        slot_of_value = [order.index(v) for v in range(per_word)]
        slots = slots[..., slot_of_value]
    return slots.flatten(-2).movedim(-1, dim)


def signed_zero(zero_unsigned: torch.Tensor, bits: int, name: str = "layer") -> torch.Tensor | None:
    """Unsigned zero points -> signed (tokq/compressed-tensors convention); None when all are the midpoint."""
    zero = zero_unsigned.to(torch.int64) - (1 << (bits - 1))
    if zero.max() > 127:
        # Only an 8-bit GPTQ v1 checkpoint gets here: its stored zero - 1 wrapped from -1 to 255, which
        # reads back as 256 (signed 128). tokq keeps zero points as int8, and guessing "0" instead would
        # change the weights the checkpoint's own kernels compute; so refuse, saying what to do.
        raise ModelError(f"{name}.qzeros: an 8-bit GPTQ v1 zero point of 256 (stored 255, a wrapped 0 - 1) cannot be "
                         "represented exactly; re-export the checkpoint in the GPTQ v2 format (checkpoint_format "
                         "'gptq_v2') or quantize it with tokq")
    if not zero.any():
        return None
    return zero.to(torch.int8).contiguous()
