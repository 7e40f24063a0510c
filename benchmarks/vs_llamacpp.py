"""tokq against llama.cpp, batch-1 decode on this CPU, one run, interleaved: the side-by-side users would make.

    python benchmarks/vs_llamacpp.py [--llama-python /work/peer-llama/bin/python] [--threads 1,2] [--repeats 3]
                                     [--prompt 512] [--new 128] [--batch 16] [--model smollm2-135m] [--quick]
                                     [--core] [--out PATH]

The peer is llama-cpp-python in its own venv outside the repository (`bash benchmarks/peer_llama_venv.sh`
builds it with flags that run on both CPUs this project meets); it is never a dependency of tokq. Both sides
decode the same real text (the first `--prompt` tokens of docs/architecture.md, tokenized by tokq), greedy,
`--new` tokens, at each thread count, each configuration once per repeat in turn (so drift on the shared
machine hits all alike). Decode tok/s is (new - 1) / (time of the decode steps): prefill is excluded on both
sides.

Sides:
- llama.cpp: the GGUF the zoo base was converted from (SmolLM2: Q4_1) and an F16 GGUF requantized from it by
  llama.cpp itself (`llama_model_quantize`, F16: the same weights as tokq's 16-bit base, which is that GGUF
  dequantized); where that GGUF is not Q4_1 (the Qwen2.5-Coder models: Q4_K_M and Q5_0 mixes), also Q4_0
  requantized from it, llama.cpp's plainest 4-bit format (blocks of 32, one fp16 scale), the closest to tokq's
  int4 in bytes and work; tokq's int4 is compared with both.
- tokq, "before" (`eager`): the engine as it ran before issue 33 (TOKQ_COMPILE=0: every op dispatched from Python;
  attention through SDPA, `cpu_paged_sdpa`; aten's int4 op; the 16-bit tied LM head); `graph`: pure decode steps
  through the compiled graph (TOKQ_NATIVE_STEP=0), attention through tokq's native decode kernel called from the
  graph; `native` (the default, "after"): each decode step one C++ call (engine/native_step.py), the int4 layers
  on the kernel the registry picks for this CPU (tokq's native int4 GEMV on AVX-512 VNNI) and the int8 LM head
  (quantization/lm_head.py, run by the native int8 GEMV); "int4aten+int8head": the same with aten's int4 op.
  int4 is RTN w4a16 g64, written as a checkpoint and loaded back as a user runs it (scales in bf16): the same
  kernel, shapes and bytes as an AWQ or GPTQ g64 build (their rounding differs, their speed does not).
- Batched (`--batch`, default 16): that many distinct prompts (windows 256 tokens apart, so no shared prefix) decoded
  together at the largest thread count, aggregate decode tok/s timed once every prefill is done: tokq through its
  engine (continuous batching, native steps), llama.cpp through its batch API (one sequence id per prompt, one
  llama_decode per step; LLAMA_BATCH_RUNNER).
- tokq against itself, step-alternated: the int4 configurations' decode steps alternating one by one (far
  steadier ratios than whole runs on a noisy machine).
- `--core`: only what a user would run, for the larger models: tokq bf16 and int4 + int8 head on the native step,
  and llama.cpp; no "before" configurations, no step alternation, and the KL of the int8 head alone and on int4.

Also recorded: the copy bandwidth measured in the same run, each side's bytes read per token (weights at
stored size plus the KV cache at the mean context) and the fraction of the copy bandwidth that is, the load
average before and after, the CPU model and flags, versions; and the KL cost of the int8 LM head and of the native
int4 GEMV's int8 activations (full-vocabulary KL against the 16-bit base, and native against aten's int4 op, on
held-out windows of the default document set, teacher forced, with a 95% interval over windows).

Writes benchmarks/results/vs-llamacpp-<model>-<cpu>.json, <cpu> naming the CPU kind (xeon-avx512amx, epyc-avx512,
epyc-avx2): each kind keeps its own results.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
PROMPT_SOURCE = REPO / "docs" / "architecture.md"

# Run inside the peer venv: one configuration, one JSON line on stdout.
LLAMA_RUNNER = r'''
import json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama
args = json.loads(sys.argv[1])
llm = Llama(model_path=args["gguf"], n_ctx=args["n_ctx"], n_threads=args["threads"], n_threads_batch=args["threads"],
            n_batch=args["n_ctx"], verbose=False, logits_all=False)
prompt = args["prompt"]
out = []
t0 = time.perf_counter()
n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(llm.model))

def greedy():  # the last token's logits (llm.scores stays empty without logits_all in 0.3.x)
    return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))))

llm.eval(prompt)
t1 = time.perf_counter()
tok = greedy()
out.append(tok)
times = []
for _ in range(args["new"] - 1):
    s = time.perf_counter()
    llm.eval([tok])
    tok = greedy()
    times.append(time.perf_counter() - s)
    out.append(tok)
print(json.dumps({"prefill_s": t1 - t0, "decode_s": sum(times), "steps": len(times), "tokens": out,
                  "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}))
'''

# Several sequences decoded together through llama.cpp's batch API: each prompt prefilled as its own sequence, then
# one llama_decode per step with one token per sequence; greedy from each sequence's logits row.
LLAMA_BATCH_RUNNER = r'''
import json, sys, time
import numpy as np
import llama_cpp as lc
args = json.loads(sys.argv[1])
prompts, new, n_seq = args["prompts"], args["new"], len(args["prompts"])
lc.llama_backend_init()
model = lc.llama_model_load_from_file(args["gguf"].encode(), lc.llama_model_default_params())
cp = lc.llama_context_default_params()
cp.n_ctx = n_seq * (max(map(len, prompts)) + new + 8)
cp.n_batch = cp.n_ubatch = max(max(map(len, prompts)), n_seq)
cp.n_seq_max = n_seq
cp.n_threads = cp.n_threads_batch = args["threads"]
ctx = lc.llama_init_from_model(model, cp)
n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
batch = lc.llama_batch_init(cp.n_batch, 0, 1)

def run(entries):  # [(token, pos, seq, wants_logits)]
    batch.n_tokens = len(entries)
    for i, (tok, pos, seq, out) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, out
        batch.seq_id[i][0] = seq
    if lc.llama_decode(ctx, batch) != 0:
        raise SystemExit("llama_decode failed")

def greedy(i):
    return int(np.argmax(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))

last, first_seq = [], []
for s, prompt in enumerate(prompts):
    run([(t, p, s, p == len(prompt) - 1) for p, t in enumerate(prompt)])
    last.append(greedy(len(prompt) - 1))
pos = [len(p) for p in prompts]
started = time.perf_counter()
for _ in range(new - 1):
    run([(last[s], pos[s], s, True) for s in range(n_seq)])
    first_seq.append(last[0])
    last = [greedy(s) for s in range(n_seq)]
    pos = [q + 1 for q in pos]
elapsed = time.perf_counter() - started
print(json.dumps({"decode_s": elapsed, "steps": new - 1, "tok_s": n_seq * (new - 1) / elapsed,
                  "tokens": first_seq + last[:1]}))
'''

LLAMA_QUANTIZE = r'''
import sys, llama_cpp
src, dst, ftype = sys.argv[1], sys.argv[2], int(sys.argv[3])
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = ftype
params.allow_requantize = True
rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
sys.exit(rc)
'''
LLAMA_FTYPE = {"F16": 1, "Q4_0": 2, "Q8_0": 7}


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def cpu_facts() -> dict:
    model, flags = platform.processor(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", "x86_64"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line.split(":", 1)[1].split()
                break
    except OSError:
        pass
    isa = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))]
    kind = "avx512+amx" if "amx_tile" in flags else "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    return {"model": model, "isa_flags": sorted(isa), "kind": kind, "cores": os.cpu_count()}


def cpu_tag(facts: dict) -> str:
    """The results file's CPU part, e.g. "xeon-avx512amx" or "epyc-avx2": each CPU kind keeps its own file."""
    name = facts["model"].lower()
    vendor = next((v for v in ("xeon", "epyc", "ryzen", "core") if v in name), "cpu")
    return f"{vendor}-{facts['kind'].replace('+', '')}"


# tokq side -----------------------------------------------------------------------------------------------

def as_saved(model: torch.nn.Module, scheme, source: Path) -> torch.nn.Module:
    """A quantized model as a user runs it: written as a checkpoint (`tokq quantize`'s format; scales in the
    checkpoint's bf16) and loaded back, under the caller's TOKQ_KERNELS."""
    from tokq.engine.checkpoint import load_model
    from tokq.quantization.formats.compressed_tensors import save_quantized

    with tempfile.TemporaryDirectory(prefix="tokq-bench-") as tmp:
        out = save_quantized(model, scheme, Path(tmp) / "model", source_dir=source)
        return load_model(out, dtype=torch.bfloat16)


def tokq_models(model_name: str, core: bool = False):
    """The models measured, each built with its own kernel selection (TOKQ_KERNELS while its layers are prepared);
    the quantized ones written and loaded back as a checkpoint (as_saved). `core`: bf16 and int4+int8head only."""
    from tokq.engine.checkpoint import load_model
    from tokq.quantization.lm_head import quantize_lm_head_
    from tokq.quantization.pipeline import quantize_model
    from tokq.quantization.scheme import preset
    from tokq.zoo import resolve_model

    path = resolve_model(model_name)
    scheme = preset("w4a16").with_weights(group_size=64)

    def build(int4: bool, head: bool, kernels: str = "") -> torch.nn.Module:
        saved = os.environ.get("TOKQ_KERNELS")
        os.environ["TOKQ_KERNELS"] = kernels
        try:
            model = load_model(path, dtype=torch.bfloat16)
            if int4:
                quantize_model(model, "rtn", scheme)
            if head:
                quantize_lm_head_(model, "int8")
            if int4:
                model = as_saved(model, scheme, path)
        finally:
            os.environ.pop("TOKQ_KERNELS") if saved is None else os.environ.__setitem__("TOKQ_KERNELS", saved)
        return model

    # "int4": the decoder on aten's int4 op and the 16-bit head, as before issue 33; "int4aten+int8head": aten's
    # int4 op with the int8 head; "int4+int8head": the kernels the registry picks on this CPU (on AVX-512 VNNI,
    # tokq's native int4 GEMV) with the int8 head
    if core:
        return path, {"bf16": build(False, False), "int4+int8head": build(True, True)}
    return path, {"bf16": build(False, False), "int4": build(True, False, "cpu_int4"),
                  "int4aten+int8head": build(True, True, "cpu_int4,cpu_native_int8"),
                  "int4+int8head": build(True, True)}


def kernel_names(model) -> list[str]:
    return sorted({m.method.kernel_name for m in model.modules() if hasattr(getattr(m, "method", None), "kernel_name")})


def step_alternated(models: dict, configs: list[tuple[str, str]], prompt: list[int], threads: int, steps: int) -> dict:
    """Decode step times with the configurations alternating step by step (one engine each, one sequence each,
    started from the same prompt): drift on a shared machine hits every configuration alike, so the ratios are
    far steadier than whole runs'. Returns median ms per step and each configuration's speed over the first."""
    from tokq.engine.sampling import SamplingParams

    torch.set_num_threads(threads)
    engines = {}
    for name, mode in configs:
        engine = decode_engine(models[name], len(prompt) + steps + 8, mode)
        engine.add_request(prompt, SamplingParams(max_tokens=steps + 4, ignore_eos=True))
        engine.step()  # prefill
        engine.step()
        engines[f"{name} {mode}"] = engine
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(steps):
        for key, engine in engines.items():
            started = time.perf_counter()
            engine.step()
            times[key].append(time.perf_counter() - started)
    first = next(iter(times))
    return {key: {"step_ms": summary([t * 1e3 for t in values]),
                  "speed_vs_" + first.replace(" ", "_"): summary([a / b for a, b in zip(times[first], values,
                                                                                          strict=True)])}
            for key, values in times.items()}


def kv_bytes_per_token_read(model, context: float) -> float:
    cfg = model.config
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * 2  # K and V, bf16
    return per_token * context * cfg.num_layers


MODES = ("eager", "graph", "native")


def decode_engine(model, max_model_len: int, mode: str, max_num_seqs: int = 1):
    """An engine decoding on one path: "eager" = before issue 33 (no compiled step, attention through SDPA rather
    than the native decode kernel); "graph" = the compiled graph (TOKQ_NATIVE_STEP=0); "native" = the native step."""
    from tokq.engine import native_step
    from tokq.engine.llm_engine import EngineConfig, LLMEngine

    os.environ[native_step.ENV] = "1" if mode == "native" else "0"
    engine = LLMEngine(model, EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                           compile_decode=mode != "eager",
                                           attention_kernels="cpu_paged_sdpa" if mode == "eager" else None))
    if (engine.runner.native_step is not None) != (mode == "native"):
        raise RuntimeError(f"the {mode} decode path is not the one this engine runs: {engine.runner.native_step_why}")
    return engine


def tokq_decode(model, prompt: list[int], new: int, threads: int, mode: str) -> dict:
    from tokq.engine import compiled_decode, native_step
    from tokq.engine.sampling import SamplingParams

    torch.set_num_threads(threads)
    engine = decode_engine(model, len(prompt) + new, mode)
    counter = {"graph": compiled_decode, "native": native_step}.get(mode)
    attr = "compiled_steps" if mode == "graph" else "steps_run"
    before = getattr(counter, attr, 0)
    out = engine.generate([prompt], SamplingParams(max_tokens=new, ignore_eos=True))[0]
    if counter is not None and getattr(counter, attr) - before < new - 1:
        raise RuntimeError(f"the {mode} decode path did not run (see the log)")
    return {"tok_s": 1.0 / out.metrics.tpot_s, "tokens": out.token_ids}


def tokq_decode_batch(model, prompts: list[list[int]], new: int, threads: int) -> dict:
    """Aggregate decode tok/s of len(prompts) sequences decoded together (native steps, warmed up first): timed
    from the first step in which every sequence decodes (all prefills done) to the end."""
    from tokq.engine.sampling import SamplingParams

    torch.set_num_threads(threads)
    engine = decode_engine(model, max(map(len, prompts)) + new + 8, "native", len(prompts))
    engine.warm_up()
    ids = [engine.add_request(p, SamplingParams(max_tokens=new, ignore_eos=True)) for p in prompts]
    seqs = [engine._seqs[i] for i in ids]
    while any(len(s) == s.num_prompt_tokens for s in seqs):
        engine.step()
    made = sum(len(s) for s in seqs)
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - started
    return {"tok_s": (sum(len(s) for s in seqs) - made) / elapsed, "sequences": len(prompts)}


def llama_decode_batch(python: str, gguf: Path, prompts: list[list[int]], new: int, threads: int) -> dict:
    args = {"gguf": str(gguf), "prompts": prompts, "new": new, "threads": threads}
    proc = subprocess.run([python, "-c", LLAMA_BATCH_RUNNER, json.dumps(args)], capture_output=True, text=True,
                          timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp batched run failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def warm_compiled(models: dict, prompt: list[int], threads: list[int], graph_models: tuple[str, ...]) -> dict:
    """Each model's first decode before timing: the graph path compiles there (later engines reuse the graph), the
    native step builds nothing but tokq's native kernels (once per machine)."""
    seconds = {}
    for name, model in models.items():
        for mode in ("native", "graph") if name in graph_models else ("native",):
            for t in threads:
                started = time.perf_counter()
                tokq_decode(model, prompt[:64], 4, t, mode)
                seconds[f"{name} {mode}@{t}"] = round(time.perf_counter() - started, 1)
    return seconds


# llama.cpp side ------------------------------------------------------------------------------------------

def llama_decode(python: str, gguf: Path, prompt: list[int], new: int, threads: int) -> dict:
    args = {"gguf": str(gguf), "prompt": prompt, "new": new, "threads": threads, "n_ctx": len(prompt) + new + 8}
    proc = subprocess.run([python, "-c", LLAMA_RUNNER, json.dumps(args)], capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp run failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["tok_s"] = result["steps"] / result["decode_s"]
    return result


def llama_ggufs(python: str, source: Path, scratch: Path) -> dict[str, Path]:
    out = {"Q4_1" if "Q4_1" in source.name else "source": source}
    wanted = ("F16",) if "Q4_1" in out else ("F16", "Q4_0")
    for name, ftype in ((n, LLAMA_FTYPE[n]) for n in wanted):
        dst = scratch / f"{source.stem}.{name}.gguf"
        proc = subprocess.run([python, "-c", LLAMA_QUANTIZE, str(source), str(dst), str(ftype)],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 or not dst.is_file():
            raise RuntimeError(f"llama_model_quantize to {name} failed: {proc.stderr.strip()[-500:]}")
        out[name] = dst
    return out


def gguf_bytes_per_token(path: Path) -> int:
    """Bytes of weights llama.cpp reads per decode token: every tensor at its stored size, the token embedding
    as one row unless it doubles as the output layer (no output.weight)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    total = sum(sizes.values())
    if "output.weight" in sizes and "token_embd.weight" in sizes:
        rows = next(int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight")
        total -= sizes["token_embd.weight"] - sizes["token_embd.weight"] // rows
    return total


# quality of the int8 head --------------------------------------------------------------------------------

def head_kl(base, variants: dict, windows: list[list[int]]) -> dict:
    """Mean full-vocabulary KL(base || variant) per token, per window; mean over windows with a t interval."""
    from scipy import stats

    out = {}
    with torch.inference_mode():
        ref = [torch.log_softmax(base.logits(torch.tensor([w]))[0].float(), -1) for w in windows]
        for name, model in variants.items():
            per_window = []
            for w, lp in zip(windows, ref, strict=True):
                lq = torch.log_softmax(model.logits(torch.tensor([w]))[0].float(), -1)
                per_window.append(float((lp.exp() * (lp - lq)).sum(-1).mean()))
            mean = statistics.mean(per_window)
            half = (stats.t.ppf(0.975, len(per_window) - 1) * statistics.stdev(per_window) / len(per_window) ** 0.5
                    if len(per_window) > 1 else float("nan"))
            out[name] = {"kl_mean": mean, "ci95": [mean - half, mean + half], "windows": len(per_window),
                         "tokens_per_window": len(windows[0])}
    return out


def held_out_windows(tokenizer, count: int, length: int) -> tuple[list[list[int]], str]:
    from tokq.paths import data_dir

    docs = data_dir() / "default"  # the default long-document set, when `tokq data build-default` has run
    files = sorted(p for p in docs.rglob("*") if p.is_file() and p.suffix in (".txt", ".md", ".rst")) if docs.is_dir() else []
    source = "the default document set" if files else "docs"  # named, not a machine path
    if not files:
        files = sorted((REPO / "docs").glob("*.md"))
    windows = []
    for f in files:
        ids = tokenizer.encode(f.read_text(encoding="utf-8", errors="replace"))
        for start in range(0, len(ids) - length + 1, length):
            windows.append(ids[start: start + length])
            if len(windows) == count:
                return windows, source
    return windows, source


@contextlib.contextmanager
def every_row_through_the_gemvs():
    """Every row through the native GEMVs (int4 and int8), as decode steps run them: the numbers of a row do not
    depend on how many rows a call has, so a teacher-forced window scored this way has the decode path's logits."""
    from tokq.kernels.cpu import native_linear

    saved = native_linear.NATIVE_MAX_M, native_linear.NATIVE_INT4_MAX_M
    native_linear.NATIVE_MAX_M = native_linear.NATIVE_INT4_MAX_M = 1 << 30
    try:
        yield
    finally:
        native_linear.NATIVE_MAX_M, native_linear.NATIVE_INT4_MAX_M = saved


def quality_costs(models: dict, path: Path, tokenizer, count: int) -> dict:
    """KL of the int8 head (alone, and on top of int4) against the 16-bit base, and of the decode kernels' int8
    activations: the int4 + int8 head build as decode steps compute it, against the base and against the same
    weights on aten's int4 op (bf16 activations)."""
    from tokq.engine.checkpoint import load_model
    from tokq.quantization.lm_head import quantize_lm_head_

    windows, window_source = held_out_windows(tokenizer, count, 512)
    kl = head_kl(models["bf16"], {"int4 (bf16 head)": models["int4"], "int4 + int8 head": models["int4+int8head"]}
                 if "int4" in models else {"int4 + int8 head": models["int4+int8head"]}, windows)
    base_head = load_model(path, dtype=torch.bfloat16)
    quantize_lm_head_(base_head, "int8")
    kl.update(head_kl(models["bf16"], {"bf16 + int8 head alone": base_head}, windows))
    with every_row_through_the_gemvs():
        kl.update(head_kl(models["bf16"], {"int4 + int8 head, decode kernels": models["int4+int8head"]}, windows))
        if "int4aten+int8head" in models and "cpu_native_int4" in kernel_names(models["int4+int8head"]):
            kl.update(head_kl(models["int4aten+int8head"], {"native int4 (int8 activations) vs aten int4":
                                                            models["int4+int8head"]}, windows))
    kl["windows_from"] = window_source
    return kl


# the run -------------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-python", default=os.environ.get("TOKQ_PEER_LLAMA_VENV", "/work/peer-llama") + "/bin/python")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--kl-windows", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16, help="sequences decoded together in the batched runs (0: none)")
    ap.add_argument("--quick", action="store_true", help="1 repeat, 32 new tokens, 4 KL windows: a smoke run")
    ap.add_argument("--core", action="store_true", help="tokq bf16 and int4+int8head (native step) and llama.cpp only")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--kl-only", action="store_true",
                    help="recompute only the KL costs (lm_head_kl) into the existing results file")
    args = ap.parse_args()
    if args.kl_only:
        from tokq.engine.tokenizer import load_tokenizer

        out = args.out or RESULTS / f"vs-llamacpp-{args.model}-{cpu_tag(cpu_facts())}.json"
        result = json.loads(out.read_text(encoding="utf-8"))
        path, models = tokq_models(args.model, args.core)
        result["lm_head_kl"] = quality_costs(models, path, load_tokenizer(path), args.kl_windows)
        out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(json.dumps(result["lm_head_kl"], indent=2))
        return
    if args.quick:
        args.repeats, args.new, args.kl_windows = 1, 32, 4
    threads = [int(t) for t in args.threads.split(",")]
    if not Path(args.llama_python).is_file():
        sys.exit(f"no peer venv at {args.llama_python}: run `bash benchmarks/peer_llama_venv.sh` first")

    from tokq import __version__
    from tokq.engine.roofline import copy_bandwidth, weight_bytes_per_step
    from tokq.engine.tokenizer import load_tokenizer
    from tokq.zoo import ZOO, locate_gguf

    load_before = os.getloadavg()
    # the copy bandwidth at the largest thread count, before and after the runs; the roofline is the larger of the two
    # medians (a busy moment on a shared machine lowers one: 33 against 50 GB/s in two runs a day apart)
    torch.set_num_threads(max(threads))
    bandwidth_before = copy_bandwidth()
    path, models = tokq_models(args.model, args.core)
    tokenizer = load_tokenizer(path)
    prompt = tokenizer.encode(PROMPT_SOURCE.read_text(encoding="utf-8"))[: args.prompt]
    scratch = Path(tempfile.mkdtemp(prefix="tokq-vs-llama-"))
    ggufs = llama_ggufs(args.llama_python, locate_gguf(ZOO[args.model], scratch), scratch)

    # the compiled graph beside the native step for these two (not in --core: the native step only)
    graph_models = () if args.core else ("bf16", "int4+int8head")
    compile_seconds = warm_compiled(models, prompt, threads, graph_models)
    int4_peer = "Q4_1" if "Q4_1" in ggufs else "source"
    int4_peers = [p for p in ("Q4_1", "source", "Q4_0") if p in ggufs]
    configs = ([("tokq", name, mode) for name in models for mode in MODES
                if mode == "native" or (mode == "eager" and name in ("bf16", "int4") and not args.core)
                or (mode == "graph" and name in graph_models)]
               + [("llama.cpp", name, None) for name in ggufs])
    runs: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    system_info = None
    for repeat in range(args.repeats):
        for t in threads:
            for side, name, mode in configs:
                key = f"tokq {name} {mode}" if side == "tokq" else f"llama.cpp {name}"
                key = f"{key} @{t}t"
                if side == "tokq":
                    r = tokq_decode(models[name], prompt, args.new, t, mode)
                else:
                    r = llama_decode(args.llama_python, ggufs[name], prompt, args.new, t)
                    system_info = r.get("system_info", system_info)
                runs.setdefault(key, []).append(r["tok_s"])
                tokens.setdefault(key, r["tokens"])
                print(f"[{repeat + 1}/{args.repeats}] {key}: {r['tok_s']:.1f} tok/s", flush=True)
    batched: dict[str, list[float]] = {}
    if args.batch:
        # distinct prompts (windows 256 tokens apart: no shared prefix for tokq's prefix cache to reuse), at the
        # largest thread count, each configuration once per repeat in turn
        ids = tokenizer.encode(PROMPT_SOURCE.read_text(encoding="utf-8"))
        step = max(1, min(256, (len(ids) - args.prompt) // max(1, args.batch - 1)))
        prompts = [ids[i * step: i * step + args.prompt] for i in range(args.batch)]
        t = max(threads)
        for repeat in range(args.repeats):
            for side, name in (("tokq", "int4+int8head"), ("tokq", "bf16"), ("tokq", "int4"),
                               ("tokq", "int4aten+int8head"), *(("llama.cpp", p) for p in int4_peers),
                               ("llama.cpp", "F16")):
                if side == "tokq" and name not in models:
                    continue
                key = f"{side} {name} x{args.batch} @{t}t"
                r = (tokq_decode_batch(models[name], prompts, args.new, t) if side == "tokq"
                     else llama_decode_batch(args.llama_python, ggufs[name], prompts, args.new, t))
                batched.setdefault(key, []).append(r["tok_s"])
                print(f"[{repeat + 1}/{args.repeats}] {key}: {r['tok_s']:.1f} tok/s aggregate", flush=True)
    torch.set_num_threads(max(threads))
    bandwidth_after = copy_bandwidth()
    bandwidth = max(bandwidth_before, bandwidth_after, key=lambda b: b["gbps_median"])
    bandwidth = {**bandwidth, "threads": max(threads), "gbps_median_before": bandwidth_before["gbps_median"],
                 "gbps_median_after": bandwidth_after["gbps_median"]}
    context = len(prompt) + args.new / 2
    weights = {name: weight_bytes_per_step(m) + m.config.hidden_size * 2 for name, m in models.items()}
    tokq_bytes = {name: w + kv_bytes_per_token_read(models[name], context) for name, w in weights.items()}
    llama_bytes = {name: gguf_bytes_per_token(p) + kv_bytes_per_token_read(models["bf16"], context)
                   for name, p in ggufs.items()}
    table = {}
    for key, values in runs.items():
        name = key.split()[1]
        nbytes = tokq_bytes[name] if key.startswith("tokq") else llama_bytes[name]
        med = statistics.median(values)
        table[key] = {**summary(values), "bytes_per_token": nbytes,
                      "roofline_fraction": med * nbytes / (bandwidth["gbps_median"] * 1e9)}
    ratios = {}
    for t in threads:
        for mine, peer in ((f"tokq int4 eager @{t}t", f"llama.cpp {int4_peer} @{t}t"),
                           (f"tokq int4 native @{t}t", f"llama.cpp {int4_peer} @{t}t"),
                           (f"tokq int4+int8head graph @{t}t", f"llama.cpp {int4_peer} @{t}t"),
                           *((f"tokq int4+int8head native @{t}t", f"llama.cpp {p} @{t}t") for p in int4_peers),
                           (f"tokq int4aten+int8head native @{t}t", f"llama.cpp {int4_peer} @{t}t"),
                           (f"tokq bf16 eager @{t}t", f"llama.cpp F16 @{t}t"),
                           (f"tokq bf16 graph @{t}t", f"llama.cpp F16 @{t}t"),
                           (f"tokq bf16 native @{t}t", f"llama.cpp F16 @{t}t"),
                           (f"tokq int4+int8head native @{t}t", f"tokq int4+int8head graph @{t}t"),
                           (f"tokq bf16 native @{t}t", f"tokq bf16 graph @{t}t")):
            if mine in runs and peer in runs:  # --core runs fewer configurations
                ratios[f"{mine} / {peer}"] = summary([a / b for a, b in zip(runs[mine], runs[peer], strict=True)])
        if f"tokq int4 eager @{t}t" in runs:
            scale = [a / b for a, b in zip(runs[f"tokq int4+int8head native @{t}t"], runs[f"tokq int4 eager @{t}t"],
                                           strict=True)]
            ratios[f"after / before (int4) @{t}t"] = summary(scale)
    if batched:
        t, b = max(threads), args.batch
        for mine, other in (*((f"tokq int4+int8head x{b} @{t}t", f"llama.cpp {p} x{b} @{t}t") for p in int4_peers),
                            (f"tokq bf16 x{b} @{t}t", f"llama.cpp F16 x{b} @{t}t"),
                            (f"tokq int4+int8head x{b} @{t}t", f"tokq bf16 x{b} @{t}t"),
                            (f"tokq int4aten+int8head x{b} @{t}t", f"tokq bf16 x{b} @{t}t"),
                            (f"tokq int4 x{b} @{t}t", f"tokq bf16 x{b} @{t}t")):
            if mine in batched and other in batched:
                ratios[f"{mine} / {other}"] = summary([a / c for a, c in zip(batched[mine], batched[other],
                                                                              strict=True)])
    if len(threads) > 1:
        lo, hi = min(threads), max(threads)
        for key in {k.rsplit(" @", 1)[0] for k in runs}:
            a, b = runs.get(f"{key} @{hi}t"), runs.get(f"{key} @{lo}t")
            if a and b:
                ratios[f"thread scaling {key} ({hi}t / {lo}t)"] = summary([x / y for x, y in zip(a, b, strict=True)])

    alternated = {} if args.core else {
        t: step_alternated(models, [("int4", "eager"), ("int4+int8head", "graph"), ("int4aten+int8head", "native"),
                                    ("int4+int8head", "native")], prompt, t, 60 if args.quick else 200)
        for t in threads}
    kl = quality_costs(models, path, tokenizer, args.kl_windows)

    def agree(a: str, b: str) -> int:
        x, y = tokens[a], tokens[b]
        return next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))

    from tokq.engine import huge_pages

    t0 = threads[0]
    result = {
        "benchmark": "vs_llamacpp", "model": args.model, "tokq_version": __version__, "torch": torch.__version__,
        "python": platform.python_version(), "cpu": cpu_facts(), "llama_cpp_system_info": system_info,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        # tokq's decode memory on 2 MiB pages at the end (engine/huge_pages.py; TOKQ_HUGE_PAGES=0: none)
        "huge_page_bytes": huge_pages.huge_page_bytes(),
        "prompt_tokens": len(prompt), "new_tokens": args.new, "repeats": args.repeats, "threads": threads,
        "copy_bandwidth": bandwidth, "compile_seconds_first_call": compile_seconds,
        "decode_tok_s": table, "batched_decode_tok_s": {k: summary(v) for k, v in batched.items()},
        "batch_sequences": args.batch, "ratios": ratios, "lm_head_kl": kl,
        "tokq_step_alternated": {f"{t}t": v for t, v in alternated.items()},
        "kernels": {name: kernel_names(m) for name, m in models.items()},
        "greedy_tokens_equal_prefix": {
            label: agree(a, b) for label, a, b in (
                ("int4 native vs eager", f"tokq int4 native @{t0}t", f"tokq int4 eager @{t0}t"),
                ("bf16 native vs eager", f"tokq bf16 native @{t0}t", f"tokq bf16 eager @{t0}t"),
                ("bf16 graph vs eager", f"tokq bf16 graph @{t0}t", f"tokq bf16 eager @{t0}t"),
                ("tokq bf16 native vs llama.cpp F16", f"tokq bf16 native @{t0}t", f"llama.cpp F16 @{t0}t"))
            if a in tokens and b in tokens} | {"of": args.new},
        "core_only": args.core,
        "ggufs": {k: v.name for k, v in ggufs.items()},
        "notes": "int4 = RTN w4a16 g64, written and loaded back as a checkpoint (same kernel and bytes as AWQ/GPTQ "
                 "g64). Decode tok/s excludes prefill. bytes_per_token = weights at stored size + the KV cache at the mean context; "
                 "roofline_fraction = tok/s x bytes_per_token / copy bandwidth (read+write counted, at the largest thread "
                 "count, the larger of the medians measured before and after the runs) of the same run.",
    }
    out = args.out or RESULTS / f"vs-llamacpp-{args.model}-{cpu_tag(cpu_facts())}{'-quick' if args.quick else ''}.json"
    out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({"ratios": {k: round(v["median"], 3) for k, v in ratios.items()},
                      "lm_head_kl": kl}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
