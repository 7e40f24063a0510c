"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, as llm-compressor writes them).

Layouts read (N = output features, K = input features, G = groups, b = bits):

- `pack-quantized`: `weight_packed` int32 [N, ceil(K*b/32)], codes + 2^(b-1) packed densely along K,
  element i at bit i*b of the little-endian word stream; `weight_scale` [N, G]; `weight_zero_point`
  (asymmetric) packed the same way along N: [ceil(N*b/32), G]; `weight_shape` [2].
- `int-quantized` / `naive-quantized` / `float-quantized`: `weight` int8 or float8_e4m3fn [N, K] +
  `weight_scale` (+ `weight_zero_point` int8 [N, G]).
- Optional `weight_g_idx` [K] (activation order) is handled like GPTQ's g_idx (see loader.py).

Each config group names its targets (module names, `re:` patterns, or `Linear`), its weights' scheme
(num_bits, type, symmetric, strategy, group_size) and its input activations (dynamic per-token int8 or
fp8, or none).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from tokq.engine.quant_formats.base import (
    QuantFormat,
    ShardWeight,
    check_scale,
    check_shape,
    group_size_of,
    need,
)
from tokq.engine.quant_formats.packing import unpack_int32_dense
from tokq.errors import ModelError
from tokq.kernels.reference import FP8Weight, IntWeight

log = logging.getLogger("tokq")

CT_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized", "mixed-precision", "dense")
INT_BITS = (2, 3, 4, 8)


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
    scale = check_scale(f"{name}.weight_scale", need(tensors, name, "weight_scale"))
    if kind == "float":
        if bits != 8 or strategy == "group":
            raise ModelError(f"{name}: float weights of {bits} bits with strategy {strategy!r} are not supported; "
                             "tokq reads fp8 e4m3 weights with per-channel or per-tensor scales")
        q = need(tensors, name, "weight")
        if q.dtype != torch.float8_e4m3fn:
            raise ModelError(f"tensor {name}.weight has dtype {q.dtype}, expected float8_e4m3fn for fp8 weights")
        n = q.shape[0]
        scale = scale.reshape(-1, 1).expand(n, 1).clone() if scale.numel() == 1 else scale.reshape(-1, 1)
        check_shape(f"{name}.weight_scale", scale, (n, 1))
        return ShardWeight(FP8Weight(q, scale), act)
    if kind != "int" or bits not in INT_BITS:
        raise ModelError(f"{name}: {bits}-bit {kind} weights are not supported; tokq reads int{'/int'.join(map(str, INT_BITS))} "
                         "and fp8 weights")
    offset = 1 << (bits - 1)
    if "weight_packed" in tensors:
        packed = tensors["weight_packed"]
        if packed.dtype != torch.int32:
            raise ModelError(f"tensor {name}.weight_packed has dtype {packed.dtype}, expected int32")
        shape = need(tensors, name, "weight_shape")
        n, k = (int(v) for v in shape.reshape(-1).tolist())
        check_shape(f"{name}.weight_packed", packed, (n, -(-k * bits // 32)), fix=f"for weight_shape {[n, k]}")
        q = (unpack_int32_dense(packed, bits, k) - offset).to(torch.int8)
    else:
        q = need(tensors, name, "weight")
        if q.dtype != torch.int8:
            raise ModelError(f"tensor {name}.weight has dtype {q.dtype}, expected int8 for {bits}-bit integer weights")
        n, k = q.shape
    if strategy == "tensor":
        scale = scale.reshape(1, 1).expand(n, 1).clone()
    groups = scale.shape[-1] if scale.dim() == 2 else -1
    check_shape(f"{name}.weight_scale", scale, (n, groups if groups > 0 else 1))
    if strategy == "group" and weights.get("group_size") and groups * int(weights["group_size"]) != k:
        raise ModelError(f"tensor {name}.weight_scale has {groups} groups but group_size {weights['group_size']} "
                         f"over {k} inputs needs {k // int(weights['group_size'])}; the checkpoint is inconsistent")
    zero = None
    if not weights.get("symmetric", True):
        zp = need(tensors, name, "weight_zero_point")
        if strategy == "tensor":
            zero = zp.to(torch.int64).reshape(1, 1).expand(n, 1)
        elif "weight_packed" in tensors:
            if zp.dtype != torch.int32:
                raise ModelError(f"tensor {name}.weight_zero_point has dtype {zp.dtype}, expected packed int32")
            check_shape(f"{name}.weight_zero_point", zp, (-(-n * bits // 32), groups))
            zero = unpack_int32_dense(zp.t(), bits, n).t() - offset  # packed along the output dim
        else:
            zero = zp.to(torch.int64)
            check_shape(f"{name}.weight_zero_point", zero, (n, groups))
        if zero.min() < -offset or zero.max() >= offset:
            raise ModelError(f"tensor {name}.weight_zero_point holds values outside the {bits}-bit range")
        zero = zero.to(torch.int8).contiguous()
    g_idx = tensors.get("weight_g_idx")
    weight = IntWeight(q.contiguous(), scale.contiguous(), zero, bits, group_size_of(k, groups, name))
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64).reshape(-1)
        check_shape(f"{name}.weight_g_idx", g_idx, (k,))
    return ShardWeight(weight, act, g_idx)


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
