"""A Llama-family decode step as one C++ call: no Python, no graph wrapper and no dispatcher per layer.

Through torch.compile's graph a SmolLM2 decode step at batch 1 still spent 34% (1 thread) to 42% (2 threads) of its
time outside tokq's kernels (benchmarks/decode_profile.py on a 2-core EPYC): the inductor wrapper's Python calling
~150 ops and as many fused pointwise loops, dynamo's guards, the pre-graph bytecode. `NativeDecodeStep` hands the
whole step to `torch.classes.tokq_native.LlamaDecoder` (kernels/cpu/native/decode_step.cpp), which loops over the
layers calling the same kernels the eager and compiled paths call (the native GEMVs, aten's int4/int8 ops, the native
paged decode attention) and writes the pointwise work out, rounding to bf16 where the eager model does.

It takes a step when everything in it has a native form: a bf16 Llama-family model on CPU (Llama, SmolLM, Mistral,
Qwen2 with its qkv bias; not QK-norm, not Gemma), SiLU, one RoPE table, every layer's attention on the native paged
kernel (a bf16 cache), every projection dense bf16 or on a weight-only int4/int8 kernel of the CPU (native or aten's),
at most `MAX_BATCH` sequences each decoding one token. Anything else runs through the compiled graph (or eagerly), and
`why_not` says why. `TOKQ_NATIVE_STEP=0` turns it off (benchmarks compare the two paths that way).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tokq.engine.compiled_decode import MAX_COMPILED_BATCH
from tokq.engine.layers import DENSE, Linear, use_native_gemv
from tokq.engine.models import CausalLM
from tokq.engine.models.llama import LlamaDecoderLayer
from tokq.engine.quant_linear import InputPermutedLinearMethod, QuantizedLinearMethod
from tokq.kernels.cpu import native
from tokq.kernels.cpu.native_linear import NATIVE_INT4_MAX_M, NATIVE_MAX_M

ENV = "TOKQ_NATIVE_STEP"
# Decode batches up to the compiled graph's limit (larger ones run eagerly): each projection takes its kernel's
# cutoffs (native int4 GEMV up to 32 rows, native int8 up to 16) as the Python kernels do.
MAX_BATCH = MAX_COMPILED_BATCH
DENSE_BF16, INT4_TILED, INT4_ROWS, INT8, ATEN_INT4, ATEN_INT8 = range(6)  # decode_step.cpp's LinearKind
_EMPTY = torch.empty(0)
steps_run = 0  # decode steps run natively in this process (tests and benchmarks read it)


def native_step_enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclass
class LinearPlan:
    kind: int
    n: int
    group: int
    max_rows: int  # rows its kernel takes; more are dequantized (int4) or go to aten's int8pack op (int8)
    tensors: list[torch.Tensor]  # decode_step.cpp's TENSORS_PER_LINEAR (empty where absent)


def _linear_plan(layer: Linear) -> LinearPlan | str:
    """How decode_step.cpp runs `layer`, or why it cannot: the kernel its registry picked, with the same cutoffs."""
    bias = _EMPTY if layer.bias is None else layer.bias
    method = layer.method
    if method is DENSE:
        if layer.weight.dtype != torch.bfloat16 or not DENSE.native_gemv:
            return f"a dense {layer.weight.dtype} layer without the native bf16 GEMV"
        return LinearPlan(DENSE_BF16, layer.out_features, 0, MAX_BATCH, [layer.weight, _EMPTY, _EMPTY, bias] + [_EMPTY] * 4)
    if not isinstance(method, QuantizedLinearMethod) or method.act is not None:
        return f"a {getattr(method, 'name', type(method).__name__)} layer"
    perm = method.input_perm if isinstance(method, InputPermutedLinearMethod) else _EMPTY
    kernel, state = method.kernel.name, method.kernel.state
    if kernel in ("cpu_native_int4", "cpu_int4"):
        codes = state.weight
        dequant = [codes.q, codes.scale, _EMPTY if codes.zero is None else codes.zero]
        if kernel == "cpu_int4":
            return LinearPlan(ATEN_INT4, state.n, state.group_size, state.max_m,
                              [state.packed, state.scales_and_zeros, _EMPTY, bias, perm, *dequant])
        return LinearPlan(INT4_TILED if state.tiled else INT4_ROWS, state.n, state.group_size, NATIVE_INT4_MAX_M,
                          [state.packed, state.scale, state.zero, bias, perm, *dequant])
    if kernel == "cpu_native_int8":
        return LinearPlan(INT8, state.n, 0, NATIVE_MAX_M,
                          [state.q, state.unsigned, state.scale, bias, perm, _EMPTY, state.scale_bf16, _EMPTY])
    if kernel == "cpu_int8":
        return LinearPlan(ATEN_INT8, state.n, 0, MAX_BATCH, [state.q, state.scales, _EMPTY, bias, perm] + [_EMPTY] * 3)
    return f"a layer on the {kernel} kernel"


def why_not(model: CausalLM, attention_kernels: list[str]) -> str | None:
    """Why `model` cannot decode through the native step (None: it can), model-level checks only."""
    config = model.config
    if model.device.type != "cpu" or model.dtype != torch.bfloat16:
        return f"a {model.dtype} model on {model.device.type} (the native step runs bf16 on CPU)"
    if native.unavailable() is not None:
        return native.unavailable()
    if not hasattr(torch.classes.tokq_native, "LlamaDecoder"):
        return "this build of tokq's native kernels has no LlamaDecoder"
    if not all(isinstance(layer, LlamaDecoderLayer) for layer in model.model.layers):
        return f"a {config.family} model (the native step runs the Llama family)"
    if config.hidden_act != "silu" or config.qk_norm or config.embed_scale != 1.0 or config.norm_weight_offset:
        return "a Llama-family variant it does not implement (SiLU, no QK-norm, unscaled embeddings, plain RMSNorm)"
    if len(set(config.layer_types)) != 1 or config.head_dim % 2 or config.head_dim > 512:
        return "layers of more than one type (RoPE table) or an unsupported head size"
    if any(name != "cpu_native_paged" for name in attention_kernels):
        return "attention not on the native paged kernel in every layer"
    return None


class NativeDecodeStep:
    """One engine's native decode step: the model's tensors and the engine's caches, bound once."""

    def __init__(self, decoder) -> None:
        self.decoder = decoder

    @classmethod
    def build(cls, model: CausalLM, caches: list[tuple[torch.Tensor, torch.Tensor]], group_of: list[int],
              attention_kernels: list[str]) -> NativeDecodeStep | str:
        """The step for this model and these caches, or why it cannot run natively."""
        use_native_gemv()
        why = why_not(model, attention_kernels)
        if why:
            return why
        config = model.config
        rotary = model.rotary[config.layer_types[0]]
        tensors = [model.model.embed_tokens.weight, model.model.norm.weight, rotary.inv_freq]
        meta: list[int] = []
        for layer in model.model.layers:
            tensors += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj):
                plan = _linear_plan(linear)
                if isinstance(plan, str):
                    return plan
                tensors += plan.tensors
                meta += [plan.kind, plan.n, plan.group, plan.max_rows]
        layer_meta: list[int] = []
        for layer in range(config.num_layers):
            layer_meta += [group_of[layer], config.layer_window(layer) or 0]
        flat_caches = [t for pair in caches for t in pair]
        dims = [config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size,
                config.num_layers]
        decoder = torch.classes.tokq_native.LlamaDecoder(dims, [config.rms_norm_eps, config.attn_scale], tensors, meta,
                                                         flat_caches, layer_meta)
        return cls(decoder)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mappings: list[torch.Tensor],
            metas: list) -> torch.Tensor:
        """input_ids, positions [1, M] (one token per sequence) -> the final hidden states [1, M, hidden]."""
        global steps_run
        hidden = self.decoder.step(input_ids[0], positions[0], slot_mappings, [m.block_tables for m in metas],
                                   [m.seq_lens for m in metas], [m.query_start_loc for m in metas])
        steps_run += 1
        return hidden.unsqueeze(0)
