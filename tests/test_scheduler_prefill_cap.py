"""The prefill cap of mixed steps (EngineConfig.max_prefill_tokens_with_decode) on a tiny random llama (fp32):
while a sequence decodes, a step carries at most the cap in prompt tokens; with nothing decoding it keeps the
whole budget; greedy outputs are identical with and without the cap (and equal the reference forward); a long
prompt arriving among steady decodes still advances every step and finishes; static batching is unchanged.
Also: the workload bench's warm-up fits a context as small as prompt + output length."""

from __future__ import annotations

import pytest
import torch

from tests.test_models_vs_hf import BASE, make_hf_checkpoint
from tokq.engine.checkpoint import load_model
from tokq.engine.llm_engine import EngineConfig, EngineError, LLMEngine
from tokq.engine.sampling import SamplingParams
from tokq.engine.workload import Workload, bench_model

VOCAB = BASE["vocab_size"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf_checkpoint("llama", path)
    return load_model(path)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def engine_of(model, **kwargs) -> LLMEngine:
    config = dict(max_model_len=160, max_num_seqs=8, max_num_batched_tokens=64, block_size=4) | kwargs
    return LLMEngine(model, EngineConfig(**config))


def pieces(engine: LLMEngine) -> dict[int, int]:
    """The last step's tokens per sequence id."""
    step = engine.last_scheduled
    return {seq.seq_id: n for seq, n in zip(step.seqs, step.num_tokens, strict=True)}


def staggered_run(engine: LLMEngine) -> tuple[dict[int, list[int]], list[dict[int, int]], dict[int, int]]:
    """Two short requests decode while long prompts arrive one step apart; returns every request's output,
    every step's pieces, and each request's index in arrival order -> id."""
    ids = {0: engine.add_request(prompt(5, 0), greedy(40)), 1: engine.add_request(prompt(3, 1), greedy(40))}
    arrivals = {3: (2, prompt(100, 2), 6), 4: (3, prompt(70, 3), 6), 6: (4, prompt(9, 4), 6)}
    outputs: dict[int, list[int]] = {}
    steps = []
    step = 0
    while engine.has_unfinished() or any(s > step for s in arrivals):
        if step in arrivals:
            index, tokens, n = arrivals[step]
            ids[index] = engine.add_request(tokens, greedy(n))
        for out in engine.step():
            outputs.setdefault(out.seq_id, []).extend(out.new_token_ids)
        steps.append(pieces(engine))
        step += 1
    return outputs, steps, ids


def test_mixed_steps_respect_the_cap_and_outputs_are_unchanged(model):
    capped, steps, ids = staggered_run(engine_of(model, max_prefill_tokens_with_decode=8))
    uncapped, steps_uncapped, _ = staggered_run(engine_of(model, max_prefill_tokens_with_decode=None))
    decoders = {ids[0], ids[1]}
    mixed = [s for s in steps if any(s.get(d) == 1 for d in decoders)]
    prefill_per_mixed_step = [sum(n for i, n in s.items() if i not in decoders and n > 1) for s in mixed]
    assert max(prefill_per_mixed_step) == 8  # the cap is reached and never passed
    # without the cap, the 100-token prompt rides along with the decodes in one big chunk
    assert max(sum(n for i, n in s.items() if i not in decoders) for s in steps_uncapped) > 8
    assert capped == uncapped
    for index, tokens, n in [(0, prompt(5, 0), 40), (2, prompt(100, 2), 6), (4, prompt(9, 4), 6)]:
        ref = list(tokens)
        for _ in range(n):
            ref.append(int(model.logits(torch.tensor([ref]))[0, -1].argmax()))
        assert capped[ids[index]] == ref[len(tokens):]


def test_full_budget_when_nothing_decodes(model):
    engine = engine_of(model, max_prefill_tokens_with_decode=8)
    engine.add_request(prompt(40, 5), greedy(2))
    engine.add_request(prompt(40, 6), greedy(2))
    engine.step()
    assert engine.last_scheduled.total_tokens == 64  # the whole budget: no sequence was decoding


def test_a_long_prompt_among_steady_decodes_advances_every_step_and_finishes(model):
    engine = engine_of(model, max_prefill_tokens_with_decode=3, max_num_seqs=6, max_model_len=200)
    decoders = [engine.add_request(prompt(2, 10 + i), greedy(120)) for i in range(4)]
    engine.step()  # their prompts
    engine.step()  # now they decode
    long_id = engine.add_request(prompt(150, 20), greedy(2))
    later = []  # short requests keep arriving behind it
    done: set[int] = set()
    long_pieces = []
    for step in range(80):
        if step % 5 == 0:
            later.append(engine.add_request(prompt(4, 30 + step), greedy(3)))
        done |= {o.seq_id for o in engine.step() if o.finished}
        if long_id in done:
            break
        long_pieces.append(pieces(engine).get(long_id, 0))
    assert long_id in done
    assert set(decoders).isdisjoint(done)  # it finished while the decodes were still running
    assert min(long_pieces) >= 1 and max(long_pieces) <= 3  # the oldest prompt gets the cap every step


def test_static_batching_ignores_the_cap(model):
    runs = []
    for cap in (4, None):
        engine = engine_of(model, static=True, max_num_seqs=2, max_prefill_tokens_with_decode=cap)
        engine.add_request(prompt(3, 40), greedy(10))
        engine.add_request(prompt(100, 41), greedy(3))
        steps = []
        while engine.has_unfinished():
            engine.step()
            steps.append(sorted(pieces(engine).values()))
        runs.append(steps)
    assert runs[0] == runs[1]
    assert max(max(s) for s in runs[0]) > 4


def test_a_cap_below_one_is_refused(model):
    with pytest.raises(EngineError, match="max_prefill_tokens_with_decode"):
        engine_of(model, max_prefill_tokens_with_decode=0)


def test_bench_warm_up_fits_a_context_of_prompt_plus_output(model):
    # `tokq bench --prompt-len 12 --gen-len 3` used to fail: the warm-up asked 16 + 4 tokens of a 15-token context
    workload = Workload(prompt_len=12, gen_len=3, num_requests=2)
    rows = bench_model("tiny", model, workload, ["continuous", "static"], {}, 10.0,
                       workload.prompts(VOCAB))
    assert [r["metrics"]["output_tokens"] for r in rows] == [6, 6]
