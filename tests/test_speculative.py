"""Speculative decoding on tiny random models (fp32): greedy output equals the target's own greedy output
token for token, whatever the draft and k; sampled output keeps the target's distribution (checked
empirically against the exact softmax, with standard-error tolerances); no KV block leaks; a draft with
another vocabulary is refused."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import transformers

from tests.test_engine import prompts, reference_greedy
from tests.test_models_vs_hf import CASES, make_hf_checkpoint
from tokq.engine.checkpoint import load_model
from tokq.engine.llm_engine import EngineConfig, EngineError, LLMEngine
from tokq.engine.sampling import SamplingParams
from tokq.engine.speculative import SpeculativeDecoder, SpeculativeStats

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


def engine(model, **overrides) -> LLMEngine:
    return LLMEngine(model, EngineConfig(**{"kv_memory": 1 << 20, "max_model_len": 128, **overrides}))


def noisy_copy(path, scale: float, seed: int = 0):
    """The model at `path` with Gaussian noise (scale x each matrix's std) on every weight matrix: a draft
    that agrees with it often but not always. Another random model agrees on (almost) no greedy token,
    the model itself on every one; neither would exercise a rollback after a partial acceptance."""
    model = load_model(path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * scale)
    return model


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def models(request, tmp_path_factory) -> dict:
    """The target and its drafts: "other" (another random model of the same architecture and vocabulary),
    "noisy" (the target with noise: about half of its greedy proposals are accepted), "same"."""
    target_dir, other_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("other")
    make_hf_checkpoint(request.param, target_dir, seed=0)
    make_hf_checkpoint(request.param, other_dir, seed=1)
    target = load_model(target_dir)
    return {"target": target, "other": load_model(other_dir), "noisy": noisy_copy(target_dir, 0.05), "same": target}


def assert_pools_empty(decoder: SpeculativeDecoder) -> None:
    assert decoder.target.blocks.num_used == 0, "the target's pool leaked blocks"
    assert decoder.draft.blocks.num_used == 0, "the draft's pool leaked blocks"


def record_positions(decoder: SpeculativeDecoder) -> list[int]:
    """Wrap both runners to record the last position (num_computed + n - 1) every forward reaches."""
    reached: list[int] = []
    for runner in {id(e.runner): e.runner for e in (decoder.target, decoder.draft)}.values():
        def run(step, _run=runner.run):
            reached.extend(s.num_computed + n - 1 for s, n in zip(step.seqs, step.num_tokens, strict=True))
            return _run(step)
        runner.run = run
    return reached


@pytest.mark.parametrize("draft_kind", ["other", "noisy", "same"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_the_targets_greedy(models, k, draft_kind):
    target_model = models["target"]
    batch = prompts([5, 23, 40])
    expected = [o.token_ids for o in engine(target_model).generate(batch, GREEDY)]
    assert expected[0] == reference_greedy(target_model, batch[0], MAX_NEW)
    decoder = SpeculativeDecoder(engine(target_model), engine(models[draft_kind]), num_speculative_tokens=k)
    outputs = decoder.generate(batch, GREEDY)
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == ref, f"k={k}, {draft_kind} draft: prompt {i} diverges from the target's greedy"
        assert out.finish_reason == "length" and out.prompt_token_ids == batch[i]
        assert out.metrics.ttft_s is not None and out.metrics.ttft_s > 0 and out.metrics.output_tokens == MAX_NEW
    stats = decoder.stats
    assert stats.emitted == len(batch) * MAX_NEW and stats.proposed > 0
    if draft_kind == "same":
        assert stats.acceptance_rate == 1.0
        # every step emits k + 1 tokens, the last one what max_tokens leaves (k shrinks)
        assert stats.tokens_per_target_forward == MAX_NEW / math.ceil(MAX_NEW / (k + 1))
    if draft_kind == "noisy":
        assert 0 < stats.acceptance_rate < 1, "the noisy draft was meant to be partly accepted"
    assert stats.target_forwards < len(batch) * MAX_NEW
    assert_pools_empty(decoder)
    metrics = decoder.metrics()
    assert metrics.requests == len(batch) and metrics.output_tokens == len(batch) * MAX_NEW
    assert metrics.ttft_mean_s > 0 and not math.isnan(metrics.tpot_mean_s)


def test_greedy_with_refill_small_blocks_chunked_prefill_and_stops(models):
    """Two seats for six requests (refilled as they finish), blocks of 4 (rollbacks cross block
    boundaries), prefill in chunks of 16, a request cut by a stop token in the middle of a step, one
    filling max_model_len exactly (k shrinks near the end) and one with max_tokens 1 (k = 0)."""
    target_model = models["target"]
    config = dict(max_num_seqs=2, block_size=4, max_num_batched_tokens=16, max_model_len=64)
    batch = prompts([30, 9, 17, 52, 3, 11], seed=4)
    params = [GREEDY] * len(batch)
    params[3] = SamplingParams(max_tokens=12, ignore_eos=True)  # 52 + 12 = max_model_len
    params[5] = SamplingParams(max_tokens=1, ignore_eos=True)
    expected = [o.token_ids for o in engine(target_model, **config).generate(batch, params)]
    stop = expected[1][6]
    params[1] = SamplingParams(max_tokens=MAX_NEW, stop_token_ids=[stop], ignore_eos=True)
    expected[1] = expected[1][: expected[1].index(stop) + 1]
    decoder = SpeculativeDecoder(engine(target_model, **config), engine(models["noisy"], **config),
                                 num_speculative_tokens=4)
    reached = record_positions(decoder)
    outputs = decoder.generate(batch, params)
    assert [o.token_ids for o in outputs] == expected
    # the long request's forwards reach its next-to-last token (the last generated token is never run),
    # and none runs past max_model_len even though k + 1 tokens would overshoot it
    assert max(reached) == 64 - 2, max(reached)
    assert outputs[1].finish_reason == "stop" and outputs[3].finish_reason == "length"
    assert_pools_empty(decoder)


def test_prefix_cache_holds_only_committed_tokens(models):
    """Blocks filled during speculative steps (generated tokens, written next to rejected proposals) are
    cached only once committed: a second request whose prompt is the first one's prompt and output hits
    them in both pools and still decodes exactly."""
    target_model = models["target"]
    config = dict(block_size=4)
    decoder = SpeculativeDecoder(engine(target_model, **config), engine(models["noisy"], **config), 3)
    first = prompts([10], seed=6)[0]
    out = decoder.generate([first], GREEDY)[0]
    assert 0 < decoder.stats.acceptance_rate < 1
    second = first + out.token_ids + [7, 8, 9]
    again = decoder.generate([second], GREEDY)[0]
    assert again.token_ids == reference_greedy(target_model, second, MAX_NEW)
    assert again.metrics.cached_prompt_tokens == 20  # the 5 full blocks of the first request's 22 tokens
    assert decoder.metrics().prefix_hit_rate > 0.5
    assert_pools_empty(decoder)


def test_same_engine_as_target_and_draft(models):
    """One engine may serve as both (two distinct sequences per request in one pool)."""
    target_model = models["target"]
    batch = prompts([7, 19], seed=2)
    shared = engine(target_model)
    decoder = SpeculativeDecoder(shared, shared, num_speculative_tokens=3)
    outputs = decoder.generate(batch, GREEDY)
    assert [o.token_ids for o in outputs] == [reference_greedy(target_model, p, MAX_NEW) for p in batch]
    assert decoder.stats.acceptance_rate == 1.0 and shared.blocks.num_used == 0


def test_seeded_sampling_does_not_depend_on_the_batch(models):
    target_model, other = models["target"], models["noisy"]
    batch = prompts([9, 14, 3], seed=11)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=123, ignore_eos=True)
    alone = SpeculativeDecoder(engine(target_model), engine(other), 3).generate([batch[0]], params)
    decoder = SpeculativeDecoder(engine(target_model), engine(other), 3)
    together = decoder.generate(batch, [params, SamplingParams(max_tokens=5, temperature=1.0, seed=1), GREEDY])
    assert alone[0].token_ids == together[0].token_ids
    assert_pools_empty(decoder)


# The distribution ---------------------------------------------------------------------------------


def peaked(model, lm_head: torch.Tensor):
    """A random model's next-token distribution is nearly uniform over the vocabulary (entropy ~ log V),
    against which any sampler would pass: a larger output projection gives a peaked one."""
    with torch.no_grad():
        model.lm_head.weight.copy_(lm_head)
    return model


def within_standard_errors(counts: torch.Tensor, probs: torch.Tensor, z: float = 5.0, missing: float = 0.0) -> bool:
    """Every token's count within z binomial standard errors of n * p (plus 3 counts for rare tokens, and
    n * missing when `probs` leaves out that much mass)."""
    n = counts.sum()
    bound = z * (n * probs * (1 - probs)).sqrt() + 3 + n * missing
    return bool(((counts - n * probs).abs() <= bound).all())


def test_sampled_tokens_keep_the_targets_distribution(tmp_path):
    """2000 seeded requests (temperature 1, k = 2, 3 tokens) of one prompt: the frequencies of the first,
    second and third generated tokens match the target's exact distribution and marginals, and the first
    does not match the draft's (so the check has the power to see a sampler that skips verification).
    The draft is the target with noise on its output projection, so about half the proposals are
    accepted: acceptance, rejection with a draw from the residual, and the bonus token (the third token
    after two acceptances) all occur often."""
    make_hf_checkpoint("llama", tmp_path, seed=0)
    base = load_model(tmp_path)
    weight = base.lm_head.weight.detach().clone() * 15
    noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)) * weight.std() * 0.7
    target_model = peaked(base, weight)
    draft_model = peaked(load_model(tmp_path), weight + noise)
    n, prompt = 2000, [5, 17, 99, 3]

    config = dict(kv_memory=4 << 20, max_model_len=16, max_num_seqs=250)
    decoder = SpeculativeDecoder(engine(target_model, **config), engine(draft_model, **config), 2)
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]
    outputs = decoder.generate([prompt] * n, params)
    assert_pools_empty(decoder)
    assert 0.2 < decoder.stats.acceptance_rate < 0.9, decoder.stats
    vocab = target_model.config.vocab_size
    tokens = torch.tensor([o.token_ids for o in outputs])
    first = torch.bincount(tokens[:, 0], minlength=vocab).double()
    second = torch.bincount(tokens[:, 1], minlength=vocab).double()
    third = torch.bincount(tokens[:, 2], minlength=vocab).double()

    with torch.no_grad():
        p1 = target_model.logits(torch.tensor([prompt]))[0, -1].double().softmax(-1)
        q1 = draft_model.logits(torch.tensor([prompt]))[0, -1].double().softmax(-1)
        # P(second = t) = sum_a p1(a) p(t | prompt + a): one forward over every possible first token
        extended = torch.cat([torch.tensor([prompt]).expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
        p2_given = target_model.logits(extended)[:, -1].double().softmax(-1)  # [a, t]
        p2 = p1 @ p2_given
        # P(third = t) = sum_ab p1(a) p(b | a) p(t | a, b) (the third token is the bonus after two accepts),
        # over the pairs of probability > 1e-7 (about half of them): the mass left out (~5e-4) is allowed for
        joint = (p1[:, None] * p2_given).reshape(-1)
        kept = (joint > 1e-7).nonzero()[:, 0]
        pairs = torch.stack([kept // vocab, kept % vocab], dim=1)
        two = torch.cat([torch.tensor([prompt]).expand(len(pairs), -1), pairs], dim=1)
        p3 = joint[kept] @ target_model.logits(two)[:, -1].double().softmax(-1)
        missing = float(1 - joint[kept].sum())
    assert within_standard_errors(first, p1), "the first token does not follow the target's distribution"
    assert within_standard_errors(second, p2), "the second token does not follow the target's marginal"
    assert within_standard_errors(third, p3, missing=missing), "the third token does not follow the target's marginal"
    assert not within_standard_errors(first, q1), "the check cannot tell the draft's distribution apart"


# Refusals and the report ----------------------------------------------------------------------------


def test_a_draft_with_another_vocabulary_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(CASES, "llama-vocab-300",
                        (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(vocab_size=300)))
    make_hf_checkpoint("llama", tmp_path / "target")
    make_hf_checkpoint("llama-vocab-300", tmp_path / "draft")
    target, draft = engine(load_model(tmp_path / "target")), engine(load_model(tmp_path / "draft"))
    with pytest.raises(EngineError, match=r"the draft model's vocabulary \(300\) differs from the target's \(211\): "
                                          "a draft must share the tokenizer"):
        SpeculativeDecoder(target, draft)
    with pytest.raises(EngineError, match="num_speculative_tokens=0"):
        SpeculativeDecoder(target, target, num_speculative_tokens=0)


def test_bad_requests_are_refused_before_anything_runs(models):
    target_model, other = models["target"], models["other"]
    decoder = SpeculativeDecoder(engine(target_model), engine(other, max_model_len=64))
    with pytest.raises(EngineError, match="the prompt has 60 tokens; with max_tokens 12 the context of 64"):
        decoder.generate([prompts([5])[0], prompts([60])[0]], GREEDY)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        decoder.generate([[10_000]], GREEDY)
    assert_pools_empty(decoder)
    out = decoder.generate([prompts([5])[0]], SamplingParams(max_tokens=0))
    assert out[0].token_ids == [] and out[0].finish_reason == "length"


def test_net_speedup_and_the_warning(caplog):
    stats = SpeculativeStats(proposed=100, accepted=23, verifications=40, emitted=63, tpot_s=0.0125)
    assert stats.acceptance_rate == 0.23 and stats.tokens_per_target_forward == 63 / 40
    assert stats.net_speedup(0.025) == pytest.approx(2.0)
    with caplog.at_level(logging.WARNING, logger="tokq"):
        assert stats.warn_if_slower(0.025) == pytest.approx(2.0)
        assert not caplog.records
        assert stats.warn_if_slower(0.01) == pytest.approx(0.8)
    assert ("speculative decoding is slower than plain decoding here (x0.80): the draft is too slow or too "
            "different (acceptance 23%)") in caplog.text
