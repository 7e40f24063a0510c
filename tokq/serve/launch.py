"""Load a model for serving and run the app under uvicorn (the work behind `tokq serve`).

SIGTERM is a graceful shutdown: uvicorn stops accepting connections, lets the requests in flight finish,
then the app's lifespan stops the engine thread and the process exits 0. (uvicorn re-raises the signal
it caught once it is done; a no-op SIGTERM handler installed here keeps that from killing the process
with status 143 after a clean drain.)
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

log = logging.getLogger("tokq.serve")


@dataclass
class Loaded:
    engine: object  # LLMEngine
    tokenizer: object
    checkpoint: str


def load_engine(model: str, *, dtype: str = "auto", device: str = "auto", **engine_options) -> Loaded:
    """The engine for a model name, zoo name, checkpoint directory or tokq.toml variant, with its tokenizer.
    `engine_options`: EngineConfig fields (kv_memory may be a size such as "2GiB")."""
    from tokq.api.compare import resolve_variant
    from tokq.dtypes import compute_dtype_name
    from tokq.engine.checkpoint import load_model
    from tokq.engine.config import read_config
    from tokq.engine.kv_cache import parse_bytes
    from tokq.engine.llm_engine import EngineConfig, LLMEngine
    from tokq.engine.tokenizer import load_tokenizer
    from tokq.runtime import resolve_device

    if isinstance(engine_options.get("kv_memory"), str):
        engine_options["kv_memory"] = parse_bytes(engine_options["kv_memory"])
    config = EngineConfig(**engine_options)
    dev = resolve_device(device)
    checkpoint = resolve_variant(os.fspath(model))
    read_config(checkpoint)  # a folder that is no checkpoint is named as such, before its tokenizer
    tokenizer = load_tokenizer(checkpoint)
    weights = load_model(checkpoint, dtype=compute_dtype_name(dtype, dev.type), device=dev)
    engine = LLMEngine(weights, config, tokenizer)
    if engine.runner.compile_decode:  # compile the decode graphs now, not inside the first clients' requests
        engine.warm_up()
    return Loaded(engine, tokenizer, str(checkpoint))


def run_server(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve `app` until SIGINT / SIGTERM (graceful: in-flight requests finish first)."""
    import uvicorn

    previous = signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: drained and stopped"))
    try:
        uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                      timeout_graceful_shutdown=None)).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
