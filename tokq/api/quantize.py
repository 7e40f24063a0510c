"""`tokq.quantize`: quantize a model with a method and write a compressed-tensors checkpoint.

Order of work: every cheap check first (method/scheme fit, group size against the model's layer sizes, the
output folder, the calibration folder), then load the model, draw calibration windows, quantize block by block
with progress, write the checkpoint atomically (an interrupted run leaves no folder that looks complete) and
optionally record it as a tokq.toml variant. The gate builds a variant from its recipe by calling this function
with the recipe's keys (QuantizeSettings) and the recipe's hash, which tokq_quantization.json records.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from tokq import __version__
from tokq.api.quantize_mix import check_mix_settings
from tokq.errors import ConfigError
from tokq.progress import progress_display
from tokq.settings import QuantizeSettings, settings_from

console = Console(stderr=True)


@dataclass
class QuantizeResult:
    """What a quantization wrote and measured; `to_json()` is the `tokq quantize --json` record."""

    model: str
    checkpoint: Path  # the quantized checkpoint written
    source_checkpoint: Path
    scheme: str
    run: object  # quantization.pipeline.MethodRun: per-block statistics, options, calibration
    seconds: float
    write_seconds: float
    peak_rss_mib: float
    size_bytes: int
    dense_16bit_bytes: int
    peak_gpu_bytes: int | None
    provenance: dict
    variant: str | None = None  # recorded in tokq.toml under this name
    recorded_in: Path | None = None
    notes: list[str] = field(default_factory=list)
    walk: str = "in-memory"  # or "streamed": one decoder block in memory at a time (quantization/streamed.py)

    def to_json(self) -> dict:
        # peak_rss_mib: the whole run's, writing included (result.peak_rss_mib is the walk's, as the checkpoint
        # records it); result.blocks[i].seconds: each block's quantization and calibration forward
        return {"tokq_version": __version__, "command": "quantize", "model": self.model,
                "checkpoint": str(self.source_checkpoint), "out": str(self.checkpoint), "variant": self.variant,
                "size_bytes": self.size_bytes, "dense_16bit_bytes": self.dense_16bit_bytes,
                "write_seconds": self.write_seconds, "peak_gpu_bytes": self.peak_gpu_bytes, "walk": self.walk,
                "peak_rss_mib": self.peak_rss_mib, **self.provenance}


def parse_alpha(alpha: str | float | None, method: str) -> tuple[bool, float | None]:
    """(given, value): alpha is a number in [0, 1] or 'search' (value None); SmoothQuant's, or fp8's optional
    migration before FP8 W8A8."""
    if alpha is None:
        return False, None
    if method not in ("smoothquant", "fp8"):
        raise ConfigError(f"--alpha is SmoothQuant's migration strength; it does not apply to --method {method}")
    if alpha == "search":
        return True, None
    try:
        value = float(alpha)
    except ValueError:
        raise ConfigError(f"--alpha {alpha!r}: give a number in [0, 1] (e.g. 0.5) or 'search'") from None
    if not 0.0 <= value <= 1.0:
        raise ConfigError(f"--alpha {value} is outside [0, 1]: 0 keeps activations as they are, 1 moves all scale "
                          "to weights")
    return True, value


def quantize(model: str | Path, *, method: str, out: str | Path, scheme: str | None = None,
             calib: str | Path | None = None, force: bool = False, name: str | None = None,
             recipe_sha256: str | None = None, threads: int | None = None, device: str = "auto",
             **options) -> QuantizeResult:
    """Quantize `model` (zoo name, checkpoint folder or tokq.toml variant) with `method` into `out`.

    `options` are QuantizeSettings fields (bits, group_size, sym, act_order, damp, alpha, num_samples, seq_len,
    max_doc_mb, max_file_mb, save_dtype, seed). `name` records the checkpoint as a tokq.toml variant; `force`
    replaces `out` only if it is a checkpoint tokq wrote.
    """
    settings = settings_from(QuantizeSettings, {"method": method, "scheme": scheme,
                                                "calib": Path(calib) if calib is not None else None, **options},
                             "tokq.quantize")
    return run_quantize(str(model), Path(out), settings, force=force, name=name, recipe_sha256=recipe_sha256,
                        threads=threads, device=device)


def run_quantize(model: str, out: Path, s: QuantizeSettings, *, force: bool = False, name: str | None = None,
                 recipe_sha256: str | None = None, threads: int | None = None, device: str = "auto",
                 layer_assignment: dict[str, str] | None = None,
                 extra_provenance: dict | None = None, in_memory: bool = False) -> QuantizeResult:
    """`quantize` on a settings object (the CLI and the gate build one); prints progress and notes only.

    By default the model is quantized streamed (quantization/streamed.py: one decoder block in memory at a time,
    the same checkpoint written); `in_memory` loads it whole first, as a --mix search and --kv-cache always do.

    `layer_assignment` (with `s.mix`): the format of every decoder Linear is given (the gate's search chose it), so
    the build is one quantization calibrated on `s.calib`, with no search of its own. `extra_provenance` is added
    to tokq_quantization.json."""
    from tokq.config_edit import check_recordable, check_variant_name, record_variant, variants_file
    from tokq.dtypes import parse_dtype
    from tokq.engine.checkpoint import load_model
    from tokq.engine.config import read_config
    from tokq.engine.quant_formats.loader import read_quantization_config
    from tokq.engine.tokenizer import load_tokenizer, model_adds_bos
    from tokq.errors import DataError
    from tokq.longctx.read_limits import read_limits
    from tokq.outputs import CHECKPOINT, check_replaceable, output_lock
    from tokq.quantization.calibration import calibration_samples
    from tokq.quantization.formats.compressed_tensors import save_quantized
    from tokq.quantization.lm_head import quantize_lm_head_
    from tokq.quantization.pipeline import (
        METHODS,
        NEEDS_CALIBRATION,
        MethodRun,
        quantize_model,
        resolve_scheme,
    )
    from tokq.quantization.streamed import quantize_streamed, streamed_blocker
    from tokq.runtime import setup_runtime
    from tokq.zoo import resolve_model

    method = s.method
    kv_only = method == KV_ONLY  # 16-bit weights as they are, plus calibrated KV-cache scales
    if kv_only and not s.kv_cache:
        raise ConfigError("--method none quantizes nothing but the KV cache: add --kv-cache fp8 or int8")
    if not kv_only and method not in METHODS:
        raise ConfigError(f"unknown --method {method!r}: choose one of {', '.join(METHODS)} (or none with --kv-cache)")
    if s.act_order is not None and method != "gptq":
        raise ConfigError(f"--act-order is a GPTQ option; it does not apply to --method {method}")
    if s.gptq_scales not in GPTQ_SCALES:
        raise ConfigError(f"--gptq-scales {s.gptq_scales!r}: choose {' or '.join(GPTQ_SCALES)}")
    check_mix_settings(s, chosen=layer_assignment is not None)  # before parse_alpha: --alpha with --mix is refused as a mix error
    check_kv_cache_settings(s)
    check_lm_head_settings(s, kv_only)
    alpha_given, alpha_value = parse_alpha(s.alpha, method)
    limits = read_limits(s.max_doc_mb, s.max_file_mb)
    if recipe_sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", recipe_sha256):
        raise ConfigError(f"--recipe-sha256 {recipe_sha256!r} is not a sha256 (64 lowercase hex digits)")
    if name is not None:  # the tokq.toml edit is checked now, not once the quantization is done
        check_variant_name(name)
        check_recordable(variants_file())
    # The lock is held from before the checks on `out` until the checkpoint is written and recorded: a second
    # quantization into the same folder fails here, before any work.
    with output_lock(out):
        if out.exists() and not force:
            raise ConfigError(f"{out} already exists; choose another --out or pass --force to replace it")
        check_replaceable(out, CHECKPOINT)  # --force replaces only a checkpoint tokq wrote, nothing added since
        runtime = setup_runtime(threads, device, s.seed)
        checkpoint = resolve_model(model)
        config = read_config(checkpoint)
        # a mix resolves each of its formats (quantize_mix); the default scheme only names the run until then
        searched = s.mix is not None and layer_assignment is None  # quantize_mix chooses, builds and verifies
        if kv_only:
            _check_kv_only(s)
            resolved, notes = None, []
        else:
            resolved, notes = resolve_scheme(method, config, s.scheme, s.bits, s.group_size, s.sym) if s.mix is None \
                else (_chosen_mix(s.mix, method, config, layer_assignment) if layer_assignment is not None else None, [])
        for note in notes:
            console.print(f"[yellow]note:[/] {note}")
        dtype = None if s.save_dtype == "auto" else parse_dtype(s.save_dtype)
        calibration = None
        # fp8 with alpha: SmoothQuant's migration first, then the same FP8 quantization of weights and activations.
        run_method = "smoothquant" if method == "fp8" and alpha_given else method
        if run_method != method and resolved is not None and resolved.activations is None:
            raise ConfigError(f"--alpha smooths activation outliers before FP8 W8A8; scheme {resolved.name} keeps "
                              "activations in 16-bit, so there is nothing to smooth")
        calib = s.calib
        # a search calibrates on its choice documents; KV scales are calibrated on the same windows as the weights
        if (run_method in NEEDS_CALIBRATION or s.kv_cache) and not searched:
            from tokq.longctx.builtin_sets import calibration_folder

            # none given: tokq's default set; `code` or `default`: that built-in set (each built at first use here)
            calib = calibration_folder(calib, console.print)
            tokenizer = load_tokenizer(checkpoint)
            if s.seq_len > config.max_position_embeddings:
                raise DataError(f"--seq-len {s.seq_len} exceeds the context of {model} "
                                f"({config.max_position_embeddings} tokens)")
            calibration = calibration_samples(calib, tokenizer, model_adds_bos(tokenizer), s.num_samples,
                                              s.seq_len, s.seed, limits)
        elif calib is not None and not searched:
            console.print(f"[yellow]note:[/] --method {method} needs no calibration data; --calib is ignored")

        options = method_options(s)
        if alpha_given:
            options.alpha = alpha_value
        streamed = not in_memory and not searched and s.lm_head == "16bit" and streamed_blocker(
            run_method, s.kv_cache, read_quantization_config(checkpoint, config.raw) is not None) is None
        # Methods search and quantize in fp32 (bf16 matmuls on CPU are slow and less exact).
        if streamed:
            lm, blocks = None, config.num_layers
        else:
            lm = load_model(checkpoint, dtype="fp32", device=runtime.device)
            dense_bytes = 2 * sum(p.numel() for p in {id(p): p for p in lm.parameters()}.values())
            blocks = len(lm.model.layers)
        calib_desc = (f"{calibration.num_samples} x {calibration.seq_len} tokens from {calibration.source}"
                      + _per_source(calibration) if calibration else "none")
        provenance = {"method": method, "source_model": model, "source_checkpoint": str(checkpoint),
                      "runtime": runtime.to_json()}
        if recipe_sha256 is not None:
            provenance["recipe_sha256"] = recipe_sha256  # in tokq_quantization.json, inside the atomic write
        provenance.update(extra_provenance or {})
        if calibration is not None:  # compare and the gate measure how far the documents they judge lie from these
            provenance["calibration_tokens"] = calibration.token_histogram().to_json()
        if searched:
            from tokq.api.quantize_mix import quantize_mixed

            console.print(f"quantizing {model} with {method}, a format per Linear from --mix {s.mix}; "
                          f"{runtime.device}, {runtime.threads} threads")
            mixed = quantize_mixed(lm, model=model, checkpoint=checkpoint, config=config, out=out, s=s,
                                   run_method=run_method, options=options, limits=limits, dtype=dtype,
                                   provenance=provenance)
            run, scheme_name, provenance, save_seconds = (mixed.run, mixed.scheme_name, mixed.provenance,
                                                          mixed.write_seconds)
            notes = notes + mixed.notes
        else:
            what = "16-bit weights, KV-cache scales only" if kv_only else resolved.name
            console.print(f"quantizing {model} with {method} ({what}); calibration: {calib_desc}; "
                          f"{runtime.device}, {runtime.threads} threads")
            if streamed:
                columns = (TextColumn(f"{method} block (streamed)"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), TimeRemainingColumn())
                with progress_display(*columns, console=console, transient=False) as progress:
                    task = progress.add_task("blocks", total=blocks)
                    weight_calibration = calibration if run_method in NEEDS_CALIBRATION else None
                    done = quantize_streamed(checkpoint, config, run_method, resolved, weight_calibration, options, out,
                                             dtype=dtype, provenance=provenance, device=runtime.device,
                                             on_block=lambda _i: progress.advance(task))
                run, dense_bytes, save_seconds = done.run, done.dense_16bit_bytes, done.write_seconds
                provenance["result"] = run.to_json()
            elif kv_only:
                run = MethodRun(method, None, options, calibration.to_json(), 0.0, 0.0)
            else:
                columns = (TextColumn(f"{method} block"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           TimeRemainingColumn())
                with progress_display(*columns, console=console, transient=False) as progress:
                    task = progress.add_task("blocks", total=blocks)
                    # RTN and fp8 take no activations; their windows (drawn for --kv-cache) wait for the KV scales
                    weight_calibration = calibration if run_method in NEEDS_CALIBRATION else None
                    run = quantize_model(lm, run_method, resolved, weight_calibration, options,
                                         on_block=lambda _i: progress.advance(task))
                if quantize_lm_head_(lm, s.lm_head):  # after the blocks, whose calibration never reads the head
                    provenance["lm_head"] = {"format": s.lm_head, "method": "rtn", "scheme": "w8a16 per channel",
                                             "untied": True}
            kv = None
            if s.kv_cache:
                kv = (s.kv_cache, _calibrate_kv(lm, calibration, s))
                provenance["kv_cache"] = {"dtype": s.kv_cache, "calibration": calibration.to_json(),
                                          **kv[1].to_json()}
            if not streamed:
                started_save = time.perf_counter()
                provenance["result"] = run.to_json()
                save_quantized(lm, resolved, out, source_dir=checkpoint, dtype=dtype, force=force,
                               provenance=provenance, kv_cache=kv)
                save_seconds = time.perf_counter() - started_save
            if kv_only:
                run.peak_rss_mib = _peak_rss_mib()
            scheme_name = f"16-bit weights, {s.kv_cache} KV" if kv_only else resolved.name if s.mix is None else "mixed (" + ", ".join(
                f"{k} x{n}" for k, n in resolved.counts().items() if n) + ")"
        if recipe_sha256 is not None:
            from tokq.quantization.pipeline import seal_recipe

            seal_recipe(out)  # the weights' hash beside the recipe's: a record copied onto other weights is caught
        peak_gpu = None
        if str(runtime.device).startswith("cuda"):
            import torch

            peak_gpu = torch.cuda.max_memory_allocated(runtime.device)
        result = QuantizeResult(model=model, checkpoint=out, source_checkpoint=checkpoint, scheme=scheme_name,
                                run=run, seconds=run.seconds, write_seconds=save_seconds,
                                peak_rss_mib=_peak_rss_mib(), size_bytes=_dir_bytes(out),
                                dense_16bit_bytes=dense_bytes, peak_gpu_bytes=peak_gpu, provenance=provenance,
                                notes=notes, walk="streamed" if streamed else "in-memory")
        if name is not None:
            # path only: a variant takes path and recipe; method, scheme and source are in tokq_quantization.json
            result.variant, result.recorded_in = name, record_variant(name, out, {})
        return result


def check_lm_head_settings(s: QuantizeSettings, kv_only: bool) -> None:
    """--lm-head: a format tokq writes, and a build it applies to (not a mix search, not a KV-only build)."""
    from tokq.quantization.lm_head import check_lm_head_format

    check_lm_head_format(s.lm_head)
    if s.lm_head != "16bit" and s.mix is not None:
        raise ConfigError("--lm-head int8 with --mix is not supported yet: the mix search measures and sizes decoder "
                          "Linears only; build the mix with --lm-head 16bit")
    if s.lm_head != "16bit" and kv_only:
        raise ConfigError("--method none keeps every weight 16-bit; --lm-head int8 needs a weight method (e.g. rtn)")


def check_kv_cache_settings(s: QuantizeSettings) -> None:
    """The cheap checks of --kv-cache and --kv-cache-strategy, before anything is loaded."""
    from tokq.engine.kv_scales import KV_CACHE_TYPES, STRATEGIES

    if s.kv_cache is not None and s.kv_cache not in KV_CACHE_TYPES:
        raise ConfigError(f"--kv-cache {s.kv_cache!r}: choose {' or '.join(KV_CACHE_TYPES)}")
    if s.kv_cache_strategy not in STRATEGIES:
        raise ConfigError(f"--kv-cache-strategy {s.kv_cache_strategy!r}: choose {' or '.join(STRATEGIES)}")
    if s.kv_cache is None and s.kv_cache_strategy != QuantizeSettings.kv_cache_strategy:
        raise ConfigError(f"--kv-cache-strategy {s.kv_cache_strategy} sets the scales of a quantized KV cache, and "
                          "no --kv-cache asks for one: add --kv-cache fp8 (or int8), or drop the option")
    if s.kv_cache is not None and s.mix is not None:
        raise ConfigError("--kv-cache with --mix is not supported yet: build the mix first, then compare its KV cache "
                          "with `tokq compare --b-kv-dtype fp8`")


GPTQ_SCALES = ("mse", "minmax")  # --gptq-scales (gptq_solver.SCALE_SEARCHES)
KV_ONLY = "none"  # --method none: the weights stay as they are; only the KV cache is quantized


def _check_kv_only(s: QuantizeSettings) -> None:
    """--method none takes no weight options: each would say the weights are quantized when they are not."""
    for flag, value in (("--scheme", s.scheme), ("--bits", s.bits), ("--group-size", s.group_size),
                        ("--sym/--asym", s.sym), ("--act-order", s.act_order), ("--alpha", s.alpha),
                        ("--mix", s.mix)):
        if value is not None:
            raise ConfigError(f"{flag} quantizes weights; --method none keeps them 16-bit and quantizes only the KV "
                              f"cache: drop {flag} or choose a weight method (rtn, awq, gptq, ...)")


def _per_source(calibration) -> str:
    """' (a 2048, b 2048)': the tokens drawn from each source, when there is more than one."""
    counts = calibration.to_json()["source_tokens"]
    return " (" + ", ".join(f"{name} {n}" for name, n in counts.items()) + ")" if len(counts) > 1 else ""


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _calibrate_kv(lm, calibration, s: QuantizeSettings):
    """Per-layer, per-head K/V scales of the quantized model `lm` over the calibration windows, with progress."""
    from tokq.quantization.kv_calibration import calibrate_kv_scales

    batch = 4
    columns = (TextColumn("KV scales"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with progress_display(*columns, console=console, transient=False) as progress:
        task = progress.add_task("kv", total=-(-calibration.num_samples // batch))
        scales = calibrate_kv_scales(lm, calibration.tokens, batch, source=f"calibrated on {calibration.source}",
                                     on_batch=lambda _i: progress.advance(task))
    return scales.per_tensor() if s.kv_cache_strategy == "tensor" else scales


def _chosen_mix(mix: str, method: str, config, assignment: dict[str, str]):
    """The LayerSchemes of a mix whose format per Linear is already chosen (`layer_assignment`)."""
    from tokq.quantization.layer_schemes import LayerSchemes, parse_mix

    formats = parse_mix(mix, method, config)
    return LayerSchemes({k: v for k, v in formats.items() if v is not None}, dict(assignment))


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def method_options(s):
    """The GPTQ options of QuantizeSettings `s` (damp, act_order, scales) as the methods take them."""
    from tokq.quantization.methods.options import MethodOptions

    options = MethodOptions(damp=s.damp, gptq_scale_search=s.gptq_scales)
    if s.act_order is not None:
        options.act_order = s.act_order
    return options
