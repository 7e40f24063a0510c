"""The compiled decode step (engine/compiled_decode.py) against the eager one, on tiny random models in fp32.

Greedy outputs must be identical token for token under a batch that shrinks as requests finish (so both the
static batch-1 graph and the dynamic one run), with a sliding-window model among them; the logits of one
compiled step must match the eager step's; and a compiler failure must leave the engine decoding eagerly.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.test_models_vs_hf import BASE, make_hf_checkpoint
from tokq.engine import compiled_decode
from tokq.engine.checkpoint import load_model
from tokq.engine.llm_engine import EngineConfig, LLMEngine
from tokq.engine.sampling import SamplingParams
from tokq.kernels.cpu import native

VOCAB = BASE["vocab_size"]


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_hf_checkpoint(request.param, path)
    return load_model(path)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def engine(model, compiled: bool, attention: str | None = None) -> LLMEngine:
    return LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=128, compile_decode=compiled,
                                         attention_kernels=attention))


@pytest.mark.parametrize("attention", [
    # the graph calls tokq_native::paged_decode_step itself (NativeGraphAttention), where the native kernels build
    pytest.param("cpu_native_paged", marks=pytest.mark.skipif(native.unavailable() is not None,
                                                              reason="native kernels unavailable")),
    "cpu_paged_sdpa",  # the graph calls tokq::paged_attend, which runs the engine's own backend
])
def test_compiled_greedy_equals_eager(model, attention):
    batch = prompts([5, 23, 40, 17])
    # different lengths: the decode batch shrinks 4 -> 1 as requests finish
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 9, 14, 20)]
    eager = engine(model, False, attention).generate(batch, params)
    before = compiled_decode.compiled_steps
    compiled_engine = engine(model, True, attention)
    assert (compiled_engine.runner.graph_attention is not None) == (attention == "cpu_native_paged")
    compiled = compiled_engine.generate(batch, params)
    assert compiled_decode.compiled_steps - before >= 19, "decode steps did not run through the compiled graph"
    assert [o.token_ids for o in compiled] == [o.token_ids for o in eager]
    assert getattr(model, "_tokq_compile_failed", None) is None, "the compiled path fell back to eager"


def test_compiled_step_logits_match_eager(model):
    eng = engine(model, False)
    eng.add_request(prompts([30], seed=3)[0], SamplingParams(max_tokens=8, ignore_eos=True))
    eng.step()  # the prefill (eager either way)
    step = eng.scheduler.schedule()
    runner = eng.runner
    eager_hidden, _ = runner.run(step)  # rerunning a step rewrites the same K/V at the same slots
    runner.compile_decode = True
    compiled_hidden, _ = runner.run(step)
    eager_logits, compiled_logits = runner.logits(eager_hidden), runner.logits(compiled_hidden)
    err = (compiled_logits - eager_logits).abs().max() / eager_logits.abs().max()
    assert err < 1e-5, f"compiled decode logits differ from eager by {err:.2e} (relative to the largest logit)"


def test_compiler_failure_falls_back_to_eager(model, monkeypatch, caplog):
    class Broken:
        def __call__(self, *args, **kwargs):
            raise torch._dynamo.exc.InternalTorchDynamoError("no C++ compiler")

    target = model
    monkeypatch.setattr(compiled_decode.torch, "compile", lambda fn, **kw: Broken())
    monkeypatch.delattr(target, "_tokq_compiled_decode", raising=False)
    batch = prompts([7, 12], seed=5)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    expected = [o.token_ids for o in engine(target, False).generate(batch, params)]
    with caplog.at_level(logging.WARNING, logger="tokq"):
        got = [o.token_ids for o in engine(target, True).generate(batch, params)]
    assert got == expected
    assert "decodes eagerly" in caplog.text
    assert getattr(target, "_tokq_compile_failed", False)
    object.__delattr__(target, "_tokq_compile_failed")  # the module-scoped model compiles again elsewhere


def test_model_changed_after_compiling_gets_a_new_graph(tmp_path):
    """Dynamo's per-call guards on the model are skipped; the engine's fingerprint check must catch a model
    quantized in place after its graph was compiled (a stale graph would decode with the 16-bit weights)."""
    from tokq.quantization.pipeline import quantize_model
    from tokq.quantization.scheme import preset

    make_hf_checkpoint("llama", tmp_path / "llama")
    fresh = load_model(tmp_path / "llama")
    batch = prompts([9, 14], seed=7)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine(fresh, True).generate(batch, params)  # compiles the 16-bit graph
    quantize_model(fresh, "rtn", preset("w4a16").with_weights(group_size=32, bits=2))  # coarse: outputs change
    expected = [o.token_ids for o in engine(fresh, False).generate(batch, params)]
    got = [o.token_ids for o in engine(fresh, True).generate(batch, params)]
    assert got == expected


@pytest.mark.skipif(native.unavailable() is not None, reason="native kernels unavailable")
def test_engines_with_other_pool_sizes_share_the_native_graph(tmp_path):
    """The native graph takes the caches as inputs: a second engine with a pool of another size, and sequences whose
    block tables grow past the first ones' width, reuse the compiled graph instead of compiling again."""
    from torch._dynamo.utils import counters

    make_hf_checkpoint("llama", tmp_path)
    model = load_model(tmp_path)
    one = SamplingParams(max_tokens=6, ignore_eos=True)
    LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=128, compile_decode=True)).generate(prompts([5]), one)
    graphs = counters["stats"]["unique_graphs"]
    other = LLMEngine(model, EngineConfig(kv_memory=3 << 19, max_model_len=96, compile_decode=True))
    assert other.runner.graph_attention is not None
    assert other.caches[0][0].shape[0] != 0
    before = compiled_decode.compiled_steps
    other.generate(prompts([70], seed=5), SamplingParams(max_tokens=20, ignore_eos=True))
    assert compiled_decode.compiled_steps - before >= 19
    assert counters["stats"]["unique_graphs"] == graphs, "a new pool size or block-table width recompiled the step"


def test_each_model_compiles_into_a_cache_of_its_own(tmp_path):
    """Dynamo keeps one cache per code object. With every model compiled from CausalLM.forward's, each step of the
    model compiled second first evaluated (and failed) the other model's guards: ~12% slower per step than the same
    model compiled first, a bias in any paired run. Each model's forward now has a code object of its own."""
    from tokq.engine.models.base import CausalLM
    from tokq.quantization.pipeline import quantize_model
    from tokq.quantization.scheme import preset

    entries = getattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if entries is None:
        pytest.skip("this torch has no dynamo cache-entry debug API")
    make_hf_checkpoint("llama", tmp_path)
    first, second = load_model(tmp_path), load_model(tmp_path)
    quantize_model(second, "rtn", preset("w4a16").with_weights(group_size=32))  # another graph
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for m in (first, second, first, second):
        engine(m, True).generate(prompts([7, 11]), params)
    codes = [getattr(m, compiled_decode._COMPILED_ATTR)[1]._torchdynamo_orig_callable.__func__.__code__
             for m in (first, second)]
    assert codes[0] is not codes[1] and CausalLM.forward.__code__ not in codes
    assert len(entries(CausalLM.forward.__code__)) == 0
    assert [len(entries(c)) for c in codes] == [1, 1]  # a static graph each (one batch size): nothing shared
