"""Decode's weights and KV caches on huge pages (engine/huge_pages.py): where they land, that nothing they hold
changes on the way, and that the engine's outputs are the same with it on or off (TOKQ_HUGE_PAGES)."""

from __future__ import annotations

import pytest
import torch

from tests.test_native_step import bf16_checkpoint
from tokq.engine import huge_pages
from tokq.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from tokq.engine.layers import Linear
from tokq.engine.llm_engine import EngineConfig, LLMEngine
from tokq.engine.quant_linear import QuantizedLinearMethod
from tokq.engine.sampling import SamplingParams
from tokq.quantization.pipeline import quantize_model
from tokq.quantization.scheme import preset

needs_linux = pytest.mark.skipif(not huge_pages.enabled(), reason="huge pages are off here (not Linux, or turned off)")


@needs_linux
def test_buffer_starts_on_a_huge_page_zeroed_and_writable():
    buf = huge_pages.huge_page_buffer(5 << 20)
    assert buf.dtype == torch.uint8 and buf.numel() == 5 << 20
    assert buf.data_ptr() % huge_pages.HUGE_PAGE == 0
    assert int(buf.count_nonzero()) == 0
    buf[-1] = 7
    assert int(buf[-1]) == 7


def test_turned_off_gives_plain_memory(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert not huge_pages.enabled()
    buf = huge_pages.huge_page_buffer(4 << 20)
    assert int(buf.count_nonzero()) == 0 and buf.numel() == 4 << 20


def test_gather_copies_in_order_each_on_a_cache_line():
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(0, 255, (1 << 20,), generator=g, dtype=torch.uint8),
               torch.randn(3, 5, generator=g).to(torch.bfloat16), torch.randn(7, generator=g)]
    copies = huge_pages.gather(tensors)
    for t, c in zip(tensors, copies, strict=True):
        assert torch.equal(t, c) and c.dtype == t.dtype and c.shape == t.shape and c.data_ptr() != t.data_ptr()
        assert c.data_ptr() % huge_pages.ALIGN == 0
    addresses = [c.data_ptr() for c in copies]
    assert addresses == sorted(addresses)
    assert addresses[1] - addresses[0] == 1 << 20  # one after another


def int4_model(tmp_path):
    model = bf16_checkpoint(tmp_path)
    quantize_model(model, "rtn", preset("w4a16").with_weights(group_size=32))
    return model


def streamed(model) -> list[torch.Tensor]:
    """What a decode step streams: quantized layers' packed layouts, dense layers' weights."""
    out = []
    for m in model.modules():
        if isinstance(getattr(m, "method", None), QuantizedLinearMethod):
            state = m.method.kernel.state
            out += [getattr(state, name) for name in ("packed", "unsigned", "scales_and_zeros") if hasattr(state, name)]
        elif isinstance(m, Linear):
            out.append(m.weight.data)
    return [t for t in out if t.numel()]


@needs_linux
def test_streamed_weights_move_once_in_module_order_and_compute_the_same(tmp_path):
    model = int4_model(tmp_path)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).view(1, -1)
    with torch.inference_mode():
        before = model.compute_logits(model(ids, positions)[0])
    old = [t.data_ptr() for t in streamed(model)]
    moved = huge_pages.gather_streamed_weights(model)
    tensors = streamed(model)
    assert moved == sum(t.nbytes for t in tensors) > 0
    new = [t.data_ptr() for t in tensors]
    assert not set(new) & set(old) and new == sorted(new)  # one arena, in the order the layers run
    with torch.inference_mode():
        after = model.compute_logits(model(ids, positions)[0])
    assert torch.equal(before, after)
    assert huge_pages.gather_streamed_weights(model) == 0  # a second engine on the same model shares the arena


@needs_linux
def test_dense_weights_move_and_a_tied_head_stays_tied(tmp_path):
    model = bf16_checkpoint(tmp_path, "llama-tied-bias")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(9).view(1, -1)
    with torch.inference_mode():
        before = model.compute_logits(model(ids, positions)[0])
    old = [t.data_ptr() for t in streamed(model)]
    assert huge_pages.gather_streamed_weights(model) == sum(t.nbytes for t in streamed(model)) > 0
    assert not set(old) & {t.data_ptr() for t in streamed(model)}
    assert model.lm_head.weight is model.model.embed_tokens.weight  # one Parameter, moved once
    with torch.inference_mode():
        after = model.compute_logits(model(ids, positions)[0])
    assert torch.equal(before, after)


@needs_linux
def test_cpu_kv_caches_share_one_zeroed_arena():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.bfloat16)
    caches = allocate_kv_cache(spec, [40, 40, 10], torch.device("cpu"))
    flat = [t for pair in caches for t in pair]
    assert [tuple(t.shape) for t in flat] == [(40, 8, 2, 16)] * 4 + [(10, 8, 2, 16)] * 2
    assert all(int(t.count_nonzero()) == 0 and t.is_contiguous() for t in flat)
    ends = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in flat]
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:], strict=False))  # no overlap
    flat[0].fill_(1)
    assert int(flat[1].count_nonzero()) == 0


def test_engine_outputs_equal_with_huge_pages_on_and_off(tmp_path, monkeypatch):
    outputs = []
    for on in ("0", "1"):
        monkeypatch.setenv(huge_pages.ENV, on)
        model = int4_model(tmp_path / on)
        engine = LLMEngine(model, EngineConfig(kv_memory=1 << 21, max_model_len=96, block_size=8))
        params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
        outputs.append(engine.generate([[5, 9, 13, 2, 7], [3] * 20], [params, params]))
    for off, on in zip(*outputs, strict=True):
        assert off.token_ids == on.token_ids
        assert [lp.logprob for lp in off.logprobs] == [lp.logprob for lp in on.logprobs]
