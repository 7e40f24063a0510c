"""The serving engine on tiny random models: greedy output equals the reference full-sequence forward
token for token (fp32) under every batch composition, chunked prefill, preemption by a tiny pool,
prefix sharing and static batching; score() equals the reference log-probabilities; bad requests are
refused while the others keep running."""

from __future__ import annotations

import pytest
import torch

from tests.test_models_vs_hf import BASE, make_hf_checkpoint
from tokq.engine.block_manager import BlockManager, blocks_held_at_most
from tokq.engine.checkpoint import load_model
from tokq.engine.kv_cache import KVCacheSpec, parse_bytes
from tokq.engine.llm_engine import EngineConfig, EngineError, LLMEngine
from tokq.engine.sampling import SamplingError, SamplingParams
from tokq.engine.sequence import Sequence
from tokq.errors import ConfigError

VOCAB = BASE["vocab_size"]
MAX_NEW = 12


@pytest.fixture(scope="module", params=["llama", "gemma3", "mistral-sliding"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_hf_checkpoint(request.param, path)
    return load_model(path)


def prompts(lengths, seed=0, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model.logits(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def reference_logprobs(model, window: list[int]) -> torch.Tensor:
    logprobs = torch.log_softmax(model.logits(torch.tensor([window]))[0].float(), dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(window[1:])[:, None])[:, 0]


def block_bytes(model, block_size: int) -> int:
    return KVCacheSpec.of(model.config, model.dtype, block_size).bytes_per_block


GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
CONFIGS = {
    "default": dict(),
    "chunked-7-tokens-block-4": dict(max_num_batched_tokens=7, block_size=4),
    "static-2": dict(static=True, max_num_seqs=2),
    "one-seat": dict(max_num_seqs=1),
    "no-prefix-cache": dict(enable_prefix_caching=False, block_size=8),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_equals_reference(model, name):
    batch = prompts([5, 23, 40, 17, 1])
    expected = [reference_greedy(model, p, MAX_NEW) for p in batch]
    engine = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=128, **CONFIGS[name]))
    outputs = engine.generate(batch, GREEDY)
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == ref, f"{name}: prompt {i} ({len(batch[i])} tokens) diverges from the reference"
        assert out.finish_reason == "length" and out.metrics.ttft_s is not None
    metrics = engine.metrics()
    assert metrics.requests == len(batch) and metrics.output_tokens == len(batch) * MAX_NEW
    assert engine.blocks.num_used == 0, "finished sequences must give back every block"


def test_preemption_by_recompute_keeps_output_exact(model):
    """The smallest pool the engine accepts (one sequence of max_model_len: 16 blocks of 4, or, when every
    layer slides, its window plus a chunk): four prompts must take turns."""
    batch = prompts([30, 22, 35, 9], seed=1)
    expected = [reference_greedy(model, p, MAX_NEW) for p in batch]
    pool = blocks_held_at_most(64, 4, model.config.window_of_every_layer, 16)
    engine = LLMEngine(model, EngineConfig(kv_memory=pool * block_bytes(model, 4), max_model_len=64, block_size=4,
                                           max_num_batched_tokens=16))
    outputs = engine.generate(batch, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert engine.metrics().preemptions > 0, "the pool was meant to force preemption"
    assert engine.blocks.num_used == 0


def test_sliding_window_blocks_are_freed(tmp_path):
    """Every layer slides (window 7): a pool of 5 blocks of 4 serves a 60-token sequence exactly."""
    make_hf_checkpoint("mistral-sliding", tmp_path)
    model = load_model(tmp_path)
    prompt = prompts([20], seed=12)[0]
    engine = LLMEngine(model, EngineConfig(kv_memory=5 * block_bytes(model, 4), max_model_len=64, block_size=4,
                                           max_num_batched_tokens=8))
    assert engine.num_blocks == 5 < 60 // 4
    out = engine.generate([prompt], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert out.token_ids == reference_greedy(model, prompt, 40)
    assert engine.blocks.num_used == 0


def test_prefix_sharing(model):
    """Prompts sharing a 32-token prefix reuse its blocks; outputs stay exact."""
    shared = prompts([32], seed=7)[0]
    first = prompts([6], seed=8, prefix=shared)
    rest = prompts([3, 11, 20], seed=9, prefix=shared)
    engine = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=128, block_size=8))
    engine.generate(first, GREEDY)  # fills the cache with the prefix's blocks
    engine.reset_metrics()
    outputs = engine.generate(rest, GREEDY)
    assert [o.token_ids for o in outputs] == [reference_greedy(model, p, MAX_NEW) for p in rest]
    assert all(o.metrics.cached_prompt_tokens == 32 for o in outputs), [o.metrics.cached_prompt_tokens for o in outputs]
    assert engine.metrics().prefix_hit_rate > 0.4


def test_static_batch_is_admitted_whole_and_waits_for_its_longest(model):
    """Static batching: the batch starts together even when the step budget cannot hold all prompts at once,
    and the next request starts only after the whole batch finished."""
    batch = prompts([20, 20, 20], seed=13)
    engine = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=64, static=True, max_num_seqs=2,
                                           max_num_batched_tokens=8))
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 9, 2)]
    ids = [engine.add_request(p, sp) for p, sp in zip(batch, params, strict=True)]
    rows = []
    run = engine.runner.run
    engine.runner.run = lambda step: (rows.append([s.seq_id for s in step.seqs]), run(step))[1]
    engine.step()
    assert len(engine.scheduler.running) == 2
    while engine.has_unfinished():
        engine.step()
    seqs = [engine._seqs[i] for i in ids]
    assert seqs[2].first_scheduled_time >= max(seqs[0].finish_time, seqs[1].finish_time)
    # the member that finished after 3 tokens stays in every step (as padding) until the other's 9th token
    batch_steps = [r for r in rows if ids[2] not in r]
    assert all(r == ids[:2] for r in batch_steps[-7:]), batch_steps
    assert engine.blocks.num_used == 0
    assert [engine.output(i).token_ids for i in ids] == [reference_greedy(model, p, sp.max_tokens)
                                                        for p, sp in zip(batch, params, strict=True)]


def test_requests_join_a_running_batch(model):
    """Continuous batching: a request added mid-run joins at the next step and is exact."""
    a, b, c = prompts([12, 30, 7], seed=3)
    engine = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=128))
    ids = [engine.add_request(a, GREEDY)]
    for _ in range(3):
        engine.step()
    ids += [engine.add_request(b, GREEDY), engine.add_request(c, SamplingParams(max_tokens=4, ignore_eos=True))]
    batch_sizes = []
    while engine.has_unfinished():
        batch_sizes.append(len(engine.step()))
    assert max(batch_sizes) == 3, "the late requests should have run alongside the first"
    outs = [engine.output(i).token_ids for i in ids]
    assert outs == [reference_greedy(model, a, MAX_NEW), reference_greedy(model, b, MAX_NEW),
                    reference_greedy(model, c, 4)]


@pytest.mark.parametrize("decode_from", [None, 1, 10])
def test_score_equals_reference(model, decode_from):
    windows = prompts([40, 2, 17], seed=5)
    engine = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=128, max_num_batched_tokens=16))
    scores = engine.score(windows, topk=5, decode_from=decode_from)
    for window, score in zip(windows, scores, strict=True):
        ref = reference_logprobs(model, window)
        err = (score.logprobs - ref).abs().max().item()
        assert score.logprobs.shape == (len(window) - 1,) and err < 1e-4, f"decode_from={decode_from}: {err:.2e}"
        full = torch.log_softmax(model.logits(torch.tensor([window]))[0, :-1].float(), -1)
        values, _ = full.topk(5, dim=-1)
        assert (score.topk_logprobs - values).abs().max().item() < 1e-4
        assert torch.allclose(score.topk_logprobs[:, 0], full.gather(1, score.topk_ids[:, :1])[:, 0], atol=1e-4)


def test_score_gathers_requested_ids(model):
    """A candidate scored at a baseline's top-k ids: log-probabilities at exactly those ids, per position."""
    window = prompts([30], seed=14)[0]
    engine = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=64, max_num_batched_tokens=8))
    ids = torch.randint(0, VOCAB, (29, 7), generator=torch.Generator().manual_seed(1))
    score = engine.score([window], gather_ids=[ids])[0]
    full = torch.log_softmax(model.logits(torch.tensor([window]))[0, :-1].float(), -1)
    assert (score.gathered - full.gather(1, ids)).abs().max().item() < 1e-4
    with pytest.raises(EngineError, match=r"must be \[29, k\]"):
        engine.score([window], gather_ids=[ids[:5]])


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    batch = prompts([9, 14, 3], seed=11)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=123, ignore_eos=True)
    alone = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=64)).generate([batch[0]], params)
    together = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=64)).generate(
        batch, [params, SamplingParams(max_tokens=5, temperature=1.0, seed=1), GREEDY])
    assert alone[0].token_ids == together[0].token_ids


def test_streamed_output(model):
    prompt = prompts([10], seed=6)[0]
    engine = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=64))
    pieces = list(engine.stream(prompt, SamplingParams(max_tokens=5, ignore_eos=True)))
    assert [t for p in pieces for t in p.new_token_ids] == reference_greedy(model, prompt, 5)
    assert len(pieces) == 5 and pieces[-1].finished and not any(p.finished for p in pieces[:-1])


def test_stop_token_and_min_tokens(model):
    prompt = prompts([10], seed=2)[0]
    ref = reference_greedy(model, prompt, MAX_NEW)
    stop = ref[3]
    engine = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=64))
    out = engine.generate([prompt], SamplingParams(max_tokens=MAX_NEW, stop_token_ids=[stop], ignore_eos=True))[0]
    assert out.token_ids == ref[: ref.index(stop) + 1] and out.finish_reason == "stop"
    late = SamplingParams(max_tokens=MAX_NEW, stop_token_ids=[stop], min_tokens=ref.index(stop) + 2, ignore_eos=True)
    out = engine.generate([prompt], late)[0]
    later = [i for i, t in enumerate(ref) if t == stop and i + 1 >= late.min_tokens]
    expected = ref[: later[0] + 1] if later else ref
    assert out.token_ids == expected and out.finish_reason == ("stop" if later else "length")


def test_bad_requests_are_refused_and_others_keep_running(model):
    engine = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=64))
    good = prompts([8], seed=4)[0]
    seq_id = engine.add_request(good, GREEDY)
    engine.step()
    with pytest.raises(EngineError, match="the prompt has 60 tokens; with max_tokens 12 the model's context of 64"):
        engine.add_request(prompts([60])[0], GREEDY)
    with pytest.raises(SamplingError, match="temperature"):
        engine.add_request(good, SamplingParams(temperature=-1.0))
    with pytest.raises(EngineError, match="stop strings .* need a tokenizer"):
        engine.add_request(good, SamplingParams(stop=["\n\n"]))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        engine.add_request([VOCAB + 5], GREEDY)
    with pytest.raises(EngineError, match="empty"):
        engine.add_request([], GREEDY)
    long = prompts([60])[0]
    truncated = engine.add_request(long, GREEDY, truncate=True)
    while engine.has_unfinished():
        engine.step()
    assert engine.output(seq_id).token_ids == reference_greedy(model, good, MAX_NEW)
    assert engine.output(truncated).prompt_token_ids == long[-(64 - MAX_NEW):]


def test_budget_too_small_names_the_minimum(model):
    per_block = block_bytes(model, 16)
    with pytest.raises(EngineError, match=r"one sequence of max_model_len 128 needs 8 blocks .* at least"):
        LLMEngine(model, EngineConfig(kv_memory=3 * per_block, max_model_len=128))
    with pytest.raises(ConfigError, match="kv-memory"):
        parse_bytes("lots")
    assert parse_bytes("2MiB") == parse_bytes("2m") == 2 << 20


# Block manager ------------------------------------------------------------------------------------


def seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams())


def test_block_manager_prefix_reuse_and_eviction():
    blocks = BlockManager(num_blocks=6, block_size=4)
    a = seq(0, range(10))  # 2 full blocks + 2 tokens
    assert blocks.admit(a) == 0
    blocks.append_slots(a, 10)
    a.num_computed = 10
    blocks.computed(a)
    assert len(a.block_table) == 3 and blocks.num_free == 3
    b = seq(1, list(range(8)) + [99, 98, 97])  # shares the 2 full blocks
    assert blocks.admit(b) == 8 and b.block_table == a.block_table[:2]
    assert blocks.blocks[a.block_table[0]].ref_count == 2
    c = seq(2, range(8))  # the whole prompt is cached, but one token must stay to compute
    assert blocks.admit(c) == 4
    blocks.release(a)
    assert blocks.num_free == 4 - 0  # a's tail block freed; the shared ones are still held by b and c
    blocks.release(b)
    blocks.release(c)
    assert blocks.num_free == 6
    d = seq(3, range(10))  # freed but still cached: hits again
    assert blocks.admit(d) == 8
    blocks.release(d)
    for i in range(6):  # taking every block evicts the cached content, least recently freed first
        e = seq(10 + i, [1000 + i] * 4)
        blocks.admit(e)
        blocks.append_slots(e, 4)
    assert blocks.cached == {} and blocks.stats.evicted_cached_blocks == 2


def test_block_manager_waste_counts_shared_blocks_once():
    blocks = BlockManager(num_blocks=8, block_size=4)
    a, b = seq(0, range(6)), seq(1, range(6))
    for s in (a, b):
        blocks.admit(s)
        blocks.append_slots(s, s.remaining)
        s.num_computed = len(s)
        blocks.computed(s)
    allocated, filled = blocks.waste([a, b])
    assert (allocated, filled) == (12, 12 - 4)  # b reused a's first block; 2 + 2 slots unused in the tails
