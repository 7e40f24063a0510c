"""Issue 20: GPTQ's MSE-searched group scales, calibration drawn as a mix of sources, and the calibration
distance that compare and the gate report (with its warning) — on tiny random models and word-level documents."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.test_models_vs_hf import make_hf_checkpoint
from tests.test_quantize_cli import WORDS, save_word_tokenizer
from tokq.cli import main
from tokq.errors import ConfigError
from tokq.evalsuite.calibration_distance import (
    FAR_EXCESS,
    TokenHistogram,
    token_distance,
    token_histogram,
    unigram_js,
)
from tokq.quantization.calibration import mixed_sample, source_of
from tokq.quantization.gptq_solver import gptq_quantize
from tokq.quantization.rounding import MSE_CLIP_RATIOS, MSE_NORM, int_qparams, mse_qparams
from tokq.quantization.scheme import preset


def w4(group_size: int = 32, symmetric: bool = True):
    return preset("w4a16").with_weights(group_size=group_size, symmetric=symmetric).weights


def group_error(w: torch.Tensor, args, scale: torch.Tensor, zero, norm: float) -> torch.Tensor:
    """sum |w - q|^norm per (row, group) on the given grid."""
    n, k = w.shape
    g = w.reshape(n, -1, args.group_size)
    z = 0.0 if zero is None else zero.float().unsqueeze(-1)
    q = (torch.round(g / scale.unsqueeze(-1) + z).clamp(args.qmin, args.qmax) - z) * scale.unsqueeze(-1)
    return (q - g).abs().pow(norm).sum(-1)


@pytest.mark.parametrize("symmetric", [True, False])
def test_mse_scales_are_the_best_of_the_searched_ratios(symmetric):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 128, generator=gen) * torch.rand(24, 1, generator=gen)
    w[3, 5] = 9.0  # an outlier: clipping it costs more than the finer grid saves, so its symmetric group keeps min/max
    args = w4(32, symmetric)
    scale, zero = mse_qparams(w, args)
    best = group_error(w, args, scale, zero, MSE_NORM)
    for ratio in MSE_CLIP_RATIOS:
        s, z = int_qparams(w, args, ratio)
        assert (best <= group_error(w, args, s, z, MSE_NORM) * (1 + 1e-6) + 1e-12).all()
    minmax = group_error(w, args, *int_qparams(w, args), MSE_NORM)
    assert best.sum() < minmax.sum() and (best < minmax).any()
    assert best[3, 0] == minmax[3, 0] or not symmetric
    assert scale.shape == (24, 4) and (zero is None) == symmetric


def test_gptq_mse_scales_lower_the_output_error_and_bad_names_are_refused():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 128, generator=gen) * torch.linspace(0.2, 3.0, 128)  # uneven input energy
    h = 2 * x.t() @ x / x.shape[0]
    w = torch.distributions.StudentT(4.0).sample((64, 128))  # heavy-tailed, as trained weights are
    args = w4(32)
    for act_order in (True, False):
        mse = gptq_quantize(w, h, args, act_order=act_order, scale_search="mse")
        minmax = gptq_quantize(w, h, args, act_order=act_order, scale_search="minmax")
        assert mse.proxy_error < 0.97 * minmax.proxy_error, (act_order, mse.proxy_error, minmax.proxy_error)
        deq = mse.weight.dequantize()
        assert deq.shape == w.shape and torch.isfinite(deq).all()
    with pytest.raises(ConfigError, match="scale search"):
        gptq_quantize(w, h, args, scale_search="median")


def test_sources_and_the_mixed_draw():
    assert source_of("python-doc/library.txt") == "python-doc"
    assert source_of("notes.jsonl#L3") == "notes.jsonl" and source_of("a.txt") == "a.txt"

    class W:
        def __init__(self, doc_id: str):
            self.doc_id = doc_id

    windows = [W("big/x.txt") for _ in range(100)] + [W("mid/y.txt") for _ in range(6)] + [W("small.txt")] * 2
    picked = mixed_sample(windows, 12, random.Random(0))
    counts = {s: sum(source_of(w.doc_id) == s for w in picked) for s in ("big", "mid", "small.txt")}
    assert counts == {"big": 5, "mid": 5, "small.txt": 2}  # the small source's spare turns go to the others
    again = mixed_sample(windows, 12, random.Random(0))
    assert [id(w) for w in again] == [id(w) for w in picked]  # seeded
    assert len(mixed_sample(windows, 500, random.Random(0))) == len(windows)  # fewer than asked: all of them


def test_js_distance():
    a = token_histogram(torch.tensor([1, 1, 2, 3]))
    assert a == TokenHistogram((1, 2, 3), (2, 1, 1)) and TokenHistogram.from_json(a.to_json()) == a
    assert unigram_js(a, a) == 0.0
    assert unigram_js(a, token_histogram(torch.tensor([7, 8]))) == pytest.approx(1.0)
    b = token_histogram(torch.tensor([1, 2, 2, 9]))
    assert 0 < unigram_js(a, b) < 1 and unigram_js(a, b) == pytest.approx(unigram_js(b, a))
    with pytest.raises(ValueError):
        TokenHistogram.from_json({"ids": [1, 2], "counts": [1]})


def test_the_distance_discounts_sample_size():
    """Two samples of one distribution: the raw JS grows as the samples shrink, the excess stays near 0; samples of
    two different distributions keep a large excess at every size."""
    gen = torch.Generator().manual_seed(0)
    zipf = 1.0 / torch.arange(1, 2001, dtype=torch.float64)
    other = zipf[torch.randperm(2000, generator=gen)]  # the same shape over other tokens
    def draw(p, n):
        return token_histogram(torch.multinomial(p, n, replacement=True, generator=gen))
    small, large = token_distance(draw(zipf, 500), draw(zipf, 500)), token_distance(draw(zipf, 20000), draw(zipf, 20000))
    assert small["js_bits"] > 2 * large["js_bits"]
    assert abs(small["excess_bits"]) < 0.05 and abs(large["excess_bits"]) < 0.02
    for n in (500, 20000):
        assert token_distance(draw(zipf, n), draw(other, n))["excess_bits"] > 0.3


@pytest.fixture(scope="module")
def two_domains(tmp_path_factory) -> dict[str, Path]:
    """A tiny model, calibration documents in two sources of the first half of the vocabulary, and documents of
    the other half (another 'domain')."""
    root = tmp_path_factory.mktemp("shift")
    model = root / "model"
    make_hf_checkpoint("llama", model, seed=0)
    save_word_tokenizer(model)
    rng = random.Random(0)
    near, far = WORDS[:90], WORDS[90:]
    calib = root / "calib"
    for source, n in (("manual", 3), ("notes", 1)):
        (calib / source).mkdir(parents=True)
        for i in range(n):
            (calib / source / f"d{i}.txt").write_text(" ".join(rng.choice(near) for _ in range(600)) + "\n")
    other = root / "other"
    other.mkdir()
    for i in range(3):
        (other / f"d{i}.txt").write_text(" ".join(rng.choice(far) for _ in range(400)) + "\n")
    return {"model": model, "calib": calib, "other": other, "root": root}


def test_quantize_records_sources_and_compare_warns_when_far(capsys, two_domains, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = two_domains
    out = tmp_path / "gptq"
    code = main(["quantize", "--model", str(d["model"]), "--out", str(out), "--method", "gptq", "--group-size", "32",
                 "--calib", str(d["calib"]), "--num-samples", "6", "--seq-len", "64", "--threads", "1"])
    text = capsys.readouterr()
    assert code == 0, text.err
    assert "(manual 192, notes 192)" in " ".join(text.err.split())
    record = json.loads((out / "tokq_quantization.json").read_text())
    calibration = record["result"]["calibration"]
    # 6 windows as a mix: 3 from each source, although `manual` holds three times the text of `notes`
    assert calibration["source_tokens"] == {"manual": 3 * 64, "notes": 3 * 64}
    assert record["calibration_tokens"]["tokens"] == 6 * 64
    assert record["result"]["options"]["gptq_scale_search"] == "mse"

    def compare(data: Path) -> tuple[dict, str]:
        folder = tmp_path / f"report-{data.name}"
        code = main(["compare", str(d["model"]), str(out), "--data", str(data), "--window", "64", "--threads", "1",
                     "--dtype", "fp32", "--no-probes", "--decode-windows", "0", "--resamples", "100",
                     "--report-dir", str(folder)])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        text = captured.err + (folder / "report.md").read_text() + (folder / "report.html").read_text()
        return json.loads((folder / "report.json").read_text()), text

    far, far_text = compare(d["other"])
    distance = far["calibration_distance"]["b"]
    assert distance["js_bits"] > 0.9 and distance["excess_bits"] > 0.5 and distance["far"]
    assert distance["threshold"] == FAR_EXCESS
    assert "a" not in far["calibration_distance"]  # the 16-bit side was never calibrated
    assert "calibrated on documents far from these" in far_text and "**Warning:**" in far_text
    assert far_text.count("calibrated on documents far from these") == 3  # console, report.md, report.html
    near, near_text = compare(d["calib"])
    assert near["calibration_distance"]["b"]["excess_bits"] < FAR_EXCESS and not near["calibration_distance"]["b"]["far"]
    assert "far from these" not in near_text and "calibrated on" in near_text
