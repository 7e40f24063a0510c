"""tokq.mixed.splits and tokq.mixed.search: the document split, the closed loop on a synthetic cost table with
plain build/verify functions, and the `tokq quantize` flag checks of --mix."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from tokq.errors import ConfigError, DataError
from tokq.longctx.documents import Document
from tokq.mixed.search import MixSearchFailed, calibrate, search_mix, size_budget
from tokq.mixed.splits import split_documents


def _docs(n: int, prefix: str = "doc") -> list[Document]:
    return [Document(f"{prefix}{i}.txt", Path(f"{prefix}{i}.txt"), f"text of document {prefix} {i}") for i in range(n)]


# ---- split_documents ----

def test_split_is_disjoint_complete_and_non_empty():
    docs = _docs(40)
    choice, held = split_documents(docs)
    assert choice and held
    assert {d.doc_id for d in choice}.isdisjoint({d.doc_id for d in held})
    assert sorted(d.doc_id for d in choice + held) == sorted(d.doc_id for d in docs)
    assert 8 <= len(held) <= 32  # about half


def test_split_depends_on_names_not_positions():
    docs = _docs(30)
    choice, held = split_documents(docs)
    shuffled = docs[:]
    random.Random(3).shuffle(shuffled)
    more = shuffled + _docs(10, prefix="extra")
    choice2, held2 = split_documents(more)
    names = {d.doc_id for d in docs}
    assert {d.doc_id for d in held2} & names == {d.doc_id for d in held}
    assert {d.doc_id for d in choice2} & names == {d.doc_id for d in choice}
    # another seed gives another split
    assert {d.doc_id for d in split_documents(docs, seed=1)[1]} != {d.doc_id for d in held}


def test_split_keeps_copies_together_and_fills_both_sides():
    twins = [Document(f"copy{i}.txt", Path(f"copy{i}.txt"), "the same text") for i in range(6)]
    choice, held = split_documents(twins + _docs(1))
    assert choice and held
    assert len({d.sha256 for d in choice} & {d.sha256 for d in held}) == 0
    # two documents, any fraction: one each side
    for fraction in (0.01, 0.5, 0.99):
        c, h = split_documents(_docs(2), held_out_fraction=fraction)
        assert len(c) == 1 and len(h) == 1


def test_split_refuses_too_few_documents():
    with pytest.raises(DataError, match="at least 2 different documents"):
        split_documents(_docs(1))
    with pytest.raises(DataError, match="at least 2"):
        split_documents([Document(f"c{i}", Path("c"), "same") for i in range(3)])
    with pytest.raises(ConfigError, match="between 0 and 1"):
        split_documents(_docs(4), held_out_fraction=1.0)


# ---- search_mix on a synthetic table ----

FORMATS = {"w4a16": 1, "w8a16": 2, "bf16": 4}


def _table(n: int = 12, seed: int = 0):
    rng = random.Random(seed)
    costs, sizes = {}, {}
    for i in range(n):
        base = rng.uniform(0.001, 0.02) * (5 if i % 4 == 0 else 1)  # some Linears far more sensitive
        costs[f"model.layers.{i}.mlp.down_proj"] = {"w4a16": base, "w8a16": base / 20, "bf16": 0.0}
        sizes[f"model.layers.{i}.mlp.down_proj"] = {f: 1000 * m + 10 * i for f, m in FORMATS.items()}
    return costs, sizes


class Builds:
    """Stands in for quantize + verify: the 'true' KL of a mix is `truth` x the sum of alone costs (errors
    compound more than the calibration point suggests), measured with a +-10% interval."""

    def __init__(self, costs, truth: float):
        self.costs, self.truth = costs, truth
        self.built: list[dict] = []
        self.discarded: list[int] = []

    def build(self, assignment, index):
        self.built.append(assignment)
        return len(self.built) - 1

    def verify(self, handle):
        a = self.built[handle]
        kl = self.truth * sum(self.costs[u][f] for u, f in a.items())
        return kl, 0.9 * kl, 1.1 * kl

    def discard(self, handle):
        self.discarded.append(handle)


def test_search_misses_then_meets_the_target_and_records_rounds():
    costs, sizes = _table()
    low_sum = sum(c["w4a16"] for c in costs.values())
    builds = Builds(costs, truth=1.6)
    # the calibration point says 1.2 x the alone sum; the truth is 1.6 x: round 1 is too optimistic
    target = 0.5 * 1.2 * low_sum
    record, handle = search_mix(costs, sizes, build=builds.build, verify=builds.verify, discard=builds.discard,
                                target_kl=target, all_quantized_kl={"w4a16": 1.2 * low_sum}, max_rounds=4)
    rounds = record.rounds
    assert record.calibration["factor"] == pytest.approx(1.2)
    assert rounds[0].passed is False and rounds[0].kl_budget == target
    assert rounds[0].predicted_kl <= target < rounds[0].kl_high
    # every budget after a miss is below the missed build's prediction: the search never loosens after a miss
    for prev, nxt in zip(rounds, rounds[1:], strict=False):
        if not prev.passed:
            assert nxt.kl_budget < prev.kl_budget and nxt.kl_budget < prev.predicted_kl
    chosen = record.chosen_round
    assert chosen.passed and chosen.kl_high <= target
    assert chosen.bytes == min(r.bytes for r in rounds if r.passed)  # the smallest passing build
    assert builds.built[handle] == chosen.assignment
    assert sorted(builds.discarded + [handle]) == list(range(len(builds.built)))  # all others cleaned up
    assert chosen.bytes == sum(sizes[u][f] for u, f in chosen.assignment.items())
    assert sum(chosen.counts.values()) == len(costs)
    doc = json.loads(json.dumps(record.to_json()))  # strict JSON
    assert doc["goal"] == {"target_kl": target} and len(doc["rounds"]) == len(rounds) >= 2
    assert doc["chosen_round"] == chosen.round and "upper bound" in doc["met_when"]
    assert doc["predicted_frontier"][0]["bytes"] < doc["predicted_frontier"][-1]["bytes"]


def test_an_easy_target_still_gives_the_smallest_build():
    costs, sizes = _table()
    builds = Builds(costs, truth=1.0)
    record, handle = search_mix(costs, sizes, build=builds.build, verify=builds.verify, target_kl=10.0,
                                all_quantized_kl={"w4a16": sum(c["w4a16"] for c in costs.values())})
    assert set(builds.built[handle].values()) == {"w4a16"}  # all dense would pass too; it is not chosen
    assert len(record.rounds) == 1


def test_a_pass_with_room_tries_a_smaller_build():
    costs, sizes = _table()
    low_sum = sum(c["w4a16"] for c in costs.values())
    builds = Builds(costs, truth=0.5)  # builds are better than predicted
    record, _ = search_mix(costs, sizes, build=builds.build, verify=builds.verify, target_kl=0.4 * low_sum,
                           all_quantized_kl={"w4a16": low_sum}, max_rounds=3)
    assert record.rounds[0].passed and len(record.rounds) >= 2
    assert record.rounds[1].kl_budget > record.rounds[0].kl_budget
    assert record.chosen_round.bytes == min(r.bytes for r in record.rounds if r.passed)
    assert record.chosen_round.bytes < record.rounds[0].bytes


def test_an_unreachable_target_is_refused_with_the_record():
    costs, sizes = _table()
    for per in costs.values():  # no dense format
        del per["bf16"]
    for per in sizes.values():
        del per["bf16"]
    builds = Builds(costs, truth=3.0)
    with pytest.raises(MixSearchFailed, match="no build in .* met it") as e:
        search_mix(costs, sizes, build=builds.build, verify=builds.verify, target_kl=1e-6, max_rounds=3)
    assert e.value.search.rounds and all(not r.passed for r in e.value.search.rounds)
    assert "\n" not in str(e.value)


def test_byte_budget_round_and_size_budget():
    costs, sizes = _table()
    dense_candidates = sum(s["bf16"] for s in sizes.values())
    dense_model = dense_candidates + 5000  # embeddings, norms: never candidates
    budget, desc = size_budget(0.5, dense_model, 5000, sizes)
    assert budget == int(0.5 * dense_model) - 5000 and desc["non_candidate_bytes"] == 5000
    builds = Builds(costs, truth=1.0)
    record, handle = search_mix(costs, sizes, build=builds.build, verify=builds.verify, max_bytes=budget)
    assert len(record.rounds) == 1 and record.chosen == 0 and record.rounds[0].passed is None
    assert record.rounds[0].bytes <= budget and handle == 0
    assert set(builds.built[0].values()) >= {"w8a16"}  # the budget buys some width
    with pytest.raises(ConfigError, match=r"smallest is 0\.\d+"):
        size_budget(0.1, dense_model, 5000, sizes)


def test_search_goal_errors():
    costs, sizes = _table()
    b = Builds(costs, 1.0)
    with pytest.raises(ConfigError, match="exactly one goal"):
        search_mix(costs, sizes, build=b.build, verify=b.verify)
    with pytest.raises(ConfigError, match="exactly one goal"):
        search_mix(costs, sizes, build=b.build, verify=b.verify, target_kl=0.1, max_bytes=10**6)
    with pytest.raises(ConfigError, match="positive"):
        search_mix(costs, sizes, build=b.build, verify=b.verify, target_kl=0.0)
    scaled, low, desc = calibrate(costs, sizes, None)
    assert low == "w4a16" and desc["factor"] == 1.0 and scaled == costs


# ---- `tokq quantize --mix` ----

def _quantize(capsys, checkpoint, out, *extra) -> tuple[int, str]:
    from tokq.cli import main

    code = main(["quantize", "--model", str(checkpoint), "--out", str(out), "--threads", "1",
                 *[str(a) for a in extra]])
    captured = capsys.readouterr()
    return code, captured.err + captured.out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny 3-layer llama with its word tokenizer, and 12 documents of 300 random words."""
    from tests.test_models_vs_hf import make_hf_checkpoint
    from tests.test_quantize_cli import WORDS, save_word_tokenizer

    root = tmp_path_factory.mktemp("mix")
    make_hf_checkpoint("llama", root / "llama")
    save_word_tokenizer(root / "llama")
    rng = random.Random(0)
    (root / "docs").mkdir()
    for i in range(12):
        (root / "docs" / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(300)) + "\n")
    return root / "llama", root / "docs"


@pytest.mark.parametrize("extra,message", [
    (["--target-kl", "0.01"], "--target-kl is a goal of a mixed-precision build: add --mix"),
    (["--max-size-ratio", "0.5"], "--max-size-ratio is a goal of a mixed-precision build"),
    (["--mix", "w4a16,bf16"], "exactly one goal.*got neither"),
    (["--mix", "w4a16,bf16", "--target-kl", "0.01", "--max-size-ratio", "0.5"],
     "exactly one goal.*got --target-kl and --max-size-ratio"),
    (["--mix", "w4a16,bf16", "--target-kl", "-1"], "positive mean KL"),
    (["--mix", "w4a16,bf16", "--max-size-ratio", "0.5", "--group-size", "32"], "--group-size sets one scheme"),
])
def test_mix_flag_errors(capsys, tmp_path, tiny, extra, message):
    checkpoint, docs = tiny
    code, text = _quantize(capsys, checkpoint, tmp_path / "out", "--method", "rtn", "--calib", docs, *extra)
    assert code == 2, text
    assert re.search(message, text), text
    assert not (tmp_path / "out").exists()


def _tensor_bytes(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(st.get_tensor(k).numel() * st.get_tensor(k).element_size() for k in st.keys())
    return total


def test_mix_within_a_size_ratio_writes_a_mixed_checkpoint(capsys, tmp_path, tiny):
    from tokq.engine.checkpoint import load_model

    checkpoint, docs = tiny
    out = tmp_path / "out"
    code, text = _quantize(capsys, checkpoint, out, "--method", "rtn", "--calib", docs, "--save-dtype", "bf16",
                           "--mix", "w4a16,w8a16,bf16", "--max-size-ratio", "0.5")
    assert code == 0, text
    record = json.loads((out / "tokq_quantization.json").read_text())
    mix = record["mix"]
    assert record["format"] == "mixed-precision" and "layer_schemes" in record
    assert mix["goal"] == {"max_bytes": mix["size"]["candidate_budget_bytes"]} and len(mix["rounds"]) == 1
    chosen = mix["rounds"][0]
    assert chosen["bytes"] <= mix["size"]["candidate_budget_bytes"]
    assert record["layer_schemes"]["assignment"] == chosen["assignment"]
    assert chosen["counts"]["w8a16"] > 0  # the budget bought some width over all-w4a16
    # what is written: every tensor of the checkpoint within ratio x the 16-bit model
    dense = mix["size"]["dense_16bit_bytes"]
    assert _tensor_bytes(out) <= 0.5 * dense
    assert _tensor_bytes(out) == mix["size"]["non_candidate_bytes"] + chosen["bytes"]
    # the split: no document on both sides; verification on the held-out side only
    assert mix["split"]["choice_documents"] + mix["split"]["held_out_documents"] == 12
    assert mix["verification"]["documents"] == mix["split"]["held_out_documents"]
    assert mix["verification"]["chosen"]["kl"]["value"] == pytest.approx(chosen["measured_kl"])
    assert 0 < chosen["measured_kl"] <= chosen["kl_high"]
    model = load_model(out)  # each Linear on its own format
    assert torch_finite(model)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the scratch builds are gone


def test_a_gptq_mix_is_chosen_from_gptqs_own_linears(capsys, tmp_path, tiny):
    """--method gptq: the costs come from uniform GPTQ builds (mixed.method_weights), recorded as such, and the
    all-w4a16 KL they are calibrated by is GPTQ's, not RTN's."""
    checkpoint, docs = tiny
    runs = {}
    for method in ("rtn", "gptq"):
        out = tmp_path / method
        code, text = _quantize(capsys, checkpoint, out, "--method", method, "--calib", docs, "--num-samples", "4",
                               "--seq-len", "32", "--save-dtype", "bf16", "--mix", "w4a16,w8a16,bf16",
                               "--max-size-ratio", "0.5")
        assert code == 0, text
        record = json.loads((out / "tokq_quantization.json").read_text())
        runs[method] = record["mix"]["sensitivity"]
        # what compare's calibration distance reads: GPTQ's 4 x 32 calibration tokens; RTN took none
        assert record.get("calibration_tokens", {}).get("tokens") == (4 * 32 if method == "gptq" else None)
    assert runs["gptq"]["how"].startswith("gptq's own Linears")
    assert runs["rtn"]["how"].startswith("RTN fake-quantization")
    assert runs["gptq"]["all_quantized_kl"]["w4a16"] != pytest.approx(runs["rtn"]["all_quantized_kl"]["w4a16"],
                                                                       rel=1e-3)


def torch_finite(model) -> bool:
    import torch

    return bool(torch.isfinite(model.logits(torch.randint(0, 200, (1, 16)))).all())


def test_target_kl_search_and_nothing_left_on_failure(capsys, tmp_path, tiny):
    checkpoint, docs = tiny
    out = tmp_path / "out"
    code, text = _quantize(capsys, checkpoint, out, "--method", "rtn", "--calib", docs, "--save-dtype", "bf16",
                           "--mix", "w4a16,w8a16,bf16", "--target-kl", "0.00005")
    assert code == 0, text
    mix = json.loads((out / "tokq_quantization.json").read_text())["mix"]
    chosen = next(r for r in mix["rounds"] if r["round"] == mix["chosen_round"])
    assert chosen["passed"] and chosen["kl_high"] <= 0.00005
    # unreachable without a dense format: refused, and no --out and no scratch folder left behind
    out2 = tmp_path / "out2"
    code, text = _quantize(capsys, checkpoint, out2, "--method", "rtn", "--calib", docs, "--save-dtype", "bf16",
                           "--mix", "w4a16,w8a16", "--target-kl", "1e-12")
    assert code == 2 and "no build in" in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # a budget so generous that every Linear stays 16-bit is not a quantized checkpoint: refused, nothing left
    code, text = _quantize(capsys, checkpoint, out2, "--method", "rtn", "--calib", docs, "--save-dtype", "bf16",
                           "--mix", "w4a16,bf16", "--max-size-ratio", "1.0")
    assert code == 2 and "every Linear at 16 bits" in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_sigterm_mid_quantize_leaves_nothing(tmp_path, tiny):
    """What a CI cancel or `docker stop` does: SIGTERM during the --mix search unwinds like Ctrl-C (exit 130) and
    leaves no --out, no scratch round and no lock file (the default action would kill the process mid-write)."""
    import os
    import signal
    import subprocess
    import sys

    checkpoint, docs = tiny
    work = tmp_path / "work"
    work.mkdir()
    # an unreachable target: three build/verify rounds after the sensitivities, seconds of work left to cancel
    proc = subprocess.Popen([sys.executable, "-m", "tokq", "quantize", "--model", str(checkpoint), "--out",
                             str(work / "out"), "--threads", "1", "--method", "rtn", "--calib", str(docs),
                             "--save-dtype", "bf16", "--mix", "w4a16,w8a16", "--target-kl", "1e-12"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "200"})
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "sensitivity of" in line:
            proc.send_signal(signal.SIGTERM)
            break
    seen.append(proc.stdout.read())
    assert proc.wait(timeout=60) == 130, "".join(seen)
    assert "aborted" in "".join(seen)
    assert list(work.iterdir()) == []
