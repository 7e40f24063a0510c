"""`tokq bench --base-url`: a client-side load generator for any OpenAI-compatible server, as vLLM's `bench serve`.

The workload: `random` prompts (random token ids, decoded with the model's tokenizer and re-encoded until the
text is as many tokens as asked, so the server sees that many) or `docs` prompts (windows cut from the user's
documents, read by tokq.longctx's readers). Requests arrive as a Poisson process (`request_rate`, inf = all at
once), at most `max_concurrency` in flight, each asking for `output_len` tokens with ignore_eos. Each is streamed:
TTFT is the first chunk carrying choices, ITL the gaps between chunks, TPOT (latency - TTFT) / (output tokens - 1),
E2EL the whole request. Output tokens are the server's usage when it reports it, else counted with the tokenizer.
A failed request is counted and its error kept; the bench goes on. The result dict has vLLM's keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from tokq.errors import ConfigError
from tokq.remote.http import EndpointClient, EndpointError
from tokq.serving_metrics import serving_summary

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class ServeBenchSettings:
    """`tokq bench --base-url` options (vLLM's names)."""

    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None  # the served model's name; default: the first id of GET /v1/models
    tokenizer: str | None = None  # a checkpoint folder (or zoo name / variant) with the tokenizer
    dataset_name: str = "random"
    data: Path | None = None  # documents for dataset "docs"
    num_prompts: int = 100
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0  # gamma shape of the inter-arrival gaps; 1 = Poisson
    percentile_metrics: str = "ttft,tpot,itl"
    metric_percentiles: str = "99"
    ignore_eos: bool = True
    temperature: float = 0.0
    extra_body: dict = field(default_factory=dict)  # more request fields, e.g. a peer's own stop controls
    seed: int = 0
    timeout_s: float = 600.0  # per request, retries included
    retries: int = 8
    api_key: str | None = None


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    output_len: int


@dataclass
class RequestOutput:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int | None = None  # the server's usage.completion_tokens when it reported it
    server_prompt_tokens: int | None = None
    generated_text: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def parse_percentile_metrics(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METRICS]
    if bad or not names:
        raise ConfigError(f"--percentile-metrics {text!r}: use a comma-separated subset of {','.join(METRICS)}")
    return names


def parse_metric_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 < p <= 100 for p in values):
        raise ConfigError(f"--metric-percentiles {text!r}: use comma-separated percentiles in (0, 100], e.g. 50,90,99")
    return values


def _check(s: ServeBenchSettings) -> None:
    for flag, value in (("--num-prompts", s.num_prompts), ("--random-input-len", s.random_input_len),
                        ("--random-output-len", s.random_output_len)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
    if s.max_concurrency is not None and s.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency {s.max_concurrency}: must be >= 1")
    if not 0 <= s.random_range_ratio < 1:
        raise ConfigError(f"--random-range-ratio {s.random_range_ratio}: must be in [0, 1)")
    if not s.request_rate > 0:
        raise ConfigError(f"--request-rate {s.request_rate}: must be > 0 requests per second (inf: all at once)")
    if s.dataset_name not in ("random", "docs"):
        raise ConfigError(f"--dataset-name {s.dataset_name!r}: use random or docs")
    if s.dataset_name == "docs" and s.data is None:
        raise ConfigError("--dataset-name docs takes its prompts from --data FOLDER: name the documents")
    if s.endpoint not in ("/v1/completions", "/v1/chat/completions"):
        raise ConfigError(f"--endpoint {s.endpoint}: use /v1/completions or /v1/chat/completions")
    parse_percentile_metrics(s.percentile_metrics)
    parse_metric_percentiles(s.metric_percentiles)


def find_tokenizer(name: str | None, model: str | None):
    """The tokenizer to build prompts and count tokens with: `name` (--tokenizer), else `model` when it is a
    local checkpoint, a pulled zoo model or a tokq.toml variant. Returns (tokenizer, where it came from)."""
    from tokq.engine.tokenizer import load_tokenizer
    from tokq.errors import ModelError
    from tokq.zoo import resolve_model

    if name is not None:
        path = Path(name).expanduser()
        return load_tokenizer(path if path.is_dir() else resolve_model(name, pull=False)), name
    if model is not None:
        try:
            path = resolve_model(model, pull=False)
        except ModelError:
            path = None
        if path is not None and path.is_dir():
            return load_tokenizer(path), model
    raise ConfigError(f"no tokenizer for the served model {model!r}: pass --tokenizer PATH (a checkpoint folder "
                      "with tokenizer.json, a zoo name or a tokq.toml variant of the same model)")


def _lengths(n: int, mean: int, ratio: float, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _text_of_length(tokenizer, ids: list[int], length: int, filler, rounds: int = 10) -> tuple[str, int]:
    """Text that re-encodes to `length` tokens (or as close as `rounds` decode/encode passes get): decoding and
    re-encoding random ids merges or splits some of them, so trim or pad and try again."""
    text, count = "", 0
    for _ in range(rounds):
        text = tokenizer.decode(ids)
        again = tokenizer(text, add_special_tokens=False)["input_ids"]
        count = len(again)
        if count == length:
            break
        ids = again[:length] if count > length else again + [filler() for _ in range(length - count)]
    return text, count


def random_requests(tokenizer, s: ServeBenchSettings, rng: random.Random) -> list[SampleRequest]:
    special = set(tokenizer.all_special_ids)
    allowed = [i for i in range(len(tokenizer)) if i not in special]

    def pick() -> int:
        return allowed[rng.randrange(len(allowed))]

    out = []
    inputs = _lengths(s.num_prompts, s.random_input_len, s.random_range_ratio, rng)
    outputs = _lengths(s.num_prompts, s.random_output_len, s.random_range_ratio, rng)
    for n_in, n_out in zip(inputs, outputs, strict=True):
        text, count = _text_of_length(tokenizer, [pick() for _ in range(n_in)], n_in, pick)
        out.append(SampleRequest(text, count, n_out))
    return out


def document_requests(tokenizer, s: ServeBenchSettings, rng: random.Random) -> list[SampleRequest]:
    from tokq.longctx.documents import load_documents

    stream = [t for d in load_documents(s.data).documents
              for t in tokenizer(d.text, add_special_tokens=False)["input_ids"]]
    inputs = _lengths(s.num_prompts, s.random_input_len, s.random_range_ratio, rng)
    outputs = _lengths(s.num_prompts, s.random_output_len, s.random_range_ratio, rng)
    if len(stream) < max(inputs):
        raise ConfigError(f"--data {s.data}: the documents hold {len(stream)} tokens, fewer than the "
                          f"{max(inputs)} one prompt needs: add documents or lower --random-input-len")
    out = []
    for n_in, n_out in zip(inputs, outputs, strict=True):
        start = rng.randint(0, len(stream) - n_in)
        window = stream[start: start + n_in]
        text, count = _text_of_length(tokenizer, window, n_in, lambda w=window: w[rng.randrange(len(w))])
        out.append(SampleRequest(text, count, n_out))
    return out


def _body(s: ServeBenchSettings, model: str, req: SampleRequest) -> dict:
    body: dict = {"model": model, "max_tokens": req.output_len, "temperature": s.temperature,
                  "stream_options": {"include_usage": True}}
    if s.ignore_eos:
        body["ignore_eos"] = True
    if s.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return {**body, **s.extra_body}


def _chunk_text(choice: dict) -> str:
    if "delta" in choice:  # chat
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(client: EndpointClient, s: ServeBenchSettings, model: str,
                       req: SampleRequest) -> RequestOutput:
    """Stream one completion and time it as vLLM's bench does."""
    out = RequestOutput(prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    try:
        async for chunk in client.stream_completion(_body(s, model, req), s.endpoint):
            if chunk.data.get("choices"):
                if not out.ttft:
                    out.ttft = chunk.arrival_s - start
                else:
                    out.itl.append(chunk.arrival_s - last)
                last = chunk.arrival_s
                out.generated_text += _chunk_text(chunk.data["choices"][0])
            usage = chunk.data.get("usage")
            if usage:
                out.output_tokens = usage.get("completion_tokens")
                out.server_prompt_tokens = usage.get("prompt_tokens")
        out.latency = last - start
        out.success = bool(out.ttft)
        if not out.success:
            out.error = "the server streamed no completion chunk"
    except EndpointError as e:
        out.error = e.message
    return out


async def _arrivals(requests: list[SampleRequest], rate: float, burstiness: float, rng: random.Random):
    for i, req in enumerate(requests):
        yield req
        if math.isinf(rate) or i == len(requests) - 1:
            continue
        await asyncio.sleep(rng.gammavariate(burstiness, 1.0 / (rate * burstiness)))


async def run_requests(client: EndpointClient, s: ServeBenchSettings, model: str,
                       requests: list[SampleRequest],
                       on_done: Callable[[], None] | None = None) -> tuple[list[RequestOutput], float]:
    """Send every request (at request_rate per second, gamma gaps of shape burstiness: 1 is Poisson; at most
    max_concurrency in flight); (outputs, duration in s). `on_done` is called as each request ends (progress)."""
    limit = asyncio.Semaphore(s.max_concurrency) if s.max_concurrency else None

    async def one(req: SampleRequest) -> RequestOutput:
        async with limit if limit else contextlib.nullcontext():
            output = await send_request(client, s, model, req)
        if on_done is not None:
            on_done()
        return output

    start = time.perf_counter()
    tasks = [asyncio.create_task(one(req))
             async for req in _arrivals(requests, s.request_rate, s.burstiness, random.Random(s.seed + 1))]
    outputs = await asyncio.gather(*tasks)
    return list(outputs), time.perf_counter() - start


def calculate_metrics(requests: list[SampleRequest], outputs: list[RequestOutput], duration: float, tokenizer,
                      metrics: list[str], percentiles: list[float]) -> dict:
    """vLLM's calculate_metrics: totals, throughputs and per-metric mean/median/std/percentiles in ms."""
    input_lens, output_lens, ttfts, tpots, itls, e2els, errors = [], [], [], [], [], [], []
    completed = 0
    for req, out in zip(requests, outputs, strict=True):
        if not out.success:
            output_lens.append(0)
            input_lens.append(req.prompt_len)  # vLLM lists every request's prompt; the totals count completed ones
            ttfts.append(0.0)
            itls.append([])
            errors.append(out.error)
            continue
        n_out = out.output_tokens
        if n_out is None:
            n_out = len(tokenizer(out.generated_text, add_special_tokens=False)["input_ids"])
        n_in = out.server_prompt_tokens if out.server_prompt_tokens is not None else req.prompt_len
        input_lens.append(n_in)
        output_lens.append(n_out)
        if n_out > 1:
            tpots.append((out.latency - out.ttft) / (n_out - 1))
        ttfts.append(out.ttft)
        itls.append(out.itl)
        e2els.append(out.latency)
        errors.append("")
        completed += 1
    total_in = sum(n for n, o in zip(input_lens, outputs, strict=True) if o.success)
    done_ttfts = [t for t, o in zip(ttfts, outputs, strict=True) if o.success]
    series = {"ttft": done_ttfts, "tpot": tpots, "itl": [g for gaps in itls for g in gaps], "e2el": e2els}
    result = serving_summary(duration_s=duration, completed=completed, failed=len(outputs) - completed,
                             input_tokens=total_in, output_tokens=sum(output_lens), series_s=series,
                             percentiles=percentiles, metrics=metrics)
    return result | {"input_lens": input_lens, "output_lens": output_lens, "ttfts": ttfts, "itls": itls,
                     "errors": errors}


def run_serve_bench(s: ServeBenchSettings, on_request_done: Callable[[int], None] | None = None) -> dict:
    """Run the client bench against `s.base_url`; the vLLM-shaped result dict (plus the client's load).
    `on_request_done(total)` is called as each benchmarked request ends."""
    from tokq.machine_load import LoadMonitor

    _check(s)
    metrics, percentiles = parse_percentile_metrics(s.percentile_metrics), parse_metric_percentiles(s.metric_percentiles)
    with EndpointClient(s.base_url, api_key=s.api_key, timeout_s=s.timeout_s, retries=s.retries) as client:
        model = s.model or client.first_model_id()
        tokenizer, tokenizer_id = find_tokenizer(s.tokenizer, model)
        rng = random.Random(s.seed)
        requests = (random_requests if s.dataset_name == "random" else document_requests)(tokenizer, s, rng)

        async def go() -> tuple[list[RequestOutput], float, dict]:
            try:
                # vLLM's initial test run: one short request, so that a wrong URL or model fails at once, in one line
                test = await send_request(client, s, model, SampleRequest(requests[0].prompt, requests[0].prompt_len, 1))
                if not test.success:
                    raise EndpointError(f"the test request failed, nothing was benchmarked: {test.error}")
                monitor = LoadMonitor()
                done = (lambda: on_request_done(len(requests))) if on_request_done else None
                outputs, duration = await run_requests(client, s, model, requests, done)
                return outputs, duration, monitor.stop()
            finally:
                await client.aclose()

        outputs, duration, load = asyncio.run(go())
    result = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai", "base_url": s.base_url,
              "endpoint": s.endpoint, "model_id": model, "tokenizer_id": tokenizer_id,
              "dataset_name": s.dataset_name, "num_prompts": s.num_prompts,
              "request_rate": "inf" if math.isinf(s.request_rate) else s.request_rate,
              "burstiness": s.burstiness, "max_concurrency": s.max_concurrency,
              "random_input_len": s.random_input_len, "random_output_len": s.random_output_len,
              "random_range_ratio": s.random_range_ratio}
    result |= calculate_metrics(requests, outputs, duration, tokenizer, metrics, percentiles)
    result["client_load"] = load
    result["load_average"] = load.get("load_average_end")
    return result


def default_result_filename(result: dict) -> str:
    """vLLM's name: {backend}-{rate}qps-concurrency{c}-{model}-{date}.json."""
    concurrency = f"-concurrency{result['max_concurrency']}" if result.get("max_concurrency") is not None else ""
    model = str(result["model_id"]).rstrip("/").split("/")[-1]
    return f"{result['backend']}-{result['request_rate']}qps{concurrency}-{model}-{result['date']}.json"


def format_result(result: dict, metrics: list[str], percentiles: list[float]) -> str:
    """vLLM's printed summary."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(name: str, value) -> None:
        lines.append(f"{name:<40}{value:<10.2f}" if isinstance(value, float) else f"{name:<40}{value:<10}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    row("Maximum request concurrency:", result["max_concurrency"] if result["max_concurrency"] else "none")
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    for metric in metrics:
        lines.append("{s:{c}^50}".format(s=METRIC_TITLES[metric], c="-"))
        name = metric.upper()
        row(f"Mean {name} (ms):", result[f"mean_{metric}_ms"])
        row(f"Median {name} (ms):", result[f"median_{metric}_ms"])
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            row(f"P{word} {name} (ms):", result[f"p{word}_{metric}_ms"])
    load = result.get("load_average")
    if load:
        row("Client load average (1/5/15 min):", " ".join(f"{x:.2f}" for x in load))
    lines.append("=" * 50)
    first_error = next((e for e in result["errors"] if e), "")
    if first_error:
        lines.append(f"first error: {first_error}")
    return "\n".join(lines)
