"""`tokq kv-calc` and `tokq bench` on a tiny random checkpoint: the arithmetic, the table's JSON, bad input."""

from __future__ import annotations

import json

import pytest

from tests.test_models_vs_hf import BASE, make_hf_checkpoint
from tokq.cli import main
from tokq.kernels.cpu import native

CPU_ATTENTION = "cpu_native_paged" if native.unavailable() is None else "cpu_paged_sdpa"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf_checkpoint("llama", path)
    return path


def test_kv_calc_arithmetic(checkpoint, tmp_path):
    out = tmp_path / "kv.json"
    assert main(["kv-calc", str(checkpoint), "--context", "100", "--seqs", "3", "--kv-memory", "1MiB",
                 "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    head_dim = BASE["hidden_size"] // BASE["num_attention_heads"]
    per_token = 2 * BASE["num_hidden_layers"] * BASE["num_key_value_heads"] * head_dim * 2  # bf16
    assert plan["bytes_per_token"] == per_token
    assert plan["bytes_per_token_without_gqa"] == per_token * BASE["num_attention_heads"] // BASE["num_key_value_heads"]
    assert plan["blocks_per_seq"] == 7 and plan["bytes_per_seq"] == 7 * 16 * per_token
    assert plan["max_concurrency"] == (1 << 20) // (16 * per_token) // 7
    assert main(["kv-calc", str(checkpoint), "--context", "100", "--kv-dtype", "fp8", "--kv-memory", "1MiB",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["bytes_per_token"] == per_token // 2


@pytest.mark.parametrize("args,message", [
    (["kv-calc", "{ckpt}", "--context", "0"], "--context 0"),
    (["kv-calc", "{ckpt}", "--context", "10", "--kv-dtype", "int3"], "--kv-dtype int3"),
    (["kv-calc", "{ckpt}", "--context", "10", "--kv-memory", "lots"], "--kv-memory 'lots'"),
    (["bench", "{ckpt}", "--prompt-len", "500", "--gen-len", "100"], "exceed"),
    (["bench", "{ckpt}", "--arrival-rate", "0"], "--arrival-rate"),
    (["bench", "{ckpt}", "--gen-len-range", "1.5"], "--gen-len-range"),
    (["bench", "/nonexistent/model"], "does not exist"),
])
def test_bad_input_exits_2(checkpoint, args, message, capsys):
    assert main([a.format(ckpt=checkpoint) for a in args]) == 2
    assert message in capsys.readouterr().err.replace("\n", " ")


def test_bench_table_and_json(checkpoint, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", str(checkpoint), str(checkpoint), "--prompt-len", "12", "--gen-len", "5", "--concurrency", "2",
                 "--num-prompts", "3", "--static", "--arrival-rate", "200", "--dtype", "fp32", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["rows"]] == ["continuous", "static"] * 2
    for row in report["rows"]:
        m = row["metrics"]
        assert m["requests"] == 3 and m["output_tokens"] == 15 and m["prompt_tokens"] == 36
        assert m["ttft_mean_s"] > 0 and m["tbt_p95_s"] >= m["tbt_p50_s"] > 0
        # the suite runs with TOKQ_COMPILE=0: decode steps eager
        assert row["kernels"] == {"linear": ["dense"], "attention": [CPU_ATTENTION], "decode": ["eager"]}
        assert row["roofline"]["bytes_per_step"] > row["roofline"]["weight_bytes"] > 0
    assert report["workload"]["arrival_rate"] == 200
    assert "TPOT" in capsys.readouterr().out


def test_bench_speculative_row(checkpoint, tmp_path):
    """--draft adds a speculative row; the model drafting for itself is always accepted."""
    out = tmp_path / "bench.json"
    assert main(["bench", str(checkpoint), "--draft", str(checkpoint), "--num-speculative", "3", "--prompt-len", "12",
                 "--gen-len", "6", "--concurrency", "2", "--dtype", "fp32", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["continuous", "speculative k=3"]
    spec = rows[1]["speculative"]
    assert spec["acceptance_rate"] == 1.0 and spec["net_speedup"] > 0
    assert rows[1]["metrics"]["output_tokens"] == rows[0]["metrics"]["output_tokens"] == 2 * 6
