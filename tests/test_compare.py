"""`tokq compare` on tiny checkpoints with a real word-level tokenizer: the self-comparison floor, a damaged
candidate failing its threshold, the baseline cache (hit, corruption), per-token metrics against a direct
computation, and bad input."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.test_models_vs_hf import make_hf_checkpoint
from tests.test_quantize_cli import WORDS, save_word_tokenizer
from tokq.cli import main
from tokq.evalsuite.ab import BaselineWindow, token_metrics
from tokq.evalsuite.quality_rules import evaluate_thresholds
from tokq.evalsuite.stats.exact import clopper_pearson, proportion


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, seed in (("a", 0), ("other", 1)):
        path = root / name
        make_hf_checkpoint("llama", path, seed=seed)
        save_word_tokenizer(path)
        out[name] = path
    return out


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("docs")
    rng = random.Random(0)
    for i, n in enumerate((700, 300, 90, 500)):
        (folder / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(n)) + "\n")
    return folder


def compare(capsys, a, b, docs, tmp_path, *extra) -> tuple[int, dict | None, str]:
    out = tmp_path / "cmp.json"
    code = main(["compare", str(a), str(b), "--data", str(docs), "--window", "128", "--threads", "1", "--dtype",
                 "fp32", "--no-probes", "--decode-tokens", "16", "--resamples", "200", "--json", str(out),
                 *map(str, extra)])
    captured = capsys.readouterr()
    return code, json.loads(out.read_text()) if out.exists() else None, captured.out + captured.err


def test_self_comparison_is_the_noise_floor(capsys, models, docs, tmp_path):
    code, result, text = compare(capsys, models["a"], models["a"], docs, tmp_path, "--max-kl", "1e-6",
                                 "--min-top1", "0.999")
    assert code == 0, text
    overall = result["prefill"]["overall"]
    assert overall["kl"]["high"] < 1e-6 and overall["top1"]["value"] == 1.0
    assert abs(overall["ppl_ratio"]["value"] - 1) < 1e-5
    assert result["windows"]["documents"] == 4 and result["data"]["shorter_than_window"] == 1  # 90 words: whole
    assert result["noise_floor"]["tokens"] >= 2 * 16 and result["noise_floor"]["kl_mean"] < 1e-6  # fp32 kernels
    assert "PASS" in text and "| KL(A‖B) |" in text


def test_damaged_candidate_fails_on_the_ci_bound(capsys, models, docs, tmp_path):
    code, result, text = compare(capsys, models["a"], models["other"], docs, tmp_path, "--max-kl", "0.01",
                                 "--max-ppl-ratio", "100")
    assert code == 1, text
    failed = {t["name"]: t for t in result["thresholds"]}
    assert not failed["max_kl"]["passed"] and failed["max_ppl_ratio"]["passed"]
    kl = result["prefill"]["overall"]["kl"]
    assert kl["low"] <= kl["value"] <= kl["high"] and kl["value"] > 0.01
    assert set(result["prefill"]["buckets"]) == {"0-511"} and result["decode"]["windows"] == 2
    assert "REGRESSION" in text and "**FAIL**" in text


def test_baseline_cache_hit_and_corruption(capsys, models, docs, tmp_path, caplog):
    first = compare(capsys, models["a"], models["other"], docs, tmp_path / "1")
    second = compare(capsys, models["a"], models["other"], docs, tmp_path / "2")
    assert not first[1]["cache"]["hit"] and second[1]["cache"]["hit"] and second[1]["cache"]["bytes"] > 0
    assert first[1]["prefill"]["overall"] == second[1]["prefill"]["overall"]
    assert first[1]["noise_floor"] == second[1]["noise_floor"]
    data = Path(second[1]["cache"]["path"]) / "scores.safetensors"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    third = compare(capsys, models["a"], models["other"], docs, tmp_path / "3")
    assert not third[1]["cache"]["hit"] and "checksum" in caplog.text
    assert third[1]["prefill"]["overall"] == first[1]["prefill"]["overall"]
    fourth = compare(capsys, models["a"], models["other"], docs, tmp_path / "4", "--no-cache")
    assert not fourth[1]["cache"]["hit"] and not fourth[1]["cache"]["enabled"]


def test_token_metrics_against_full_distributions():
    """With k = the whole vocabulary the bucketed KL is the exact KL; with a smaller k it is a lower bound."""
    g = torch.Generator().manual_seed(0)
    la, lb = torch.log_softmax(torch.randn(6, 50, generator=g) * 2, -1), torch.log_softmax(torch.randn(6, 50, generator=g), -1)
    actual = torch.randint(0, 50, (6,), generator=g)
    exact_kl = (la.exp() * (la - lb)).sum(-1)
    for k in (50, 10):
        vals, ids = la.topk(k, -1)
        base = BaselineWindow(la.gather(1, actual[:, None])[:, 0], ids, vals)
        m = token_metrics(base, lb.gather(1, actual[:, None])[:, 0], lb.max(-1).values, lb.gather(1, ids))
        if k == 50:
            assert torch.allclose(m["kl_topk"], exact_kl.float(), atol=1e-5)
            assert torch.allclose(m["accept"], torch.minimum(la.exp(), lb.exp()).sum(-1).float(), atol=1e-5)
        else:
            assert (m["kl_topk"] <= exact_kl.float() + 1e-6).all() and (m["kl_topk"] > 0).all()
        assert torch.equal(m["top1"], (la.argmax(-1) == lb.argmax(-1)).float())
        assert torch.allclose(m["delta_nll"], (la - lb).gather(1, actual[:, None])[:, 0].float())
    # ties: B's two best tokens are equal and A's argmax is the second of them -> still agreement
    tied = torch.tensor([[0.0, 0.0, -5.0]]).log_softmax(-1)
    base = BaselineWindow(tied[:, 1], torch.tensor([[1, 0, 2]]), tied[:, [1, 0, 2]])
    assert token_metrics(base, tied[:, 1], tied.max(-1).values, tied[:, [1, 0, 2]])["top1"].item() == 1.0


@pytest.mark.parametrize("case", ["tokenizer", "window", "empty", "threshold", "bucket"])
def test_bad_input_exits_2(capsys, models, docs, tmp_path, case):
    args = []
    if case == "tokenizer":
        other = tmp_path / "other"
        make_hf_checkpoint("llama", other, seed=2)
        from tests.test_windows import tiny_hf_tokenizer
        tiny_hf_tokenizer().save_pretrained(str(other))
        b, message = other, "different tokenizers"
    elif case == "window":
        b, message, args = models["a"], "exceeds the models' context of 512 tokens", ["--window", "1024"]
    elif case == "empty":
        empty = tmp_path / "empty"
        empty.mkdir()
        (empty / "x.bin").write_bytes(b"\x00\x01" * 100)
        b, message, docs = models["a"], "no usable", empty
    elif case == "threshold":
        b, message, args = models["a"], "--max-kl 'lots'", ["--max-kl", "lots"]
    else:
        b, message, args = models["a"], "names bucket '8K-16K'", ["--max-kl", "8K-16K=0.1"]
    out = tmp_path / "cmp.json"
    code = main(["compare", str(models["a"]), str(b), "--data", str(docs), "--window", "128", "--threads", "1",
                 "--no-probes", "--dtype", "fp32", "--json", str(out), *args])
    err = capsys.readouterr().err.replace("\n", " ")
    assert code == 2 and message in err, err
    assert not out.exists()


def test_probes_and_a_kv_cache_difference(capsys, models, docs, tmp_path):
    """The model against itself on an fp8 KV cache: the difference shows (above the fp32 noise floor), and the
    retrieval probes of both run on the same prompts."""
    out = tmp_path / "cmp.json"
    code = main(["compare", str(models["a"]), str(models["a"]), "--data", str(docs), "--window", "128", "--threads",
                 "1", "--dtype", "fp32", "--b-kv-dtype", "fp8", "--decode-tokens", "16", "--resamples", "100",
                 "--probe-max-context", "120", "--probe-depths", "3", "--probe-repeats", "2", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["kv_dtype"] == {"a": "auto", "b": "fp8"}
    assert result["kv_cache"]["b"]["dtype"] == "fp8_e4m3fn" and result["kv_cache"]["b"]["scales"].startswith(
        "fp8 KV with scale 1")  # the checkpoint has no calibrated scales: the report says so
    assert result["decode"]["overall"]["kl"]["value"] > 100 * max(result["noise_floor"]["kl_mean"], 1e-9)
    probes = result["probes"]
    assert probes["n"] == 1 * 3 * 2 and probes["a_right_b_wrong"] + probes["a_wrong_b_right"] <= probes["n"]
    assert result["settings"]["probe_repeats"] == 2 and result["settings"]["probe_depths"] == [0.0, 0.5, 1.0]
    assert set(probes["a_grid"]) == set(probes["b_grid"]) and 0 <= probes["mcnemar_p"] <= 1
    assert set(probes["a_grid"]["120"]) == {"0.00", "0.50", "1.00"}
    for name, count in (("flip_rate", probes["a_right_b_wrong"]), ("a_accuracy", round(probes["a_accuracy"] * 6)),
                        ("b_accuracy", round(probes["b_accuracy"] * 6))):
        ci = probes["intervals"][name]
        assert (ci["low"], ci["high"]) == pytest.approx(clopper_pearson(count, 6)) and ci["n_docs"] == 6
        assert ci["low"] <= ci["value"] <= ci["high"] and ci["method"].startswith("exact")


def test_undecidable_thresholds_are_refused_before_scoring(capsys, models, docs, tmp_path):
    """Five probes cannot show a flip rate below 0.25 (0 flips: upper bound 0.52); --no-probes cannot show any."""
    base = ["compare", str(models["a"]), str(models["a"]), "--data", str(docs), "--window", "128", "--threads", "1",
            "--probe-max-context", "120", "--json", str(tmp_path / "cmp.json")]
    assert main([*base, "--max-flip-rate", "0.25"]) == 2
    err = capsys.readouterr().err.replace("\n", " ")
    assert "--max-flip-rate 0.25 cannot pass with the 5 retrieval probes of this run" in err
    assert "needs at least 13 probes (has 5): raise --probe-repeats / --probe-depths" in err
    assert main([*base, "--no-probes", "--max-flip-rate", "0.5"]) == 2
    assert "0 retrieval probes" in capsys.readouterr().err
    assert main([*base, "--min-top1", "0"]) == 2
    assert "cannot fail" in capsys.readouterr().err
    assert main([*base, "--probe-repeats", "0"]) == 2
    assert "--probe-repeats 0: must be >= 1" in capsys.readouterr().err.replace("\n", " ")
    assert not (tmp_path / "cmp.json").exists()


def probe_result(n: int, flips: int) -> dict:
    """What evaluate_thresholds reads of a compare result with n probes, `flips` of them A right and B wrong."""
    ci = proportion(flips, n).to_json()
    return {"probes": {"n": n, "flip_rate": flips / n, "intervals": {"flip_rate": ci}}, "prefill": {}}


@pytest.mark.parametrize("n,flips,on,outcome", [
    (5, 0, "bound", "inconclusive"),  # upper bound 0.52 even with no flip: 5 probes cannot show < 0.25
    (5, 0, "point", "pass"),
    (5, 5, "bound", "fail"),  # lower bound 0.48 > 0.25: shown above the limit, whatever the probe count
    (20, 0, "bound", "pass"),
    (20, 1, "bound", "pass"),  # upper bound 0.249
    (20, 2, "bound", "inconclusive"),  # [0.012, 0.317] holds 0.25: neither shown below nor above it
    (20, 9, "bound", "inconclusive"),  # [0.231, 0.685]: still holds it
    (20, 10, "bound", "fail"),  # [0.272, 0.728]: shown above the limit
])
def test_flip_rate_decides_on_the_exact_bound(n, flips, on, outcome):
    (row,) = evaluate_thresholds(probe_result(n, flips), {"max_flip_rate": {None: 0.25}}, on)
    got = "pass" if row["passed"] else "inconclusive" if row.get("inconclusive") else "fail"
    assert got == outcome, row
    assert row["high"] == pytest.approx(clopper_pearson(flips, n)[1]) and row["value"] == flips / n
    if outcome == "inconclusive":
        assert ("needs at least 13 probes" if flips == 0 else "holds the threshold") in row["rule"]


def test_threshold_verdicts_the_data_cannot_give():
    (none,) = evaluate_thresholds({"probes": None}, {"max_flip_rate": {None: 0.25}})
    assert not none["passed"] and none["inconclusive"] and "no retrieval probes ran" in none["rule"]
    one_doc = {"value": 0.2, "low": 0.0, "high": None, "n_tokens": 100, "n_docs": 1}  # JSON's infinite bound
    result = {"prefill": {"overall": {"kl": one_doc, "kl_p95": {**one_doc, "low": 0.3, "high": 0.4, "n_docs": 30}},
                          "buckets": {}}}
    (row,) = evaluate_thresholds(result, {"max_kl": {None: 0.5}})
    assert not row["passed"] and row["inconclusive"] and "1 document gives no interval" in row["rule"]
    assert row["high"] is None
    (tail,) = evaluate_thresholds(result, {"max_kl_p95": {None: 0.5}})
    assert tail["passed"] and tail["metric"] == "kl_p95"
    # with the KL estimated from a sample of positions, per-token quantiles are of the top-k lower bound
    result["kl_estimator"] = {"prefill": {"kind": "estimated"}}
    (bound,) = evaluate_thresholds(result, {"max_kl_p95": {None: 0.5}})
    assert not bound["passed"] and bound["inconclusive"] and "lower bound" in bound["rule"]
    (shown,) = evaluate_thresholds(result, {"max_kl_p95": {None: 0.01}})  # the lower bound itself is above
    assert not shown["passed"] and not shown["inconclusive"]


def test_thresholds_default_from_tokq_toml(capsys, models, docs, tmp_path, monkeypatch):
    config = tmp_path / "tokq.toml"
    monkeypatch.setenv("TOKQ_CONFIG", str(config))
    config.write_text('[compare.thresholds]\nmax_kl = { overall = 0.01, "0-511" = 0.02 }\nmin_top1 = 0.5\n')
    code, result, text = compare(capsys, models["a"], models["other"], docs, tmp_path)
    assert code == 1, text
    assert {(t["name"], t["bucket"]) for t in result["thresholds"]} == {("max_kl", None), ("max_kl", "0-511"),
                                                                      ("min_top1", None)}
    code, result, _ = compare(capsys, models["a"], models["other"], docs, tmp_path, "--max-kl", "100")
    assert {(t["name"], t["bucket"]) for t in result["thresholds"]} == {("max_kl", None), ("min_top1", None)}
    config.write_text('[compare.thresholds]\nmax_kl = "small"\n')
    code, _, text = compare(capsys, models["a"], models["other"], docs, tmp_path)
    assert code == 2 and "max_kl = 'small' must be a number" in text


def test_report_folder(capsys, models, docs, tmp_path, monkeypatch):
    """--report-dir writes report.json/.md/.html (plots inline)/junit.xml; `tokq report` re-renders them."""
    from xml.etree import ElementTree as ET

    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    folder = tmp_path / "report"
    code, result, _ = compare(capsys, models["a"], models["other"], docs, tmp_path, "--max-kl", "0.01",
                              "--max-rms-delta-p", "0.99", "--report-dir", folder)
    assert code == 1
    assert sorted(p.name for p in folder.iterdir()) == [".tokq-owner.json", "junit.xml", "report.html", "report.json",
                                                        "report.md"]
    markdown = (folder / "report.md").read_text()
    assert "| scope | KL p90 | KL p95 | KL p99 | KL p99.9 | KL max | RMS Δp |" in markdown
    assert "| max_rms_delta_p 0.99 | overall | pass |" in markdown and "Few documents" in markdown
    page = (folder / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 3 and "REGRESSION" in page
    suite = ET.parse(folder / "junit.xml").getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert suite.get("tests") == "2" and suite.get("failures") == "1"
    assert [c.find("failure") is not None for c in cases] == [True, False]
    assert "REGRESSION" in summary.read_text()
    written = summary.read_text()
    (folder / "report.html").unlink()
    assert main(["report", str(folder)]) == 0
    assert (folder / "report.html").read_text().count("data:image/png") == 3
    assert summary.read_text() == written  # a re-render does not post the summary twice
    assert main(["report", str(tmp_path / "nowhere")]) == 2


@pytest.mark.parametrize("value", ["nan", "inf", "4K-8K=nan"])
def test_non_finite_command_line_threshold_is_refused(value):
    from tokq.commands.compare import _thresholds
    from tokq.errors import ConfigError

    # nan compares false with everything, so it would pass any estimate: refused like nan in tokq.toml
    with pytest.raises(ConfigError, match="finite"):
        _thresholds({"max_kl": [value]})
    assert _thresholds({"max_kl": ["0.1", "4K-8K=0.2"]}) == {"max_kl": {None: 0.1, "4K-8K": 0.2}}
