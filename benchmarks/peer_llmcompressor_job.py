"""One llm-compressor run, executed by the *peer* venv's python (benchmarks/peer_venv.sh), never by tokq's.

benchmarks/peer_quant.py starts this script in a subprocess. It imports nothing of tokq: it loads the
base HF checkpoint (the zoo model directory: bf16 safetensors + config + tokenizer) in fp32, applies
one llm-compressor recipe with exactly the calibration token ids it is given, and saves a
compressed-tensors checkpoint. Everything it measures goes to a small JSON file next to it.

Recipes (weights only on the decoder's Linears; lm_head and embeddings stay 16-bit, as in tokq):

- gptq: GPTQModifier, int4 symmetric, one scale per group of G inputs; llm-compressor's own defaults
  for everything else (dampening_frac 0.01, block_size 128, actorder "static"), recorded in the output.
- gptq-no-actorder: the same with actorder None (columns in their natural order), to set beside
  tokq's GPTQ with act_order=False.
- awq:  AWQModifier (llm-compressor's default mappings, duo_scaling, n_grid 20) followed by a
  QuantizationModifier with the same int4 symmetric group-G weights (llm-compressor's AWQ uses
  min-max weight observers here: no separate clipping search). Its mappings, as resolved in the
  runs recorded: Llama (SmolLM2) smooths input_layernorm -> q/k/v, post_attention_layernorm ->
  gate/up and up -> down; v -> o is skipped (GQA: v_proj's outputs are fewer than o_proj's inputs).
  Gemma 3 smooths only pre_feedforward_layernorm -> gate/up and up -> down: llm-compressor leaves
  out input_layernorm -> q/k/v on purpose (q_norm/k_norm), and v -> o again falls to GQA, so its
  attention projections are plain min-max int4.
- fp8:  QuantizationModifier scheme FP8_DYNAMIC (fp8 e4m3 weights, one scale per output channel;
  dynamic per-token fp8 activations). Data-free: the calibration tokens are not used.

Calibration: the token ids arrive as a safetensors file (`input_ids` int64 [S, T]); they are fed as a
pre-tokenized `datasets.Dataset` in their given order (no shuffling, no truncation, batch size 1), so
llm-compressor sees exactly the S x T tokens tokq's own methods calibrate on.

With --logits-of it quantizes nothing: it loads a saved checkpoint with transformers + compressed-tensors
(the peer's own reader) and writes its logits on a probe sequence, so peer_quant.py can check that tokq
reads the checkpoint as the peer means it (reader parity).

Usage (peer python): peer_llmcompressor_job.py --model-dir DIR --tokens calib.safetensors
                     --method gptq --group-size 64 --out OUT_DIR --meta meta.json
                     peer_llmcompressor_job.py --logits-of OUT_DIR --probe probe.safetensors --probe-out logits.safetensors
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def int4_group(group_size: int) -> dict:
    return {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                    "group_size": group_size}}}


def recipe(method: str, group_size: int) -> tuple[list, dict]:
    """(modifiers, a JSON description of them)."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    if method in ("gptq", "gptq-no-actorder"):
        extra = {"actorder": None} if method == "gptq-no-actorder" else {}
        mod = GPTQModifier(config_groups=int4_group(group_size), ignore=["lm_head"], **extra)
        desc = {"GPTQModifier": {"config_groups": int4_group(group_size), "ignore": ["lm_head"],
                                 "block_size": mod.block_size, "dampening_frac": mod.dampening_frac,
                                 "actorder": str(mod.actorder)}}
        return [mod], desc
    if method == "awq":
        from llmcompressor.modifiers.transform.awq import AWQModifier

        awq = AWQModifier()
        quant = QuantizationModifier(config_groups=int4_group(group_size), ignore=["lm_head"])
        desc = {"AWQModifier": {"duo_scaling": awq.duo_scaling, "n_grid": awq.n_grid, "mappings": "default"},
                "QuantizationModifier": {"config_groups": int4_group(group_size), "ignore": ["lm_head"]}}
        return [awq, quant], desc
    if method == "fp8":
        mod = QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])
        return [mod], {"QuantizationModifier": {"targets": "Linear", "scheme": "FP8_DYNAMIC", "ignore": ["lm_head"]}}
    raise SystemExit(f"unknown method {method!r}: choose gptq, awq or fp8")


def cpu_patches() -> list[str]:
    """Runtime patches llm-compressor needs on a machine without an accelerator; returns their names.

    AWQ pins its cached activations (IntermediatesCache.pin_memory) for faster host-to-device copies;
    torch refuses to pin memory without an accelerator. Pinning changes no value, so skipping it on
    CPU is exact.
    """
    if torch.accelerator.is_available():
        return []
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    return ["IntermediatesCache.pin_memory -> no-op (no accelerator to pin memory for)"]


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("llmcompressor", "compressed-tensors", "transformers", "torch", "accelerate", "datasets"):
        try:
            out[pkg] = version(pkg)
        except Exception:  # noqa: BLE001 - a missing optional package is just not recorded
            out[pkg] = None
    return out


def peer_logits(checkpoint: Path, probe: Path, out: Path) -> None:
    """The peer stack's own reading of its checkpoint: logits [T, V] in fp32 on the probe tokens.

    transformers + compressed-tensors decompress the saved tensors (and run dynamic activation
    quantization where the config asks for it); peer_quant.py compares tokq's logits with these.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids = load_file(str(probe))["input_ids"].to(torch.int64)
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    save_file({"logits": logits.contiguous()}, str(out))


def drop_script_dir_from_path() -> None:
    """Python puts this script's folder (benchmarks/) first on sys.path; modules there would shadow packages.

    transformers probes for optional packages with importlib.import_module (e.g. `kernels`); a benchmark
    named like one (tokq's kernel benchmark once was benchmarks/kernels.py, now kernel_speed.py) would be
    imported instead. This job imports nothing from benchmarks/, so the folder leaves sys.path.
    """
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]


def main() -> None:
    drop_script_dir_from_path()  # before transformers is imported (lazily, below)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--tokens", type=Path, help="safetensors file with input_ids int64 [S, T]")
    ap.add_argument("--method", choices=("gptq", "gptq-no-actorder", "awq", "fp8"))
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--out", type=Path, help="directory for the compressed-tensors checkpoint")
    ap.add_argument("--meta", type=Path, help="JSON file for versions, recipe and timings")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--logits-of", type=Path, help="instead of quantizing: load this (compressed) checkpoint with "
                    "transformers + compressed-tensors and write its logits on --probe to --probe-out")
    ap.add_argument("--probe", type=Path, help="safetensors file with input_ids int64 [1, T]")
    ap.add_argument("--probe-out", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.logits_of:
        if not (args.probe and args.probe_out):
            ap.error("--logits-of needs --probe and --probe-out")
        peer_logits(args.logits_of, args.probe, args.probe_out)
        return
    missing = [f"--{k.replace('_', '-')}" for k in ("model_dir", "tokens", "method", "out", "meta") if not getattr(args, k)]
    if missing:
        ap.error(f"quantizing needs {', '.join(missing)}")

    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    patches = cpu_patches()
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    loaded = time.perf_counter()

    modifiers, desc = recipe(args.method, args.group_size)
    ids = load_file(str(args.tokens))["input_ids"].to(torch.int64)
    kwargs: dict = {}
    if args.method != "fp8":
        rows = ids.tolist()
        dataset = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
        kwargs = {"dataset": dataset, "num_calibration_samples": ids.shape[0], "max_seq_length": ids.shape[1],
                  "shuffle_calibration_samples": False, "batch_size": 1}
    oneshot(model=model, tokenizer=tokenizer, recipe=modifiers, **kwargs)
    quantized = time.perf_counter()

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, save_compressed=True)
    for name in TOKENIZER_FILES:  # the reader wants the tokenizer next to the weights
        if (args.model_dir / name).is_file():
            shutil.copy2(args.model_dir / name, args.out / name)
    saved = time.perf_counter()

    meta = {
        "peer": "llm-compressor", "method": args.method, "group_size": args.group_size if args.method != "fp8" else None,
        "recipe": desc, "patches": patches, "versions": versions(), "threads": torch.get_num_threads(),
        "calibration": {"num_samples": int(ids.shape[0]), "seq_len": int(ids.shape[1])} if kwargs else None,
        "seconds": {"load": loaded - started, "quantize": quantized - loaded, "save": saved - quantized,
                    "total": saved - started},
    }
    args.meta.write_text(json.dumps(meta, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
