"""The native decode step (engine/native_step.py, kernels/cpu/native/decode_step.cpp) against the eager step, on tiny
random bf16 models: the same greedy tokens and logprobs within bf16 rounding, with a batch that shrinks as requests
finish, for every kind of projection it runs (dense bf16, native int4 in both layouts, aten's int4 and int8 ops,
the native int8 head, an input permutation, qkv and MLP biases, a sliding window); and the models and batches it does
not take run through the other paths, saying why.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_models_vs_hf import BASE, CASES, make_hf_checkpoint
from tokq.engine import native_step
from tokq.engine.checkpoint import load_model
from tokq.engine.llm_engine import EngineConfig, LLMEngine
from tokq.engine.quant_linear import InputPermutedLinearMethod
from tokq.engine.sampling import SamplingParams
from tokq.kernels.cpu import native
from tokq.quantization.lm_head import quantize_lm_head_
from tokq.quantization.pipeline import quantize_model
from tokq.quantization.scheme import preset

pytestmark = pytest.mark.skipif(native.unavailable() is not None, reason="native kernels unavailable")


def engine(model, native_on: bool, monkeypatch, max_num_seqs: int = 8) -> LLMEngine:
    """native_on: the native step; else the eager step (TOKQ_COMPILE off), the reference path."""
    monkeypatch.setenv(native_step.ENV, "1")
    return LLMEngine(model, EngineConfig(kv_memory=1 << 21, max_model_len=160, compile_decode=native_on,
                                         max_num_seqs=max_num_seqs, block_size=8))


def prompts(vocab: int, lengths=(5, 23, 40, 17), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def decode_both(model, monkeypatch, lengths=(5, 23, 40, 17), max_num_seqs: int = 8):
    batch = prompts(model.config.vocab_size, lengths)
    # different lengths: the decode batch shrinks as requests finish
    params = [SamplingParams(max_tokens=4 + 5 * (i % 4), ignore_eos=True, logprobs=3) for i in range(len(batch))]
    eager = engine(model, False, monkeypatch, max_num_seqs).generate(batch, params)
    fast_engine = engine(model, True, monkeypatch, max_num_seqs)
    before = native_step.steps_run
    fast = fast_engine.generate(batch, params)
    return eager, fast, fast_engine, native_step.steps_run - before


def assert_same(eager, fast, tol: float = 0.05) -> None:
    assert [o.token_ids for o in fast] == [o.token_ids for o in eager]
    for a, b in zip(eager, fast, strict=True):
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            # the chosen token's logprob and the top-3 values (their ids may swap on a near tie)
            worst = max([abs(la.logprob - lb.logprob)] + [abs(x[1] - y[1]) for x, y in zip(la.top, lb.top, strict=True)])
            assert worst <= tol, f"logprobs differ by {worst}"


def bf16_checkpoint(tmp_path, case: str = "llama", **overrides):
    """A tiny random HF checkpoint (make_hf_checkpoint's, with `overrides` to its config) loaded in bf16."""
    if overrides:
        config_cls, model_cls, extra = CASES[case]
        torch.manual_seed(0)
        config = config_cls(**{**BASE, **extra, **overrides})
        model = model_cls(config).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(torch.rand_like(p) * 0.5 + 0.75)
        model.save_pretrained(tmp_path, safe_serialization=True)
    else:
        make_hf_checkpoint(case, tmp_path)
    return load_model(tmp_path, dtype="bf16")


@pytest.mark.parametrize("case", ["llama", "llama-tied-bias", "llama3-rope-scaling", "qwen2", "mistral-sliding"])
def test_dense_bf16_greedy_and_logprobs_equal_eager(case, tmp_path, monkeypatch):
    model = bf16_checkpoint(tmp_path, case)
    eager, fast, fast_engine, steps = decode_both(model, monkeypatch)
    assert fast_engine.runner.native_step is not None, fast_engine.runner.native_step_why
    assert steps == max(len(o.token_ids) for o in fast) - 1, "decode steps did not all run through the native step"
    assert_same(eager, fast)


@pytest.mark.parametrize("kernels,group", [
    ("", 64),  # the registry's choice on this CPU (native int4, tiled on AVX-512 VNNI)
    ("cpu_native_int4,cpu_native_int8", 32),  # groups of 32: the row-major layout; the native int8 head
    ("cpu_int4,cpu_int8", 64),  # aten's int4 and int8 ops
])
def test_int4_with_int8_head_equals_eager(kernels, group, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKQ_KERNELS", kernels)
    model = bf16_checkpoint(tmp_path, "llama", intermediate_size=128, hidden_size=128)
    quantize_model(model, "rtn", preset("w4a16").with_weights(group_size=group))
    quantize_lm_head_(model, "int8")
    names = {m.method.kernel_name for m in model.modules() if hasattr(getattr(m, "method", None), "kernel_name")}
    if kernels:
        assert names == set(kernels.split(","))
    eager, fast, fast_engine, steps = decode_both(model, monkeypatch)
    assert fast_engine.runner.native_step is not None, fast_engine.runner.native_step_why
    assert steps == max(len(o.token_ids) for o in fast) - 1
    assert_same(eager, fast)


def test_int8_weights_and_an_input_permutation_equal_eager(tmp_path, monkeypatch):
    model = bf16_checkpoint(tmp_path, "llama", hidden_size=128, intermediate_size=128)
    quantize_model(model, "rtn", preset("w8a16"))
    layer = model.model.layers[1].mlp.down_proj
    perm = torch.randperm(layer.in_features, generator=torch.Generator().manual_seed(5))
    layer.method = InputPermutedLinearMethod(layer.method.weight, perm, None, torch.bfloat16)
    eager, fast, fast_engine, steps = decode_both(model, monkeypatch)
    assert fast_engine.runner.native_step is not None, fast_engine.runner.native_step_why
    assert_same(eager, fast)


@pytest.mark.parametrize("scheme,kernels", [("w4a16", ""), ("w8a16", "cpu_native_int8")])
def test_batches_above_the_gemv_cutoffs_equal_eager(scheme, kernels, tmp_path, monkeypatch):
    """More rows than the native GEMVs take (int4: 32, int8: 16): as in the Python kernels, int4 weights are
    dequantized for a dense GEMM and int8 ones go to aten's int8pack op, inside the same native step."""
    monkeypatch.setenv("TOKQ_KERNELS", kernels)
    model = bf16_checkpoint(tmp_path, "llama", hidden_size=128, intermediate_size=128)
    quantize_model(model, "rtn", preset(scheme).with_weights(group_size=64) if scheme == "w4a16" else preset(scheme))
    lengths = [3 + i for i in range(34)]
    eager, fast, _, steps = decode_both(model, monkeypatch, lengths, max_num_seqs=len(lengths))
    assert steps == max(len(o.token_ids) for o in fast) - 1
    assert [o.token_ids for o in fast] == [o.token_ids for o in eager]


def test_what_it_does_not_take_says_why(tmp_path, monkeypatch):
    gemma = tmp_path / "gemma"
    make_hf_checkpoint("gemma3", gemma)
    fp32 = tmp_path / "fp32"
    make_hf_checkpoint("llama", fp32)
    qwen3 = tmp_path / "qwen3"
    make_hf_checkpoint("qwen3", qwen3)
    cases = {"gemma3 model": load_model(gemma, dtype="bf16"), "float32": load_model(fp32, dtype="fp32"),
             "QK-norm": load_model(qwen3, dtype="bf16")}
    for words, model in cases.items():
        runner = engine(model, True, monkeypatch).runner
        assert runner.native_step is None and words in runner.native_step_why
    w8a8 = load_model(fp32, dtype="bf16")
    quantize_model(w8a8, "rtn", preset("w8a8-int8"))
    runner = engine(w8a8, True, monkeypatch).runner
    assert runner.native_step is None and "layer" in runner.native_step_why
    monkeypatch.setenv(native_step.ENV, "0")
    runner = LLMEngine(load_model(fp32, dtype="bf16"), EngineConfig(kv_memory=1 << 20, max_model_len=64,
                                                                    compile_decode=True)).runner
    assert runner.native_step is None and "TOKQ_NATIVE_STEP=0" in runner.native_step_why


def test_the_decoder_checks_what_it_is_built_from():
    with pytest.raises(RuntimeError, match="dims"):
        torch.classes.tokq_native.LlamaDecoder([1, 2], [1e-5, 0.1], [], [], [], [])
    embed, norm, inv = torch.zeros(10, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16), torch.ones(2)
    with pytest.raises(RuntimeError, match="tensors"):
        torch.classes.tokq_native.LlamaDecoder([8, 2, 1, 4, 16, 1], [1e-5, 0.5], [embed, norm, inv], [], [], [])

