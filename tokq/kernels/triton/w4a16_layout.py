"""tokq's packed layout for integer weights on the GPU (read by the w4a16 Triton kernel). Pure torch.

`pack_int_weight(IntWeight, dtype)` turns tokq's in-memory integer weight (signed int8 codes q [N, K],
fp32 scales [N, G], optional signed zero points [N, G]; see kernels/reference.py) into the layout
below, once per layer at load time. Checkpoints in other layouts (AutoAWQ GEMM, AutoGPTQ v1/v2
including act-order g_idx, compressed-tensors pack-quantized) reach it through the engine's readers,
which turn them into IntWeight first (engine/quant_formats/), so there is one packer.

Layout (N output features, K input features, G = K / group_size groups; FIELD = 4 for codes of at
most 4 bits, 8 for codes of 5 to 8 bits; PACK = 32 // FIELD codes per word; KW = ceil(K / PACK)):

- `qweight`: int32 [KW, N], contiguous (N fastest). The code of weight W[n, k] is the unsigned
  u = q + 2^(FIELD-1) (0..2^FIELD - 1) in bits [FIELD*(k % PACK), FIELD*(k % PACK + 1)) of word
  qweight[k // PACK, n], read as an unsigned 32-bit word (the int32 tensor holds the same bits).
  When K is not a multiple of PACK, rows K..KW*PACK-1 hold the code of q = 0 (u = 2^(FIELD-1));
  the kernel masks x to 0 there, so they never contribute.
- `scales`: [G, N], contiguous, in `dtype` (the activations' dtype: fp16/bf16, or fp32 for fp32
  models): scales[g, n] is the scale of input columns g*group_size .. (g+1)*group_size - 1.
- `zeros`: [G, N] in the same dtype, or None for symmetric weights: the unsigned zero point
  zu = z + 2^(FIELD-1), an integer in [0, 2^FIELD] (exact in fp16, bf16 and fp32; the top value
  2^FIELD comes from AutoGPTQ v1 checkpoints, whose zero points may exceed the code range by one).
  Symmetric weights need no tensor: their zu is the constant 2^(FIELD-1).

  W[n, k] = u * s - zu * s = (q - z) * s,  with s = scales[k // group_size, n], zu = zeros[...].

Why this layout:

- Words run along K with N contiguous, so a kernel tile of [BLOCK_K / PACK, BLOCK_N] words is
  BLOCK_K / PACK rows of contiguous memory (coalesced loads), and one word unpacks by shift and mask
  into PACK consecutive K rows of one column. It is AutoGPTQ's `qweight` layout for 4 and 8 bits.
- Scales and zero points as [G, N] rows: a K tile inside one group reads one contiguous row of each.
- Unsigned zero points rather than precomputed zero * scale: the in-loop dequantization is still one
  FMA per element (the kernel forms zu * s once per group row, not per element: u * s - (zu * s)),
  and the layout stays exact: `unpack_int_weight` gives back the IntWeight bit for bit (scales are
  exact when they are representable in `dtype`: always for fp32, and for checkpoints whose scales are
  fp16 when packed as fp16). A precomputed zero * scale in fp16/bf16 would round.
- With 16-bit scales, u * s and zu * s are exact in fp32 (at most 8 + 11 significant bits), so the
  kernel's FMA gives exactly (q - z) * s, the oracle's value; with fp32 scales it is within an ulp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokq.dtypes import FLOAT_DTYPES

from ..reference import IntWeight

SCALE_DTYPES = FLOAT_DTYPES
MAX_CODE_BITS = 8


def field_bits(code_bits: int) -> int:
    """The packed field width for codes of `code_bits` bits: 4 (8 per word) or 8 (4 per word)."""
    if not 1 <= code_bits <= MAX_CODE_BITS:
        raise ValueError(f"integer weights of {code_bits} bits cannot be packed; tokq packs codes of 1 to 8 bits")
    return 4 if code_bits <= 4 else 8


@dataclass
class PackedIntWeight:
    """An integer weight in tokq's packed GPU layout (see the module docstring for the exact layout)."""

    qweight: torch.Tensor  # int32 [ceil(K / pack), N]: codes + 2^(bits-1), `pack` per word along K
    scales: torch.Tensor  # [G, N] in the activation dtype
    zeros: torch.Tensor | None  # [G, N] unsigned zero points (integers) in the scales' dtype; None: symmetric
    bits: int  # field width: 4 or 8
    group_size: int  # K for per-channel scales
    n: int
    k: int
    code_bits: int = 0  # the codes' own width (2, 3, 4, 8, ...): kept so unpacking is exact; 0 means `bits`

    def __post_init__(self) -> None:
        if not self.code_bits:
            self.code_bits = self.bits

    @property
    def pack(self) -> int:
        """Codes per int32 word."""
        return 32 // self.bits

    @property
    def groups(self) -> int:
        return self.k // self.group_size

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def offset(self) -> int:
        """2^(bits-1): the unsigned code of q = 0, and a symmetric weight's zero point."""
        return 1 << (self.bits - 1)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def to(self, device: torch.device | str) -> PackedIntWeight:
        zeros = None if self.zeros is None else self.zeros.to(device)
        return PackedIntWeight(self.qweight.to(device), self.scales.to(device), zeros, self.bits, self.group_size,
                               self.n, self.k, self.code_bits)

    def unsigned_codes(self) -> torch.Tensor:
        """The codes u, int64 [N, K] (padding rows dropped)."""
        words = self.qweight.to(torch.int64) & 0xFFFFFFFF
        shifts = torch.arange(self.pack, device=words.device, dtype=torch.int64) * self.bits
        fields = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << self.bits) - 1)  # [KW, pack, N]
        return fields.reshape(-1, self.n)[: self.k].t()


def _check(w: IntWeight, dtype: torch.dtype) -> None:
    if dtype not in SCALE_DTYPES:
        raise ValueError(f"scales of {dtype} are not supported; pack with float16, bfloat16 or float32")
    if w.q.dim() != 2 or w.q.dtype != torch.int8:
        raise ValueError(f"IntWeight.q must be an int8 [N, K] matrix, got {w.q.dtype} {tuple(w.q.shape)}")
    n, k = w.q.shape
    if w.group_size < 1 or k % w.group_size:
        raise ValueError(f"group size {w.group_size} does not divide K={k}; the packed layout needs equal groups")
    groups = k // w.group_size
    if tuple(w.scale.shape) != (n, groups):
        raise ValueError(f"IntWeight.scale has shape {tuple(w.scale.shape)}, expected [N, G] = {[n, groups]}")
    if w.zero is not None and tuple(w.zero.shape) != (n, groups):
        raise ValueError(f"IntWeight.zero has shape {tuple(w.zero.shape)}, expected [N, G] = {[n, groups]}")
    half = 1 << (w.bits - 1)
    if w.q.numel() and (int(w.q.min()) < -half or int(w.q.max()) >= half):
        raise ValueError(f"IntWeight.q holds codes outside the signed {w.bits}-bit range [{-half}, {half - 1}]")
    # AutoGPTQ v1 checkpoints may carry a zero point one past the range (z = 2^(bits-1)); it still fits.
    if w.zero is not None and w.zero.numel() and (int(w.zero.min()) < -half or int(w.zero.max()) > half):
        raise ValueError(f"IntWeight.zero holds zero points outside [{-half}, {half}] for {w.bits}-bit codes")


def _to_int32_bits(words: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit words -> int32 with the same bit pattern."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_int_weight(w: IntWeight, dtype: torch.dtype) -> PackedIntWeight:
    """IntWeight -> tokq's packed layout, scales (and zero points) in `dtype`. Runs on w's device."""
    _check(w, dtype)
    bits = field_bits(w.bits)
    pack, offset = 32 // bits, 1 << (bits - 1)
    n, k = w.q.shape
    kw = -(-k // pack)
    u = w.q.t().to(torch.int32) + offset  # [K, N]
    if kw * pack != k:  # pad with the code of q = 0
        u = torch.cat([u, u.new_full((kw * pack - k, n), offset)])
    u = u.view(kw, pack, n)
    words = torch.zeros(kw, n, dtype=torch.int64, device=u.device)
    for j in range(pack):
        words |= u[:, j, :].to(torch.int64) << (bits * j)  # int64: field 7's bits 28..31 would overflow int32
    scale = w.scale.float()
    scales = scale.t().to(dtype).contiguous()
    if not torch.isfinite(scales).all() and torch.isfinite(scale).all():
        raise ValueError(f"scales overflow {dtype} (largest |scale| {scale.abs().max().item():.3g}); pack with float32")
    zeros = None if w.zero is None else (w.zero.to(torch.int64) + offset).t().to(dtype).contiguous()
    return PackedIntWeight(_to_int32_bits(words).contiguous(), scales, zeros, bits, w.group_size, n, k, w.bits)


def unpack_int_weight(p: PackedIntWeight) -> IntWeight:
    """The exact inverse of `pack_int_weight` (scales come back as fp32 values of the packed dtype)."""
    q = (p.unsigned_codes() - p.offset).to(torch.int8).contiguous()
    scale = p.scales.float().t().contiguous()
    zero = None
    if p.zeros is not None:
        zero = (p.zeros.float().t().round().to(torch.int64) - p.offset).to(torch.int8).contiguous()
    return IntWeight(q, scale, zero, p.code_bits, p.group_size)


def dequantize(p: PackedIntWeight) -> torch.Tensor:
    """fp32 [N, K]: W[n, k] = (u - zu) * s, computed exactly as IntWeight.dequantize does ((q - z) * s)."""
    u = p.unsigned_codes().float().view(p.n, p.groups, p.group_size)
    zu = p.offset if p.zeros is None else p.zeros.float().t().unsqueeze(-1)
    return ((u - zu) * p.scales.float().t().unsqueeze(-1)).view(p.n, p.k)
