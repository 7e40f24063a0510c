"""`tokq compare` when a side is a URL (`url=http://host:port[/v1][#model=NAME&tokenizer=DIR&topk=K]`, or a
tokq.toml url variant): the windows are cut with the local side's tokenizer (or the one `#tokenizer=DIR` names
when both sides are URLs), then evalsuite.remote_compare scores and compares (KL as a rigorous lower bound and a
point estimate, evalsuite.topk_bounds)."""

from __future__ import annotations

from pathlib import Path

from tokq.errors import ConfigError


def run_remote_settings(a: str, b: str, data: Path | None, s, runtime, limits, console, resolve_variant) -> dict:
    """What run_compare_settings does for a compare with at least one URL side: the result dict
    (`resolve_variant`: api.compare's, passed in so the two modules do not import each other)."""
    from tokq.api.compare_windows import document_windows, engine_loader
    from tokq.dtypes import compute_dtype_name
    from tokq.engine.config import read_config
    from tokq.engine.kv_cache import parse_bytes
    from tokq.engine.tokenizer import load_tokenizer
    from tokq.evalsuite.compare import ScoringPlan, token_window_docs
    from tokq.evalsuite.remote_compare import Side, run_remote_compare
    from tokq.remote.endpoint_scoring import EndpointScorer, parse_side
    from tokq.remote.urls import redact

    if s.window < 1 or s.topk < 1:
        raise ConfigError("--window and --topk must be >= 1")
    if not 0 < s.timeout < float("inf"):
        raise ConfigError(f"--timeout {s.timeout}: must be a finite number of seconds > 0")
    specs = {"a": parse_side(a), "b": parse_side(b)}
    names = {"a": a, "b": b}
    local = {key: resolve_variant(names[key]) for key, spec in specs.items() if spec is None}
    if local:
        checkpoint = next(iter(local.values()))
        tokenizer = load_tokenizer(checkpoint)
        config = read_config(checkpoint)
        window = min(s.window, config.max_position_embeddings)
        topk = min(s.topk, config.vocab_size)
    else:
        given = next((spec.tokenizer for spec in specs.values() if spec.tokenizer), None)
        if given is None:
            raise ConfigError("both sides are URLs: name the served models' tokenizer, e.g. "
                              "url=http://host:8000/v1#tokenizer=/path/to/model (a checkpoint folder)")
        tokenizer = load_tokenizer(Path(given).expanduser())
        window, topk = s.window, s.topk
    data, docs, windows, _ = document_windows(data, tokenizer, window, s, limits)
    compute = compute_dtype_name(s.dtype, runtime.device)
    budget = parse_bytes(s.kv_memory) if s.kv_memory else None

    def side(key: str) -> Side:
        spec = specs[key]
        if spec is not None:
            # the side's name goes into every report: never with the URL's user:password
            return Side(redact(names[key]), endpoint=EndpointScorer(spec, tokenizer, s.max_concurrency,
                                                                    timeout_s=s.timeout))
        checkpoint = local[key]
        kv = (s.b_kv_dtype or s.kv_dtype) if key == "b" else s.kv_dtype

        load = engine_loader(checkpoint, load_tokenizer(checkpoint), dtype=compute, device=runtime.device,
                             max_model_len=window, kv_memory=budget, kv_dtype=kv, window=window)
        return Side(names[key], load=load, checkpoint=checkpoint)

    plan = ScoringPlan(window=window, stride=windows.stride, max_tokens=s.max_tokens, topk=topk, full_kl_rows=0,
                       decode_windows=0, probes=False, resamples=s.resamples, seed=s.seed, use_cache=False,
                       dtype=compute, kv_dtype=s.kv_dtype, kv_memory=budget, thresholds=s.thresholds or {},
                       threshold_on=s.threshold_on)
    console.print(f"{len(windows.windows)} windows; a URL side: no decode path, probes or baseline cache; the KL is "
                  "a lower bound (and an estimate)", highlight=False)
    result = run_remote_compare(side("a"), side("b"), windows, token_window_docs(windows), plan)
    result["data"] = {"path": str(data), "documents": len(docs.documents), "skipped": len(docs.skipped)}
    result["runtime"] = runtime.to_json()
    result["kv_dtype"] = {"a": s.kv_dtype, "b": s.b_kv_dtype or s.kv_dtype}
    return result
