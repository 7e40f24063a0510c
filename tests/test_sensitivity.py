"""tokq sensitivity (tokq.mixed.sensitivity, tokq.api.sensitivity, the CLI) on a tiny random llama: an unquantized
candidate costs exactly nothing, int4 costs more than int8, a block costs about what its Linears do, the JSON
round-trips, and the command writes its JSON and report or refuses bad data in one line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tests.test_models_vs_hf import make_hf_checkpoint
from tests.test_quantize_cli import WORDS, save_word_tokenizer
from tokq.cli import main
from tokq.engine.checkpoint import load_model
from tokq.engine.layers import DENSE as DENSE_METHOD
from tokq.engine.tokenizer import load_tokenizer
from tokq.longctx.documents import load_documents
from tokq.longctx.text_encoding import as_text_encoder
from tokq.longctx.windows import build_windows
from tokq.mixed.sensitivity import SensitivityResult, measure_sensitivity
from tokq.quantization.layer_schemes import DENSE, candidate_linears
from tokq.quantization.pipeline import resolve_scheme


def _docs(folder: Path, n: int = 6, words: int = 100) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for i in range(n):
        (folder / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(words)) + "\n")
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "llama"
    make_hf_checkpoint("llama", path)
    save_word_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> Path:
    return _docs(tmp_path_factory.mktemp("docs") / "docs")


def _setup(checkpoint: Path, docs: Path):
    model = load_model(checkpoint, dtype="fp32")
    windows = build_windows(load_documents(docs).documents, as_text_encoder(load_tokenizer(checkpoint), False), 64)
    schemes = {k: resolve_scheme("rtn", model.config, k)[0] for k in ("w4a16", "w8a16")}
    return model, windows, schemes


@pytest.fixture(scope="module")
def measured(checkpoint, docs, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # module-scoped: made before the per-test TOKQ_HOME is set
        mp.setenv("TOKQ_HOME", str(tmp_path_factory.mktemp("home")))
        model, windows, schemes = _setup(checkpoint, docs)
        return measure_sensitivity(model, windows, schemes, full_kl_rows=64)


def test_the_unquantized_model_costs_exactly_nothing_also_from_the_cached_base(checkpoint, docs):
    model, windows, schemes = _setup(checkpoint, docs)
    before = model.logits(torch.tensor([windows.windows[0].tokens]))
    first = measure_sensitivity(model, windows, {"w8a16": schemes["w8a16"]}, wide_gain=False, blocks=False)
    again = measure_sensitivity(model, windows, {"w8a16": schemes["w8a16"]}, wide_gain=False, blocks=False)
    assert not any("baseline cache" in n for n in first.notes)
    assert any("read from the baseline cache" in n for n in again.notes)
    for result in (first, again):
        assert result.floor["kl"].value == 0.0 and result.floor["kl"].high == 0.0
        assert result.floor["top1"].value == 1.0
        assert result.floor["delta_nll"].value == 0.0
        assert all(costs[DENSE] == 0.0 for costs in result.linear_costs().values())
    # the model is handed back as it came: every Linear dense, the same logits
    assert all(model.get_submodule(n).method is DENSE_METHOD for n in candidate_linears(model))
    assert torch.equal(model.logits(torch.tensor([windows.windows[0].tokens])), before)


def test_the_kl_beyond_the_top_k_is_measured_on_whole_rows(checkpoint, docs, measured):
    """top-k 16 of 211 tokens: with every row kept whole (π = 1) the KL is the exact one of top-k = vocabulary
    (up to the bf16 tail); a sample of rows estimates it; both give the unquantized model KL 0 exactly."""
    model, windows, schemes = _setup(checkpoint, docs)
    exact = measured.linear_costs()
    n = measured.windows["scored_tokens"]
    for rows, tolerance in ((n, 0.01), (n // 3, 0.5)):
        result = measure_sensitivity(model, windows, {"w4a16": schemes["w4a16"]}, wide_gain=False, blocks=False,
                                     topk=16, full_kl_rows=rows)
        assert result.windows["kl"] == ("exact" if rows == n else "estimated")
        assert result.floor["kl"].value == 0.0 and result.floor["top1"].value == 1.0
        for name, costs in result.linear_costs().items():
            assert abs(costs["w4a16"] / exact[name]["w4a16"] - 1) < tolerance, (rows, name, costs, exact[name])


def test_int4_costs_more_than_int8_for_every_linear(measured):
    costs = measured.linear_costs()
    assert len(costs) == 12  # 3 layers x (qkv, o, gate_up, down)
    ratios = []
    for name, c in costs.items():
        assert c["w4a16"] > 0, name
        assert c["w8a16"] < c["w4a16"] / 4, (name, c)
        ratios.append(c["w4a16"] / max(c["w8a16"], 1e-12))
    assert sorted(ratios)[len(ratios) // 2] > 20  # int8's rounding error is ~16x smaller: its KL ~100x
    w4 = measured.unit("model.layers.0.self_attn.qkv_proj", "w4a16").alone
    assert 0 <= w4["kl"].low <= w4["kl"].value <= w4["kl"].high
    assert w4["kl"].n_docs == 6 and w4["kl"].n_tokens == measured.windows["scored_tokens"]


def test_a_block_costs_about_what_its_linears_cost(measured):
    for b in range(3):
        block = measured.unit(f"model.layers.{b}", "w4a16").alone["kl"].value
        parts = sum(u.alone["kl"].value for u in measured.units
                    if u.kind == "linear" and u.fmt == "w4a16" and u.unit.startswith(f"model.layers.{b}."))
        assert 0.25 < block / parts < 4, (b, block, parts)
    everything = measured.all_quantized["w4a16"]["kl"].value
    assert everything > max(u.alone["kl"].value for u in measured.units if u.fmt == "w4a16")


def test_keeping_a_unit_wide_gains_what_it_costs_roughly(measured):
    for u in measured.units:
        assert u.wide_gain is not None and set(u.wide_gain) == {"kl", "top1", "delta_nll"}
    # keeping every block but one wide is not measured; keeping one block wide must recover a real part of the KL
    gains = [measured.unit(f"model.layers.{b}", "w4a16").wide_gain["kl"].value for b in range(3)]
    assert all(g > 0 for g in gains)
    assert sum(gains) < 3 * measured.all_quantized["w4a16"]["kl"].value


def test_bytes_per_format(measured, checkpoint):
    shapes = candidate_linears(load_model(checkpoint, dtype="fp32"))
    assert set(measured.bytes) == set(shapes)
    for name, sizes in measured.bytes.items():
        out, inp = shapes[name]
        assert sizes[DENSE] == out * inp * 2
        assert out * inp // 2 < sizes["w4a16"] < sizes["w8a16"] < sizes[DENSE]


def test_the_json_round_trips(measured):
    data = measured.to_json()
    text = json.dumps(data, allow_nan=False)  # strict JSON: NaN/inf written as null
    back = SensitivityResult.from_json(json.loads(text))
    assert back.to_json() == data
    assert back.linear_costs() == measured.linear_costs()
    assert back.schemes == measured.schemes
    assert {u["kind"] for u in data["units"]} == {"linear", "block"}
    assert data["windows"]["documents"] == 6 and data["windows"]["kl"] == "exact"


def test_cli_writes_json_and_a_report_with_a_plot(checkpoint, docs, tmp_path, capsys):
    out, report = tmp_path / "s.json", tmp_path / "report"
    code = main(["sensitivity", str(checkpoint), "--data", str(docs), "--window", "64", "--windows", "6",
                 "--json", str(out), "--report-dir", str(report), "--resamples", "200"])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["formats"] == ["w4a16", "w8a16"]
    assert len(data["units"]) == 2 * (12 + 3)
    assert data["windows"]["count"] == 6
    assert json.loads((report / "report.json").read_text())["units"] == data["units"]
    html = (report / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') >= 3  # alone, keep-wide gain, blocks
    assert "model.layers.0.self_attn.qkv_proj" in html
    printed = capsys.readouterr().out
    assert "most sensitive units" in printed and "self_attn.qkv_proj" in printed


@pytest.mark.parametrize("case", ["missing", "empty"])
def test_cli_refuses_missing_or_empty_data_in_one_line(checkpoint, tmp_path, capsys, case):
    folder = tmp_path / "docs"
    if case == "empty":
        folder.mkdir()
    code = main(["sensitivity", str(checkpoint), "--data", str(folder), "--json", str(tmp_path / "s.json")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1, err
    assert str(folder) in err.replace("\n", "")
    assert not (tmp_path / "s.json").exists()


def test_a_16_bit_format_is_refused(checkpoint, docs, tmp_path, capsys):
    code = main(["sensitivity", str(checkpoint), "--data", str(docs), "--scheme", "bf16"])
    assert code == 2
    assert "16-bit model itself" in capsys.readouterr().err


def test_the_python_api(checkpoint, docs, tmp_path):
    import tokq

    out = tmp_path / "s.json"
    result = tokq.sensitivity(checkpoint, data=docs, schemes=("w8a16",), window=64, windows=4, wide_gain=False,
                              blocks=False, progress=False, json_path=out, resamples=100)
    assert isinstance(result, tokq.SensitivityResult)
    assert result.formats == ["w8a16"] and result.windows["count"] == 4
    assert all(u.kind == "linear" and u.wide_gain is None for u in result.units)
    assert json.loads(out.read_text())["checkpoint"] == str(checkpoint)
    with pytest.raises(tokq.TokqError, match="unknown setting"):
        tokq.sensitivity(checkpoint, data=docs, windw=64)


def test_costs_from_a_builds_own_weights_match_the_rounding_they_came_from(checkpoint, docs):
    """mixed.method_weights: the dequantized Linears of a uniform RTN build, given as `weights`, cost exactly
    what RTN rounding in the sensitivity costs; a GPTQ build's weights give other costs (its own rounding)."""
    import copy

    from tokq.mixed.method_weights import dequantized_linears
    from tokq.quantization.calibration import calibration_samples
    from tokq.quantization.pipeline import quantize_model

    model, windows, schemes = _setup(checkpoint, docs)
    w4 = {"w4a16": schemes["w4a16"]}
    rtn_build, gptq_build = copy.deepcopy(model), copy.deepcopy(model)
    quantize_model(rtn_build, "rtn", schemes["w4a16"])
    calib = calibration_samples(docs, load_tokenizer(checkpoint), False, 4, 32)
    quantize_model(gptq_build, "gptq", resolve_scheme("gptq", model.config, "w4a16")[0], calib)
    rtn_weights, gptq_weights = dequantized_linears(rtn_build), dequantized_linears(gptq_build)
    assert set(rtn_weights) == set(candidate_linears(model))

    def costs(weights=None):
        r = measure_sensitivity(model, windows, w4, wide_gain=False, blocks=False, weights=weights)
        return {n: c["w4a16"] for n, c in r.linear_costs().items()}, r

    rtn, plain = costs(), costs()[1]
    given, given_result = costs({"w4a16": rtn_weights})
    assert given == pytest.approx(rtn[0], rel=1e-6, abs=1e-9)
    assert any("the given weights" in n for n in given_result.notes)
    assert not any("the given weights" in n for n in plain.notes)
    gptq = costs({"w4a16": gptq_weights})[0]
    assert gptq != pytest.approx(rtn[0], rel=1e-3)
    assert all(model.get_submodule(n).method is DENSE_METHOD for n in candidate_linears(model))


def test_a_permuted_linear_dequantizes_in_the_models_column_order(checkpoint):
    """An activation-ordered checkpoint stores a Linear's columns permuted (InputPermutedLinearMethod): the
    dense matrix handed to the sensitivity must compute what the quantized Linear computes."""
    from tokq.engine.quant_linear import quantize_linear_
    from tokq.mixed.method_weights import dequantized_linears
    from tokq.quantization.methods.block_ops import quantize_weight

    model = load_model(checkpoint, dtype="fp32")
    scheme = resolve_scheme("rtn", model.config, "w8a16")[0]
    names = list(candidate_linears(model))
    for name in names:
        layer = model.get_submodule(name)
        perm = torch.randperm(layer.in_features, generator=torch.Generator().manual_seed(1))
        quantize_linear_(layer, quantize_weight(layer.weight[:, perm], scheme, name), None, input_perm=perm)
    dense = dequantized_linears(model)
    x = torch.randn(5, model.get_submodule(names[0]).in_features, generator=torch.Generator().manual_seed(2))
    layer = model.get_submodule(names[0])
    assert torch.allclose(torch.nn.functional.linear(x, dense[names[0]]), layer(x), rtol=1e-4, atol=1e-5)


def test_method_weights_refuse_a_dense_linear_and_a_wrong_shape(checkpoint, docs):
    from tokq.errors import ModelError
    from tokq.mixed.method_weights import dequantized_linears

    model, windows, schemes = _setup(checkpoint, docs)
    first = next(iter(candidate_linears(model)))
    with pytest.raises(ModelError, match=f"{first} is not quantized"):
        dequantized_linears(model)
    bad = {n: torch.zeros(3, 3) for n in candidate_linears(model)}
    with pytest.raises(ModelError, match="is \\(3, 3\\), the Linear is"):
        measure_sensitivity(model, windows, {"w4a16": schemes["w4a16"]}, wide_gain=False, blocks=False,
                            weights={"w4a16": bad})
    assert all(model.get_submodule(n).method is DENSE_METHOD for n in candidate_linears(model))
