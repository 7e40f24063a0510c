"""Reading quantized checkpoints: compressed-tensors, AutoGPTQ and AutoAWQ layouts.

`load_model` calls `load_quantized_weights` when config.json carries a `quantization_config` (or the
directory has an AutoGPTQ `quantize_config.json`). Each quantized checkpoint tensor set is unpacked
into tokq's in-memory layout (`kernels.reference.IntWeight` / `FP8Weight`: signed codes [N, K],
fp32 scales [N, G], signed zero points [N, G] or None), the shards of a merged Linear (q/k/v,
gate/up) are concatenated row-wise, and the Linear is made quantized with `quantize_linear_`.
Nothing is dequantized: the runtime computes with the checkpoint's own integer codes.

Layouts read (N = output features, K = input features, G = groups, b = bits):

- compressed-tensors `pack-quantized`: `weight_packed` int32 [N, ceil(K*b/32)], codes + 2^(b-1)
  packed densely along K, element i at bit i*b of the little-endian word stream; `weight_scale`
  [N, G]; `weight_zero_point` (asymmetric) packed the same way along N: [ceil(N*b/32), G];
  `weight_shape` [2]. `int-quantized` / `naive-quantized` / `float-quantized`: `weight` int8 or
  float8_e4m3fn [N, K] + `weight_scale` (+ `weight_zero_point` int8 [N, G]). Optional
  `weight_g_idx` [K] (activation order) is handled like GPTQ's g_idx.
- AutoGPTQ (`quant_method: gptq`): `qweight` int32 [K*b/32, N] packed along K (row k at bit
  b*(k % (32/b)) of word k // (32/b)); `qzeros` int32 [G, N*b/32] packed along N the same way;
  `scales` [G, N]; `g_idx` [K] (group of each input column). `checkpoint_format: gptq` stores
  zero - 1 (the historical off-by-one), `gptq_v2` stores the zero point itself. Dequantized:
  W[n, k] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n].
- AutoAWQ GEMM (`quant_method: awq, version: gemm`): `qweight` int32 [K, N/8] and `qzeros` int32
  [G, N/8], both packed along N with AWQ's interleaved order (nibble p of a word holds column
  8*i + [0, 2, 4, 6, 1, 3, 5, 7][p]); `scales` [G, N]; zero points stored as is.

Activation order (GPTQ desc_act, compressed-tensors g_idx): tokq's integer layout needs each group's
columns to be contiguous, so the input dimension is permuted once at load time (columns sorted by
group; an exact integer repack, no rounding), and the layer permutes its input activations by the
same permutation at run time (`InputPermutedLinearMethod`). That keeps the checkpoint's codes bit for
bit; dequantizing to a dense weight would lose the memory saving and the quantized kernels. All shards
of a merged Linear share one input, so they must share the permutation; when they do not (a GPTQ run
with per-shard orders), that Linear is dequantized to a dense weight, with a warning.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokq.engine.checkpoint import (
    check_all_filled,
    checkpoint_targets,
    copy_dense_tensor,
    iter_tensors,
    read_checkpoint_header,
)
from tokq.engine.layers import Linear
from tokq.engine.models import CausalLM
from tokq.engine.quant_linear import InputPermutedLinearMethod, quantize_linear_  # noqa: F401 (re-exported: tests, writers)
from tokq.errors import ModelError
from tokq.kernels.reference import FP8Weight, IntWeight, QuantizedWeight

log = logging.getLogger("tokq")

SUPPORTED_METHODS = ("compressed-tensors", "gptq", "awq")
CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized", "mixed-precision", "dense")
INT_BITS = (2, 3, 4, 8)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column (within a packed word of 8) stored at nibble p


# --------------------------------------------------------------------------------------------------
# Bit packing


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


# --------------------------------------------------------------------------------------------------
# One shard's tensors -> tokq layout


@dataclass
class ShardWeight:
    """One checkpoint projection, unpacked; `g_idx` is set when its groups are not contiguous."""

    weight: QuantizedWeight
    act: str | None = None
    g_idx: torch.Tensor | None = None  # int64 [K]: group of each input column (original column order)


def _need(tensors: dict[str, torch.Tensor], prefix: str, suffix: str) -> torch.Tensor:
    if suffix not in tensors:
        raise ModelError(f"tensor {prefix}.{suffix} is missing from the checkpoint; the quantized checkpoint is "
                         "incomplete: re-export it")
    return tensors[suffix]


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], fix: str = "") -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ModelError(f"tensor {name} has shape {tuple(tensor.shape)} but {expected} was expected "
                         f"{fix or 'from config.json and the quantization config'}; the checkpoint is inconsistent")


def _check_2d(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 2:
        raise ModelError(f"tensor {name} has shape {tuple(tensor.shape)}, expected 2 dimensions [groups, outputs]")


def _signed_zero(zero_unsigned: torch.Tensor, bits: int, name: str = "layer") -> torch.Tensor | None:
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


def _group_size(k: int, groups: int, name: str) -> int:
    if groups < 1 or k % groups:
        raise ModelError(f"{name}: {groups} groups do not split the input size {k} evenly; tokq needs equal-size "
                         "groups (choose a group size that divides every layer's input size)")
    return k // groups


# compressed-tensors --------------------------------------------------------------------------------

def _ct_activation(args: dict | None, where: str) -> str | None:
    if not args:
        return None
    kind, bits = args.get("type", "int"), int(args.get("num_bits", 8))
    dynamic, strategy = args.get("dynamic", False), args.get("strategy")
    if bits != 8 or kind not in ("int", "float"):
        raise ModelError(f"{where}: input activations of {bits}-bit {kind} are not supported; tokq runs dynamic "
                         "per-token int8 or fp8 activations")
    if dynamic is not True or strategy != "token" or not args.get("symmetric", True):
        raise ModelError(
            f"{where}: input activations with strategy={strategy!r}, dynamic={dynamic!r}, "
            f"symmetric={args.get('symmetric', True)!r} are not supported; tokq runs dynamic symmetric per-token "
            "activations (strategy 'token', dynamic true): re-export with those")
    return "int8" if kind == "int" else "fp8"


def compressed_tensors_weight(tensors: dict[str, torch.Tensor], weights: dict[str, Any], name: str = "layer",
                              act: str | None = None) -> ShardWeight:
    """One compressed-tensors module (suffix -> tensor: weight_packed / weight / weight_scale / ...) -> tokq layout.

    `weights` is the config group's `weights` arguments (num_bits, type, symmetric, strategy, group_size).
    """
    bits, kind = int(weights.get("num_bits", 8)), weights.get("type", "int")
    strategy = weights.get("strategy") or ("group" if weights.get("group_size") else "channel")
    if strategy not in ("group", "channel", "tensor"):
        raise ModelError(f"{name}: weight strategy {strategy!r} is not supported; tokq reads group, channel and "
                         "tensor strategies")
    scale = _need(tensors, name, "weight_scale").float()
    if kind == "float":
        if bits != 8 or strategy == "group":
            raise ModelError(f"{name}: float weights of {bits} bits with strategy {strategy!r} are not supported; "
                             "tokq reads fp8 e4m3 weights with per-channel or per-tensor scales")
        q = _need(tensors, name, "weight")
        if q.dtype != torch.float8_e4m3fn:
            raise ModelError(f"tensor {name}.weight has dtype {q.dtype}, expected float8_e4m3fn for fp8 weights")
        n = q.shape[0]
        scale = scale.reshape(-1, 1).expand(n, 1).clone() if scale.numel() == 1 else scale.reshape(-1, 1)
        _check_shape(f"{name}.weight_scale", scale, (n, 1))
        return ShardWeight(FP8Weight(q, scale), act)
    if kind != "int" or bits not in INT_BITS:
        raise ModelError(f"{name}: {bits}-bit {kind} weights are not supported; tokq reads int{'/int'.join(map(str, INT_BITS))} "
                         "and fp8 weights")
    offset = 1 << (bits - 1)
    if "weight_packed" in tensors:
        packed = tensors["weight_packed"]
        if packed.dtype != torch.int32:
            raise ModelError(f"tensor {name}.weight_packed has dtype {packed.dtype}, expected int32")
        shape = _need(tensors, name, "weight_shape")
        n, k = (int(v) for v in shape.reshape(-1).tolist())
        _check_shape(f"{name}.weight_packed", packed, (n, -(-k * bits // 32)), fix=f"for weight_shape {[n, k]}")
        q = (unpack_int32_dense(packed, bits, k) - offset).to(torch.int8)
    else:
        q = _need(tensors, name, "weight")
        if q.dtype != torch.int8:
            raise ModelError(f"tensor {name}.weight has dtype {q.dtype}, expected int8 for {bits}-bit integer weights")
        n, k = q.shape
    if strategy == "tensor":
        scale = scale.reshape(1, 1).expand(n, 1).clone()
    groups = scale.shape[-1] if scale.dim() == 2 else -1
    _check_shape(f"{name}.weight_scale", scale, (n, groups if groups > 0 else 1))
    if strategy == "group" and weights.get("group_size") and groups * int(weights["group_size"]) != k:
        raise ModelError(f"tensor {name}.weight_scale has {groups} groups but group_size {weights['group_size']} "
                         f"over {k} inputs needs {k // int(weights['group_size'])}; the checkpoint is inconsistent")
    zero = None
    if not weights.get("symmetric", True):
        zp = _need(tensors, name, "weight_zero_point")
        if strategy == "tensor":
            zero = zp.to(torch.int64).reshape(1, 1).expand(n, 1)
        elif "weight_packed" in tensors:
            if zp.dtype != torch.int32:
                raise ModelError(f"tensor {name}.weight_zero_point has dtype {zp.dtype}, expected packed int32")
            _check_shape(f"{name}.weight_zero_point", zp, (-(-n * bits // 32), groups))
            zero = unpack_int32_dense(zp.t(), bits, n).t() - offset  # packed along the output dim
        else:
            zero = zp.to(torch.int64)
            _check_shape(f"{name}.weight_zero_point", zero, (n, groups))
        if zero.min() < -offset or zero.max() >= offset:
            raise ModelError(f"tensor {name}.weight_zero_point holds values outside the {bits}-bit range")
        zero = zero.to(torch.int8).contiguous()
    g_idx = tensors.get("weight_g_idx")
    weight = IntWeight(q.contiguous(), scale.contiguous(), zero, bits, _group_size(k, groups, name))
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64).reshape(-1)
        _check_shape(f"{name}.weight_g_idx", g_idx, (k,))
    return ShardWeight(weight, act, g_idx)


# AutoGPTQ / AutoAWQ -------------------------------------------------------------------------------

def gptq_weight(tensors: dict[str, torch.Tensor], bits: int, version: int, name: str = "layer") -> ShardWeight:
    """AutoGPTQ tensors (qweight, qzeros, scales, optional g_idx) -> tokq layout. `version` 1 stores zero - 1."""
    qweight, qzeros, scales = (_need(tensors, name, s) for s in ("qweight", "qzeros", "scales"))
    for suffix, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32:
            raise ModelError(f"tensor {name}.{suffix} has dtype {t.dtype}, expected int32 (AutoGPTQ layout)")
    _check_2d(f"{name}.scales", scales)
    groups, n = scales.shape
    k = qweight.shape[0] * 32 // bits
    _check_shape(f"{name}.qweight", qweight, (k * bits // 32, n))
    _check_shape(f"{name}.qzeros", qzeros, (groups, n * bits // 32), fix=f"for scales {tuple(scales.shape)}")
    group_size = _group_size(k, groups, name)
    q = unpack_int32_words(qweight, bits, dim=0).t()  # [N, K] unsigned
    zero = unpack_int32_words(qzeros, bits, dim=1).t()  # [N, G] as stored
    if version == 1:
        # v1 stores zero - 1. A stored 2^b - 1 reads back as 2^b (signed 2^(b-1)): kept exact, as AutoGPTQ's
        # own kernels compute it, although that zero lies outside the b-bit range.
        zero = zero + 1
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64).reshape(-1)
        _check_shape(f"{name}.g_idx", g_idx, (k,))
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise ModelError(f"tensor {name}.g_idx refers to groups outside 0..{groups - 1}; the checkpoint is corrupt")
        if torch.equal(g_idx, torch.arange(k, device=g_idx.device) // group_size):
            g_idx = None  # plain contiguous groups
    offset = 1 << (bits - 1)
    weight = IntWeight((q - offset).to(torch.int8).contiguous(), scales.float().t().contiguous(),
                       _signed_zero(zero, bits, name), bits, group_size)
    return ShardWeight(weight, None, g_idx)


def awq_weight(tensors: dict[str, torch.Tensor], bits: int, name: str = "layer") -> ShardWeight:
    """AutoAWQ GEMM tensors (qweight [K, N/8], qzeros [G, N/8], scales [G, N]) -> tokq layout."""
    qweight, qzeros, scales = (_need(tensors, name, s) for s in ("qweight", "qzeros", "scales"))
    for suffix, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32:
            raise ModelError(f"tensor {name}.{suffix} has dtype {t.dtype}, expected int32 (AutoAWQ GEMM layout)")
    _check_2d(f"{name}.scales", scales)
    groups, n = scales.shape
    k = qweight.shape[0]
    _check_shape(f"{name}.qweight", qweight, (k, n * bits // 32), fix=f"for scales {tuple(scales.shape)}")
    _check_shape(f"{name}.qzeros", qzeros, (groups, n * bits // 32), fix=f"for scales {tuple(scales.shape)}")
    q = unpack_int32_words(qweight, bits, dim=1, order=AWQ_ORDER).t()
    zero = unpack_int32_words(qzeros, bits, dim=1, order=AWQ_ORDER).t()
    offset = 1 << (bits - 1)
    return ShardWeight(IntWeight((q - offset).to(torch.int8).contiguous(), scales.float().t().contiguous(),
                                 _signed_zero(zero, bits, name), bits, _group_size(k, groups, name)))


# --------------------------------------------------------------------------------------------------
# Formats: which tensors belong to a quantized projection, and how to read them


class QuantFormat:
    """A checkpoint quantization format: names its tensors and turns one projection's tensors into weights."""

    method: str
    suffixes: tuple[str, ...]  # tensor-name suffixes read for a quantized projection
    marker: str  # a projection is quantized when `<name>.<marker>` exists

    def is_quantized(self, name: str, keys: set[str]) -> bool:
        return f"{name}.{self.marker}" in keys

    def read(self, name: str, tensors: dict[str, torch.Tensor]) -> ShardWeight:
        raise NotImplementedError


class CompressedTensorsFormat(QuantFormat):
    method = "compressed-tensors"
    suffixes = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                "input_scale", "input_zero_point")
    marker = "weight_scale"

    def __init__(self, qc: dict, where: str):
        self.where = where
        fmt = qc.get("format") or "dense"
        if fmt not in CT_FORMATS:
            raise ModelError(f"{where}: compressed-tensors format {fmt!r} is not supported; tokq reads "
                             f"{', '.join(CT_FORMATS[:4])}")
        if qc.get("sparsity_config") and qc["sparsity_config"].get("format", "dense") != "dense":
            raise ModelError(f"{where}: sparse compressed-tensors checkpoints are not supported")
        if qc.get("transform_config") and qc["transform_config"].get("config_groups"):
            raise ModelError(f"{where}: compressed-tensors transforms (rotations) are not supported")
        if qc.get("kv_cache_scheme"):
            log.warning("%s: kv_cache_scheme is ignored; tokq keeps the KV cache in 16 bits", where)
        self.groups = []
        for gname, group in (qc.get("config_groups") or {}).items():
            gfmt = group.get("format") or fmt
            if gfmt not in CT_FORMATS:
                raise ModelError(f"{where}: config group {gname} has format {gfmt!r}; tokq reads "
                                 f"{', '.join(CT_FORMATS[:4])}")
            if group.get("output_activations"):
                raise ModelError(f"{where}: config group {gname} quantizes output activations; not supported")
            act = _ct_activation(group.get("input_activations"), f"{where}: config group {gname}")
            self.groups.append((list(group.get("targets") or []), group.get("weights"), act))
        self.ignore = list(qc.get("ignore") or [])

    @staticmethod
    def _match(name: str, target: str) -> bool:
        if target.startswith("re:"):
            return re.match(target[3:], name) is not None
        return target in (name, "Linear")

    def is_quantized(self, name: str, keys: set[str]) -> bool:
        return f"{name}.weight_scale" in keys or f"{name}.weight_packed" in keys

    def read(self, name: str, tensors: dict[str, torch.Tensor]) -> ShardWeight:
        if any(self._match(name, t) for t in self.ignore if t != "Linear"):
            log.warning("%s: %s is in the ignore list but has quantized tensors; reading them", self.where, name)
        for targets, weights, act in self.groups:
            if weights and any(self._match(name, t) for t in targets):
                if "input_scale" in tensors:
                    raise ModelError(f"{name}: static input scales are not supported; tokq quantizes activations "
                                     "dynamically per token")
                return compressed_tensors_weight(tensors, weights, name, act)
        raise ModelError(f"{self.where}: {name} has quantized tensors but no config group's targets match it")


class GPTQFormat(QuantFormat):
    method = "gptq"
    suffixes = ("qweight", "qzeros", "scales", "g_idx")
    marker = "qweight"

    def __init__(self, qc: dict, where: str):
        self.bits = int(qc.get("bits", 4))
        if self.bits not in (2, 4, 8):
            raise ModelError(f"{where}: {self.bits}-bit GPTQ is not supported; tokq reads 2, 4 and 8-bit GPTQ")
        fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ModelError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported; tokq reads gptq and gptq_v2")
        if qc.get("dynamic"):
            raise ModelError(f"{where}: GPTQ per-module overrides ('dynamic') are not supported")
        self.version = 2 if fmt == "gptq_v2" else 1
        self.desc_act = bool(qc.get("desc_act", False))

    def read(self, name: str, tensors: dict[str, torch.Tensor]) -> ShardWeight:
        if self.desc_act and "g_idx" not in tensors:
            _need(tensors, name, "g_idx")  # act-order weights cannot be read without their column groups
        return gptq_weight(tensors, self.bits, self.version, name)


class AWQFormat(QuantFormat):
    method = "awq"
    suffixes = ("qweight", "qzeros", "scales")
    marker = "qweight"

    def __init__(self, qc: dict, where: str):
        self.bits = int(qc.get("bits", qc.get("w_bit", 4)))
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelError(f"{where}: AWQ version {version!r} is not supported; tokq reads the GEMM layout "
                             "(version 'gemm')")
        if self.bits != 4:
            raise ModelError(f"{where}: {self.bits}-bit AWQ is not supported; tokq reads 4-bit AWQ (GEMM)")
        if not qc.get("zero_point", True):
            raise ModelError(f"{where}: AWQ without zero points is not supported; tokq reads zero_point=true")

    def read(self, name: str, tensors: dict[str, torch.Tensor]) -> ShardWeight:
        return awq_weight(tensors, self.bits, name)


FORMATS: dict[str, Callable[[dict, str], QuantFormat]] = {
    "compressed-tensors": CompressedTensorsFormat, "gptq": GPTQFormat, "awq": AWQFormat,
}


def read_quantization_config(checkpoint_dir: Path, raw_config: dict) -> dict | None:
    """The checkpoint's quantization config: config.json's `quantization_config`, or AutoGPTQ's quantize_config.json."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        path = Path(checkpoint_dir) / "quantize_config.json"
        if not path.is_file():
            return None
        try:
            qc = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelError(f"{path} is not valid JSON ({exc}); restore it from the original checkpoint") from exc
        if isinstance(qc, dict):
            qc.setdefault("quant_method", "gptq")
    if not isinstance(qc, dict):
        raise ModelError(f"{checkpoint_dir}/config.json: quantization_config is not a JSON object")
    return qc


def quant_format(qc: dict, where: str) -> QuantFormat:
    method = qc.get("quant_method")
    if method not in FORMATS:
        raise ModelError(f"{where}: checkpoint quantization {method!r} is not supported; tokq reads "
                         f"{', '.join(SUPPORTED_METHODS)} checkpoints (or quantize the 16-bit model with tokq)")
    return FORMATS[method](qc, where)


# --------------------------------------------------------------------------------------------------
# Merging shards and installing them


def _contiguous_perm(shards: list[ShardWeight], group_size: int) -> torch.Tensor | None:
    """One input permutation that makes every shard's groups contiguous, or None if they disagree."""
    g_idx = next(s.g_idx for s in shards if s.g_idx is not None)
    perm = torch.argsort(g_idx, stable=True)
    k = g_idx.numel()
    target = torch.arange(k, device=g_idx.device) // group_size
    for s in shards:
        gi = s.g_idx if s.g_idx is not None else target
        if not torch.equal(gi[perm], target):
            return None
    return perm


def _merge(name: str, shards: list[ShardWeight]) -> tuple[QuantizedWeight, str | None]:
    first = shards[0]
    for s in shards[1:]:
        same = type(s.weight) is type(first.weight) and s.act == first.act
        if same and isinstance(s.weight, IntWeight):
            same = (s.weight.bits, s.weight.group_size) == (first.weight.bits, first.weight.group_size)
        if not same:
            raise ModelError(f"{name}: the projections merged into this layer are quantized differently; tokq "
                             "runs them as one matrix, so they must share one scheme (bits, group size, activations)")
    if isinstance(first.weight, FP8Weight):
        return FP8Weight(torch.cat([s.weight.q for s in shards]), torch.cat([s.weight.scale for s in shards])), first.act
    ws: list[IntWeight] = [s.weight for s in shards]
    zero = None
    if any(w.zero is not None for w in ws):
        zero = torch.cat([w.zero if w.zero is not None else torch.zeros_like(w.scale, dtype=torch.int8) for w in ws])
    merged = IntWeight(torch.cat([w.q for w in ws]), torch.cat([w.scale for w in ws]), zero, first.weight.bits,
                       first.weight.group_size)
    return merged, first.act


def _install(layer: Linear, module_name: str, shards: list[ShardWeight], device: torch.device, dtype: torch.dtype) -> None:
    weight, act = _merge(module_name, shards)
    perm = None
    if any(s.g_idx is not None for s in shards):
        perm = _contiguous_perm(shards, weight.group_size)
        if perm is None:
            log.warning("%s: its merged projections use different activation orders; dequantizing it to a dense "
                        "weight", module_name)
            dense = torch.cat([_dequantize_with_g_idx(s) for s in shards])
            layer.weight.data.copy_(dense.to(device=device, dtype=dtype))
            return
        weight.q = weight.q[:, perm].contiguous()
    weight = _to_device(weight, device)
    # Checks the shape, drops the dense weight, chooses the layer's kernel (the layer computes in `dtype`).
    quantize_linear_(layer, weight, act, input_perm=None if perm is None else perm.to(device))


def _dequantize_with_g_idx(s: ShardWeight) -> torch.Tensor:
    w = s.weight
    g = s.g_idx if s.g_idx is not None else torch.arange(w.q.shape[1]) // w.group_size
    zero = 0.0 if w.zero is None else w.zero.float()[:, g]
    return (w.q.float() - zero) * w.scale.float()[:, g]


def _to_device(weight: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    if isinstance(weight, FP8Weight):
        return FP8Weight(weight.q.to(device), weight.scale.to(device))
    zero = None if weight.zero is None else weight.zero.to(device)
    return IntWeight(weight.q.to(device), weight.scale.to(device), zero, weight.bits, weight.group_size)


def _checkpoint_keys(checkpoint_dir: Path) -> set[str]:
    """Every tensor name, from the validated headers of exactly the checkpoint's files (no data read)."""
    return set(read_checkpoint_header(checkpoint_dir))


@dataclass
class _PendingLinear:
    name: str  # module name, e.g. model.layers.0.self_attn.qkv_proj
    layer: Linear
    expected: set[str]  # checkpoint tensor names still to come
    tensors: dict[str, dict[str, torch.Tensor]]  # projection name (q_proj's full name) -> suffix -> tensor

    def install(self, fmt: QuantFormat, device: torch.device, dtype: torch.dtype) -> None:
        shards = [fmt.read(n, t) for n, t in self.tensors.items()]
        for n, s, shard in zip(self.tensors, shards, self.layer.shards, strict=True):
            _check_shape(f"{n} (unpacked)", s.weight.q, (shard.size, self.layer.in_features), fix="by config.json")
        _install(self.layer, self.name, shards, device, dtype)
        self.tensors.clear()


def load_quantized_weights(model: CausalLM, checkpoint_dir: Path, dtype: torch.dtype, qc: dict,
                           fmt: QuantFormat | None = None) -> None:
    """Fill `model` from a quantized checkpoint: quantized projections become quantized Linears.

    `fmt`: the format read from `qc` already (load_model reads it once, to vet the tensors first)."""
    checkpoint_dir = Path(checkpoint_dir)
    where = str(checkpoint_dir / "config.json")
    fmt = fmt or quant_format(qc, where)
    keys = _checkpoint_keys(checkpoint_dir)
    device = model.device
    targets = checkpoint_targets(model)
    pending: dict[str, _PendingLinear] = {}  # quantized-tensor name -> its Linear's pending entry
    for module_name, module in model.named_modules():
        if not isinstance(module, Linear) or (module is model.lm_head and model.config.tie_word_embeddings):
            continue
        prefix = module_name.rpartition(".")[0]
        prefix = f"{prefix}." if prefix else ""
        names = [f"{prefix}{s.name}" for s in module.shards]
        quantized = [fmt.is_quantized(n, keys) for n in names]
        if not any(quantized):
            continue
        if not all(quantized):
            dense = [n for n, q in zip(names, quantized, strict=True) if not q]
            raise ModelError(f"{checkpoint_dir}: {', '.join(dense)} not quantized while "
                             f"{', '.join(n for n, q in zip(names, quantized, strict=True) if q)} are; tokq merges them into one "
                             "layer, so they must all be quantized the same way")
        entry = _PendingLinear(module_name, module, set(), {n: {} for n in names})
        for n in names:
            targets.pop(f"{n}.weight", None)
            for suffix in fmt.suffixes:
                if f"{n}.{suffix}" in keys:
                    entry.expected.add(f"{n}.{suffix}")
                    pending[f"{n}.{suffix}"] = entry
    filled: set[str] = set()
    installed = 0
    for name, tensor in iter_tensors(checkpoint_dir):
        entry = pending.get(name)
        if entry is not None:
            shard_name, _, suffix = name.rpartition(".")
            entry.tensors[shard_name][suffix] = tensor
            entry.expected.discard(name)
            if not entry.expected:  # all of this Linear's tensors are in: unpack, merge, install
                entry.install(fmt, device, dtype)
                installed += 1
            continue
        copy_dense_tensor(model, targets, name, tensor, dtype, checkpoint_dir, filled)
    check_all_filled(targets, filled, checkpoint_dir)
    if installed == 0:
        log.warning("%s: quantization_config says %s but no layer has quantized tensors", checkpoint_dir, fmt.method)
