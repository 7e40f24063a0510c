"""Verdicts no input can forge (issue 34), without models: a URL side's numbers are checked before any statistic,
its credentials never printed, its slowness and size bounded; a quality rule whose interval holds its threshold is
inconclusive; a rule no data could fail is a config error; a recipe hash copied onto other weights and an edited
baseline-cache manifest are caught."""

from __future__ import annotations

import gzip
import http.server
import json
import math
import re
import threading
import time
from pathlib import Path

import pytest
import torch

from tokq.errors import ConfigError, DataError

# A URL side's answers ------------------------------------------------------------------------------------------


class _Tokenizer:
    def __len__(self) -> int:
        return 50

    def decode(self, ids) -> str:
        return " ".join(f"w{i}" for i in ids)


class _Window:
    doc_id, window_index, score_from = "doc", 0, 1

    def __init__(self, tokens):
        self.tokens = tokens


def _scorer(topk: int = 3):
    from tokq.remote.endpoint_scoring import EndpointScorer, parse_side

    scorer = EndpointScorer(parse_side(f"url=http://127.0.0.1:9#model=m&topk={topk}"), _Tokenizer(), client=object())
    scorer.topk = topk
    return scorer


def _answer(rows: list[dict | None], ids: list[int]) -> dict:
    return {"choices": [{"prompt_token_ids": ids, "prompt_logprobs": rows}]}


def _row(actual: int, listed: dict[int, tuple[float, int]]) -> dict:
    return {str(t): {"logprob": lp, "rank": rank} for t, (lp, rank) in listed.items()} | (
        {} if str(actual) in {str(t) for t in listed} else {str(actual): {"logprob": -5.0, "rank": 9}})


GOOD = {4: (-0.5, 1), 5: (-1.5, 2), 6: (-2.5, 3)}


def test_an_honest_answer_is_read():
    rows = _scorer()._rows(_Window([1, 4, 5]), _answer([None, _row(4, GOOD), _row(5, GOOD)], [1, 4, 5]))
    assert rows.logprob.tolist() == [-0.5, -1.5] and rows.top1.tolist() == [4, 4]


@pytest.mark.parametrize("listed, message", [
    ({4: (0.7, 1), 5: (-1.5, 2), 6: (-2.5, 3)}, "log-probability 0.7 > 0"),  # raw logits, not logprobs
    ({4: (float("nan"), 1), 5: (-1.5, 2), 6: (-2.5, 3)}, "log-probability NaN"),
    ({4: (-0.1, 1), 5: (-0.2, 2), 6: (-0.3, 3)}, "sum to 2.46"),  # probabilities above 1 in total
    ({4: (-0.5, 1)}, "lists 1 alternatives, 3 were asked for"),  # only the sampled token
    ({4: ("high", 1), 5: (-1.5, 2), 6: (-2.5, 3)}, "'high', not a number"),
])
def test_impossible_numbers_are_refused_naming_the_check(listed, message):
    with pytest.raises(DataError, match="http://127.0.0.1:9") as exc:
        _scorer()._rows(_Window([1, 4]), _answer([None, _row(4, listed)], [1, 4]))
    assert message in exc.value.message and "prompt position 1" in exc.value.message


@pytest.mark.parametrize("answer", [
    [], "text", {"choices": "x"}, {"choices": [{"prompt_logprobs": "x"}]},
    {"choices": [{"prompt_logprobs": [None, ["4", -0.5]]}]}, {"choices": [{"prompt_logprobs": [None, {"4": 3}]}]},
    {"choices": [{"prompt_logprobs": [None, {"4": {"rank": 1}}]}]},
    {"choices": [{"prompt_token_ids": ["a"], "prompt_logprobs": [None]}]},
    {"choices": [{"prompt_logprobs": [None, {"x4": {"logprob": -1, "rank": 1}, "4": {"logprob": -1, "rank": 1}}]}]},
])
def test_malformed_answers_are_one_clean_error(answer):
    with pytest.raises(DataError):
        _scorer()._rows(_Window([1, 4]), answer)


def test_legacy_answers_are_checked_too():
    scorer = _scorer()
    scorer.mode = "logprobs"
    legacy = {"tokens": ["w1", "w4"], "token_logprobs": [None, -0.5],
              "top_logprobs": [None, {"w4": -0.5, "w5": -0.1, "w6": -0.2}]}
    with pytest.raises(DataError, match="sum to"):
        scorer._rows(_Window([1, 4]), {"choices": [{"logprobs": legacy}]})
    legacy["token_logprobs"][1] = float("nan")
    with pytest.raises(DataError, match="NaN"):
        scorer._rows(_Window([1, 4]), {"choices": [{"logprobs": legacy}]})


# Server addresses -----------------------------------------------------------------------------------------------


def test_credentials_are_split_off_and_never_shown():
    from tokq.remote.endpoint_scoring import parse_side
    from tokq.remote.urls import redact

    spec = parse_side("url=http://alice:s3cret@127.0.0.1:8000/v1#model=m")
    assert spec.url == "http://127.0.0.1:8000/v1" and "s3cret" in spec.connect_url and "s3cret" not in spec.label
    assert redact('{"b": {"name": "url=https://alice:s3cret@h/v1#model=m"}}') == \
        '{"b": {"name": "url=https://***@h/v1#model=m"}}'
    for bad in ("url=http://[::1", "url=http://host:port", "url=http://user:s3cret@host:99999"):
        with pytest.raises(ConfigError) as exc:
            parse_side(bad)
        assert "s3cret" not in exc.value.message and "malformed" in exc.value.message


class _Hostile(http.server.BaseHTTPRequestHandler):
    seen_auth: list[str] = []
    bomb = b""  # 64 MB of zeros gzipped to ~64 KB (made by the fixture, before any RSS is measured)

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        _Hostile.seen_auth.append(self.headers.get("Authorization", ""))
        if self.path.endswith("/trickle"):  # a byte every 0.2 s: each read well inside httpx's per-read timeout
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            try:
                for _ in range(100):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:  # the client gave up, as it should
                pass
        elif self.path.endswith("/bomb"):
            body = _Hostile.bomb
            self.send_response(200)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            body = json.dumps({"error": {"message": "no such route"}}).encode()
            self.send_response(400)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)


@pytest.fixture(scope="module")
def hostile_server():
    _Hostile.bomb = gzip.compress(b"0" * (64 << 20), compresslevel=9)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_trickling_server_is_cut_at_the_total_deadline(hostile_server):
    from tokq.remote.http import EndpointClient, EndpointError

    started = time.monotonic()
    with EndpointClient(f"http://{hostile_server}", timeout_s=1.0, retries=0) as client, \
            pytest.raises(EndpointError, match="still arriving when the 1 s timeout passed"):
        client.post_json("/trickle", {})
    assert time.monotonic() - started < 5


def test_a_gzip_bomb_is_refused_at_the_size_cap(hostile_server):
    import resource

    from tokq.remote.http import EndpointClient, EndpointError

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with EndpointClient(f"http://{hostile_server}", max_response_bytes=1 << 20, retries=0) as client, \
            pytest.raises(EndpointError, match="larger than 1048576 bytes decoded"):
        client.post_json("/bomb", {})
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 48 << 10  # KiB: far below the 64 MB


def test_credentials_go_as_basic_auth_and_not_into_errors(hostile_server):
    from tokq.remote.http import EndpointClient, EndpointError

    with EndpointClient(f"http://alice:s3cret@{hostile_server}/v1", retries=0) as client, \
            pytest.raises(EndpointError) as exc:
        client.post_json("/v1/completions", {})
    assert "no such route" in str(exc.value) and "s3cret" not in str(exc.value) and "alice" not in str(exc.value)
    assert _Hostile.seen_auth[-1].startswith("Basic ")


# Quality rules ------------------------------------------------------------------------------------------------


def _result(value: float, low: float, high: float, docs: int = 4) -> dict:
    est = {"value": value, "low": low, "high": high, "n_tokens": 1000, "n_docs": docs}
    return {"prefill": {"overall": {"kl": est, "top1": est}, "buckets": {}}}


@pytest.mark.parametrize("interval, verdict", [
    ((0.226, 0.20, 0.26), "inconclusive"),  # issue 34: this 4-window gate FAILED at max_kl 0.25
    ((0.27, 0.24, 0.30), "inconclusive"),  # estimate past the limit, interval not
    ((0.28, 0.26, 0.30), "fail"),
    ((0.10, 0.05, 0.20), "pass"),
])
def test_a_quality_interval_holding_its_threshold_is_inconclusive(interval, verdict):
    from tokq.evalsuite.quality_rules import evaluate_thresholds

    row = evaluate_thresholds(_result(*interval), {"max_kl": {None: 0.25}})[0]
    got = "pass" if row["passed"] else "inconclusive" if row.get("inconclusive") else "fail"
    assert got == verdict, row["rule"]
    if verdict == "inconclusive":
        value, low, high = interval
        factor = ((high - low) / 2 / abs(value - 0.25)) ** 2
        assert row["more_data_factor"] == pytest.approx(factor)
        assert f"about {math.ceil(4 * factor)} documents instead of 4" in row["rule"]


def test_min_rules_straddle_the_same_way():
    from tokq.evalsuite.quality_rules import evaluate_thresholds

    row = evaluate_thresholds(_result(0.82, 0.78, 0.86), {"min_top1": {None: 0.8}})[0]
    assert not row["passed"] and row["inconclusive"]
    row = evaluate_thresholds(_result(0.72, 0.70, 0.74), {"min_top1": {None: 0.8}})[0]
    assert not row["passed"] and not row.get("inconclusive")


@pytest.mark.parametrize("rule, value, message", [
    ("max_kl", 1e308, "cannot fail: the metric is at most 6.80565e+38"),
    ("max_kl_p99", 1e39, "cannot fail"),
    ("min_top1", 0.0, "cannot fail"),
    ("max_ppl_ratio", 0.0, "cannot pass"),
])
def test_a_rule_no_data_could_fail_is_a_config_error(rule, value, message):
    from tokq.evalsuite.power import Sample, check_thresholds
    from tokq.evalsuite.rule_defs import QUALITY_RULES

    with pytest.raises(ConfigError, match=re.escape(message)):
        check_thresholds({rule: {None: value}}, QUALITY_RULES, "bound", Sample("this run", 30, 10))


# Integrity of what a verdict reads ---------------------------------------------------------------------------------


def _checkpoint(folder: Path, seed: int, recipe: str | None = None) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text("{}")
    if recipe:
        (folder / "tokq_quantization.json").write_text(json.dumps({"method": "rtn", "recipe_sha256": recipe}))
    return folder


def test_a_recipe_hash_copied_onto_other_weights_is_not_trusted(tmp_path):
    from tokq.quantization.pipeline import recipe_record_problem, recorded_recipe_sha256, seal_recipe

    recipe = "a" * 64
    built = _checkpoint(tmp_path / "built", 0, recipe)
    assert recorded_recipe_sha256(built) is None and "no hash of the weights" in recipe_record_problem(built)
    seal_recipe(built)
    assert recorded_recipe_sha256(built) == recipe and recipe_record_problem(built) is None
    forged = _checkpoint(tmp_path / "forged", 1)
    (forged / "tokq_quantization.json").write_bytes((built / "tokq_quantization.json").read_bytes())
    assert recorded_recipe_sha256(forged) is None and "not the ones" in recipe_record_problem(forged)


def test_an_edited_manifest_extra_is_recomputed(caplog):
    import logging

    from tokq.evalsuite import baseline_cache
    from tokq.evalsuite.ab import BaselineWindow

    parts = dict(model="c" * 64, data="d" * 64, window=128)
    key = baseline_cache.cache_key(**parts)
    windows = [BaselineWindow(torch.randn(5), torch.randint(0, 50, (5, 3)), torch.randn(5, 3))]
    folder, _ = baseline_cache.store(key, windows, {"probes": {"flips": 3, "n": 10}}, key_parts=parts)
    assert baseline_cache.load(key, key_parts=parts)[1] == {"probes": {"flips": 3, "n": 10}}
    manifest = folder / "manifest.json"
    meta = json.loads(manifest.read_text())
    meta["extra"]["probes"]["flips"] = 0  # flipped probes: what a forger of a PASS would edit
    manifest.write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING, logger="tokq"):
        assert baseline_cache.load(key, key_parts=parts) is None
    assert "fails its checksum" in caplog.text


def test_compare_says_when_both_sides_are_the_same_bytes(tmp_path):
    from tokq.api.compare import _identical_weights

    a = _checkpoint(tmp_path / "a", 0)
    copy = _checkpoint(tmp_path / "copy", 0)
    other = _checkpoint(tmp_path / "other", 1)
    note = _identical_weights("a", a, "copy", copy)
    assert note is not None and "A/A comparison" in note["warning"] and len(note["sha256"]) == 64
    assert _identical_weights("a", a, "other", other) is None
