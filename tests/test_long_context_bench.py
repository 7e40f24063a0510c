"""benchmarks/long_context.py's pure parts and longctx.multi_key_probes: the multi-key probe context (exact length,
every needle intact at its depth, on a line break), the prefill/decode row split and the 1/π tail weighting, the full-vocabulary row sample,
and the table and plot on a synthetic record (no model: the benchmark itself runs the real one)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tokq.evalsuite.ab import TokenMetrics
from tokq.longctx import multi_key_probes as mk
from tokq.longctx.windows import TokenWindow

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports its siblings' helpers
    try:
        spec = importlib.util.spec_from_file_location("long_context_bench", ROOT / "benchmarks" / "long_context.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


def chars(text: str) -> list[int]:
    """One token per character: positions and line breaks are easy to check."""
    return [ord(c) for c in text]


def test_multi_key_context_is_exact_and_keeps_every_needle_at_its_depth() -> None:
    filler_text = "".join(f"line {i} of some filler text that goes on\n" for i in range(400))
    filler = chars(filler_text)
    breaks = [i + 1 for i, c in enumerate(filler_text) if c == "\n"]
    header = chars("HEADER\n")
    ctx = mk.multi_key_context(4000, filler, breaks, header, chars, needles=5, seed=3)
    assert len(ctx.ids) == 4000 and ctx.ids[: len(header)] == header
    assert len(set(ctx.keys)) == 5 and all(len(k) == 5 for k in ctx.keys)
    budget = 4000 - len(header) - sum(len(chars(mk.NEEDLE.format(label=lab, key=k)))
                                      for lab, k in zip(ctx.labels, ctx.keys, strict=True))
    for start, lab, key, depth, want in zip(ctx.needle_starts, ctx.labels, ctx.keys, ctx.depths,
                                            (0, 0.25, 0.5, 0.75, 1.0), strict=True):
        needle = chars(mk.NEEDLE.format(label=lab, key=key))
        assert ctx.ids[start: start + len(needle)] == needle  # intact, where the record says
        assert abs(depth - want) <= mk.SNAP_TOKENS / budget  # within the snap distance of the asked depth
        before = ctx.ids[start - 1]
        assert start == len(header) or before == ord("\n")  # after the header or a line break
    # the filler is all there, in order, around the needles
    rest = [t for i, t in enumerate(ctx.ids[len(header):])
            if not any(s <= i + len(header) < s + len(chars(mk.NEEDLE.format(label=lab, key=k)))
                       for s, lab, k in zip(ctx.needle_starts, ctx.labels, ctx.keys, strict=True))]
    assert rest == filler[: len(rest)] and len(rest) == budget
    # seeded: same arguments, same keys; another filler order, other keys
    assert mk.multi_key_context(4000, filler, breaks, header, chars, 5, seed=3).keys == ctx.keys
    assert mk.multi_key_context(4000, filler, breaks, header, chars, 5, seed=3, filler=1).keys != ctx.keys
    with pytest.raises(ValueError, match="filler tokens"):
        mk.multi_key_context(4000, filler[:1000], breaks, header, chars, 5, seed=3)


def metrics(positions: list[int]) -> TokenMetrics:
    n = len(positions)
    kl_topk = torch.linspace(0.1, 0.2, n)
    gap = torch.zeros(n)
    gap[::3] = 0.05
    return TokenMetrics(kl=kl_topk + gap, kl_topk=kl_topk, kl_gap=gap, sampled=gap > 0, top1=torch.ones(n),
                        delta_nll=torch.zeros(n), delta_p=torch.zeros(n), accept=torch.ones(n),
                        coverage=torch.ones(n), position=torch.tensor(positions), doc_index=torch.zeros(n, dtype=torch.long),
                        non_finite=torch.zeros(n, dtype=torch.bool))


def test_split_rows_by_the_path_that_computed_them_and_reweight_the_prefill_tail(bench) -> None:
    m = metrics(list(range(1, 20)))  # positions 1..19 of a 20-token window, decode_from 15
    pre, dec = bench.split_rows(m, 15)
    assert pre.position.tolist() == list(range(1, 16))  # row 14 (predicting 15) is the prefill's last
    assert dec.position.tolist() == list(range(16, 20))
    assert pre.tokens + dec.tokens == m.tokens and torch.equal(dec.kl, m.kl[15:])
    heavier = bench.reweight_tail(pre, 0.25)
    assert torch.allclose(heavier.kl, pre.kl_topk + 4 * pre.kl_gap)
    assert bench.reweight_tail(pre, 1.0) is pre


def test_full_sample_keeps_every_decode_row_and_a_prefill_sample(bench) -> None:
    wins = [TokenWindow(f"d{i}", 0, 0, list(range(100)), True, 1) for i in range(3)]
    sample, prob = bench.full_sample(wins, 90, 30, seed=0)
    assert sample.prob == 1.0 and prob == pytest.approx(30 / 270)
    for rows in sample.rows:
        assert rows[rows >= 90].tolist() == list(range(90, 99))  # decode rows 90..98 (the window's last row: 98)
    assert sum(int((r < 90).sum()) for r in sample.rows) == 30


def est(v, lo, hi):
    return {"value": v, "low": lo, "high": hi, "n_tokens": 100, "n_docs": 4}


def test_markdown_and_plot_from_a_synthetic_record(bench, tmp_path: Path) -> None:
    def variant(kl):
        return {"prefill": {"kl": est(kl, kl / 2, kl * 2), "top1": est(0.9, 0.8, 0.95)},
                "prefill_buckets": {"0-511": {"kl": est(kl, kl / 2, kl * 2), "top1": est(0.9, 0.8, 0.95)},
                                    "16K-32K": {"kl": est(kl * 2, kl, kl * 3), "top1": est(0.8, 0.7, 0.9)}},
                "decode": {"kl": est(kl * 3, kl, kl * 4), "top1": est(0.85, 0.7, 0.9)}}
    probes = [{"context": 4096, "depth": 0.0, "correct": True}, {"context": 4096, "depth": 1.0, "correct": False}]
    record = {"model": "m", "device": "cpu", "threads": 2, "tokq_commit": "abc",
              "evaluation": {"window": 32768, "windows": 4, "documents": 4, "doc_ids": ["a", "b", "c", "d"],
                             "decode_from": 32704, "decode_tokens": 64},
              "variants": {"fp8-unit": variant(0.01), "fp8-calibrated": variant(0.011)},
              "noise_floor": {"what": "x", "tokens": 63, "decode_kl_mean": 1e-4, "decode_kl_max": 1e-3,
                              "decode_top1": 0.99, "prefill_tokens": 100, "prefill_kl_mean": 0.0},
              "targets": [{"what": "ratio", "target": 0.5, "ratio": 1.1, "conservative_ratio": 4.4, "met": False}],
              "probes": {"needles": 2, "fillers": 1, "contexts": [4096], "n": 2, "prefix_hit_rate": 0.5,
                         "base_by_context": {"4096": 0.5}, "base_grid": mk.accuracy_grid(probes),
                         "variants": {"fp8-unit": {"by_context": {"4096": 0.5}, "comparison": {
                             "n": 2, "b_accuracy": 0.5, "a_right_b_wrong": 0, "a_wrong_b_right": 0, "flip_rate": 0.0,
                             "intervals": {"flip_rate": {"low": 0.0, "high": 0.84}}, "mcnemar_p": 1.0}}}}}
    text = bench.long_markdown(record)
    assert "ratio 1.100 (not met)" in text and "| 16K-32K |" in text and "| fp8-unit | 50.0% | 0 / 2 |" in text
    assert "| 4096 | 100% | 0% | 50% |" in text  # the base's grid: depth 0 right, depth 1 wrong
    bench.plot(record, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_multi_key_probes_through_the_engine_hit_the_prefix_cache_and_answer_as_uncached(tmp_path: Path) -> None:
    from tests.test_models_vs_hf import make_hf_checkpoint
    from tests.test_quantize_cli import WORDS, save_word_tokenizer
    from tokq.engine.checkpoint import load_model
    from tokq.engine.llm_engine import EngineConfig, LLMEngine
    from tokq.engine.tokenizer import load_tokenizer
    from tokq.longctx.documents import Document

    make_hf_checkpoint("llama", tmp_path)
    save_word_tokenizer(tmp_path)
    tok = load_tokenizer(tmp_path)
    rng = torch.Generator().manual_seed(0)
    docs = [Document(doc_id=f"d{i}", path=Path(f"d{i}.txt"), text=" ".join(WORDS[int(j)] for j in torch.randint(0, 180, (300,), generator=rng)))
            for i in range(2)]
    contexts = mk.build_contexts(docs, tok, [160, 256], needles=4, fillers=1, seed=0, add_bos=False)
    assert [len(c.ids) for c in contexts] == [160, 256]

    def run(prefix_caching: bool):
        engine = LLMEngine(load_model(tmp_path, dtype="fp32"),
                           EngineConfig(max_model_len=320, block_size=16, enable_prefix_caching=prefix_caching), tok)
        return mk.run_multi_key_probes(engine, contexts, tok)

    cached, hit_rate = run(True)
    plain, no_hits = run(False)
    assert len(cached) == 8 and no_hits == 0.0
    assert hit_rate > 0.5  # 3 of each context's 4 requests reuse its full blocks
    assert [r["output"] for r in cached] == [r["output"] for r in plain]  # the cache changes no answer
    assert all(r["correct"] == (r["predicted"] == r["key"]) for r in cached)
