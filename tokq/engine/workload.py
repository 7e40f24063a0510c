"""A serving workload and the loop that plays it against an engine, as the common serving benchmark does.

`Workload`: N requests of `prompt_len` tokens each (random token ids from a seeded generator, or
token windows of real documents) with output lengths of `gen_len` tokens, or, with `gen_len_range`
r > 0, drawn uniformly from [gen_len (1 - r), gen_len (1 + r)] (mixed lengths: what makes static
batching wait for its longest member). Arrivals are all at once, or a Poisson process of
`arrival_rate` requests per second (seeded exponential gaps; with `burstiness` b != 1, gamma gaps of shape b and
the same mean, as vLLM's --burstiness). Outputs are forced to their length
(ignore_eos), so every variant produces the same number of tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from tokq.engine.llm_engine import EngineConfig, LLMEngine
from tokq.engine.metrics import RunMetrics
from tokq.engine.models import CausalLM
from tokq.engine.roofline import decode_roofline
from tokq.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Workload:
    prompt_len: int = 512
    gen_len: int = 256
    num_requests: int = 16
    gen_len_range: float = 0.0
    arrival_rate: float = math.inf  # requests per second; inf = all at once
    seed: int = 0
    burstiness: float = 1.0  # gamma shape of the gaps between arrivals (vLLM's): 1 Poisson, < 1 burstier

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(self).items()}

    def prompts(self, vocab_size: int, documents: list[list[int]] | None = None) -> list[list[int]]:
        """Prompts of prompt_len tokens: slices of the documents' tokens when given, else random ids."""
        g = torch.Generator().manual_seed(self.seed)
        if documents:
            stream = [t for doc in documents for t in doc]
            if len(stream) >= self.prompt_len:
                starts = torch.randint(0, len(stream) - self.prompt_len + 1, (self.num_requests,), generator=g)
                return [stream[s: s + self.prompt_len] for s in starts.tolist()]
        # Avoid the first ids (special tokens in most vocabularies).
        low = min(1000, vocab_size // 2)
        return torch.randint(low, vocab_size, (self.num_requests, self.prompt_len), generator=g).tolist()

    def output_lengths(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + 1)
        if self.gen_len_range <= 0:
            return [self.gen_len] * self.num_requests
        lo = max(1, round(self.gen_len * (1 - self.gen_len_range)))
        hi = max(lo, round(self.gen_len * (1 + self.gen_len_range)))
        return torch.randint(lo, hi + 1, (self.num_requests,), generator=g).tolist()

    def arrival_offsets(self) -> list[float]:
        """Seconds after the start at which each request arrives."""
        if math.isinf(self.arrival_rate):
            return [0.0] * self.num_requests
        if self.burstiness != 1.0:  # gamma gaps with the same mean 1 / rate, as vLLM's --burstiness
            import random

            rng = random.Random(self.seed + 2)
            gaps = [0.0] + [rng.gammavariate(self.burstiness, 1.0 / (self.burstiness * self.arrival_rate))
                            for _ in range(self.num_requests - 1)]
            return [sum(gaps[: i + 1]) for i in range(len(gaps))]
        g = torch.Generator().manual_seed(self.seed + 2)
        gaps = torch.empty(self.num_requests).exponential_(self.arrival_rate, generator=g)
        gaps[0] = 0.0
        return gaps.cumsum(0).tolist()


def warm_up(engine: LLMEngine, prompt: list[int]) -> None:
    """One short request to pay first-call costs before timing: up to 16 prompt tokens and 4 new ones, cut
    to fit the engine's context (a workload's max_model_len can be as small as prompt + output length); and the
    engine's own warm-up (the compiled decode graphs)."""
    engine.warm_up()
    new = min(4, engine.max_model_len - 1)
    engine.generate([prompt[:min(16, engine.max_model_len - new)]], SamplingParams(max_tokens=new, ignore_eos=True))


def run_workload(engine: LLMEngine, workload: Workload, prompts: list[list[int]],
                 on_finish: Callable[[int], None] | None = None) -> RunMetrics:
    """Play the workload (arrivals on the wall clock) until every request finishes; the run's metrics."""
    lengths = workload.output_lengths()
    offsets = workload.arrival_offsets()
    engine.reset_metrics()
    start = time.perf_counter()
    pending = list(zip(offsets, prompts, lengths, strict=True))
    ids: list[int] = []
    unfinished: set[int] = set()
    while pending or unfinished:
        now = time.perf_counter()
        while pending and start + pending[0][0] <= now:
            offset, prompt, length = pending.pop(0)
            seq_id = engine.add_request(prompt, SamplingParams(max_tokens=length, ignore_eos=True),
                                        arrival_time=start + offset)
            ids.append(seq_id)
            unfinished.add(seq_id)
        if not engine.has_unfinished():
            if pending:  # idle until the next arrival
                time.sleep(max(0.0, start + pending[0][0] - time.perf_counter()))
            continue
        for out in engine.step():
            if out.finished and out.seq_id in unfinished:
                unfinished.discard(out.seq_id)
                if on_finish:
                    on_finish(1)
    metrics = engine.metrics(ids)
    engine.forget(ids)
    return metrics


def bench_model(name: str, model: CausalLM, workload: Workload, modes: list[str], engine_kwargs: dict,
                bandwidth_gbps: float, prompts: list[list[int]], progress=None) -> list[dict]:
    """Run the workload on one loaded model in each mode (continuous, static); one result row per mode.

    `progress`: a rich Progress to show requests finishing (optional)."""
    rows = []
    max_len = workload.prompt_len + max(workload.output_lengths())
    for mode in modes:
        engine = LLMEngine(model, EngineConfig(static=mode == "static", max_model_len=max_len, **engine_kwargs))
        warm_up(engine, prompts[0])
        task = progress.add_task(f"{name} {mode}", total=workload.num_requests) if progress else None
        start = time.perf_counter()
        metrics = run_workload(engine, workload, prompts,
                               on_finish=(lambda n, t=task: progress.advance(t, n)) if progress else None)
        wall = time.perf_counter() - start
        batch = min(workload.num_requests, engine.config.max_num_seqs)
        roof = decode_roofline(model, engine.kv_spec.bytes_per_token, batch,
                               workload.prompt_len + workload.gen_len / 2, bandwidth_gbps)
        weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        rows.append({
            "variant": name, "mode": mode, "metrics": metrics.to_json(), "wall_s": wall,
            "kernels": engine.kernel_names, "roofline": roof,
            "roofline_fraction": roof["roofline_step_s"] / metrics.tpot_mean_s if metrics.tpot_mean_s > 0 else None,
            "model_bytes": weights, "kv_cache_bytes": engine.kv_cache_bytes,
            "num_blocks": engine.num_blocks, "block_size": engine.kv_spec.block_size,
        })
        del engine
    return rows
