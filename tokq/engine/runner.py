"""The model runner: one scheduled step through the model, reading and writing the paged KV cache.

A step's sequences are flattened into one row of tokens (the model sees input_ids [1, T] with each
token's own position), and `PagedAttention`, the attention backend, writes each layer's new K/V into
the cache slots of those tokens and attends through the block tables with the kernel the registry
chose (kernels/attention.py). Each layer group (kv_cache.layer_groups: layers sharing a window) has its
own pool, so the slot mapping and the attention metadata are built once per group from that group's
block tables, and each layer reads and writes through its group's. Logits are computed only where they are needed: the last token of a
sequence that samples this step, and every token of a scoring request (scored in chunks, so a
large vocabulary never needs a whole window's logits at once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokq.engine.attention import AttentionSpec
from tokq.engine.compiled_decode import (
    MAX_COMPILED_BATCH,
    NativeGraphAttention,
    compile_enabled,
    model_fingerprint,
    run_compiled,
)
from tokq.engine.kv_cache import KVCacheSpec, LayerGroup
from tokq.engine.layers import use_native_gemv
from tokq.engine.models import CausalLM
from tokq.engine.native_step import NativeDecodeStep, native_step_enabled
from tokq.engine.scheduler import ScheduledStep
from tokq.kernels.attention import AttentionProblem, PreparedAttention
from tokq.kernels.paged import QUANT_KV_DTYPES, PagedAttentionMetadata
from tokq.kernels.registry import prepare_attention_kernel


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [1, T]
    positions: torch.Tensor  # int64 [1, T]
    slot_mappings: list[torch.Tensor]  # per layer group: int64 [T]
    metas: list[PagedAttentionMetadata]  # per layer group
    query_start: list[int]  # host copy of query_start_loc

    @property
    def slot_mapping(self) -> torch.Tensor:
        """The first group's slot mapping (a single-pool model's only one)."""
        return self.slot_mappings[0]

    @property
    def meta(self) -> PagedAttentionMetadata:
        return self.metas[0]


class PagedAttention:
    """The attention backend over the paged cache (engine/attention.py's seam)."""

    def __init__(self, caches: list[tuple[torch.Tensor, torch.Tensor]], kernels: list[PreparedAttention],
                 scales: list[tuple[torch.Tensor, torch.Tensor]] | None, group_of: list[int] | None = None):
        """`group_of[layer]`: the layer group (pool) whose slot mapping and block tables the layer uses."""
        self.caches, self.kernels, self.scales = caches, kernels, scales
        self.group_of = group_of if group_of is not None else [0] * len(caches)
        self.step: StepInputs | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> torch.Tensor:
        step = self.step
        group = self.group_of[spec.layer]
        k_cache, v_cache = self.caches[spec.layer]
        kernel = self.kernels[spec.layer]
        k_scale, v_scale = self.scales[spec.layer] if self.scales is not None else (None, None)
        kernel.write_kv(k[0], v[0], k_cache, v_cache, step.slot_mappings[group], k_scale, v_scale)
        out = kernel.attend(q[0], k_cache, v_cache, step.metas[group], spec.scale, spec.sliding_window,
                            k_scale, v_scale)
        return out.unsqueeze(0)


class ModelRunner:
    def __init__(self, model: CausalLM, spec: KVCacheSpec, caches: list[tuple[torch.Tensor, torch.Tensor]],
                 attention_kernels: str | None = None,
                 kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 groups: list[LayerGroup] | None = None, compile_decode: bool | None = None):
        """`compile_decode`: run pure decode steps through the model's compiled graph (engine/compiled_decode.py;
        None: $TOKQ_COMPILE, default on). `kv_scales`: per layer (k_scale, v_scale) fp32 [kv_heads], required by an int8/fp8 cache
        (engine/kv_scales.plan_kv_cache makes them). `groups`: the layer groups, in pool order (a sequence's
        block_tables[i] is group i's); None: one pool for every layer."""
        self.model, self.spec = model, spec
        config = model.config
        self.groups = groups or [LayerGroup("all", None, tuple(range(config.num_layers)))]
        group_of = [-1] * config.num_layers
        for i, group in enumerate(self.groups):
            for layer in group.layers:
                group_of[layer] = i
        if -1 in group_of:
            raise ValueError(f"layer {group_of.index(-1)} is in no KV pool's group")
        self.device = model.device
        if self.device.type == "cpu":
            use_native_gemv()
        self.compile_decode = compile_enabled(compile_decode)
        self.fingerprint = model_fingerprint(model) if self.compile_decode else None
        self.kernels = [prepare_attention_kernel(
            AttentionProblem(self.device.type, model.dtype, spec.dtype, config.num_heads, config.num_kv_heads,
                             config.head_dim, spec.block_size, config.layer_window(layer)), attention_kernels)
            for layer in range(config.num_layers)]
        if (spec.dtype in QUANT_KV_DTYPES) != (kv_scales is not None):
            raise ValueError(f"a {spec.dtype} KV cache {'needs' if kv_scales is None else 'takes no'} KV scales")
        if kv_scales is not None and len(kv_scales) != config.num_layers:
            raise ValueError(f"{len(kv_scales)} layers of KV scales for a {config.num_layers}-layer model")
        self.backend = PagedAttention(caches, self.kernels, kv_scales, group_of)
        # every layer on the native decode kernel: compiled steps call it straight from the graph (no Python per layer)
        self.graph_attention = (NativeGraphAttention(caches, group_of)
                                if all(k.name == "cpu_native_paged" for k in self.kernels) else None)
        # The whole decode step in one C++ call where everything in it has a native form (engine/native_step.py);
        # otherwise the compiled graph. `native_step_why` says why not (None when it runs).
        self.native_step: NativeDecodeStep | None = None
        self.native_step_why: str | None = "decode steps are not compiled" if not self.compile_decode else None
        if self.compile_decode:
            built = (NativeDecodeStep.build(model, caches, group_of, [k.name for k in self.kernels])
                     if native_step_enabled() else "turned off by TOKQ_NATIVE_STEP=0")
            self.native_step, self.native_step_why = (None, built) if isinstance(built, str) else (built, None)
        # each group's pool size, read off its first layer's cache (for the metadata's bounds check)
        self.group_blocks = [caches[group.layers[0]][0].shape[0] for group in self.groups]

    @property
    def decode_path(self) -> str:
        """How pure decode steps run: "native step", "compiled graph" or "eager" (bench rows and reports say it)."""
        return "native step" if self.native_step is not None else "compiled graph" if self.compile_decode else "eager"

    @property
    def kernel_names(self) -> list[str]:
        return sorted({k.name for k in self.kernels})

    def prepare(self, step: ScheduledStep) -> StepInputs:
        """The step's flat token row, positions, slot mapping and attention metadata.

        Per sequence only its token slice and block table are read on the host; positions and slots of
        every token come from tensor ops over the padded block tables (no loop over tokens: a prefill
        chunk of 2048 tokens used to cost a Python iteration each)."""
        if all(n == 1 for n in step.num_tokens):
            return self._prepare_decode(step)
        ids: list[int] = []
        starts, query_lens = [], []
        bs = self.spec.block_size
        for seq, n in zip(step.seqs, step.num_tokens, strict=True):
            start = seq.num_computed
            ids.extend(seq.token_ids[start: start + n])
            starts.append(start)
            query_lens.append(n)
        seq_lens = [s + n for s, n in zip(starts, query_lens, strict=True)]
        lens = torch.tensor(query_lens, dtype=torch.int64)
        seq_of = torch.repeat_interleave(torch.arange(len(starts)), lens)  # each token's sequence
        first = torch.cumsum(lens, 0) - lens  # each sequence's first token in the row
        positions = torch.tensor(starts, dtype=torch.int64)[seq_of] + torch.arange(len(ids)) - first[seq_of]
        dev = self.device
        slot_mappings, metas, query_start = [], [], []
        for group, num_blocks in enumerate(self.group_blocks):
            tables = [seq.table(group) for seq in step.seqs]
            width = max([len(t) for t in tables] + [1])
            table = torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                 dtype=torch.int64).view(len(tables), width)
            slots = table[seq_of, positions // bs] * bs + positions % bs
            # A DROPPED block (-1: out of the group's window) is never read: the metadata names block 0 instead.
            meta = PagedAttentionMetadata.from_tensors(table.clamp_min(0).to(torch.int32), seq_lens, query_lens)
            meta.validate(len(ids), num_blocks, bs)  # once per step and group, not once per layer
            meta = PagedAttentionMetadata(meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                          meta.max_query_len, meta.max_seq_len, trusted=True)
            query_start = query_start or meta.query_start_loc.tolist()  # the same in every group: a host copy
            slot_mappings.append(slots.to(dev))
            metas.append(meta.to(dev))
        return StepInputs(torch.tensor([ids], dtype=torch.int64, device=dev), positions.view(1, -1).to(dev),
                          slot_mappings, metas, query_start)

    def _prepare_decode(self, step: ScheduledStep) -> StepInputs:
        """`prepare` for a step in which every sequence decodes one token: the same inputs from host lists, with
        no tensor ops over them (0.5 ms of a 10 ms SmolLM2 step at one thread went to the general path's)."""
        bs = self.spec.block_size
        positions = [seq.num_computed for seq in step.seqs]
        ids = [seq.token_ids[p] for seq, p in zip(step.seqs, positions, strict=True)]
        seq_lens = [p + 1 for p in positions]
        count = len(ids)
        dev = self.device
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
        query_start = list(range(count + 1))
        qsl = torch.tensor(query_start, dtype=torch.int32)
        slot_mappings, metas = [], []
        for group, num_blocks in enumerate(self.group_blocks):
            tables = [seq.table(group) for seq in step.seqs]
            width = max([len(t) for t in tables] + [1])
            slots, rows = [], []
            for b, (table, pos) in enumerate(zip(tables, positions, strict=True)):
                need = pos // bs + 1
                if len(table) < need:
                    raise ValueError(f"block table too short: sequence {b} has seq_len {pos + 1}, which needs "
                                     f"{need} blocks of {bs}, but its table has {len(table)}")
                # A DROPPED block (-1: out of the group's window) is never read: the metadata names block 0 instead.
                row = [max(block, 0) for block in table] + [0] * (width - len(table))
                if max(row[:need]) >= num_blocks or table[need - 1] < 0:
                    raise ValueError(f"block_tables names a block outside the cache's {num_blocks} blocks "
                                     f"(sequence {b})")
                slots.append(table[need - 1] * bs + pos % bs)
                rows.append(row)
            table_t = torch.tensor(rows, dtype=torch.int32)
            meta = PagedAttentionMetadata(table_t, seq_lens_t, qsl, 1, max(seq_lens), trusted=True)
            meta.check_shapes()
            slot_mappings.append(torch.tensor(slots, dtype=torch.int64, device=dev))
            metas.append(meta.to(dev))
        return StepInputs(torch.tensor([ids], dtype=torch.int64, device=dev),
                          torch.tensor([positions], dtype=torch.int64, device=dev), slot_mappings, metas, query_start)

    @property
    def caches_blocks(self) -> int:
        """The first pool's number of blocks (a single-pool model's only one; group_blocks has them all)."""
        return self.group_blocks[0]

    @torch.inference_mode()
    def run(self, step: ScheduledStep) -> tuple[torch.Tensor, StepInputs]:
        """Run the step; returns the final hidden states [T, hidden] (logits are the caller's choice)."""
        inputs = self.prepare(step)
        self.backend.step = inputs
        try:
            hidden = None
            decode = all(n == 1 for n in step.num_tokens) and len(step.num_tokens) <= MAX_COMPILED_BATCH
            if decode and self.native_step is not None:  # (native_step.MAX_BATCH is the graph's limit too)
                hidden = self.native_step.run(inputs.input_ids, inputs.positions, inputs.slot_mappings, inputs.metas)
            elif self.compile_decode and decode:
                if self.graph_attention is not None:
                    self.graph_attention.set_step(inputs.slot_mappings, inputs.metas)
                hidden = run_compiled(self.model, self.backend, inputs.input_ids, inputs.positions,
                                      self.fingerprint, self.graph_attention)
            if hidden is None:
                hidden = self.model(inputs.input_ids, inputs.positions, backend=self.backend)
        finally:
            self.backend.step = None
        return hidden[0], inputs

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).float()
