"""The streamed quantization walk: quantize a model that does not fit in memory twice, one block at a time.

`quantize_streamed` does what `load_model` + `pipeline.quantize_model` + `formats.save_quantized` do, with peak
memory set by one decoder block instead of the whole model. The model is built on the meta device (shapes only);
when the walk reaches block i, that block alone is allocated in fp32 and filled from the safetensors files
(`get_tensor` reads just the tensors asked for), quantized on the calibration activations entering it, run to
produce the next block's inputs, written compressed to a scratch file inside the output's atomic temp folder,
and put back on the meta device. The embedding is read in the checkpoint's dtype only to embed the calibration
tokens; the final norm and an untied LM head are read only when the checkpoint is assembled. Assembly streams the
scratch files and the source's non-block tensors into the same files, tensor names and bytes the in-memory path
writes (tests/test_streamed_quantize.py compares them), then deletes the scratch.

Every method is block-local (AWQ and SmoothQuant fold their scales into the block's own norms and Linears:
mappings.block_mappings), so each block's checkpoint tensors are final when the block is done. KV-cache scales
are calibrated on the whole quantized model after the walk: `tokq quantize --kv-cache` keeps the in-memory path.
"""

from __future__ import annotations

import copy
import gc
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tokq.engine.checkpoint import check_checkpoint_matches
from tokq.engine.config import ModelConfig
from tokq.engine.layers import Linear, rope_inverse_frequencies
from tokq.engine.models import DECODER_LAYERS, CausalLM, build_model
from tokq.engine.quant_linear import QuantizedLinearMethod
from tokq.engine.safetensors_io import (
    TensorInfo,
    check_all_filled,
    checkpoint_targets,
    copy_dense_tensor,
    read_checkpoint_header,
)
from tokq.errors import ModelError, TokqError
from tokq.outputs import CHECKPOINT
from tokq.paths import atomic_directory
from tokq.quantization import pipeline
from tokq.quantization.calibration import CalibrationSet
from tokq.quantization.formats.compressed_tensors import (
    block_tensors,
    checkpoint_dtype,
    set_quantization_config,
    shard_file_names,
    shard_plan,
    write_checkpoint_files,
    write_shard_index,
)
from tokq.quantization.formats.streamed_safetensors import StreamedTensor, write_streamed
from tokq.quantization.layer_schemes import LayerSchemes
from tokq.quantization.methods.options import MethodOptions
from tokq.quantization.pipeline import METHODS, MethodRun
from tokq.quantization.scheme import QuantScheme

BLOCK_NAME = re.compile(r"model\.layers\.(\d+)")
SCRATCH = ".tokq-scratch"  # inside the atomic temp folder; removed before the folder is renamed into place


class SourceTensors:
    """The source checkpoint's tensors by name, each read from its safetensors file when asked for.

    safetensors maps the file and hands out tensors backed by the mapping: every page read stays resident (and
    counts in RSS) while the file is open. So each read opens the file, copies what it needs and closes it again:
    the pages of a finished block do not add up to the whole checkpoint."""

    ROWS_BYTES = 64 * 2**20  # a large 2-D tensor is read this many bytes of rows at a time

    def __init__(self, checkpoint_dir: Path, header: dict[str, TensorInfo]):
        self.checkpoint_dir = checkpoint_dir
        self.header = header

    def _info(self, name: str) -> TensorInfo:
        info = self.header.get(name)
        if info is None:
            raise ModelError(f"{self.checkpoint_dir}: tensor {name} is missing from the safetensors; download or "
                             "convert the checkpoint again")
        return info

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor `name` as `dtype` (always a copy, not the file's mapping)."""
        return next(self._read(name, dtype, None))

    def row_chunks(self, name: str, dtype: torch.dtype | None = None) -> Iterator[torch.Tensor]:
        """Tensor `name` as `dtype` (None: its own), a slice of rows at a time (copies)."""
        return self._read(name, dtype, True)

    def _read(self, name: str, dtype: torch.dtype | None, chunked: bool | None) -> Iterator[torch.Tensor]:
        info = self._info(name)
        row_bytes = max(info.nbytes // max(info.shape[0], 1), 1) if info.shape else info.nbytes
        step = max(self.ROWS_BYTES // row_bytes, 1) if chunked and len(info.shape) >= 1 else None
        starts = range(0, info.shape[0], step) if step else [None]
        for start in starts:
            try:
                with safe_open(str(info.file), framework="pt") as f:
                    t = f.get_tensor(name) if start is None else f.get_slice(name)[start: start + step]
                    out = t.to(dtype or t.dtype, copy=True)
                    del t
            except Exception as exc:  # safetensors raises its own error types for corrupt data
                raise ModelError(f"{info.file} could not be read at {name} ({exc}); download or convert it "
                                 "again") from exc
            yield out


@dataclass
class StreamedResult:
    run: MethodRun
    dense_16bit_bytes: int
    write_seconds: float


def streamed_blocker(method: str, kv_cache: str | None, quantized_source: bool) -> str | None:
    """Why this build cannot stream (None: it can): the in-memory path then runs instead."""
    if kv_cache is not None:
        return "--kv-cache calibrates KV scales on the whole quantized model"
    if quantized_source:
        return "the source checkpoint is already quantized"
    if method not in METHODS:
        return f"--method {method} quantizes no weights"
    return None


def meta_model(config: ModelConfig) -> CausalLM:
    with torch.device("meta"):
        return build_model(config)


def _materialize_block(model: CausalLM, index: int, source: SourceTensors, device: torch.device) -> torch.nn.Module:
    """Allocate block `index` in fp32 on `device` and fill it from the source, as load_model would."""
    block = model.model.layers[index].to_empty(device=device).to(torch.float32)
    prefix = f"model.layers.{index}."
    targets = {n: t for n, t in checkpoint_targets(model).items() if n.startswith(prefix)}
    filled: set[str] = set()
    # the block's tensors as the header lists them: a zero bias the model lacks is checked as load_model checks it
    for name in [n for n in source.header if n.startswith(prefix)]:
        copy_dense_tensor(model, targets, name, source.get(name, torch.float32), torch.float32,
                          source.checkpoint_dir, filled)
    check_all_filled(targets, filled, source.checkpoint_dir)
    return block


def _release_block(model: CausalLM, index: int) -> None:
    """Put block `index` back on the meta device: its fp32 and quantized tensors are freed."""
    with torch.device("meta"):
        model.model.layers[index] = DECODER_LAYERS[model.config.family](model.config, index)
    gc.collect()


def _non_block_tensors(model: CausalLM, name: str, module: torch.nn.Module, source: SourceTensors,
                       dtype: torch.dtype, dense_linears: list[str]) -> list[StreamedTensor]:
    """A module outside the blocks (embedding, final norm, LM head): its tensors as checkpoint_tensors writes
    them from an fp32-loaded model (the source tensor in fp32, then `dtype`), read when written."""

    def entry(tensor_name: str, shape: tuple[int, ...]) -> StreamedTensor:
        # fp32 first, then `dtype`: what an fp32-loaded model writes (the same rounding when the dtypes differ)
        return StreamedTensor(tensor_name, dtype, shape, lambda: (
            t.to(dtype) for t in source.row_chunks(tensor_name, torch.float32)))

    if not isinstance(module, Linear):
        return [entry(f"{name}.{p}", tuple(param.shape)) for p, param in module.named_parameters(recurse=False)]
    out = []
    parent = name.rpartition(".")[0]
    tied = model.config.tie_word_embeddings and module is model.lm_head
    for shard in module.shards:
        shard_name = f"{parent}.{shard.name}" if parent else shard.name
        if module.bias is not None:
            out.append(entry(f"{shard_name}.bias", (shard.size,)))
        dense_linears.append(shard_name)
        if not tied:
            out.append(entry(f"{shard_name}.weight", (shard.size, module.in_features)))
    return out


class _ScratchReader:
    """Reads the scratch files block by block during assembly, one open at a time."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.index: int | None = None
        self.handle = None

    def get(self, index: int, name: str) -> torch.Tensor:
        if self.index != index:
            self.handle = safe_open(str(self.folder / f"block-{index:05d}.safetensors"), framework="pt")
            self.index = index
        return self.handle.get_tensor(name)


class StreamedBlocks:
    """The walk's BlockSource (calibration.BlockSource): loads block i from the source checkpoint, and once it is
    quantized writes its checkpoint tensors to a scratch file and frees it."""

    def __init__(self, model: CausalLM, source: SourceTensors, device: torch.device, scratch: Path,
                 scheme: QuantScheme | LayerSchemes, dtype: torch.dtype,
                 watch: Callable[[CausalLM, int], None] | None = None):
        self.model, self.source, self.device, self.scheme, self.dtype, self.watch = (
            model, source, device, scheme, dtype, watch)
        self.reader = _ScratchReader(scratch)
        self.entries: dict[int, list[StreamedTensor]] = {}
        self.dense_linears: list[str] = []
        self.targets: dict[str, list[str]] = {}  # a mix: scheme key -> projections, as save_quantized fills it
        self.quantized = 0

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `tokens` in the checkpoint's dtype, read a slice of the table at a time."""
        tokens = tokens.cpu()
        out = None
        start = 0
        for chunk in self.source.row_chunks("model.embed_tokens.weight"):
            if out is None:
                out = torch.empty(*tokens.shape, chunk.shape[1], dtype=chunk.dtype)
            hit = (tokens >= start) & (tokens < start + chunk.shape[0])
            out[hit] = chunk[tokens[hit] - start]
            start += chunk.shape[0]
        return out

    def load(self, index: int) -> torch.nn.Module:
        return _materialize_block(self.model, index, self.source, self.device)

    def done(self, index: int, block: torch.nn.Module) -> None:
        if self.watch:
            self.watch(self.model, index)
        self.quantized += sum(isinstance(m, QuantizedLinearMethod) for m in block.modules())
        tensors, dense = block_tensors(block, f"model.layers.{index}", self.scheme, self.dtype, self.targets)
        self.dense_linears += dense
        save_file(tensors, str(self.reader.folder / f"block-{index:05d}.safetensors"), metadata={"format": "pt"})
        reader = self.reader
        self.entries[index] = [StreamedTensor(n, t.dtype, tuple(t.shape), lambda i=index, n=n: reader.get(i, n))
                               for n, t in tensors.items()]
        del tensors, block
        _release_block(self.model, index)


def quantize_streamed(
    checkpoint: Path, config: ModelConfig, method: str, scheme: QuantScheme | LayerSchemes,
    calibration: CalibrationSet | None, options: MethodOptions, out: Path, *, dtype: torch.dtype | None = None,
    provenance: dict | None = None, device: torch.device | str = "cpu",
    on_block: Callable[[int], None] | None = None, watch: Callable[[CausalLM, int], None] | None = None,
) -> StreamedResult:
    """Quantize the checkpoint at `checkpoint` block by block and write it to `out` (see module docstring).

    `watch(model, i)` is called once block i is quantized and has produced the next inputs, while it is the one
    block in memory (tests inspect the model there). `provenance` gets "result" (the run) before it is written.
    """
    device = torch.device(device)
    model = meta_model(config)
    model.name = str(checkpoint)
    header = read_checkpoint_header(checkpoint)
    check_checkpoint_matches(model, header, checkpoint)  # every tensor present, every shape right, before any work
    dtype = checkpoint_dtype(config.raw, dtype)
    dense_bytes = 2 * sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    for kind, rot in model.rotary.items():  # RoPE tables are small: computed once, as load_model does
        rot.inv_freq = rope_inverse_frequencies(config.rope[kind], config.head_dim).to(device)
    source = SourceTensors(checkpoint, header)
    with atomic_directory(out, CHECKPOINT, "tokq quantize") as tmp:
        scratch = tmp / SCRATCH
        scratch.mkdir()
        blocks = StreamedBlocks(model, source, device, scratch, scheme, dtype, watch)
        run = pipeline.quantize_model(model, method, scheme, calibration, options, on_block, blocks=blocks)
        if not blocks.quantized:
            raise TokqError("the model has no quantized layers: the scheme leaves every Linear 16-bit")
        started_write = time.perf_counter()
        entries: list[StreamedTensor] = []
        head_dense: list[str] = []
        for name, mod in model.named_modules():
            match = BLOCK_NAME.fullmatch(name)
            if match:
                entries += blocks.entries[int(match.group(1))]
            elif not name.startswith("model.layers"):
                entries += _non_block_tensors(model, name, mod, source, dtype, head_dense)
        _write_assembled(entries, tmp)
        blocks.reader.handle = None
        shutil.rmtree(scratch)
        raw = copy.deepcopy(config.raw)
        # the in-memory order: the blocks' 16-bit Linears, then the LM head (set_quantization_config puts it first)
        set_quantization_config(raw, run.scheme, dtype, blocks.dense_linears + head_dense, blocks.targets, None)
        write_checkpoint_files(tmp, raw, run.scheme, checkpoint, {**(provenance or {}), "result": run.to_json()},
                               out)
    return StreamedResult(run, dense_bytes, time.perf_counter() - started_write)


def _write_assembled(entries: list[StreamedTensor], folder: Path) -> None:
    """model.safetensors (or shards + index), split as the in-memory writer splits them."""
    plan = shard_plan([(e.name, e.nbytes) for e in entries])
    names = shard_file_names(len(plan))
    by_name = {e.name: e for e in entries}
    for fname, shard in zip(names, plan, strict=True):
        write_streamed([by_name[n] for n in shard], folder / fname, {"format": "pt"})
    if len(plan) > 1:
        write_shard_index(folder, {n: f for f, shard in zip(names, plan, strict=True) for n in shard},
                          sum(e.nbytes for e in entries))
