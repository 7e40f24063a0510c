"""`tokq serve MODEL`: an OpenAI-compatible server (vLLM's API) for one model on tokq's engine.

The work is `tokq.serve` (launch.load_engine, app.build_app, launch.run_server); this module parses the options.
"""

from __future__ import annotations

import logging

import typer

log = logging.getLogger("tokq.serve")


def serve_cmd(
    model: str = typer.Argument(..., help="Checkpoint directory, zoo name or tokq.toml variant."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8000, "--port", help="Port to listen on."),
    served_model_name: str = typer.Option(None, "--served-model-name",
                                          help="The model name clients send (default: MODEL as given)."),
    max_num_seqs: int = typer.Option(16, "--max-num-seqs", help="Requests the engine runs at once (its batch)."),
    max_queue: int = typer.Option(None, "--max-queue", help="Requests held (running + waiting) before new ones get "
                                                            "503 + Retry-After (default: 4 x --max-num-seqs)."),
    max_logprobs: int = typer.Option(20, "--max-logprobs", help="Most logprobs / top_logprobs / prompt_logprobs a "
                                                               "request may ask for (more: 400)."),
    max_model_len: int = typer.Option(None, "--max-model-len", help="Context length (default: the model's)."),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens", help="Token budget of one step."),
    kv_memory: str = typer.Option(None, "--kv-memory", help="KV cache budget, e.g. 2GiB (default: 80% of the "
                                                            "device's free memory, capped at what --max-num-seqs "
                                                            "full-length requests need)."),
    dtype: str = typer.Option("auto", "--dtype", help="Compute dtype: auto (bf16 on CPU, fp16 on CUDA), fp32, bf16, fp16."),
    kv_dtype: str = typer.Option("auto", "--kv-cache-dtype", "--kv-dtype",
                                 help="KV cache dtype: auto (the compute dtype), fp16, bf16, fp32, fp8."),
    chat_template: str = typer.Option(None, "--chat-template",
                                      help="A chat template replacing the tokenizer's: a Jinja file, or the "
                                           "template itself (as vLLM's --chat-template)."),
    threads: int = typer.Option(None, "--threads", help="CPU threads for torch (default: torch's choice)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda[:N]."),
    seed: int = typer.Option(0, "--seed", help="Seed of the global RNG (requests without a seed)."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn's log level: debug, info, warning, error."),
    api_key: str = typer.Option(None, "--api-key", envvar="TOKQ_API_KEY",
                                help="Key every /v1 request must send as `Authorization: Bearer <key>` "
                                     "(default: $TOKQ_API_KEY; none: open to anyone who can reach the port)."),
    max_body_mb: float = typer.Option(8.0, "--max-body-mb", help="Largest request body accepted (MiB); larger: 413."),
    trust_request_chat_template: bool = typer.Option(
        False, "--trust-request-chat-template",
        help="Let requests bring their own chat template (a program the server runs; off by default)."),
) -> None:
    """Serve MODEL over HTTP with the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, /health,
    /metrics) until SIGINT / SIGTERM (graceful: requests in flight finish first)."""
    from tokq.errors import ConfigError
    from tokq.runtime import setup_runtime
    from tokq.serve.app import build_app
    from tokq.serve.launch import load_engine, run_server

    for name, value in (("--max-queue", max_queue), ("--max-num-seqs", max_num_seqs), ("--port", port)):
        if value is not None and value < (0 if name == "--port" else 1):
            raise ConfigError(f"{name} {value}: must be >= {0 if name == '--port' else 1}")
    if max_logprobs < 0:
        raise ConfigError(f"--max-logprobs {max_logprobs}: must be >= 0")
    if not max_body_mb > 0:
        raise ConfigError(f"--max-body-mb {max_body_mb}: must be > 0")
    if api_key is not None and not api_key.strip():
        raise ConfigError("--api-key is empty: give a key, or leave the option out to serve without one")
    template = None
    if chat_template is not None:  # refused before minutes of loading, not after
        from tokq.serve.chat import read_chat_template

        template = read_chat_template(chat_template)
    setup_runtime(threads, device, seed)
    loaded = load_engine(model, dtype=dtype, device=device, kv_memory=kv_memory,
                         kv_dtype=None if kv_dtype == "auto" else kv_dtype, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)
    if template is not None:
        loaded.tokenizer.chat_template = template
    app = build_app(loaded.engine, loaded.tokenizer, served_model_name or model, max_logprobs=max_logprobs,
                    max_queue=max_queue, root=loaded.checkpoint, api_key=api_key,
                    max_body_bytes=int(max_body_mb * 2**20), trust_request_chat_template=trust_request_chat_template)
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without --api-key: anyone who can reach the port can use the model", host)
    run_server(app, host, port, log_level)
