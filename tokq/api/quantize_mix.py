"""`tokq quantize --mix FORMATS (--target-kl X | --max-size-ratio R)`: a format per decoder Linear, chosen
from measured sensitivities, built, and verified on documents the choice never saw.

Steps (run_quantize calls `quantize_mixed` inside its output lock, with the dense fp32 model loaded):
  1. the documents of --calib (default: the default set) are split by name (mixed.splits): the choice half
     gives the sensitivity windows and, for AWQ/GPTQ, the calibration windows; the held-out half the
     verification windows (SENSITIVITY_WINDOWS and VERIFY_WINDOWS windows of MIX_WINDOW tokens at most,
     round-robin over documents so that the intervals rest on as many documents as there are);
  2. every candidate Linear's KL alone at every quantized format of the mix (mixed.sensitivity), and the KL
     with all of them at each format, which calibrates the additive model (mixed.search). With --method gptq
     each format's Linears are GPTQ's own: a uniform GPTQ build of a copy at that format, dequantized
     (mixed.method_weights; on SmolLM2-135M this halves the equal-size mix's KL against RTN costs); other
     methods are measured with RTN fake-quantization (AWQ folds scales into the layer before: its Linears
     cannot be measured alone);
  3. the search (mixed.search.search_mix): each round quantizes a copy of the fp32 model with the chosen
     LayerSchemes and --method, writes it to a scratch folder next to --out (`.NAME.mix-*`), loads it back
     and measures KL(base ‖ build) on the held-out windows (mixed.verify: full vocabulary, fp32, document
     bootstrap). --target-kl is met when the interval's upper bound is <= the target;
  4. the chosen build's files are moved into --out in one atomic step (paths.atomic_directory: --out appears
     complete or not at all), its tokq_quantization.json rewritten with the search record under "mix". The
     scratch folder is removed whatever happens: a failure leaves nothing half-written.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from tokq.errors import ConfigError, DataError

console = Console(stderr=True)

MIX_WINDOW = 256  # tokens per sensitivity / verification window (at most --seq-len)
SENSITIVITY_WINDOWS = 8  # windows the sensitivities are measured on (each Linear at each format re-runs them)
VERIFY_WINDOWS = 32  # held-out windows each build is verified on (one forward per build)
HELD_OUT_FRACTION = 0.5
MAX_ROUNDS = 3


def check_mix_settings(s, chosen: bool = False) -> None:
    """The cheap checks of the --mix flags (QuantizeSettings `s`), before anything is loaded. `chosen`: the format
    of every Linear is given (the gate's search), so the mix needs no goal."""
    goals = [flag for flag, value in (("--target-kl", s.target_kl), ("--max-size-ratio", s.max_size_ratio))
             if value is not None]
    if s.mix is None:
        if goals:
            raise ConfigError(f"{goals[0]} is a goal of a mixed-precision build: add --mix with the formats to "
                              "choose from (e.g. --mix w4a16,w8a16,bf16)")
        return
    if chosen:
        if goals:
            raise ConfigError(f"{goals[0]}: the format of every Linear is already chosen; drop the goal")
    elif len(goals) != 1:
        given = " and ".join(goals) if goals else "neither"
        raise ConfigError(f"--mix needs exactly one goal, --target-kl X (the smallest build whose held-out KL "
                          f"meets X) or --max-size-ratio R (the lowest-KL build within R x the 16-bit size); "
                          f"got {given}")
    if s.target_kl is not None and not (math.isfinite(s.target_kl) and s.target_kl > 0):
        raise ConfigError(f"--target-kl {s.target_kl}: give a positive mean KL in nats, e.g. 0.02")
    if s.max_size_ratio is not None and not (math.isfinite(s.max_size_ratio) and s.max_size_ratio > 0):
        raise ConfigError(f"--max-size-ratio {s.max_size_ratio}: give a fraction of the 16-bit size, e.g. 0.35")
    for flag, value in (("--scheme", s.scheme), ("--bits", s.bits), ("--group-size", s.group_size),
                        ("--sym/--asym", s.sym), ("--alpha", s.alpha)):
        if value is not None:
            raise ConfigError(f"{flag} sets one scheme for every Linear; with --mix each Linear gets one of the "
                              f"formats --mix names (e.g. w4a16,w8a16,bf16): drop {flag}")


@dataclass
class MixedBuild:
    """What `quantize_mixed` wrote: the chosen round's MethodRun, its LayerSchemes and the provenance."""

    run: object
    layer_schemes: object
    provenance: dict
    write_seconds: float
    notes: list[str] = field(default_factory=list)

    @property
    def scheme_name(self) -> str:
        counts = ", ".join(f"{k} x{n}" for k, n in self.layer_schemes.counts().items() if n)
        return f"mixed ({counts})"


def mix_windows(documents, tokenizer, add_bos: bool, window: int, count: int, side: str, data: Path):
    from tokq.longctx.text_encoding import as_text_encoder
    from tokq.longctx.windows import build_windows
    from tokq.mixed.verify import spread_windows

    built = build_windows(documents, as_text_encoder(tokenizer, add_bos), window, add_bos=add_bos)
    picked = spread_windows(built.windows, count)
    if not picked:
        raise DataError(f"{data}: no {side} document yields a window of at least 16 tokens; add longer documents")
    return picked


def written_itemsize(config, dtype) -> int:
    """Bytes per value of the 16-bit (or fp32) tensors save_quantized writes: `dtype`, else the source's dtype."""
    import torch

    from tokq.dtypes import HF_DTYPES

    return (dtype or HF_DTYPES.get(str(config.raw.get("dtype") or config.raw.get("torch_dtype")),
                                   torch.bfloat16)).itemsize


def mix_sizes(lm, formats: dict, item: int) -> dict[str, dict[str, int]]:
    """Linear -> format -> bytes written, at `item` bytes per 16-bit value, so a byte budget holds on what is
    written even for an fp32 source."""
    from tokq.quantization.layer_schemes import candidate_linears, linear_bytes

    sizes = {}
    for name in candidate_linears(lm):
        m = lm.get_submodule(name)
        sizes[name] = {f: linear_bytes(m.out_features, m.in_features, formats[f], dense_bytes=item,
                                       shards=[sh.size for sh in m.shards]) for f in formats}
    return sizes


def sensitivity_progress():
    """An on_step for measure_sensitivity that prints a line every 10 s (not one per Linear: logs stay short)."""
    last = [time.perf_counter()]

    def on_step(done: int, total: int, label: str) -> None:
        if time.perf_counter() - last[0] > 10 or done == total:
            last[0] = time.perf_counter()
            console.print(f"  sensitivity {done}/{total}: {label}", highlight=False)

    return on_step


def mix_costs(lm, choice_windows, formats: dict, seed: int, on_step=None, weights=None):
    """(SensitivityResult, Linear -> format -> KL alone, format -> KL with every Linear at it): RTN
    fake-quantization of the fp32 model `lm` on the choice windows (mixed.sensitivity), the formats of the mix;
    `weights` (format -> Linear -> dense matrix: a build's own rounding, mixed.method_weights) in place of RTN."""
    from tokq.mixed.sensitivity import measure_sensitivity

    schemes = {k: v for k, v in formats.items() if v is not None}
    sens = measure_sensitivity(lm, choice_windows, schemes, wide_gain=False, blocks=False, on_step=on_step,
                               seed=seed, weights=weights)
    costs = {u: {f: c for f, c in per.items() if f in formats} for u, per in sens.linear_costs().items()}
    return sens, costs, {f: est["kl"].value for f, est in sens.all_quantized.items()}


def method_cost_weights(lm, run_method: str, schemes: dict, calibration, options) -> dict | None:
    """Format -> Linear -> dense weight of a uniform `run_method` build of a copy of `lm`, for methods whose
    Linears can be measured one at a time and whose rounding differs from RTN's (GPTQ); None for the others."""
    from tokq.mixed.method_weights import dequantized_linears, measured_with_own_rounding
    from tokq.quantization.pipeline import quantize_model

    if not measured_with_own_rounding(run_method):
        return None
    out = {}
    for fmt, scheme in schemes.items():
        console.print(f"--mix costs: a uniform {run_method} build at {fmt}, its Linears measured one at a time")
        build = copy.deepcopy(lm)
        quantize_model(build, run_method, scheme, calibration, options)
        out[fmt] = dequantized_linears(build)
        del build
    return out


def quantize_mixed(lm, *, model: str, checkpoint: Path, config, out: Path, s, run_method: str, options, limits,
                   dtype, provenance: dict) -> MixedBuild:
    """Choose, build, verify and write the mix (module docstring). `lm` is the dense fp32 model; it is not
    changed (each round quantizes a copy). `provenance` is what tokq_quantization.json records besides."""
    import torch

    from tokq.engine.checkpoint import load_model
    from tokq.engine.tokenizer import load_tokenizer, model_adds_bos
    from tokq.longctx.builtin_sets import calibration_folder
    from tokq.longctx.documents import DocumentSet, load_documents
    from tokq.mixed.search import search_mix, size_budget
    from tokq.mixed.splits import split_documents
    from tokq.mixed.verify import HeldOutKL
    from tokq.outputs import CHECKPOINT, MARKER
    from tokq.paths import atomic_directory
    from tokq.quantization.calibration import calibration_samples
    from tokq.quantization.formats.compressed_tensors import save_quantized
    from tokq.quantization.layer_schemes import (
        DENSE,
        LayerSchemes,
        parse_mix,
    )
    from tokq.quantization.pipeline import NEEDS_CALIBRATION, quantize_model

    formats = parse_mix(s.mix, provenance["method"], config)
    schemes = {k: v for k, v in formats.items() if v is not None}
    data = calibration_folder(s.calib, console.print)  # a built-in set is built here at its first use
    docs = load_documents(data, limits=limits)
    choice, held_out = split_documents(docs.documents, HELD_OUT_FRACTION, s.seed)
    tokenizer = load_tokenizer(checkpoint)
    add_bos = model_adds_bos(tokenizer)
    window = min(s.seq_len, MIX_WINDOW, config.max_position_embeddings)
    choice_windows = mix_windows(choice, tokenizer, add_bos, window, SENSITIVITY_WINDOWS, "choice", data)
    held_windows = mix_windows(held_out, tokenizer, add_bos, window, VERIFY_WINDOWS, "held-out", data)
    calibration = None
    if run_method in NEEDS_CALIBRATION:  # calibrated on the choice documents only: nothing tuned on held-out
        calibration = calibration_samples(data, tokenizer, add_bos, s.num_samples, s.seq_len, s.seed, limits,
                                          documents=DocumentSet(docs.root, choice))
        # compare and the gate measure how far the documents they judge lie from these (as a uniform build)
        provenance = {**provenance, "calibration_tokens": calibration.token_histogram().to_json()}

    item = written_itemsize(config, dtype)
    sizes = mix_sizes(lm, formats, item)
    params = {id(p): p for p in lm.parameters()}.values()
    dense_16bit = 2 * sum(p.numel() for p in params)
    max_bytes, size_desc = None, {}
    if s.max_size_ratio is not None:
        fixed = item * (sum(p.numel() for p in params) - sum(lm.get_submodule(u).weight.numel() for u in sizes))
        max_bytes, size_desc = size_budget(s.max_size_ratio, dense_16bit, fixed, sizes)
        size_desc["bytes_per_16bit_value"] = item
    console.print(f"--mix {','.join(formats)}: sensitivity of {provenance['source_model']} on "
                  f"{len(choice_windows)} windows of {len(choice)} choice documents; builds verified on "
                  f"{len(held_windows)} windows of {len(held_out)} held-out documents")
    on_step = sensitivity_progress()
    weights = method_cost_weights(lm, run_method, schemes, calibration, options)
    cost_source = (f"{run_method}'s own Linears (a uniform {run_method} build per format, dequantized)" if weights
                   else "RTN fake-quantization") + " of the fp32 model, each Linear alone"
    sens, costs, all_quantized = mix_costs(lm, choice_windows, formats, s.seed, on_step, weights=weights)
    del weights
    notes: list[str] = []

    heldout = HeldOutKL(lm, held_windows, seed=s.seed)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.mix-", dir=out.parent))
    built: dict[Path, tuple[object, LayerSchemes]] = {}
    verified: dict[Path, dict] = {}

    def build(assignment: dict[str, str], index: int) -> Path:
        if all(fmt == DENSE for fmt in assignment.values()):  # nothing to quantize: not a checkpoint to write
            goal = (f"--target-kl {s.target_kl:g}" if s.target_kl is not None
                    else f"--max-size-ratio {s.max_size_ratio:g}")
            raise ConfigError(f"{goal} leaves every Linear at 16 bits (the model as it is): "
                              + ("raise the target" if s.target_kl is not None else "give a smaller ratio"))
        layer_schemes = LayerSchemes(schemes, assignment)
        candidate = copy.deepcopy(lm)
        run = quantize_model(candidate, run_method, layer_schemes, calibration, options)
        path = scratch / f"round-{index}"
        save_quantized(candidate, layer_schemes, path, source_dir=checkpoint, dtype=dtype,
                       provenance={**provenance, "result": run.to_json()})
        del candidate
        built[path] = (run, layer_schemes)
        return path

    def verify(path: Path) -> tuple[float, float, float]:
        candidate = load_model(path, dtype="fp32", device=lm.device)
        est = heldout(candidate)
        del candidate
        verified[path] = {k: e.to_json() for k, e in est.items()}
        return est["kl"].value, est["kl"].low, est["kl"].high

    def on_round(r) -> None:
        goal = (f"KL budget {r.kl_budget:.4g}" if r.kl_budget is not None else f"byte budget {r.max_bytes:,}")
        verdict = "" if r.passed is None else (" [green]meets the target[/]" if r.passed else " [red]misses[/]")
        console.print(f"  round {r.round}: {goal} -> {r.bytes:,} bytes, predicted KL {r.predicted_kl:.4g}, "
                      f"held-out KL {r.measured_kl:.4g} [{r.kl_low:.4g}, {r.kl_high:.4g}]{verdict}")

    try:
        record, chosen = search_mix(costs, sizes, build=build, verify=verify, target_kl=s.target_kl,
                                    max_bytes=max_bytes, all_quantized_kl=all_quantized, max_rounds=MAX_ROUNDS,
                                    discard=lambda p: shutil.rmtree(p, ignore_errors=True), on_round=on_round)
        record.size = size_desc
        record.notes.extend(notes)
        run, layer_schemes = built[chosen]
        mix = {**record.to_json(),
               "split": {"data": str(data), "seed": s.seed, "held_out_fraction": HELD_OUT_FRACTION,
                         "by": "sha256 of each document's name (mixed.splits)",
                         "choice_documents": len(choice), "held_out_documents": len(held_out)},
               "sensitivity": {"windows": sens.windows, "seconds": sens.seconds, "how": cost_source,
                               "all_quantized_kl": all_quantized},
               "verification": {**heldout.describe(), "chosen": verified[chosen]}}
        final = {**provenance, "result": run.to_json(), "mix": mix}
        started = time.perf_counter()
        with atomic_directory(out, CHECKPOINT, "tokq quantize") as tmp:
            for entry in chosen.iterdir():
                if entry.name != MARKER:
                    os.replace(entry, tmp / entry.name)  # same filesystem (both next to --out): a rename
            info = tmp / "tokq_quantization.json"
            written = json.loads(info.read_text(encoding="utf-8"))
            info.write_text(json.dumps({**written, **final}, indent=2, default=str) + "\n", encoding="utf-8")
        write_seconds = time.perf_counter() - started
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return MixedBuild(run, layer_schemes, final, write_seconds, notes)
