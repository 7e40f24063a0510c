"""`tokq.llm.LLM` on a tiny random llama with a word tokenizer (fp32, CPU): generate equals LLMEngine's own
output for the same prompts and parameters (greedy and seeded sampling, text and token ids), max_tokens and
stops are kept, score() equals the model's full-forward log-softmax at the actual tokens, and bad input
(no prompts, an unknown model, an unknown option, a refused request in a batch) raises a TokqError that
says what is wrong, with nothing left running."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.test_engine import reference_greedy, reference_logprobs
from tests.test_models_vs_hf import make_hf_checkpoint
from tests.test_quantize_cli import save_word_tokenizer
from tokq.engine.checkpoint import load_model
from tokq.engine.llm_engine import EngineConfig, EngineError, LLMEngine
from tokq.engine.sampling import SamplingError
from tokq.engine.tokenizer import load_tokenizer
from tokq.errors import ConfigError, ModelError, TokqError
from tokq.llm import LLM, SamplingParams

OPTIONS = dict(kv_memory=1 << 20, max_model_len=128)
TEXTS = ["w5 w17 w99 w3 w42", "w1 w2", "w170 w9 w9 w9 w31 w64 w100 w7"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llm") / "tiny-llama"
    make_hf_checkpoint("llama", path)
    save_word_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(checkpoint, dtype="fp32", device="cpu", **OPTIONS)


@pytest.fixture(scope="module")
def engine(checkpoint) -> LLMEngine:
    """The same model and options on LLMEngine directly: what LLM must reproduce."""
    return LLMEngine(load_model(checkpoint, dtype="fp32"), EngineConfig(**OPTIONS), load_tokenizer(checkpoint))


def test_sampling_params_is_the_engines():
    import tokq.engine.sampling

    assert SamplingParams is tokq.engine.sampling.SamplingParams


def test_greedy_generate_equals_the_engine(llm, engine):
    token_prompt = [5, 17, 99, 3, 42, 8, 1]
    prompts = [*TEXTS, token_prompt]
    params = SamplingParams(max_tokens=10)  # greedy (temperature 0), eos honoured
    expected = engine.generate(prompts, params)
    outputs = llm.generate(prompts, params)
    assert len(outputs) == len(prompts)
    for prompt, out, ref in zip(prompts, outputs, expected, strict=True):
        assert out.token_ids == ref.token_ids and out.text == ref.text
        assert out.prompt_token_ids == ref.prompt_token_ids and out.finish_reason == ref.finish_reason
        assert out.prompt == (prompt if isinstance(prompt, str) else None)
    assert outputs[-1].prompt_token_ids == token_prompt
    # and the engine's greedy is the model's (one full forward per token)
    forced = llm.generate([token_prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert forced.token_ids == reference_greedy(llm.model, token_prompt, 10)
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_used == 0


def test_a_single_prompt_may_be_given_bare(llm):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    [from_text] = llm.generate(TEXTS[0], params)
    [from_ids] = llm.generate(from_text.prompt_token_ids, params)
    [from_tensor] = llm.generate(torch.tensor(from_text.prompt_token_ids), params)
    assert from_text.prompt == TEXTS[0] and from_ids.prompt is None
    assert from_text.token_ids == from_ids.token_ids == from_tensor.token_ids


def test_seeded_sampling_equals_the_engine(llm, engine):
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    outputs = llm.generate(TEXTS, params, use_tqdm=True)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in engine.generate(TEXTS, params)]
    assert outputs[0].token_ids != outputs[1].token_ids  # the seeds do differ


def test_max_tokens_is_respected(llm):
    lengths = [1, 4, 11]
    outputs = llm.generate(TEXTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
    for out, n in zip(outputs, lengths, strict=True):
        assert len(out.token_ids) == n and out.finish_reason == "length" and out.metrics.output_tokens == n
    assert llm.generate(TEXTS[0], SamplingParams(max_tokens=0))[0].token_ids == []


def test_stop_tokens_and_stop_strings_are_respected(llm):
    prompt = TEXTS[2]
    free = llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    stop = free[4]
    out = llm.generate(prompt, SamplingParams(max_tokens=12, stop_token_ids=[stop], ignore_eos=True))[0]
    assert out.token_ids == free[: free.index(stop) + 1] and out.finish_reason == "stop"
    # a stop string ends the output and is cut from the text
    words = llm.tokenizer.decode(free, skip_special_tokens=True).split()
    assert len(words) >= 3, words
    out = llm.generate(prompt, SamplingParams(max_tokens=12, stop=[words[2]], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and words[2] not in out.text.split()
    assert out.text.split() == words[: words.index(words[2])]


def test_score_equals_the_forward_log_softmax(llm):
    token_window = [5, 17, 99, 3, 42, 8, 1, 150, 64, 2, 77]
    scores = llm.score([TEXTS[0], token_window], topk=3)
    text_ids = llm.tokenizer(TEXTS[0], add_special_tokens=True)["input_ids"]
    for window, score in zip([text_ids, token_window], scores, strict=True):
        ref = reference_logprobs(llm.model, window)
        assert score.token_ids == window and score.logprobs.shape == (len(window) - 1,)
        assert (score.logprobs - ref).abs().max().item() < 1e-4
        assert torch.equal(score.nll, -score.logprobs) and score.topk_logprobs.shape == (len(window) - 1, 3)
    [single] = llm.score(token_window)
    assert torch.allclose(single.logprobs, scores[1].logprobs, atol=1e-5)
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_used == 0


def test_auto_dtype_is_the_clis(checkpoint):
    assert LLM(checkpoint, device="cpu", **OPTIONS).model.dtype == torch.bfloat16  # auto on CPU: bf16


def test_bad_input_raises_a_clear_tokq_error(llm, checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no tokq.toml variants here
    with pytest.raises(TokqError, match="generate: no prompts given"):
        llm.generate([])
    with pytest.raises(TokqError, match="score: no prompts given"):
        llm.score([])
    with pytest.raises(ModelError, match="model directory ./no/such/model does not exist"):
        LLM("./no/such/model")
    with pytest.raises(ModelError, match="model 'no-such-model' not found"):
        LLM("no-such-model")
    with pytest.raises(ConfigError, match="LLM: unknown option max_num_seq "):
        LLM(checkpoint, max_num_seq=4)
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    for f in checkpoint.iterdir():
        if f.name == "config.json" or f.suffix == ".safetensors":
            shutil.copy(f, no_tokenizer / f.name)
    with pytest.raises(ModelError, match="has no tokenizer files .*: copy them from the original checkpoint"):
        LLM(no_tokenizer, device="cpu")
    with pytest.raises(EngineError, match="2 sampling params for 3 prompts"):
        llm.generate(TEXTS, [SamplingParams(), SamplingParams()])
    with pytest.raises(EngineError, match="a window of 1 token"):
        llm.score([[5, 6, 7], [5]])


def test_a_refused_request_runs_nothing(llm):
    """Every request of a call is checked before any runs: one refused, none queued or left running."""
    good, too_long = TEXTS[0], list(range(1, 121))
    with pytest.raises(EngineError, match="the prompt has 120 tokens; with max_tokens 16 the model's context of 128"):
        llm.generate([good, too_long])
    with pytest.raises(SamplingError, match="temperature=-1"):
        llm.generate([good, good], [SamplingParams(), SamplingParams(temperature=-1)])
    with pytest.raises(EngineError, match="outside the vocabulary"):
        llm.score([[5, 6, 7], [5, 10_000]])
    assert not llm.engine.has_unfinished()


def test_token_prompts_without_a_tokenizer(checkpoint):
    bare = LLM(checkpoint, dtype="fp32", device="cpu", skip_tokenizer_init=True, **OPTIONS)
    assert bare.tokenizer is None
    out = bare.generate([5, 17, 99], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.text == ""
    with pytest.raises(EngineError, match="a text prompt needs a tokenizer"):
        bare.generate("w1 w2")

