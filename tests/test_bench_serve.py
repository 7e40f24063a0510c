"""`tokq bench --base-url` (tokq/remote/bench_serve.py) and its HTTP client (tokq/remote/http.py) against a real
`tokq serve` on a tiny llama, each server a subprocess on a free localhost port."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.hostile.conftest import write_word_docs
from tests.serve_process import free_port, tokq_serve
from tests.test_models_vs_hf import make_hf_checkpoint
from tests.test_quantize_cli import save_word_tokenizer
from tokq.cli import main
from tokq.errors import ConfigError
from tokq.remote.bench_serve import (
    ServeBenchSettings,
    default_result_filename,
    parse_metric_percentiles,
    parse_percentile_metrics,
    run_serve_bench,
)
from tokq.remote.http import EndpointClient, EndpointError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "llama"
    make_hf_checkpoint("llama", path)
    save_word_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    with tokq_serve(checkpoint, "--max-num-seqs", "4") as url:
        yield url


@pytest.fixture(scope="module")
def one_at_a_time(checkpoint):
    """A server that holds one request at most: any other gets 503 + Retry-After."""
    with tokq_serve(checkpoint, "--max-num-seqs", "1", "--max-queue", "1") as url:
        yield url


def test_result_has_vllm_keys_and_counts(server, checkpoint):
    s = ServeBenchSettings(server, num_prompts=6, random_input_len=16, random_output_len=5, max_concurrency=3,
                           percentile_metrics="ttft,tpot,itl,e2el", metric_percentiles="50,99.9")
    r = run_serve_bench(s)
    # --model defaults to the first id of /v1/models (here the checkpoint path), whose tokenizer counts tokens
    assert r["model_id"] == str(checkpoint)
    assert r["tokenizer_id"] == str(checkpoint)
    for key in ("date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "max_concurrency",
                "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "input_lens", "output_lens",
                "ttfts", "itls", "errors", "load_average"):
        assert key in r, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99.9"):
            assert f"{stat}_{metric}_ms" in r
    assert "p99_ttft_ms" not in r
    assert r["completed"] == 6 and r["failed"] == 0 and r["errors"] == [""] * 6
    assert r["input_lens"] == [16] * 6 and r["total_input_tokens"] == 6 * 16  # the server's usage
    assert r["output_lens"] == [5] * 6 and r["total_output_tokens"] == 6 * 5  # ignore_eos: all 5 tokens
    assert r["request_rate"] == "inf" and r["max_concurrency"] == 3
    assert r["request_throughput"] == pytest.approx(6 / r["duration"])
    assert all(t > 0 for t in r["ttfts"])
    assert all(len(gaps) >= 1 for gaps in r["itls"])  # 5 tokens stream in more than one chunk
    assert r["median_e2el_ms"] >= r["median_ttft_ms"] > 0
    assert len(r["load_average"]) == 3


def test_docs_dataset_prompts_have_the_asked_length(server, checkpoint, tmp_path):
    docs = write_word_docs(tmp_path / "docs", (300, 200))
    r = run_serve_bench(ServeBenchSettings(server, dataset_name="docs", data=docs, num_prompts=3,
                                           random_input_len=24, random_output_len=2, request_rate=50.0))
    assert r["completed"] == 3 and r["total_input_tokens"] == 3 * 24 and r["total_output_tokens"] == 3 * 2


def test_cli_vllm_flags_and_save_result(server, checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = main(["bench", "--base-url", server + "/v1", "--model", str(checkpoint), "--num-prompts", "3",
               "--random-input-len", "10", "--random-output-len", "3", "--max-concurrency", "2",
               "--request-rate", "100", "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90",
               "--save-result"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "P90 E2EL (ms):" in printed and "TPOT" not in printed
    files = list(tmp_path.glob("openai-100.0qps-concurrency2-llama-*.json"))
    assert len(files) == 1, list(tmp_path.iterdir())
    saved = json.loads(files[0].read_text())
    assert files[0].name == default_result_filename(saved)
    assert saved["completed"] == 3 and saved["total_input_tokens"] == 30 and "p90_e2el_ms" in saved


def test_503s_are_retried_until_every_request_completes(one_at_a_time, checkpoint):
    s = ServeBenchSettings(one_at_a_time, num_prompts=6, random_input_len=12, random_output_len=8,
                           max_concurrency=4, retries=1000, timeout_s=300)
    r = run_serve_bench(s)
    assert r["completed"] == 6 and r["failed"] == 0 and r["total_output_tokens"] == 6 * 8
    # The same load without retries does hit the full queue: the retries above were needed.
    no_retry = run_serve_bench(ServeBenchSettings(one_at_a_time, num_prompts=6, random_input_len=12,
                                                  random_output_len=8, max_concurrency=4, retries=0))
    assert no_retry["failed"] >= 1
    assert no_retry["completed"] + no_retry["failed"] == 6
    error = next(e for e in no_retry["errors"] if e)
    assert "HTTP 503" in error and f"{one_at_a_time}/v1/completions" in error and "\n" not in error


def test_server_error_message_reaches_the_user(server, checkpoint):
    with pytest.raises(EndpointError) as info:
        run_serve_bench(ServeBenchSettings(server, model="no-such-model", tokenizer=str(checkpoint),
                                           num_prompts=1, random_input_len=4, random_output_len=1))
    message = info.value.message
    assert "HTTP 404" in message and "no-such-model" in message and "--model" in message and "\n" not in message


def test_connection_refused_is_one_line_naming_the_url(checkpoint, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EndpointError) as info:
        run_serve_bench(ServeBenchSettings(url, tokenizer=str(checkpoint), timeout_s=2, num_prompts=1))
    message = info.value.message
    assert message.startswith(f"{url}/v1/models: ") and "\n" not in message
    assert "refused" in message.lower() and "start the server or check --base-url" in message
    rc = main(["bench", "--base-url", url, "--tokenizer", str(checkpoint), "--timeout", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and url in err[0]


def test_timeout_is_one_line_naming_the_url():
    # A socket that listens but never answers: connecting works, the answer never comes.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with EndpointClient(url, timeout_s=1.0, retries=3) as client, pytest.raises(EndpointError) as info:
            client.post_json("/v1/completions", {"prompt": "x"})
    message = info.value.message
    assert message.startswith(f"{url}/v1/completions: no success within the 1 s timeout") and "\n" not in message
    assert "raise --timeout" in message and info.value.status is None


def test_percentile_flags_parsed():
    assert parse_percentile_metrics("ttft, itl,e2el") == ["ttft", "itl", "e2el"]
    assert parse_metric_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    for bad in ("ttft,bogus", ""):
        with pytest.raises(ConfigError, match="--percentile-metrics"):
            parse_percentile_metrics(bad)
    for bad in ("0", "101", "fifty", ""):
        with pytest.raises(ConfigError, match="--metric-percentiles"):
            parse_metric_percentiles(bad)
    assert main(["bench", "--base-url", "http://127.0.0.1:1", "--metric-percentiles", "150"]) == 2


def test_in_process_bench_takes_the_vllm_names(checkpoint, tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", str(checkpoint), "--random-input-len", "12", "--random-output-len", "5",
                 "--max-concurrency", "2", "--num-prompts", "3", "--request-rate", "500", "--dtype", "fp32",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    w = report["workload"]
    assert (w["prompt_len"], w["gen_len"], w["num_requests"], w["arrival_rate"]) == (12, 5, 3, 500)
    assert report["rows"][0]["metrics"]["prompt_tokens"] == 36
    # --base-url measures the server: a model argument beside it is refused, not silently ignored
    assert main(["bench", str(checkpoint), "--base-url", "http://127.0.0.1:1"]) == 2
    assert main(["bench", str(checkpoint), "--no-ignore-eos"]) == 2  # the engine's bench always ignores EOS
    assert main(["bench", str(checkpoint), "--burstiness", "0"]) == 2


def test_one_schema_in_process_and_against_a_server(server, checkpoint, tmp_path, monkeypatch):
    """A row of the in-process bench carries, under `serving`, the very keys --base-url reports for a server."""
    out = tmp_path / "bench.json"
    assert main(["bench", str(checkpoint), "--random-input-len", "10", "--random-output-len", "4",
                 "--max-concurrency", "2", "--num-prompts", "3", "--request-rate", "200", "--burstiness", "0.5",
                 "--dtype", "fp32", "--json", str(out)]) == 0
    serving = json.loads(out.read_text())["rows"][0]["metrics"]["serving"]
    assert json.loads(out.read_text())["workload"]["burstiness"] == 0.5
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--base-url", server + "/v1", "--model", str(checkpoint), "--num-prompts", "3",
                 "--random-input-len", "10", "--random-output-len", "4", "--max-concurrency", "2",
                 "--request-rate", "200", "--burstiness", "0.5", "--percentile-metrics", "ttft,tpot,itl,e2el",
                 "--save-result", "--result-dir", "results"]) == 0
    (saved,) = (tmp_path / "results").glob("openai-*.json")
    remote = json.loads(saved.read_text())
    assert remote["burstiness"] == 0.5
    assert set(serving) <= set(remote), sorted(set(serving) - set(remote))
    assert serving["completed"] == remote["completed"] == 3
    assert serving["total_output_tokens"] == remote["total_output_tokens"] == 12
    for key in ("mean_ttft_ms", "p99_itl_ms", "median_tpot_ms", "mean_e2el_ms", "output_throughput"):
        assert serving[key] > 0 and remote[key] > 0, key


def test_burstiness_keeps_the_mean_rate_and_changes_the_spread():
    import statistics

    from tokq.engine.workload import Workload

    def gaps(b):
        t = Workload(num_requests=4000, arrival_rate=10.0, burstiness=b).arrival_offsets()
        return [y - x for x, y in zip(t, t[1:], strict=False)]

    poisson, bursty, steady = gaps(1.0), gaps(0.25), gaps(4.0)
    for g in (poisson, bursty, steady):
        assert abs(statistics.fmean(g) - 0.1) < 0.012  # 10 requests a second on average, whatever the shape
    assert statistics.stdev(bursty) > 1.5 * statistics.stdev(poisson) > 2 * statistics.stdev(steady)
