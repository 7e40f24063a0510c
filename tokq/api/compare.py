"""`tokq.compare`: is B worse than A on these documents, where, and how sure are we.

Resolves both models and the documents, checks every setting and that each threshold can be decided by this
run (evalsuite.power) before any scoring, builds the windows, then evalsuite.compare scores A (or reads its
cached scores) and B and aggregates. The CLI (`tokq compare`) and the gate call `run_compare_settings`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

from tokq.errors import EXIT_CHECK_FAILED, EXIT_INCONCLUSIVE, EXIT_OK
from tokq.progress import progress_display
from tokq.settings import CompareSettings, settings_from

console = Console(stderr=True)
BASE_NAMES = ("fp16", "bf16", "base")


@dataclass
class CompareResult:
    """A comparison's verdict and every number (`data`: the report.json content)."""

    data: dict

    @property
    def passed(self) -> bool:
        return bool(self.data["passed"])

    @property
    def inconclusive(self) -> bool:
        """Not passed, and every unmet rule is one the data could not decide (rerun or lengthen the run)."""
        return not self.passed and all(t["passed"] or t.get("inconclusive") for t in self.data["thresholds"])

    @property
    def exit_code(self) -> int:
        """0 pass, 1 a rule failed (a regression), 3 inconclusive (never a pass)."""
        return EXIT_OK if self.passed else EXIT_INCONCLUSIVE if self.inconclusive else EXIT_CHECK_FAILED

    @property
    def rules(self) -> list[dict]:
        return self.data["thresholds"]

    def __getitem__(self, key: str):
        return self.data[key]

    def to_json(self) -> dict:
        return self.data

    def to_markdown(self) -> str:
        from tokq.reports.markdown import compare_markdown

        return compare_markdown(self.data)

    def write_json(self, path: str | Path) -> None:
        from tokq.reports.json_io import write_json

        write_json(Path(path), self.data)

    def write_report(self, folder: str | Path) -> Path:
        """report.json, report.md, report.html (plots) and junit.xml in `folder` (replaced only if tokq wrote it)."""
        from tokq.reports.compare_report import write_report

        return write_report(Path(folder), self.data)


def resolve_variant(name: str, other: str | None = None) -> Path:
    """A variant name, zoo name or path; `fp16` / `bf16` / `base` (when tokq.toml does not define them) name
    the 16-bit model the other side was quantized from (its tokq_quantization.json records it)."""
    from tokq.config import find_variant
    from tokq.errors import ConfigError
    from tokq.zoo import resolve_model

    if name in BASE_NAMES and find_variant(name) is None:
        if other is None:
            raise ConfigError(f"{name!r} names the 16-bit base of the other model, but both sides are {name!r}")
        record = resolve_model(other) / "tokq_quantization.json"
        source = json.loads(record.read_text()).get("source_checkpoint") if record.is_file() else None
        if not source:
            raise ConfigError(f"{name!r} names the 16-bit base of {other}, which records none (no "
                              "tokq_quantization.json with source_checkpoint): name the base model's directory or "
                              "zoo name instead")
        return resolve_model(source)
    return resolve_model(name)


def compare(a: str | Path, b: str | Path, *, data: str | Path | None = None, report_dir: str | Path | None = None,
            threads: int | None = None, device: str = "auto", **settings) -> CompareResult:
    """Score the same windows of `data` (a folder, or a tokq.toml [data.NAME] set name; default: the default
    long-document set) with A and B. `settings` are CompareSettings fields (window, thresholds, threshold_on, ...);
    a [data.NAME] set's keys apply unless given here. `report_dir` also writes the reports there."""
    from tokq.runtime import setup_runtime

    folder, set_keys = resolve_data(data)
    s = settings_from(CompareSettings, {**set_keys, **settings}, "tokq.compare")
    if report_dir is not None:  # refused before minutes of scoring, not after
        from tokq.reports.folder import check_report_folder

        check_report_folder(Path(report_dir), "--report-dir")
    runtime = setup_runtime(threads, device, s.seed)
    result = run_compare_settings(str(a), str(b), folder, s, runtime)
    if report_dir is not None:
        console.print(f"report: {result.write_report(report_dir)}")
    return result


def resolve_data(data: str | Path | None) -> tuple[Path | None, dict]:
    """(folder, settings): a folder as it is; a tokq.toml [data.NAME] set name -> its path and its keys; the name of
    a tokq built-in set (`default`) -> this machine's copy, built at first use."""
    if data is None:
        return None, {}
    folder = Path(data).expanduser()
    if folder.is_dir() or isinstance(data, Path) or "/" in str(data):
        return folder, {}
    from tokq.config import find_config, load_project
    from tokq.longctx.builtin_sets import builtin_problem, ensure_builtin_set

    config = find_config()
    project = load_project(config) if config is not None else None
    if project is not None and str(data) in project.data:
        return data_set_settings(project.data[str(data)])
    if builtin_problem(str(data)) is None:
        return ensure_builtin_set(str(data), console.print), {}
    return folder, {}  # neither a set name nor a built-in set: the folder check names it


def given_data_set(data: str | Path):
    """A `--data` that names no [data.NAME] table, as a data set: a folder (with the set defaults), or a tokq
    built-in set by name (built here at its first use on this machine); None when it is neither."""
    from tokq.config import DataSet
    from tokq.longctx.builtin_sets import builtin_problem, builtin_set_path

    folder = Path(data).expanduser()
    if folder.is_dir():
        return DataSet(name=folder.name, path=folder.resolve())
    if builtin_problem(str(data)) is not None:
        return None
    chosen = DataSet(name=str(data), path=builtin_set_path(str(data)), builtin=str(data))
    data_set_settings(chosen)
    return chosen


def data_set_settings(data_set) -> tuple[Path, dict]:
    """A [data.NAME] table as (folder, CompareSettings keys): its keys are CompareSettings field names. A built-in
    set is built here the first time a machine uses it."""
    keys = {k: v for k, v in vars(data_set).items() if k not in ("name", "path", "builtin")}
    if data_set.builtin is not None:
        from tokq.longctx.builtin_sets import ensure_builtin_set

        return ensure_builtin_set(data_set.builtin, console.print), keys
    return data_set.path, keys


def run_compare_settings(a: str, b: str, data: Path | None, s: CompareSettings, runtime) -> CompareResult:
    """Everything `tokq compare` does after parsing its options (the gate calls it too)."""
    from tokq.api.compare_windows import document_windows, engine_loader
    from tokq.engine.config import read_config
    from tokq.engine.kv_cache import parse_bytes
    from tokq.engine.tokenizer import check_windows_fit, load_tokenizer
    from tokq.errors import ConfigError, DataError
    from tokq.evalsuite.compare import ModelRun, ScoringPlan, run_compare, token_window_docs
    from tokq.longctx.probes import evenly_spaced_depths
    from tokq.longctx.read_limits import read_limits

    for flag, value in (("--topk", s.topk), ("--resamples", s.resamples), ("--window", s.window),
                        ("--probe-depths", s.probe_depths), ("--probe-repeats", s.probe_repeats)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
    if s.full_kl_rows < 0:
        raise ConfigError(f"--full-kl-rows {s.full_kl_rows}: must be >= 0 (0: the top-k lower bound of the KL "
                          "only)")
    if s.threshold_on not in ("bound", "point"):
        raise ConfigError(f"--threshold-on {s.threshold_on!r}: use bound (the CI's unfavourable bound) or point")
    limits = read_limits(s.max_doc_mb, s.max_file_mb)
    from tokq.config import find_url_variant

    a, b = find_url_variant(a) or a, find_url_variant(b) or b  # a tokq.toml url variant is its url=... side
    if a.startswith("url=") or b.startswith("url="):
        from tokq.api.remote_compare import run_remote_settings

        return CompareResult(run_remote_settings(a, b, data, s, runtime, limits, console, resolve_variant))
    ckpt_b = resolve_variant(b, a)
    ckpt_a = resolve_variant(a, b)
    config_a, config_b = read_config(ckpt_a), read_config(ckpt_b)
    context = min(config_a.max_position_embeddings, config_b.max_position_embeddings)
    window = s.window
    if window > context:
        raise DataError(f"--window {window} exceeds the models' context of {context} tokens: use --window "
                        f"{context} or less")
    tok_a, tok_b = load_tokenizer(ckpt_a), load_tokenizer(ckpt_b)
    if config_a.vocab_size != config_b.vocab_size or tok_a.get_vocab() != tok_b.get_vocab():
        raise ConfigError(f"{a} and {b} use different tokenizers (vocabularies of {len(tok_a.get_vocab())} and "
                          f"{len(tok_b.get_vocab())} tokens): per-token metrics need the same tokens; compare "
                          "variants of one model")
    identical = _identical_weights(a, ckpt_a, b, ckpt_b)
    topk = min(s.topk, config_a.vocab_size)  # more than the vocabulary is all of it: the KL is exact
    data, docs, windows, add_bos = document_windows(data, tok_a, window, s, limits)
    check_windows_fit(windows.windows, config_a.vocab_size, a, tok_a)
    capacity = window - int(add_bos)
    used = {w.doc_id for w in windows.windows}
    shorter = sum(1 for d in used if windows.doc_tokens[d] <= capacity)
    console.print(f"{len(windows.windows)} windows from {len(used)} documents ({shorter} shorter than a window, "
                  f"used whole; {len(used) - shorter} longer, windowed by {windows.stride}); "
                  f"{len(windows.dropped_documents)} too short to score", highlight=False)
    from tokq.dtypes import compute_dtype_name

    compute = compute_dtype_name(s.dtype, runtime.device)
    budget = parse_bytes(s.kv_memory) if s.kv_memory else None
    probe_ctx = min(s.probe_max_context or window, context)
    engine_len = max(window, probe_ctx + 16)
    _check_power(s, probe_ctx, min(engine_len, context) if s.probes else None, len(used))

    kv_caches: dict[str, dict] = {}  # per side: the cache dtype and where its scales came from

    def loader(side: str, checkpoint: Path, tokenizer, cache_dtype: str, kv_scales: str = "auto"):
        return engine_loader(checkpoint, tokenizer, dtype=compute, device=runtime.device,
                             max_model_len=min(engine_len, context), kv_memory=budget, kv_dtype=cache_dtype,
                             window=window, kv_scales=kv_scales, described=kv_caches.setdefault(side, {}))

    plan = ScoringPlan(window=window, stride=windows.stride, max_tokens=s.max_tokens, topk=topk,
                       full_kl_rows=s.full_kl_rows, decode_windows=s.decode_windows,
                       decode_tokens=s.decode_tokens, probes=s.probes, probe_max_context=probe_ctx,
                       probe_depths=evenly_spaced_depths(s.probe_depths), probe_repeats=s.probe_repeats,
                       resamples=s.resamples, seed=s.seed, use_cache=s.use_cache, dtype=compute,
                       kv_dtype=s.kv_dtype, kv_memory=budget, thresholds=s.thresholds or {},
                       threshold_on=s.threshold_on)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("windows"),
               TimeElapsedColumn())
    with progress_display(*columns, console=console, transient=True) as progress:
        def track(label: str, total: int):
            task = progress.add_task(label, total=total)
            return lambda n: progress.advance(task, n)

        result = run_compare(ModelRun(a, ckpt_a, loader("a", ckpt_a, tok_a, s.kv_dtype), tok_a),
                             ModelRun(b, ckpt_b, loader("b", ckpt_b, tok_b, s.b_kv_dtype or s.kv_dtype, s.b_kv_scales),
                                      tok_b),
                             windows, token_window_docs(windows), plan,
                             probe_documents=[d for d in docs.documents if d.doc_id in used][:50], progress=track)
    result["data"] = {"path": str(data), "documents": len(docs.documents), "skipped": len(docs.skipped),
                      "shorter_than_window": shorter, "windowed": len(used) - shorter}
    result["runtime"] = runtime.to_json()
    result["kv_dtype"] = {"a": s.kv_dtype, "b": s.b_kv_dtype or s.kv_dtype}
    # what each side's cache was (A's may come from the baseline cache and then was not loaded this run)
    result["kv_cache"] = {side: kv_caches[side] for side in ("a", "b") if kv_caches.get(side)}
    result["calibration_distance"] = calibration_distances({"a": (a, ckpt_a), "b": (b, ckpt_b)}, windows)
    if identical:
        result["identical_weights"] = identical
    return CompareResult(result)


def _identical_weights(a: str, ckpt_a: Path, b: str, ckpt_b: Path) -> dict | None:
    """A warning record when both sides hold the same weights and config byte for byte (a link, a copy, the same
    folder twice): every difference such a compare measures is noise, and its rules cannot fail."""
    from tokq.evalsuite.baseline_cache import model_hash

    digest = model_hash(ckpt_a)
    if digest != model_hash(ckpt_b):
        return None
    warning = (f"{a} and {b} hold the same weights and config byte for byte (sha256 {digest[:12]}): this is an A/A "
               "comparison, every difference is noise and no rule can fail; compare against the quantized checkpoint")
    console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    return {"sha256": digest, "warning": warning}


def calibration_distances(sides: dict[str, tuple[str, Path]], windows) -> dict:
    """Per side quantized by tokq with calibration: how far the scored windows' tokens lie from its calibration
    tokens (evalsuite.calibration_distance), each far one warned about on the console and in `warning`."""
    import torch

    from tokq.evalsuite.calibration_distance import distance_record, far_warning, token_histogram

    evaluated = token_histogram(torch.tensor([t for w in windows.windows for t in w.tokens], dtype=torch.long))
    out = {}
    for side, (name, checkpoint) in sides.items():
        path = checkpoint / "tokq_quantization.json"
        try:
            record = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
            distance = distance_record(record, evaluated) if isinstance(record, dict) else None
        except (OSError, ValueError) as exc:  # a damaged record loses this note, not the comparison
            console.print(f"[yellow]note:[/] {path}: cannot read its calibration record ({exc})", highlight=False)
            continue
        if distance is None:
            continue
        if distance["far"]:
            distance["warning"] = far_warning(name, distance)
            console.print(f"[yellow]warning:[/] {distance['warning']}", highlight=False)
        out[side] = distance
    return out


def _check_power(s: CompareSettings, probe_ctx: int, engine_len: int | None, documents: int) -> None:
    """Refuse, before minutes of scoring, a threshold this run cannot decide (evalsuite.power): e.g.
    --max-flip-rate 0.25 over 5 probes, whose exact upper bound is 0.52 even with no flip. engine_len None:
    no probes run."""
    from tokq.evalsuite.power import Sample, check_thresholds
    from tokq.evalsuite.rule_defs import THRESHOLD_METRICS
    from tokq.longctx.probes import probe_grid

    n_probes = (probe_grid(s.window, probe_ctx, s.probe_depths, s.probe_repeats, engine_len).size
                if engine_len else 0)
    sample = Sample("this run", n_probes, documents, more_probes="raise --probe-repeats / --probe-depths",
                    more_documents="give more documents, or raise --sample-windows")
    check_thresholds(s.thresholds or {}, {name: direction for name, (_, direction) in THRESHOLD_METRICS.items()},
                     s.threshold_on, sample)
