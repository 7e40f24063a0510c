"""The CPU batched-decode attention kernel (kernels/cpu/batched.py) against the oracle, its registry
entry, and the runner's tensor-built step inputs against the per-token rule they replace."""

from __future__ import annotations

import pytest
import torch

from tokq.kernels import registry
from tokq.kernels.attention import AttentionProblem
from tokq.kernels.cpu.batched import paged_attention_cpu_batched
from tokq.kernels.paged import paged_attention_reference, random_paged_layout

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _case(seed: int, dtype: torch.dtype, kv_dtype: str | None, window: int | None, mixed: bool):
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(1, 150, (9,), generator=g).tolist()  # ragged, some under one block
    query_lens = [1] * len(seq_lens)
    if mixed:  # a prefill chunk, a whole prompt and an idle sequence among the decodes
        query_lens[2], query_lens[5], query_lens[7] = min(6, seq_lens[2]), seq_lens[5], 0
    layout = random_paged_layout(seq_lens, query_lens, 16, num_kv_heads=2, head_dim=32, dtype=dtype,
                                 kv_dtype=kv_dtype, seed=seed)
    q = torch.randn(sum(query_lens), 6, 32, generator=g).to(dtype)  # GQA: 6 query heads on 2 kv heads
    return q, layout


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                            (torch.bfloat16, "fp8"), (torch.float32, "int8")])
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("mixed", [False, True])
def test_matches_the_reference(seed, dtype, kv_dtype, window, mixed):
    q, lay = _case(seed, dtype, kv_dtype, window, mixed)
    args = (lay.k_cache, lay.v_cache, lay.meta, 0.2, window, lay.k_scale, lay.v_scale)
    ref = paged_attention_reference(q, *args).float()
    out = paged_attention_cpu_batched(q, *args)
    assert out.dtype == dtype and out.shape == q.shape
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    print(f"seed {seed} {dtype} kv {kv_dtype} window {window} mixed {mixed}: relative error {rel:.2e}")
    assert rel < TOLERANCE[dtype]


def test_groups_split_by_the_byte_cap(monkeypatch):
    """Many small groups (a tiny cap) give the same answer as one group."""
    from tokq.kernels.cpu import attention as base
    q, lay = _case(3, torch.float32, None, None, mixed=False)
    args = (lay.k_cache, lay.v_cache, lay.meta, 0.2, None, None, None)
    whole = paged_attention_cpu_batched(q, *args)
    monkeypatch.setattr(base, "DECODE_BATCH_BYTES", 1)
    from tokq.kernels.paged import PagedAttentionMetadata
    meta = PagedAttentionMetadata(*(t.clone() for t in (lay.meta.block_tables, lay.meta.seq_lens,
                                                         lay.meta.query_start_loc)), lay.meta.max_query_len,
                                  lay.meta.max_seq_len)  # a new metadata object: a new plan
    split = paged_attention_cpu_batched(q, lay.k_cache, lay.v_cache, meta, 0.2)
    assert torch.allclose(whole, split, atol=1e-6)
    ref = paged_attention_reference(q, *args)
    assert ((split - ref).norm() / ref.norm()).item() < 1e-5


def test_registry_selects_the_batched_kernel_by_name(monkeypatch):
    monkeypatch.delenv(registry.ENV, raising=False)
    problem = AttentionProblem("cpu", torch.bfloat16, torch.bfloat16, 9, 3, 64)
    assert registry.choose(problem, "-cpu_native_paged")[0].name == "cpu_paged_sdpa"  # before it: no faster in the engine
    assert registry.choose(problem, "cpu_paged_batched")[0].name == "cpu_paged_batched"
    assert registry.choose(problem, "-cpu_native_paged,-cpu_paged_sdpa")[0].name == "cpu_paged_batched"


def test_runner_step_inputs_follow_the_block_tables(tmp_path):
    """prepare()'s tensor-built positions and slots equal the per-token rule, in a step mixing a prefill
    chunk with decodes; and the engine's greedy output is the same with either CPU kernel."""
    from tests.test_models_vs_hf import make_hf_checkpoint
    from tokq.engine.checkpoint import load_model
    from tokq.engine.llm_engine import EngineConfig, LLMEngine
    from tokq.engine.sampling import SamplingParams

    make_hf_checkpoint("llama", tmp_path)
    model = load_model(tmp_path, dtype="fp32")
    outputs, checked = {}, [0]
    for kernel in ("cpu_paged_sdpa", "cpu_paged_batched"):
        engine = LLMEngine(model, EngineConfig(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=24,
                                               block_size=4, attention_kernels=kernel))
        real_prepare = engine.runner.prepare

        def check(step, _real=real_prepare, _bs=engine.runner.spec.block_size):
            inputs = _real(step)
            spans = [(seq, range(seq.num_computed, seq.num_computed + n))
                     for seq, n in zip(step.seqs, step.num_tokens, strict=True)]
            assert inputs.positions[0].tolist() == [p for _, r in spans for p in r]
            assert inputs.slot_mapping.tolist() == [seq.block_table[p // _bs] * _bs + p % _bs
                                                    for seq, r in spans for p in r]
            checked[0] += len(step.seqs) > 1 and max(step.num_tokens) > 1 and min(step.num_tokens) == 1
            return inputs
        engine.runner.prepare = check
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in (5, 30, 11, 17)]
        outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        outputs[kernel] = [o.token_ids for o in outs]
    assert checked[0] >= 2  # steps that mixed a prefill chunk with decodes were checked
    assert outputs["cpu_paged_sdpa"] == outputs["cpu_paged_batched"]
