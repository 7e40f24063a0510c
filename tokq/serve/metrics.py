"""/metrics: Prometheus series of the server, in the app's own CollectorRegistry (two apps in one process,
as in tests, do not collide in the global registry).

The names follow vLLM's with the `tokq:` prefix (vLLM: `vllm:`), so vLLM dashboards need only the prefix
changed: time to first token, time per output token, inter-token latency (histograms, seconds), running
and waiting requests and the KV cache usage (gauges, updated by the engine thread after every step), and
counters of preemptions, prompt and generated tokens, and finished requests by finish reason.
"""

from __future__ import annotations

import itertools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        self.ttft = hist("tokq:time_to_first_token_seconds", "Time from arrival to the first generated token.")
        self.tpot = hist("tokq:time_per_output_token_seconds",
                         "Per request: (finish - first token) / (generated tokens - 1).")
        self.itl = hist("tokq:inter_token_latency_seconds", "Time between consecutive generated tokens.")
        self.e2e = hist("tokq:e2e_request_latency_seconds", "Time from arrival to finish.")
        self.running = gauge("tokq:num_requests_running", "Requests in the engine's running batch.")
        self.waiting = gauge("tokq:num_requests_waiting", "Requests queued in the engine, waiting for a seat.")
        self.kv_usage = gauge("tokq:kv_cache_usage_perc", "Fraction of the KV cache blocks in use (0 to 1).")
        self.preemptions = counter("tokq:num_preemptions", "Requests preempted (recomputed) for lack of KV blocks.")
        self.prompt_tokens = counter("tokq:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("tokq:generation_tokens", "Generated tokens of finished requests.")
        self._success = Counter("tokq:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name
        for reason in ("stop", "length", "abort"):  # present at 0 before the first request
            self._success.labels(model_name, reason)

    def engine_state(self, running: int, waiting: int, kv_usage: float, new_preemptions: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        if new_preemptions > 0:
            self.preemptions.inc(new_preemptions)

    def request_finished(self, reason: str, arrival: float, token_times: list[float], num_prompt: int) -> None:
        self._success.labels(self._model_name, reason).inc()
        self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(len(token_times))
        if not token_times:
            return
        self.ttft.observe(token_times[0] - arrival)
        self.e2e.observe(token_times[-1] - arrival)
        gaps = [b - a for a, b in itertools.pairwise(token_times)]
        for gap in gaps:
            self.itl.observe(gap)
        if gaps:
            self.tpot.observe((token_times[-1] - token_times[0]) / len(gaps))

    def render(self) -> bytes:
        return generate_latest(self.registry)
