"""Calibration: token sequences from documents, and the block-by-block walk through the model.

`calibration_samples` cuts the documents into windows of `seq_len` tokens (the model's BOS
policy applied) and draws `num_samples` of them with a seeded RNG, as an even mix of the documents'
sources (`source_of`: a sub-folder, or a file at the top of the folder), so one large source cannot
crowd out the rest: calibrated on one kind of text only, GPTQ and AWQ lose part of their gain on
the others (benchmarks/calibration_shift.py). `BlockwiseRunner` pushes all
samples through the embeddings once, then visits the decoder blocks in order: a method quantizes
block i on the inputs captured there, then the *quantized* block produces the inputs of block
i + 1, so every block is calibrated on what the quantized model will really feed it. Peak
memory is one block's activations for all samples.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from tokq.engine.attention import DenseCausalAttention
from tokq.engine.layers import Linear
from tokq.engine.models import CausalLM
from tokq.engine.tokenizer import check_token_ids
from tokq.errors import DataError

log = logging.getLogger("tokq")


@dataclass
class CalibrationSet:
    tokens: torch.Tensor  # [num_samples, seq_len] int64
    source: str
    data_hash: str
    seed: int
    requested: int
    sources: dict[str, int] = field(default_factory=dict)  # source -> calibration windows drawn from it

    @property
    def num_samples(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens.shape[1])

    def to_json(self) -> dict:
        return {
            "source": self.source, "data_hash": self.data_hash, "seed": self.seed,
            "num_samples": self.num_samples, "requested_samples": self.requested, "seq_len": self.seq_len,
            "tokens_hash": hashlib.sha256(self.tokens.numpy().tobytes()).hexdigest()[:16],
            "source_tokens": {name: n * self.seq_len for name, n in sorted(self.sources.items())},
        }

    def token_histogram(self):
        """The calibration tokens' id histogram (evalsuite.calibration_distance), which `tokq quantize` records
        so that compare and the gate can tell how far the documents they judge lie from these."""
        from tokq.evalsuite.calibration_distance import token_histogram

        return token_histogram(self.tokens)


def source_of(doc_id: str) -> str:
    """The source a document belongs to: its top-level sub-folder, or its file when that lies at the top
    (`notes.jsonl#L3` -> `notes.jsonl`)."""
    first = doc_id.split("/", 1)[0]
    return first.split("#", 1)[0] if "/" not in doc_id else first


def mixed_sample(windows: list, count: int, rng: random.Random) -> list:
    """`count` windows (all, if fewer) spread evenly over their sources: each source's windows in a seeded
    random order, then one from each source in turn (sources in name order), a source that runs out leaving
    its turns to the others."""
    by_source: dict[str, list] = defaultdict(list)
    for w in windows:
        by_source[source_of(w.doc_id)].append(w)
    queues = []
    for name in sorted(by_source):
        group = by_source[name]
        queues.append(rng.sample(group, len(group)))
    picked: list = []
    turn = 0
    while len(picked) < count and any(queues):
        queue = queues[turn % len(queues)]
        if queue:
            picked.append(queue.pop())
        turn += 1
    return picked


def calibration_samples(
    data: Path, tokenizer, add_bos: bool, num_samples: int, seq_len: int, seed: int = 0, limits=None,
    documents=None,
) -> CalibrationSet:
    """Draw `num_samples` full windows of `seq_len` tokens from the documents under `data` (read within
    `limits`, a read_limits.ReadLimits: default caps when None), or from `documents` (a DocumentSet already
    read from `data`: `quantize --mix` calibrates on its choice documents only)."""
    from tokq.longctx.documents import load_documents
    from tokq.longctx.text_encoding import as_text_encoder
    from tokq.longctx.windows import build_windows

    if num_samples < 1 or seq_len < 16:
        raise DataError(f"calibration needs at least 1 sample of at least 16 tokens (got {num_samples} x {seq_len})")
    docs = load_documents(data, limits=limits) if documents is None else documents
    windows = build_windows(docs.documents, as_text_encoder(tokenizer, add_bos), seq_len, add_bos=add_bos,
                            min_window_tokens=seq_len - int(add_bos))
    full = [w for w in windows.windows if len(w.tokens) == seq_len]
    if not full:
        raise DataError(f"{data}: no document is long enough for one calibration window of {seq_len} tokens; "
                        "use a smaller --seq-len or longer documents")
    picked = mixed_sample(full, num_samples, random.Random(seed))
    if len(picked) < num_samples:
        log.warning("calibration: asked for %d samples of %d tokens, %s has only %d; continuing with %d",
                    num_samples, seq_len, data, len(full), len(picked))
    tokens = torch.tensor([w.tokens for w in picked], dtype=torch.long)
    sources: dict[str, int] = defaultdict(int)
    for w in picked:
        sources[source_of(w.doc_id)] += 1
    return CalibrationSet(tokens, str(data), docs.content_hash(), seed, num_samples, dict(sources))


@contextmanager
def capture_inputs(modules: dict[str, nn.Module], sink: Callable[[str, torch.Tensor], None]) -> Iterator[None]:
    """Call sink(name, input) for every forward of each module while the context is open."""
    handles = [m.register_forward_pre_hook(lambda _m, args, name=name: sink(name, args[0])) for name, m in modules.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class _StopForward(Exception):
    """Raised by a capture hook to end a forward whose remaining work is not needed."""


@dataclass
class BlockContext:
    """What a method needs to run block `index` on its calibration inputs."""

    index: int
    block: nn.Module
    inputs: torch.Tensor  # [S, T, H] hidden states entering the block
    rope: tuple[torch.Tensor, torch.Tensor]
    batch_size: int

    def linears(self) -> dict[str, Linear]:
        return {name: m for name, m in self.block.named_modules() if isinstance(m, Linear)}

    def forward(self, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """The block's outputs for `inputs` (default: its calibration inputs), in micro-batches."""
        return self.run_sub(self.block, self.inputs if inputs is None else inputs, needs_rope=True)

    def capture(
        self, modules: dict[str, nn.Module], sink: Callable[[str, torch.Tensor], None], stop_after: str | None = None
    ) -> None:
        """Feed the calibration inputs through the block, calling sink(name, input) for each module, and
        cut every micro-batch's forward short once `stop_after` has seen its input: what runs after
        it cannot change the inputs being collected (GPTQ's true-sequential steps save most of a
        block forward this way)."""

        def record(name: str, x: torch.Tensor) -> None:
            sink(name, x)
            if name == stop_after:
                raise _StopForward

        backend = DenseCausalAttention()
        with torch.inference_mode(), capture_inputs(modules, record):
            for start in range(0, self.inputs.shape[0], self.batch_size):
                try:
                    self.block(self.inputs[start : start + self.batch_size], self.rope, backend)
                except _StopForward:
                    pass

    def run_sub(self, module: nn.Module, inputs: torch.Tensor, needs_rope: bool = False) -> torch.Tensor:
        """Run the block or one of its sub-modules (attention, MLP, a Linear) on [S, T, H] inputs.

        The RoPE tables are [1, T, D] and broadcast over the micro-batch.
        """
        backend = DenseCausalAttention()
        outs = []
        with torch.inference_mode():
            for start in range(0, inputs.shape[0], self.batch_size):
                chunk = inputs[start : start + self.batch_size]
                outs.append(module(chunk, self.rope, backend) if needs_rope else module(chunk))
        return torch.cat(outs)


class BlockSource(Protocol):
    """Where the walk gets its blocks when they are not all in memory (quantization/streamed.py)."""

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def load(self, index: int) -> nn.Module: ...

    def done(self, index: int, block: nn.Module) -> None: ...


# The widest activation one micro-batch of calibration windows makes in a block (fp32) is kept under this: a
# 1.5B model's MLP is 8960 wide (17920 out of its fused gate/up projection), so 8 windows of 512 tokens made
# 294 + 147 + 147 MB tensors at once beside GPTQ's Hessians and set the streamed quantize's peak memory.
# Matmuls of a few windows are as fast per token.
MICRO_BATCH_BYTES = 128 * 2**20


def micro_batch_size(config, seq_len: int, most: int = 8) -> int:
    """Calibration windows run through a block at once: `most`, or fewer where one window's widest fp32
    activation (the MLP's intermediate, the attention's projections, or its [heads, T, T] scores) times that
    many would pass MICRO_BATCH_BYTES."""
    widest = max(config.intermediate_size * 2, config.hidden_size, config.num_heads * config.head_dim,
                 config.num_heads * seq_len)  # gate and up come out of one fused projection
    return max(1, min(most, MICRO_BATCH_BYTES // (4 * seq_len * widest)))


class BlockwiseRunner:
    """Walk the decoder blocks in order with calibration activations (see module docstring). With `blocks`, each
    block is loaded when the walk reaches it and handed back once it has fed the next one."""

    def __init__(self, model: CausalLM, calib: CalibrationSet, batch_size: int = 8, blocks: BlockSource | None = None):
        self.model = model
        self.calib = calib
        self.batch_size = batch_size
        self.blocks = blocks

    def run(self, quantize_block: Callable[[BlockContext], None], on_block: Callable[[int], None] | None = None) -> None:
        model, config = self.model, self.model.config
        if self.blocks is None:
            weight = model.model.embed_tokens.weight
            hidden, ropes = embed_calibration(model, self.calib.tokens, lambda ids: weight[ids.to(weight.device)],
                                              weight.device, weight.dtype)
        else:  # 16-bit checkpoint rows are exact in fp32: what an fp32-loaded model embeds
            hidden, ropes = embed_calibration(model, self.calib.tokens, self.blocks.embed_rows,
                                              next(iter(model.rotary.values())).inv_freq.device, torch.float32)
        for i in range(config.num_layers):
            block = model.model.layers[i] if self.blocks is None else self.blocks.load(i)
            ctx = BlockContext(i, block, hidden, ropes[config.layer_types[i]], self.batch_size)
            quantize_block(ctx)
            hidden = ctx.forward()  # the quantized block feeds the next one
            if self.blocks is not None:
                del ctx
                self.blocks.done(i, block)
                del block
            if on_block:
                on_block(i)


def embed_calibration(model: CausalLM, tokens: torch.Tensor, lookup: Callable[[torch.Tensor], torch.Tensor],
                      device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    """The hidden states entering block 0 for calibration `tokens` (`lookup` gives their embedding rows), in
    `dtype` on `device`, and the RoPE tables of each layer type."""
    config = model.config
    # Calibration embeds the ids directly (not through the model's forward, which checks them).
    check_token_ids(tokens, config.vocab_size, model.name)
    with torch.inference_mode():
        hidden = lookup(tokens).to(device, dtype)
        if config.embed_scale != 1.0:
            hidden = hidden * torch.tensor(config.embed_scale, dtype=hidden.dtype)
        positions = torch.arange(tokens.shape[1], device=device)[None]
        ropes = {kind: rot.cos_sin(positions, hidden.dtype) for kind, rot in model.rotary.items()}
    return hidden, ropes
