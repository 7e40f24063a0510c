"""Logprobs, prompt logprobs and abort in the engine, on a tiny random llama (fp32, CPU).

prompt_logprobs equal `LLMEngine.score` at every position (chunked prefill, a prefix already in the prefix
cache, preemption mid-prefill); generated tokens' logprobs equal a dense forward's log_softmax of the raw
logits (not the temperature's); abort of a waiting, a prefilling and a decoding request frees its blocks
and leaves the others' greedy tokens exact; out-of-range k is refused."""

from __future__ import annotations

import pytest
import torch

from tests.test_engine import block_bytes, prompts, reference_greedy
from tests.test_models_vs_hf import BASE, make_hf_checkpoint
from tests.test_quantize_cli import save_word_tokenizer
from tokq.engine.checkpoint import load_model
from tokq.engine.llm_engine import EngineConfig, EngineError, LLMEngine
from tokq.engine.requests import TokenLogprob
from tokq.engine.sampling import SamplingError, SamplingParams
from tokq.engine.sequence import Status
from tokq.engine.speculative import SpeculativeDecoder

VOCAB = BASE["vocab_size"]
K = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("logprobs") / "tiny-llama"
    make_hf_checkpoint("llama", path)
    save_word_tokenizer(path)  # for tokq.LLM; the engines here take token ids
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint, dtype="fp32")


def engine_of(model, **config) -> LLMEngine:
    return LLMEngine(model, EngineConfig(**{"kv_memory": 1 << 20, "max_model_len": 128, **config}))


def dense_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the full-sequence forward's fp32 logits: row p is the distribution of token p + 1."""
    with torch.inference_mode():
        return torch.log_softmax(model.logits(torch.tensor([ids]))[0].float(), dim=-1)


def dense_rank_bounds(row: torch.Tensor, logprob: float, tol: float) -> tuple[int, int]:
    """The ranks `logprob` may have in `row` when both carry up to `tol` of rounding."""
    return int((row > logprob + tol).sum()) + 1, int((row > logprob - tol).sum()) + 1


def assert_prompt_logprobs_equal_score(entries, score, prompt: list[int], k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    assert all(isinstance(e, TokenLogprob) for e in entries[1:])
    assert [e.token_id for e in entries[1:]] == prompt[1:]
    got = torch.tensor([e.logprob for e in entries[1:]])
    assert (got - score.logprobs).abs().max().item() < 1e-5
    tops = torch.tensor([[lp for _, lp in e.top] for e in entries[1:]])
    assert [[t for t, _ in e.top] for e in entries[1:]] == score.topk_ids.tolist()
    assert tops.shape == (len(prompt) - 1, k) and (tops - score.topk_logprobs).abs().max().item() < 1e-5
    for e in entries[1:]:  # the rank agrees with the top-k it came with
        above = sum(lp > e.logprob for _, lp in e.top)
        assert e.rank == above + 1 or (above == k and e.rank > k), (e.rank, e.top, e.logprob)


# Prompt logprobs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [dict(), dict(max_num_batched_tokens=7, block_size=4)],
                         ids=["one-chunk", "chunked-7-tokens"])
def test_prompt_logprobs_equal_score(model, config):
    batch = prompts([40, 2, 17, 1], seed=21)
    engine = engine_of(model, **config)
    params = SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=K)
    outputs = engine.generate(batch, params)
    scores = engine.score(batch[:-1], topk=K)
    for out, score, prompt in zip(outputs[:-1], scores, batch[:-1], strict=True):
        assert_prompt_logprobs_equal_score(out.prompt_logprobs, score, prompt, K)
        assert out.logprobs is None  # not asked
    assert outputs[-1].prompt_logprobs == [None]  # a one-token prompt has nothing to score
    assert [o.token_ids for o in outputs] == [reference_greedy(model, p, 4) for p in batch]
    assert engine.blocks.num_used == 0


def test_prompt_logprobs_ranks_equal_dense(model):
    prompt = prompts([30], seed=22)[0]
    engine = engine_of(model, max_num_batched_tokens=8)
    out = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    dense = dense_logprobs(model, prompt)
    for p, entry in enumerate(out.prompt_logprobs[1:]):
        assert entry.top == []
        lo, hi = dense_rank_bounds(dense[p], entry.logprob, 1e-5)
        assert lo <= entry.rank <= hi, (p, entry.rank, lo, hi)


def test_prompt_logprobs_with_the_prefix_in_the_cache(model):
    """The same prompt twice: the second, with prompt_logprobs, must not take the cached blocks of its first
    positions (their logprobs would be missing) and must score them exactly; without prompt_logprobs it hits."""
    prompt = prompts([37], seed=23)[0]
    engine = engine_of(model, block_size=8)
    plain = SamplingParams(max_tokens=3, ignore_eos=True)
    first = engine.generate([prompt], plain)[0]
    second = engine.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=K))[0]
    third = engine.generate([prompt], plain)[0]
    assert third.metrics.cached_prompt_tokens == 32, "the cache was meant to hold the prompt's blocks"
    assert second.metrics.cached_prompt_tokens == 0
    assert_prompt_logprobs_equal_score(second.prompt_logprobs, engine.score([prompt], topk=K)[0], prompt, K)
    assert first.token_ids == second.token_ids == third.token_ids


def test_prompt_logprobs_survive_preemption_mid_prefill(model):
    """A pool so small that prompts are preempted while being read: positions kept before the preemption
    are not kept twice, and the rerun scores the rest."""
    batch = prompts([30, 22, 35, 9], seed=24)
    engine = LLMEngine(model, EngineConfig(kv_memory=16 * block_bytes(model, 4), max_model_len=64, block_size=4,
                                           max_num_batched_tokens=16))
    outputs = engine.generate(batch, SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=2))
    assert engine.metrics().preemptions > 0, "the pool was meant to force preemption"
    scores = engine_of(model).score(batch, topk=2)
    for out, score, prompt in zip(outputs, scores, batch, strict=True):
        assert_prompt_logprobs_equal_score(out.prompt_logprobs, score, prompt, 2)
    assert [o.token_ids for o in outputs] == [reference_greedy(model, p, 12) for p in batch]


def test_scoring_under_preemption_keeps_each_position_once(model):
    """The same bookkeeping serves score(): a preempted window rerun from its start is not scored twice
    (windows read one token per step from decode_from grow together past the 16-block pool)."""
    windows = prompts([30, 22, 35, 9], seed=31)
    engine = LLMEngine(model, EngineConfig(kv_memory=16 * block_bytes(model, 4), max_model_len=64, block_size=4,
                                           max_num_batched_tokens=16))
    scores = engine.score(windows, topk=2, decode_from=2)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    for window, score, ref in zip(windows, scores, engine_of(model).score(windows, topk=2), strict=True):
        assert score.logprobs.shape == (len(window) - 1,)
        assert (score.logprobs - ref.logprobs).abs().max().item() < 1e-5


def test_prompt_only_request_returns_its_prompt_logprobs(model):
    prompt = prompts([12], seed=25)[0]
    engine = engine_of(model)
    seq_id = engine.add_request(prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))
    steps = []
    while engine.has_unfinished():
        steps += engine.step()
    assert len(steps) == 1 and steps[0].finished and steps[0].new_token_ids == []
    assert_prompt_logprobs_equal_score(steps[0].prompt_logprobs, engine.score([prompt], topk=1)[0], prompt, 1)
    assert engine.output(seq_id).prompt_logprobs == steps[0].prompt_logprobs


# Generated tokens' logprobs -----------------------------------------------------------------------


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=10, ignore_eos=True, logprobs=K),
                                    SamplingParams(max_tokens=10, ignore_eos=True, logprobs=K, temperature=2.0,
                                                   seed=3),
                                    SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0, temperature=1.0,
                                                   top_k=20, seed=4)],
                         ids=["greedy", "temperature-2", "top-k-20-k0"])
def test_generated_logprobs_equal_dense_forward(model, params):
    batch = prompts([9, 25, 3], seed=26)
    engine = engine_of(model, max_num_batched_tokens=16)
    ids = [engine.add_request(p, params) for p in batch]
    streamed: dict[int, list[TokenLogprob]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
            assert [lp.token_id for lp in out.logprobs] == out.new_token_ids
            streamed[out.seq_id] += out.logprobs
    for seq_id, prompt in zip(ids, batch, strict=True):
        out = engine.output(seq_id)
        assert out.logprobs == streamed[seq_id] and len(out.logprobs) == len(out.token_ids) == 10
        assert out.prompt_logprobs is None
        dense = dense_logprobs(model, prompt + out.token_ids)[len(prompt) - 1: -1]
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        # the raw distribution's logprob, not the one the request sampled from (temperature, top-k)
        assert (got - dense.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]).abs().max().item() < 1e-4
        for row, lp in zip(dense, out.logprobs, strict=True):
            lo, hi = dense_rank_bounds(row, lp.logprob, 1e-4)
            assert lo <= lp.rank <= hi
            values, top_ids = row.topk(params.logprobs)
            assert len(lp.top) == params.logprobs
            if lp.top:
                assert (torch.tensor([v for _, v in lp.top]) - values).abs().max().item() < 1e-4
                assert lp.top[0][0] == int(top_ids[0])
            if params.greedy:
                assert lp.rank == 1 and lp.top[0] == (lp.token_id, lp.logprob)
    assert engine.blocks.num_used == 0


def test_sampling_with_logprobs_draws_the_same_tokens(model):
    batch = prompts([9, 14], seed=27)
    base = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=123, ignore_eos=True)
    with_lps = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=123, ignore_eos=True, logprobs=3,
                              prompt_logprobs=3)
    assert [o.token_ids for o in engine_of(model).generate(batch, base)] == \
        [o.token_ids for o in engine_of(model).generate(batch, with_lps)]


# Abort --------------------------------------------------------------------------------------------


def run_all(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def abort_and_check(engine: LLMEngine, seq_id: int) -> None:
    seq = engine._seqs[seq_id]
    held = len([b for b in seq.block_table if b >= 0])
    used = engine.blocks.num_used
    assert engine.abort(seq_id)
    assert engine.blocks.num_used == used - held
    assert seq not in engine.scheduler.running and seq not in engine.scheduler.waiting
    assert not engine.abort(seq_id), "a second abort finds it finished"
    out = engine.output(seq_id)
    assert out.finish_reason == "abort"
    engine.forget([seq_id])
    assert seq_id not in engine._seqs


@pytest.mark.parametrize("static", [False, True], ids=["continuous", "static"])
def test_abort_a_decoding_request(model, static):
    batch = prompts([12, 20, 7], seed=28)
    engine = engine_of(model, enable_prefix_caching=False, static=static, max_num_seqs=3)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in batch]
    for _ in range(4):
        engine.step()
    victim = engine._seqs[ids[1]]
    assert victim.status == Status.RUNNING and victim.num_output_tokens >= 2 and victim.block_table
    abort_and_check(engine, ids[1])
    run_all(engine)
    assert engine.output(ids[0]).token_ids == reference_greedy(model, batch[0], 10)
    assert engine.output(ids[2]).token_ids == reference_greedy(model, batch[2], 10)
    assert engine.blocks.num_used == 0


def test_abort_a_request_mid_prefill(model):
    short, long = prompts([5, 60], seed=29)
    engine = engine_of(model, enable_prefix_caching=False, max_num_batched_tokens=8, block_size=4)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ids = [engine.add_request(short, params), engine.add_request(long, params)]
    for _ in range(3):
        engine.step()
    victim = engine._seqs[ids[1]]
    assert victim.status == Status.RUNNING and 0 < victim.num_computed < len(long), "meant to be mid-prefill"
    abort_and_check(engine, ids[1])
    run_all(engine)
    assert engine.output(ids[0]).token_ids == reference_greedy(model, short, 12)
    assert engine.blocks.num_used == 0


def test_abort_a_waiting_request(model):
    a, b, c = prompts([10, 14, 6], seed=30)
    engine = engine_of(model, max_num_seqs=1)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in (a, b, c)]
    engine.step()
    assert engine._seqs[ids[1]] in engine.scheduler.waiting
    abort_and_check(engine, ids[1])
    run_all(engine)
    assert [engine.output(i).token_ids for i in (ids[0], ids[2])] == [reference_greedy(model, a, 6),
                                                                      reference_greedy(model, c, 6)]
    assert not engine.abort(12345), "an unknown id"
    assert not engine.abort(ids[0]), "a finished request"
    assert engine.blocks.num_used == 0


# Refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 1.5, True, "3"])
def test_bad_k_is_refused(name, value):
    with pytest.raises(SamplingError, match=rf"^{name}="):
        SamplingParams(**{name: value}).validate()


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_k_beyond_the_vocabulary_is_refused(model, name):
    engine = engine_of(model)
    with pytest.raises(SamplingError, match=rf"{name}={VOCAB + 1}: .*vocabulary size {VOCAB}"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=1, **{name: VOCAB + 1}))
    assert not engine.has_unfinished()
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=1, **{name: VOCAB}))[0]
    entry = out.logprobs[0] if name == "logprobs" else out.prompt_logprobs[1]
    assert len(entry.top) == VOCAB and abs(sum(torch.tensor([v for _, v in entry.top]).exp().tolist()) - 1) < 1e-4


def test_speculative_decoding_refuses_logprobs(model):
    engine = engine_of(model)
    decoder = SpeculativeDecoder(engine, engine, num_speculative_tokens=2)
    for params in (SamplingParams(max_tokens=2, logprobs=1), SamplingParams(max_tokens=2, prompt_logprobs=0)):
        with pytest.raises(EngineError, match="speculative decoding does not return logprobs"):
            decoder.generate([[1, 2, 3]], params)
    assert decoder.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0].logprobs is None


def test_llm_generate_carries_logprobs(checkpoint):
    from tokq.llm import LLM

    llm = LLM(checkpoint, dtype="fp32", device="cpu", kv_memory=1 << 20, max_model_len=64)
    out = llm.generate("w5 w17 w99 w3", SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=2))[0]
    assert len(out.logprobs) == len(out.token_ids) == 3
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
