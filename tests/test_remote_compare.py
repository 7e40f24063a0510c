"""URL sides in compare/gate (issue 16): the top-k KL bounds (evalsuite.topk_bounds), tokenization agreement
(remote.endpoint_scoring) and end-to-end compares against `tokq serve` on tiny real models."""

from __future__ import annotations

import pytest
import torch

from tokq.evalsuite.topk_bounds import PartialRows, pair_metrics


def _side(logprobs: torch.Tensor, k: int, targets: torch.Tensor) -> PartialRows:
    """What a server reporting its own top-k (and the actual token) gives of a distribution."""
    top = logprobs.topk(k, -1)
    return PartialRows(logprobs.gather(1, targets[:, None])[:, 0], top.indices, top.values, top.values[:, -1],
                       top.indices[:, 0], top.values[:, 0])


def _pair(vocab: int, rows: int, sharp: float, noise: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    la = (torch.randn(rows, vocab, generator=g, dtype=torch.float64) * sharp).log_softmax(-1)
    lb = (la + noise * torch.randn(rows, vocab, generator=g, dtype=torch.float64)).log_softmax(-1)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    return la, lb, targets, (la.exp() * (la - lb)).sum(-1)


@pytest.mark.parametrize("sharp", [0.3, 1.0, 3.0, 6.0])
@pytest.mark.parametrize("k", [1, 3, 20])
def test_lower_bound_never_above_the_true_kl(sharp, k):
    la, lb, targets, true = _pair(100, 300, sharp, 0.7, seed=int(sharp * 10) + k)
    for a_k in (k, 100):  # A remote (its own top-k) or local (everything)
        m = pair_metrics(_side(la, a_k, targets), _side(lb, k, targets), targets)
        assert (m["kl_bound"].double() <= true + 1e-5).all()
        assert (m["kl_estimate"] >= m["kl_bound"]).all()
        # exact metrics stay exact
        torch.testing.assert_close(m["delta_nll"].double(), la.gather(1, targets[:, None])[:, 0]
                                   - lb.gather(1, targets[:, None])[:, 0], atol=1e-5, rtol=0)
        agree = (la.argmax(-1) == lb.argmax(-1)).float()
        assert torch.equal(m["top1"], agree)


def test_bound_is_exact_when_k_is_the_vocabulary():
    la, lb, targets, true = _pair(60, 200, 1.0, 0.5, seed=3)
    m = pair_metrics(_side(la, 60, targets), _side(lb, 60, targets), targets)
    torch.testing.assert_close(m["kl_bound"].double(), true, atol=1e-5, rtol=0)
    torch.testing.assert_close(m["kl_estimate"].double(), true, atol=1e-5, rtol=0)


def test_bound_uses_the_caps_a_remote_candidate_reports():
    """A local A against B's top-k: B's unreported tokens are each <= its k-th value, which makes the bound
    strictly tighter than the plain top-k + rest coarse-graining (the KL of the two partitions' masses)."""
    la, lb, targets, true = _pair(100, 300, 1.0, 0.7, seed=5)
    m = pair_metrics(_side(la, 100, targets), _side(lb, 5, targets), targets)
    top = lb.topk(5, -1).indices
    p, q = la.exp(), lb.exp()
    pk, qk = p.gather(1, top), q.gather(1, top)
    coarse = (pk * (pk / qk).log()).sum(-1) + (1 - pk.sum(-1)) * ((1 - pk.sum(-1)) / (1 - qk.sum(-1))).log()
    assert float(m["kl_bound"].double().mean()) > float(coarse.mean()) * 1.05
    assert float(m["kl_bound"].double().mean()) <= float(true.mean())


def test_estimate_close_on_peaked_distributions():
    la, lb, targets, true = _pair(200, 400, 6.0, 0.5, seed=7)
    m = pair_metrics(_side(la, 20, targets), _side(lb, 20, targets), targets)
    assert abs(float(m["kl_estimate"].double().mean()) / float(true.mean()) - 1) < 0.05



def test_work_scales_with_the_reported_ids_not_the_vocabulary():
    """The bound and the estimate see only the ids either side reported. They were computed over [rows, vocab]
    float64 rows (times 80 bisections): on SmolLM2's 49K vocabulary the client's metrics took minutes, longer than
    both servers' scoring (benchmarks/remote_compare.py). Ids shifted by 2**40 (a vocab-wide row: 256 TiB) give
    the same numbers."""
    la, lb, targets, _ = _pair(80, 70, 2.0, 0.6, seed=7)
    a, b = _side(la, 80, targets), _side(lb, 5, targets)
    b.ids[:, -1] = -1  # padding stays padding
    want = pair_metrics(a, b, targets)
    shift = 2 ** 40

    def shifted(side: PartialRows) -> PartialRows:
        return PartialRows(side.logprob, torch.where(side.ids < 0, -1, side.ids + shift), side.logprobs, side.cap,
                           side.top1 + shift, side.top1_logprob)
    got = pair_metrics(shifted(a), shifted(b), targets + shift)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=0, rtol=0)


# -- end to end against tokq serve ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tests.hostile.conftest import write_word_docs
    from tests.test_models_vs_hf import make_hf_checkpoint
    from tests.test_quantize_cli import save_word_tokenizer

    root = tmp_path_factory.mktemp("remote")
    for name, seed in (("a", 0), ("b", 1)):
        make_hf_checkpoint("llama", root / name, seed=seed)
        save_word_tokenizer(root / name)
    return root, write_word_docs(root / "docs", (200, 150, 300, 120), seed=0)


def _served(checkpoint, name: str):
    from tokq.engine.checkpoint import load_model
    from tokq.engine.llm_engine import EngineConfig, LLMEngine
    from tokq.engine.tokenizer import load_tokenizer
    from tokq.serve.app import build_app
    from tokq.serve.testing import serve_in_thread

    tokenizer = load_tokenizer(checkpoint)
    engine = LLMEngine(load_model(checkpoint, dtype="fp32", device="cpu"),
                       EngineConfig(max_model_len=256, max_num_seqs=4), tokenizer)
    return serve_in_thread(build_app(engine, tokenizer, name))


COMMON = dict(window=64, probes=False, decode_windows=0, dtype="fp32", use_cache=False, resamples=50)


def test_compare_against_tokq_serve_matches_the_local_compare(models):
    import tokq

    root, docs = models
    local = tokq.compare(root / "a", root / "b", data=docs, topk=1000, **COMMON)  # k = vocabulary: exact KL
    assert local["kl_estimator"]["prefill"]["kind"] == "exact"
    with _served(root / "a", "tiny-a") as url_a, _served(root / "b", "tiny-b") as url_b:
        mixed = tokq.compare(root / "a", f"url={url_b}/v1#model=tiny-b", data=docs, thresholds={"max_kl": {None: 100.0}}, **COMMON)
        both = tokq.compare(f"url={url_a}#tokenizer={root / 'a'}", f"url={url_b}/v1", data=docs, **COMMON)
    exact = local["prefill"]["overall"]
    for remote in (mixed, both):
        overall = remote["prefill"]["overall"]
        assert remote["kl_estimator"]["estimator"] == "remote top-k lower bound"
        assert remote["kl_estimator"]["prefill"]["kind"] == "lower_bound"
        assert remote["windows"]["scored_tokens"] == local["windows"]["scored_tokens"]
        assert abs(overall["delta_nll"]["value"] - exact["delta_nll"]["value"]) < 1e-4
        assert overall["top1"]["value"] == pytest.approx(exact["top1"]["value"], abs=1e-6)
        assert overall["kl"]["value"] <= exact["kl"]["value"] + 1e-6
        assert overall["kl_estimate"]["value"] >= overall["kl"]["value"]
    assert both["kl_estimator"]["remote"]["a"]["mode"] == "prompt_logprobs"
    # a KL rule on a lower bound is never a pass: a lenient one is inconclusive
    rule = next(t for t in mixed["thresholds"] if t["name"] == "max_kl")
    assert not rule["passed"] and rule["inconclusive"]


def test_a_lower_bound_above_the_limit_fails_the_kl_rule(models):
    import tokq

    root, docs = models
    with _served(root / "b", "tiny-b") as url_b:
        result = tokq.compare(root / "a", f"url={url_b}", data=docs, thresholds={"max_kl": {None: 1e-6}}, **COMMON)
    rule = next(t for t in result["thresholds"] if t["name"] == "max_kl")
    assert not rule["passed"] and not rule.get("inconclusive")
    assert result.exit_code == 1


def test_tokenization_mismatch_names_the_position_and_both_tokens(models):
    from dataclasses import replace

    from tokq.engine.tokenizer import load_tokenizer
    from tokq.errors import DataError
    from tokq.longctx.windows import TokenWindow
    from tokq.remote.endpoint_scoring import EndpointScorer, parse_side

    root, _ = models
    tokenizer = load_tokenizer(root / "a")
    from tests.test_quantize_cli import WORDS

    tokens = tokenizer.encode(" ".join(WORDS[:12]), add_special_tokens=False)
    window = TokenWindow(doc_id="d", start=0, tokens=tokens, score_from=1, window_index=0, has_bos=False)
    with _served(root / "a", "tiny-a") as url:
        scorer = EndpointScorer(parse_side(f"url={url}"), tokenizer)
        scorer.score([window])  # agrees with itself
        answer = scorer._post(window.tokens)
        other = list(tokens)
        other[5] = (other[5] + 1) % len(tokenizer)
        with pytest.raises(DataError, match=r"at position 5 .* same tokenizer"):
            scorer._rows(replace(window, tokens=other), answer)


def test_url_variant_in_tokq_toml(tmp_path, models):
    from tokq.config import load_project
    from tokq.errors import ConfigError

    path = tmp_path / "tokq.toml"
    path.write_text('[base]\nmodel = "m"\n[variants]\nprod = { url = "http://127.0.0.1:8000/v1", model = "served" }\n'
                    '[gate.quality]\nmax_kl = 0.05\n')
    variant = load_project(path).variants["prod"]
    assert variant.side == "url=http://127.0.0.1:8000/v1#model=served"
    path.write_text('[base]\nmodel = "m"\n[variants]\nprod = { url = "http://x:1", recipe = { method = "rtn" } }\n'
                    '[gate.quality]\nmax_kl = 0.05\n')
    with pytest.raises(ConfigError, match=r"tokq.toml:4.*cannot be quantized"):
        load_project(path)


def test_compare_help_shows_the_url_syntax(capsys):
    """The URL syntax's optional parts were written in brackets, which rich read as markup: `tokq compare --help`
    crashed (MarkupError: closing tag '[/v1]')."""
    from tokq.cli import main

    assert main(["compare", "--help"]) == 0
    out = capsys.readouterr().out
    assert "#model=NAME&tokenizer=DIR&topk=K" in out
