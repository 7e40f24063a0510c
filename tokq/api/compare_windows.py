"""What both compare paths (two local models: api.compare; a URL side: api.remote_compare) share: the scored
windows cut from the documents, and how a local side's engine is loaded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tokq.errors import ConfigError, DataError


def document_windows(data: Path | None, tokenizer, window: int, s, limits):
    """(data folder, loaded documents, WindowSet, add_bos) for the settings `s` (a CompareSettings): the default
    set when `data` is None, windows of `window` tokens, `s.sample_windows` of them when set."""
    from tokq.engine.tokenizer import model_adds_bos
    from tokq.longctx.documents import load_documents
    from tokq.longctx.text_encoding import as_text_encoder
    from tokq.longctx.windows import build_windows
    from tokq.paths import data_dir

    if data is None:
        data = data_dir() / "default"
        if not data.is_dir():
            raise DataError(f"the default document set {data} is not built yet: run `tokq data build-default` or "
                            "pass --data DIR")
    docs = load_documents(data, strict=s.strict, limits=limits)
    add_bos = model_adds_bos(tokenizer)
    # not every document encoded up front: with max_tokens, only as much as the windows can reach
    windows = build_windows(docs.documents, as_text_encoder(tokenizer, add_bos), window, s.stride, add_bos,
                            s.max_tokens)
    if s.sample_windows is not None:
        if s.sample_windows < 1:
            raise ConfigError(f"--sample-windows {s.sample_windows}: must be >= 1")
        windows = windows.sample(s.sample_windows)
    if not windows.windows:
        raise DataError(f"{data}: no document yields a window of at least 16 tokens; add longer documents")
    return data, docs, windows, add_bos


# A window up to this long is prefilled in one step; a longer one in steps of this many tokens. One step per window
# is not faster on a CPU, and its activations and attention scratch grow with the step: `tokq compare --window 32768`
# on Gemma-3-270M (one document, 2 threads) peaked at 15.5 GB RSS in 15:24 with one 32K-token step, 3.9 GB in
# 9:05 with 4096-token steps, and the KL moved 0.14% (0.010705 -> 0.010720). Chunk boundaries alone move the
# base's own KL by 7e-8 (benchmarks/results/long-context-gemma3-270m.json, noise floor).
MAX_PREFILL_STEP = 4096


def prefill_step(window: int) -> int:
    """Tokens per prefill step when scoring windows of `window` tokens: the whole window up to MAX_PREFILL_STEP."""
    return min(max(2048, window), MAX_PREFILL_STEP)


def engine_loader(checkpoint: Path, tokenizer, *, dtype: str, device, max_model_len: int, kv_memory: int | None,
                  kv_dtype: str, window: int, kv_scales: str = "auto", described: dict | None = None) -> Callable:
    """A function that loads the checkpoint into an engine sized for scoring windows (called when its turn
    comes, so the two models of a compare are never loaded at once). `described`, when given, is filled with
    the cache the engine chose: its dtype and where an int8/fp8 cache's scales came from."""

    def load():
        from tokq.dtypes import dtype_name
        from tokq.engine.checkpoint import load_model
        from tokq.engine.llm_engine import EngineConfig, LLMEngine

        model = load_model(checkpoint, dtype=dtype, device=device)
        engine = LLMEngine(model, EngineConfig(max_model_len=max_model_len, kv_memory=kv_memory, kv_dtype=kv_dtype,
                                               max_num_seqs=4, max_num_batched_tokens=prefill_step(window),
                                               kv_scales=kv_scales), tokenizer)
        if described is not None:
            described.update({"dtype": dtype_name(engine.kv_plan.dtype), "scales": engine.kv_plan.scales_note})
        return engine
    return load
