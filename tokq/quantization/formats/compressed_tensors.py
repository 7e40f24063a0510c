"""Writing a quantized model as a compressed-tensors checkpoint (what vLLM, SGLang and HF transformers load).

`save_quantized(model, scheme, out_dir)` writes the model whose Linears `quantize_model` made
quantized: config.json (+ `quantization_config`), model.safetensors, and the tokenizer files copied
from the source checkpoint. Tensors keep HF names; a merged Linear (qkv_proj, gate_up_proj) is split
back into its per-projection tensors by row ranges.

Formats, as compressed-tensors infers them from a scheme:

- integer weights, 16-bit activations (w4a16, w8a16): `pack-quantized`. `weight_packed` int32
  [N, ceil(K*b/32)]: codes shifted to unsigned (+2^(b-1)) and laid end to end along K, element i at
  bit i*b of the little-endian word stream (8 per word for int4, 4 for int8); `weight_scale`
  [N, G]; `weight_zero_point` (asymmetric only) packed the same way along N: [ceil(N*b/32), G];
  `weight_shape` int64 [2].
- integer weights with int8 activations (w8a8-int8): `int-quantized`: `weight` int8 [N, K] +
  `weight_scale` [N, G] (+ `weight_zero_point` int8 [N, G] when asymmetric).
- fp8 weights: `float-quantized` with fp8 activations (w8a8-fp8), `naive-quantized` weights-only:
  `weight` float8_e4m3fn [N, K] + `weight_scale` [N, 1].

Scales are written in the checkpoint dtype (as compressed-tensors does: the dtype the model was
quantized in); pass `dtype=torch.float32` to keep tokq's fp32 scales bit-exact. Everything that is not
quantized (embeddings, norms, lm_head, ignored layers, biases) is written in that dtype too.
Bit widths 2 and 3 use the same dense packing (current compressed-tensors); vLLM runs 4 and 8 only.

A mix (`quantization.layer_schemes.LayerSchemes`) is written as compressed-tensors' `mixed-precision` format:
one config group per scheme used, each with its own `format` and its projections named one by one as
targets (model.layers.3.self_attn.q_proj, ...); the Linears left 16-bit go to `ignore` with lm_head.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from tokq import __version__ as TOKQ_VERSION
from tokq.dtypes import HF_DTYPE_NAMES, HF_DTYPES
from tokq.engine.kv_scales import KVScales, kv_cache_scheme, kv_scale_tensors
from tokq.engine.layers import Linear
from tokq.engine.models import CausalLM
from tokq.engine.quant_linear import QuantizedLinearMethod
from tokq.errors import TokqError
from tokq.kernels.reference import FP8Weight, IntWeight, QuantizedWeight
from tokq.outputs import CHECKPOINT, TOKENIZER_FILES
from tokq.paths import atomic_directory
from tokq.quantization.layer_schemes import LayerSchemes, candidate_linears
from tokq.quantization.lm_head import LM_HEAD, LM_HEAD_SCHEME
from tokq.quantization.scheme import CHANNEL, QuantScheme

log = logging.getLogger("tokq")

# The compressed-tensors release whose layout this writer was checked against (packing, names, config).
COMPRESSED_TENSORS_VERSION = "0.20.1"
MAX_SHARD_BYTES = 5 * 2**30


def pack_int32_dense(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned `bits`-bit values [R, C] -> int32 [R, ceil(C*bits/32)], element i at bit i*bits of the word stream."""
    rows, cols = values.shape
    words = -(-cols * bits // 32)
    start = torch.arange(cols, device=values.device, dtype=torch.int64) * bits
    acc = torch.zeros(rows, words + 1, dtype=torch.int64, device=values.device)
    # Fields never overlap, so a sum is an OR; bits past 32 belong to the next word.
    acc.index_add_(1, start // 32, values.to(torch.int64) << (start % 32))
    low, spill = acc & 0xFFFFFFFF, acc >> 32
    out = low[:, :words] + torch.cat([torch.zeros_like(spill[:, :1]), spill[:, : words - 1]], dim=1)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def compression_format(scheme: QuantScheme) -> str:
    """The compressed-tensors format name for a scheme (the one compressed-tensors itself would infer)."""
    if scheme.weights.kind == "float":
        return "float-quantized" if scheme.activations is not None else "naive-quantized"
    return "int-quantized" if scheme.activations is not None else "pack-quantized"


def compress_weight(weight: QuantizedWeight, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One projection's quantized weight -> its compressed-tensors tensors (suffix -> tensor)."""
    scale = weight.scale.to(dtype).contiguous()
    if isinstance(weight, FP8Weight):
        return {"weight": weight.q.contiguous(), "weight_scale": scale}
    if fmt != "pack-quantized":
        out = {"weight": weight.q.to(torch.int8).contiguous(), "weight_scale": scale}
        if weight.zero is not None:
            out["weight_zero_point"] = weight.zero.to(torch.int8).contiguous()
        return out
    offset = 1 << (weight.bits - 1)
    out = {
        "weight_packed": pack_int32_dense(weight.q.to(torch.int64) + offset, weight.bits),
        "weight_scale": scale,
        "weight_shape": torch.tensor(list(weight.q.shape), dtype=torch.int64),
    }
    if weight.zero is not None:  # packed along the output dimension
        out["weight_zero_point"] = pack_int32_dense(weight.zero.to(torch.int64).t() + offset, weight.bits).t().contiguous()
    return out


def _weight_args(scheme: QuantScheme) -> dict:
    w = scheme.weights
    channel = w.strategy == CHANNEL or w.kind == "float"
    return {
        "num_bits": w.bits, "type": w.kind, "symmetric": w.symmetric if w.kind == "int" else True,
        "strategy": "channel" if channel else "group", "group_size": None if channel else w.group_size,
        "dynamic": False, "observer": "minmax",
    }


def _config_group(scheme: QuantScheme, targets: list[str]) -> dict:
    group: dict = {"targets": targets, "weights": _weight_args(scheme), "input_activations": None,
                   "output_activations": None}
    if scheme.activations is not None:
        group["input_activations"] = {"num_bits": 8, "type": scheme.activations.kind, "symmetric": True,
                                      "strategy": "token", "group_size": None, "dynamic": True}
    return group


def quantization_config(scheme: QuantScheme | LayerSchemes, ignore: list[str],
                        targets: dict[str, list[str]] | None = None, head_quantized: bool = False) -> dict:
    """config.json's `quantization_config`: one config group targeting every Linear for a scheme; for a mix, one
    group per scheme used, with its own format, targeting the projections `targets` lists under its key.

    `head_quantized`: the LM head is int8 (quantization/lm_head.py): a group of its own targets it by name, first
    (compressed-tensors and tokq both let a name match win over the `Linear` class match), each group says its
    format, and the top-level format is the shared one or `mixed-precision`."""
    if head_quantized:
        rest = quantization_config(scheme, ignore, targets)
        groups = {"group_0": {**_config_group(LM_HEAD_SCHEME, [LM_HEAD]),
                              "format": compression_format(LM_HEAD_SCHEME)}}
        for i, group in enumerate(rest["config_groups"].values(), start=1):
            groups[f"group_{i}"] = {**group, "format": group.get("format") or rest["format"]}
        formats = {g["format"] for g in groups.values()}
        return {**rest, "config_groups": groups,
                "format": formats.pop() if len(formats) == 1 else "mixed-precision"}
    if isinstance(scheme, LayerSchemes):
        used = scheme.used()
        groups = {}
        for i, key in enumerate(used):
            groups[f"group_{i}"] = {**_config_group(scheme.schemes[key], (targets or {}).get(key, [])),
                                    "format": compression_format(scheme.schemes[key])}
        # Even when every group has the same format: each group's own `format` is what readers use, and the
        # top-level name says that the config groups differ (compressed-tensors, vLLM and tokq all read it).
        fmt = "mixed-precision"
    else:
        groups, fmt = {"group_0": _config_group(scheme, ["Linear"])}, compression_format(scheme)
    return {
        "quant_method": "compressed-tensors", "format": fmt,
        "config_groups": groups, "ignore": ignore, "kv_cache_scheme": None,
        "quantization_status": "compressed", "global_compression_ratio": None, "sparsity_config": {},
        "transform_config": {}, "version": COMPRESSED_TENSORS_VERSION,
    }


def kv_only_quantization_config() -> dict:
    """`quantization_config` of a checkpoint whose weights stay dense and only the KV cache is quantized (no
    config groups, format dense); save_quantized adds the kv_cache_scheme."""
    return {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {}, "ignore": [],
            "kv_cache_scheme": None, "quantization_status": "compressed", "global_compression_ratio": None,
            "sparsity_config": {}, "transform_config": {}, "version": COMPRESSED_TENSORS_VERSION}


def _check_matches(name: str, weight: QuantizedWeight, act: str | None, scheme: QuantScheme) -> None:
    """Raise unless `weight` (and activations `act`) is quantized as `scheme` says: the config must describe it."""
    w = scheme.weights
    want_act = scheme.activations.name if scheme.activations else None
    if isinstance(weight, FP8Weight):
        ok = w.kind == "float"
    else:
        k = weight.q.shape[1]
        group_size = k if w.strategy == CHANNEL else w.group_size
        ok = (w.kind == "int" and weight.bits == w.bits and weight.group_size == group_size
              and (weight.zero is None) == w.symmetric)
    if not ok or act != want_act:
        raise TokqError(f"{name} is quantized differently from scheme {scheme.name}; the checkpoint's config would "
                        "not describe it: quantize the model with the scheme (or the layer schemes) you save it with")


def _layer_scheme(scheme: QuantScheme | LayerSchemes, module_name: str, quantized: bool) -> QuantScheme | None:
    """The scheme module `module_name` is saved under; for a mix, checked against whether it is quantized."""
    if not isinstance(scheme, LayerSchemes):
        return scheme
    own = scheme.for_layer(module_name)
    if quantized and own is None:
        raise TokqError(f"{module_name} is quantized but the layer schemes leave it 16-bit; save with the layer "
                        "schemes the model was quantized with")
    if own is not None and not quantized:
        raise TokqError(f"{module_name} is 16-bit but the layer schemes assign it {own.name}; save with the layer "
                        "schemes the model was quantized with")
    return own


def checkpoint_tensors(
    model: CausalLM, scheme: QuantScheme | LayerSchemes, dtype: torch.dtype, targets: dict[str, list[str]] | None = None,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """HF-named tensors of the model (quantized projections compressed) and the names of unquantized Linears.

    For a mix, `targets` (scheme key -> HF projection names) is filled with where each quantized projection went.
    """
    tensors: dict[str, torch.Tensor] = {}
    dense_linears: list[str] = []
    tied_head = model.lm_head if model.config.tie_word_embeddings else None
    for module_name, module in model.named_modules():
        module_tensors(module_name, module, scheme, dtype, targets, tensors, dense_linears, tied_head)
    return tensors, dense_linears


def block_tensors(block: torch.nn.Module, prefix: str, scheme: QuantScheme | LayerSchemes, dtype: torch.dtype,
                  targets: dict[str, list[str]] | None = None) -> tuple[dict[str, torch.Tensor], list[str]]:
    """`checkpoint_tensors` of one decoder block named `prefix` (model.layers.3): the same names, tensors, order."""
    tensors: dict[str, torch.Tensor] = {}
    dense_linears: list[str] = []
    for name, module in block.named_modules():
        module_tensors(f"{prefix}.{name}" if name else prefix, module, scheme, dtype, targets, tensors,
                       dense_linears, None)
    return tensors, dense_linears


def module_tensors(module_name: str, module: torch.nn.Module, scheme: QuantScheme | LayerSchemes, dtype: torch.dtype,
                   targets: dict[str, list[str]] | None, tensors: dict[str, torch.Tensor], dense_linears: list[str],
                   tied_head: Linear | None) -> None:
    """Add one module's own tensors (not its children's) to `tensors`; a Linear's unquantized shards go to
    `dense_linears`. `tied_head`: the LM head whose weight is the embedding's (written once, as the embedding)."""
    if isinstance(module, QuantizedLinearMethod):
        return  # written through its Linear
    if not isinstance(module, Linear):
        for pname, param in module.named_parameters(recurse=False):
            tensors[f"{module_name}.{pname}"] = param.detach().to("cpu", dtype).contiguous()
        return
    parent = module_name.rpartition(".")[0]
    prefix = f"{parent}." if parent else ""
    method = module.method
    quantized = isinstance(method, QuantizedLinearMethod)
    own = LM_HEAD_SCHEME if module_name == LM_HEAD and quantized else _layer_scheme(scheme, module_name, quantized)
    if quantized and hasattr(method, "input_perm"):
        raise TokqError(f"{module_name} holds activation-ordered GPTQ weights (input permutation); compressed-tensors "
                        "has no layout for them: quantize the 16-bit model with tokq instead")
    for shard in module.shards:
        name = f"{prefix}{shard.name}"
        rows = slice(shard.offset, shard.offset + shard.size)
        if module.bias is not None:
            tensors[f"{name}.bias"] = module.bias.detach()[rows].to("cpu", dtype).contiguous()
        if quantized:
            weight = method.weight
            _check_matches(name, weight, method.act, own)
            if targets is not None and isinstance(scheme, LayerSchemes) and module_name != LM_HEAD:
                targets.setdefault(scheme.assignment[module_name], []).append(name)
            if isinstance(weight, FP8Weight):
                part = FP8Weight(weight.q[rows].cpu(), weight.scale[rows].cpu())
            else:
                zero = None if weight.zero is None else weight.zero[rows].cpu()
                part = IntWeight(weight.q[rows].cpu(), weight.scale[rows].cpu(), zero, weight.bits, weight.group_size)
            for suffix, t in compress_weight(part, compression_format(own), dtype).items():
                tensors[f"{name}.{suffix}"] = t
        else:
            dense_linears.append(name)
            if module is not tied_head:
                tensors[f"{name}.weight"] = module.weight.detach()[rows].to("cpu", dtype).contiguous()


def shard_plan(sizes: list[tuple[str, int]]) -> list[list[str]]:
    """Tensor names (name, bytes, in writing order) grouped into files of at most MAX_SHARD_BYTES (HF's rule)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes:
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_file_names(count: int) -> list[str]:
    return ["model.safetensors"] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors"
                                                       for i in range(1, count + 1)]


def write_shard_index(out: Path, files: dict[str, str], total: int) -> None:
    """model.safetensors.index.json for a sharded checkpoint (`files`: tensor name -> file name)."""
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": files}, indent=2), encoding="utf-8")


def _write_safetensors(tensors: dict[str, torch.Tensor], out: Path) -> None:
    """model.safetensors, or shards + index when larger than MAX_SHARD_BYTES (HF's naming)."""
    plan = shard_plan([(name, t.numel() * t.element_size()) for name, t in tensors.items()])
    names = shard_file_names(len(plan))
    for fname, shard in zip(names, plan, strict=True):
        save_file({n: tensors[n] for n in shard}, str(out / fname), metadata={"format": "pt"})
    if len(plan) > 1:
        write_shard_index(out, {n: f for f, shard in zip(names, plan, strict=True) for n in shard},
                          sum(t.numel() * t.element_size() for t in tensors.values()))


def save_quantized(
    model: CausalLM,
    scheme: QuantScheme | LayerSchemes | None,
    out_dir: str | Path,
    *,
    source_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
    force: bool = False,
    provenance: dict | None = None,
    kv_cache: tuple[str, KVScales] | None = None,
) -> Path:
    """Write `model` (its quantized Linears as made by `quantize_model`) as a compressed-tensors checkpoint.

    `source_dir`: the checkpoint the model was loaded from; its tokenizer files are copied.
    `dtype`: for scales and unquantized tensors; default the source checkpoint's dtype (bf16 if unknown).
    `provenance`: what produced it (method, calibration, versions); written to tokq_quantization.json.
    `kv_cache`: ("fp8" or "int8", calibrated KVScales): written as kv_cache_scheme and per-layer k_scale/v_scale.
    The directory appears complete or not at all; an existing one is replaced only with `force=True`, and only
    if tokq wrote it as a checkpoint with nothing added since (outputs.check_replaceable).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        raise TokqError(f"{out_dir} already exists; choose another --out or pass --force to replace it")
    raw = copy.deepcopy(model.config.raw)
    dtype = checkpoint_dtype(raw, dtype)
    if scheme is None:  # a KV-cache-only build: every Linear stays 16-bit
        if kv_cache is None:
            raise TokqError("nothing to save as quantized: give a scheme (after quantize_model) or KV-cache scales")
        if any(isinstance(m, QuantizedLinearMethod) for m in model.modules()):
            raise TokqError("the model has quantized layers but no scheme was given: save with the scheme it was "
                            "quantized with")
    elif not any(isinstance(m, QuantizedLinearMethod) for m in model.modules()):
        raise TokqError("the model has no quantized layers: run quantize_model before saving")
    if isinstance(scheme, LayerSchemes):
        unknown = sorted(set(scheme.assignment) - set(candidate_linears(model)))
        if unknown:
            raise TokqError(f"the layer schemes assign {', '.join(unknown[:3])}, not a decoder Linear of this model; "
                            "save with the layer schemes the model was quantized with")
    targets: dict[str, list[str]] = {}
    tensors, dense_linears = checkpoint_tensors(model, scheme, dtype, targets)
    set_quantization_config(raw, scheme, dtype, dense_linears, targets, kv_cache)
    if kv_cache is not None:
        tensors.update(kv_scale_tensors(kv_cache[1], kv_cache[0]))
    with atomic_directory(out_dir, CHECKPOINT, "tokq quantize") as tmp:
        _write_safetensors(tensors, tmp)
        write_checkpoint_files(tmp, raw, scheme, source_dir, provenance, out_dir)
    return out_dir


def checkpoint_dtype(raw: dict, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of scales and unquantized tensors: `dtype`, else config.json's (bf16 if it names none)."""
    if dtype is None:
        dtype = HF_DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype")), torch.bfloat16)
    if dtype not in HF_DTYPE_NAMES:
        raise TokqError(f"checkpoint dtype {dtype} is not supported: use bfloat16, float16 or float32")
    return dtype


def set_quantization_config(raw: dict, scheme: QuantScheme | LayerSchemes | None, dtype: torch.dtype,
                            dense_linears: list[str], targets: dict[str, list[str]],
                            kv_cache: tuple[str, KVScales] | None) -> None:
    """config.json (`raw`, edited in place): the checkpoint dtype and the quantization_config."""
    head_quantized = scheme is not None and LM_HEAD not in dense_linears
    ignore = ([] if head_quantized else [LM_HEAD]) + [n for n in dense_linears if n != LM_HEAD]
    raw.pop("quantization_config", None)
    raw["dtype" if "torch_dtype" not in raw else "torch_dtype"] = HF_DTYPE_NAMES[dtype]
    raw["quantization_config"] = quantization_config(scheme, ignore, targets, head_quantized) \
        if scheme is not None else kv_only_quantization_config()
    if kv_cache is not None:
        kv_name, kv_scales = kv_cache
        raw["quantization_config"]["kv_cache_scheme"] = kv_cache_scheme(kv_name, kv_scales.strategy)


def write_checkpoint_files(tmp: Path, raw: dict, scheme: QuantScheme | LayerSchemes | None,
                           source_dir: str | Path | None, provenance: dict | None, out_dir: Path) -> None:
    """Everything but the weights: config.json, the source's tokenizer files, tokq_quantization.json."""
    (tmp / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if source_dir is not None:
        for fname in TOKENIZER_FILES:
            if (Path(source_dir) / fname).is_file():
                shutil.copy2(Path(source_dir) / fname, tmp / fname)
    else:
        log.warning("no source checkpoint given: %s gets no tokenizer files", out_dir)
    if scheme is None:
        mixed = {"scheme": None, "format": "dense"}
    elif isinstance(scheme, LayerSchemes):
        mixed = {"scheme": {"name": scheme.name, "schemes": {k: scheme.schemes[k].name for k in scheme.used()}},
                 "format": "mixed-precision", "layer_schemes": scheme.to_json()}
    else:
        mixed = {"scheme": scheme.to_json(), "format": compression_format(scheme)}
    record = {"tokq_version": TOKQ_VERSION, **mixed, **(provenance or {})}
    (tmp / "tokq_quantization.json").write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
