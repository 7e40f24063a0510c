"""`tokq.sensitivity`: what quantizing each decoder Linear (and block) of a model costs on these documents, alone
and against everything else quantized; the numbers a mixed-precision build is chosen from.

Resolves the model (zoo.resolve_model), the formats (quantization.pipeline.resolve_scheme, fitted to the model:
SmolLM2's w4a16 gets group size 64) and the windows (api.compare_windows.document_windows, as compare cuts them),
loads the 16-bit model in fp32 and measures (tokq.mixed.sensitivity, whose docstring says how it stays fast).

Default sample: 8 windows of 128 tokens spread evenly over the documents (~1,000 scored tokens), sized so that
SmolLM2-135M's 150 units at two formats, alone and kept wide, take about 7 minutes on a quiet 2-core CPU (an
estimate from its parts, mixed.sensitivity; time grows linearly with windows x window); more windows give
firmer intervals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

from tokq.longctx.read_limits import DEFAULT_MAX_DOC_MB, DEFAULT_MAX_FILE_MB
from tokq.progress import progress_display

console = Console(stderr=True)
DEFAULT_WINDOW = 128
DEFAULT_WINDOWS = 8
DEFAULT_SCHEMES = ("w4a16", "w8a16")


@dataclass
class SensitivitySettings:
    """`tokq sensitivity` options (the keyword arguments of `tokq.sensitivity`)."""

    schemes: Sequence[str] = DEFAULT_SCHEMES
    method: str = "rtn"  # which method's presets the formats are resolved for; units are rounded with RTN
    window: int = DEFAULT_WINDOW
    windows: int = DEFAULT_WINDOWS  # windows scored, spread evenly over the documents
    wide_gain: bool = True
    blocks: bool = True
    topk: int = 256
    full_kl_rows: int = 256
    resamples: int = 1000
    use_cache: bool = True
    strict: bool = False
    max_doc_mb: float = DEFAULT_MAX_DOC_MB
    max_file_mb: float = DEFAULT_MAX_FILE_MB
    seed: int = 0


def sensitivity(model: str | Path, *, data: str | Path | None = None, schemes: Sequence[str] = DEFAULT_SCHEMES,
                method: str = "rtn", window: int = DEFAULT_WINDOW, windows: int = DEFAULT_WINDOWS,
                json_path: str | Path | None = None, report_dir: str | Path | None = None,
                threads: int | None = None, device: str = "auto", progress: bool = True, **settings):
    """Measure every decoder Linear's and block's sensitivity of `model` (zoo name, checkpoint folder or tokq.toml
    variant; 16-bit) at each of `schemes` on `data` (a folder, or a tokq.toml [data.NAME] set name; default: the
    default long-document set). `settings` are SensitivitySettings fields (wide_gain, blocks, topk, ...).
    `json_path` / `report_dir` also write the JSON / the report folder. Returns a SensitivityResult."""
    from tokq.api.compare import resolve_data
    from tokq.reports.json_io import check_json_target
    from tokq.runtime import setup_runtime
    from tokq.settings import settings_from

    check_json_target(json_path)  # refused before minutes of measuring, not after
    if report_dir is not None:
        from tokq.reports.folder import check_report_folder

        check_report_folder(Path(report_dir), "--report-dir")
    folder, _ = resolve_data(data)
    s = settings_from(SensitivitySettings, {"schemes": tuple(schemes), "method": method, "window": window,
                                            "windows": windows, **settings}, "tokq.sensitivity")
    runtime = setup_runtime(threads, device, s.seed)
    result = run_sensitivity(str(model), folder, s, runtime, progress=progress)
    if json_path is not None:
        result.write_json(json_path)
    if report_dir is not None:
        console.print(f"report: {result.write_report(report_dir)}")
    return result


def resolve_formats(names: Sequence[str], method: str, config) -> tuple[dict, list[str]]:
    """Format name -> the preset resolved for this model, and resolve_scheme's notes (group size fallbacks)."""
    from tokq.errors import ConfigError
    from tokq.quantization.layer_schemes import DENSE_ALIASES
    from tokq.quantization.pipeline import resolve_scheme

    if not names:
        raise ConfigError("--scheme: name at least one format to measure (e.g. --scheme w4a16 --scheme w8a16)")
    out, notes = {}, []
    for name in dict.fromkeys(names):
        if name in DENSE_ALIASES:
            raise ConfigError(f"--scheme {name}: {name} is the 16-bit model itself, whose cost is 0 by definition; "
                              "name quantized formats (w4a16, w8a16, ...)")
        scheme, why = resolve_scheme(method, config, name)
        out[name] = scheme
        notes.extend(f"{name}: {n}" for n in why)
    return out, notes


def run_sensitivity(model: str, data: Path | None, s: SensitivitySettings, runtime, progress: bool = True):
    """Everything `tokq sensitivity` does after parsing its options."""
    from tokq.api.compare_windows import document_windows
    from tokq.engine.checkpoint import load_model
    from tokq.engine.config import read_config
    from tokq.engine.quant_formats.loader import read_quantization_config
    from tokq.engine.tokenizer import check_windows_fit, load_tokenizer
    from tokq.errors import ConfigError, DataError, ModelError
    from tokq.longctx.read_limits import read_limits
    from tokq.mixed.sensitivity import measure_sensitivity
    from tokq.settings import CompareSettings
    from tokq.zoo import resolve_model

    for flag, value in (("--window", s.window), ("--windows", s.windows), ("--topk", s.topk),
                        ("--resamples", s.resamples)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
    if s.full_kl_rows < 0:
        raise ConfigError(f"--full-kl-rows {s.full_kl_rows}: must be >= 0 (0: the top-k lower bound of the KL only)")
    checkpoint = resolve_model(model)
    config = read_config(checkpoint)
    if read_quantization_config(checkpoint, config.raw) is not None:
        raise ModelError(f"{model} ({checkpoint}) is already quantized: sensitivity measures a 16-bit model; give "
                         "the base checkpoint it was quantized from")
    formats, notes = resolve_formats(s.schemes, s.method, config)
    if s.window > config.max_position_embeddings:
        raise DataError(f"--window {s.window} exceeds the model's context of {config.max_position_embeddings} "
                        f"tokens: use --window {config.max_position_embeddings} or less")
    tokenizer = load_tokenizer(checkpoint)
    cut = CompareSettings(window=s.window, sample_windows=s.windows, strict=s.strict, max_doc_mb=s.max_doc_mb,
                          max_file_mb=s.max_file_mb)
    folder, docs, windows, _ = document_windows(data, tokenizer, s.window, cut, read_limits(s.max_doc_mb,
                                                                                             s.max_file_mb))
    check_windows_fit(windows.windows, config.vocab_size, model, tokenizer)
    loaded = load_model(checkpoint, dtype="fp32", device=runtime.device)
    kwargs = dict(wide_gain=s.wide_gain, blocks=s.blocks, topk=s.topk, full_kl_rows=s.full_kl_rows,
                  resamples=s.resamples, seed=s.seed, use_cache=s.use_cache)
    if progress:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with progress_display(*columns, console=console, transient=True) as bar:
            task = bar.add_task("sensitivity", total=None)

            def on_step(done: int, total: int, label: str) -> None:
                bar.update(task, completed=done, total=total, description=label)

            result = measure_sensitivity(loaded, windows, formats, on_step=on_step, **kwargs)
    else:
        result = measure_sensitivity(loaded, windows, formats, **kwargs)
    result.model, result.checkpoint = model, str(checkpoint)
    result.notes[:0] = notes
    result.windows.update(data=str(folder), documents_read=len(docs.documents), skipped=len(docs.skipped))
    result.windows["runtime"] = runtime.to_json()
    return result
