"""`tokq.LLM`: load a model once, then generate or score in one call (shaped like vLLM's and nano-vllm's `LLM`).

    from tokq import LLM, SamplingParams

    llm = LLM("smollm2-135m", dtype="fp32", max_model_len=1024, kv_memory="256MiB")
    outputs = llm.generate(["The capital of France is", "Once upon a time"],
                           SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=0))
    for out in outputs:
        print(repr(out.prompt), "->", repr(out.text), out.token_ids, out.finish_reason)

    llm.generate("The capital of France is", SamplingParams(max_tokens=16, stop=["."]))  # one prompt, a stop
    llm.generate([[1, 4093, 314]], SamplingParams(max_tokens=8))                     # token ids as the prompt

    scores = llm.score(["The quick brown fox jumps over the lazy dog."])
    scores[0].logprobs            # log P(token p + 1 | tokens 0..p), fp32 [L - 1]
    scores[0].nll.mean().exp()    # the text's perplexity

`model`: what the CLI takes, a zoo name (pulled on first use), a checkpoint directory (16-bit or quantized)
or a tokq.toml variant (`tokq.zoo.resolve_model`). Options: `dtype` (auto = bf16 on CPU, fp16 on CUDA, as
in the CLI; fp32, bf16, fp16), `device` (auto, cpu, cuda[:N]), `skip_tokenizer_init` (token-id prompts
only: no tokenizer files needed), and every `EngineConfig` field: kv_memory (bytes, or a size such as
"2GiB"), kv_dtype, max_model_len, max_num_seqs, max_num_batched_tokens, block_size,
enable_prefix_caching, chunked_prefill, static, memory_fraction, attention_kernels.

This is wiring only. `generate` is `LLMEngine.generate` (continuous batching over the paged KV cache;
`SamplingParams` is `tokq.engine.sampling.SamplingParams`), with every request checked before any runs;
each output is the engine's `RequestOutput` (`token_ids`, `text`, `prompt_token_ids`, `finish_reason`,
`metrics`, and `logprobs` / `prompt_logprobs` (lists of `TokenLogprob`) when SamplingParams asked for them)
with `prompt` set to the prompt's text (None for token ids). `score` is `LLMEngine.score`: each
text or token list runs as one prompt through chunked prefill, keeping the log-probability of every
actual next token (`WindowScores`: `token_ids`, `logprobs`, `nll`, the top-k with `topk=`). Text is
tokenized with the model's special tokens (BOS where it uses one). `llm.engine` is the engine itself
(streaming with `stream` / `add_request` + `step`, `metrics()`), `llm.model` and `llm.tokenizer` its
parts. Every refusal is a `tokq.errors.TokqError` (EngineError, SamplingError, ModelError, ConfigError)
whose message names the problem and the fix.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import fields, replace
from numbers import Integral
from pathlib import Path

import torch

from tokq.dtypes import compute_dtype_name
from tokq.engine.llm_engine import EngineConfig, LLMEngine, WindowScores
from tokq.engine.requests import EngineError, RequestOutput, pair_params
from tokq.engine.sampling import SamplingParams
from tokq.errors import ConfigError

__all__ = ["LLM", "SamplingParams"]

ENGINE_OPTIONS = tuple(f.name for f in fields(EngineConfig))


class LLM:
    """A model on tokq's engine: `generate` texts and `score` them (module docstring)."""

    def __init__(self, model: str | os.PathLike, *, dtype: str | torch.dtype = "auto", device: str = "auto",
                 skip_tokenizer_init: bool = False, **engine_options):
        from tokq.engine.checkpoint import load_model
        from tokq.engine.config import read_config
        from tokq.engine.kv_cache import parse_bytes
        from tokq.engine.tokenizer import load_tokenizer
        from tokq.runtime import resolve_device
        from tokq.zoo import resolve_model

        # The cheap checks first: options, device, the model's name, before any weights are read.
        unknown = sorted(set(engine_options) - set(ENGINE_OPTIONS))
        if unknown:
            raise ConfigError(f"LLM: unknown option {', '.join(unknown)} (known: dtype, device, skip_tokenizer_init, "
                              f"{', '.join(ENGINE_OPTIONS)})")
        if isinstance(engine_options.get("kv_memory"), str):
            engine_options["kv_memory"] = parse_bytes(engine_options["kv_memory"])
        config = EngineConfig(**engine_options)
        dev = resolve_device(device)
        compute = compute_dtype_name(dtype, dev.type)
        self.checkpoint: Path = resolve_model(os.fspath(model))
        read_config(self.checkpoint)  # a folder that is no checkpoint is named as such, before its tokenizer
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(self.checkpoint)
        self.model = load_model(self.checkpoint, dtype=compute, device=dev)
        self.engine = LLMEngine(self.model, config, self.tokenizer)

    def generate(self, prompts: str | Seq[int] | Seq[str | Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for each prompt (text, or a list of token ids; a single one may be given bare) with one
        SamplingParams for all or one per prompt (None: SamplingParams()); outputs in the prompts' order.

        Every request is checked before any runs: a refused one raises and nothing is generated."""
        batch = _batch(prompts, "generate")
        batch, plist = pair_params(batch, sampling_params)
        checked = [self.engine.check_request(p, sp) for p, sp in zip(batch, plist, strict=True)]
        with _progress(use_tqdm, "generate", len(batch)) as advance:
            outputs = self.engine.generate([tokens for _, tokens in checked], [sp for sp, _ in checked],
                                           progress=advance)
        self.engine.forget(out.seq_id for out in outputs)  # the outputs hold everything: the engine keeps nothing
        return [replace(out, prompt=p if isinstance(p, str) else None) for p, out in zip(batch, outputs, strict=True)]

    def score(self, texts_or_token_lists: str | Seq[int] | Seq[str | Seq[int]], *, topk: int = 0,
              use_tqdm: bool = False) -> list[WindowScores]:
        """Per text (or token list; a single one may be given bare) the log-probability of every token after
        the first given the ones before it (`.logprobs`, `.nll`: fp32 [L - 1]), with the top-k
        log-probabilities at each position when topk > 0; in the inputs' order. Each needs >= 2 tokens."""
        batch = _batch(texts_or_token_lists, "score")
        windows = [self.engine.check_window(w) for w in batch]  # every one checked before any runs
        with _progress(use_tqdm, "score", len(windows)) as advance:
            return self.engine.score(windows, topk=topk, progress=advance)

    def __repr__(self) -> str:
        return f"LLM({str(self.checkpoint)!r}, dtype={self.model.dtype}, device={self.model.device})"


def _batch(prompts, what: str) -> list:
    """The prompts as a list: a bare text or token-id list (or 1-D tensor) is one prompt, a 2-D tensor one
    prompt per row."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, torch.Tensor):
        return [prompts] if prompts.dim() <= 1 else list(prompts)
    if not isinstance(prompts, (list, tuple)):
        prompts = list(prompts)
    if prompts and isinstance(prompts[0], Integral):
        return [prompts]
    if not prompts:
        raise EngineError(f"{what}: no prompts given: pass a text, a list of token ids, or a list of either")
    return list(prompts)


@contextlib.contextmanager
def _progress(enabled: bool, what: str, total: int) -> Iterator[Callable[[int], None] | None]:
    """A progress bar of finished requests on stderr (None when disabled)."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from tokq.progress import progress_display

    columns = (TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with progress_display(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(what, total=total)
        yield lambda n: progress.advance(task, n)
