"""`tokq.gate`: compare and bench each variant against the base as tokq.toml says; one verdict.

For each variant (all of [variants], or the ones named): build it with `tokq.api.quantize` when its checkpoint
is missing and it has a recipe; compare it with the base on the data set (quality rules from [gate.quality],
baseline cache reused); then one paired speed experiment on the [bench] workload: base and variant interleaved
by blocks of steps in one process for [bench] max_seconds (engine.paired_bench), ratios with bootstrap intervals
(evalsuite.speed_stats), speed rules from [gate.speed] (evalsuite.gate_rules). A url variant is measured over
HTTP instead, base served in this process, by blocks of the same requests (remote.paired_http_bench); its
memory rules are not measured (inconclusive). Reports go to `report_dir`
(report.json, report.md, report.html, junit.xml, written atomically; a previous report tokq wrote there is
removed when the gate starts, so an interrupted gate leaves none that looks complete; a folder holding anything
else is refused), and the Markdown is appended to $GITHUB_STEP_SUMMARY when set. Quality numbers are seeded and
identical on every rerun; speed is re-measured, and a rule the run cannot decide is "inconclusive" (exit 3),
never a pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import signal
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from tokq import __version__
from tokq.errors import (
    EXIT_CHECK_FAILED,
    EXIT_INCONCLUSIVE,
    EXIT_OK,
    ConfigError,
    TokqError,
    interrupt_on_signal,
)

console = Console(stderr=True)


@dataclass
class GateResult:
    """The gate's verdict and every number (`report`: the report.json content)."""

    report: dict
    report_dir: Path

    @property
    def result(self) -> str:
        """"pass", "fail" or "inconclusive"."""
        return self.report["result"]

    @property
    def passed(self) -> bool:
        return self.result == "pass"

    @property
    def exit_code(self) -> int:
        """0 every rule passed, 1 a rule failed (a regression), 3 inconclusive (rerun or lengthen: never a pass)."""
        return {"pass": EXIT_OK, "fail": EXIT_CHECK_FAILED, "inconclusive": EXIT_INCONCLUSIVE}[self.result]

    def to_json(self) -> dict:
        return self.report


def gate(config: str | Path | None = None, *, variants: list[str] | None = None, data: str | Path | None = None,
         report_dir: str | Path = "tokq_gate", no_speed: bool = False, threads: int | None = None,
         device: str = "auto", seed: int = 0, timeout: float = 600.0) -> GateResult:
    """Gate the variants of `config` (default: $TOKQ_CONFIG or the nearest tokq.toml) on quality and speed.

    `data` is a [data.NAME] set name or a folder (default: the first set). `timeout`: seconds one request to a
    url variant may take in all (scoring and the HTTP bench). Bad input raises tokq.errors.TokqError
    (ConfigError names the tokq.toml line); the verdict is in the result, never an exception.
    """
    from tokq.config import find_config, load_project
    from tokq.outputs import REPORT, output_lock, remove_owned
    from tokq.reports.folder import check_report_folder
    from tokq.runtime import setup_runtime

    runtime = setup_runtime(threads, device, seed)
    if not 0 < timeout < float("inf"):
        raise ConfigError(f"--timeout {timeout}: must be a finite number of seconds > 0")
    path = Path(config) if config is not None else find_config()
    if path is None:
        raise ConfigError("no tokq.toml here or above: run `tokq init`, or pass --config PATH")
    project = load_project(Path(path))
    if no_speed and not project.quality:  # the speed rules are skipped: the gate would check nothing
        raise project.error("gate.quality", None, "holds no rule and --no-speed skips [gate.speed]: nothing would "
                                                  "be checked; add a quality rule or drop --no-speed")
    names = list(variants or project.variants)
    for name in names:
        if name not in project.variants:
            raise ConfigError(f"{path}: variant {name!r} is not in [variants] (known: "
                              f"{', '.join(project.variants) or 'none'})")
    if not names:
        raise project.error("variants", None, "is empty: add the checkpoints (or recipes) to gate")
    data_set = _data_set(project, path, data)
    base = base_checkpoint(project)
    for name in names:
        _check_variant(project, name, base)
    out = Path(report_dir)
    check_report_folder(out)

    # From here on the run may take minutes: a CI cancel (SIGTERM) must unwind like Ctrl-C so no half-written
    # folder is left, and no other tokq process may write the report folder meanwhile.
    held = contextlib.ExitStack()
    previous = signal.signal(signal.SIGTERM, interrupt_on_signal)
    try:
        held.enter_context(output_lock(out))
        # A stale report must not pass for this run's verdict: removed now, and only if tokq wrote it.
        remove_owned(out, REPORT)
        # a url variant's "checkpoint" is its compare side (url=...#model=...): it is never built
        checkpoints = {name: project.variants[name].side or _checkpoint(project, name, threads, data_set, runtime, seed)
                       for name in names}
        report = {"tokq_version": __version__, "command": "gate", "config": str(path),
                  "config_sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(),
                  "base": display_name(project.base), "base_checkpoint": str(base), "data": data_set.name,
                  "runtime": runtime.to_json(), "versions": _versions(), "context": _context(Path(path), base),
                  "variants": {}}
        for name in names:
            report["variants"][name] = _gate_variant(project, name, checkpoints[name], base, data_set, runtime,
                                                     seed, no_speed, timeout)
        from tokq.evalsuite.gate_rules import overall_result

        report["result"] = overall_result([v["result"] for v in report["variants"].values()])
        report["passed"] = report["result"] == "pass"
        result = GateResult(report, out)
        from tokq.reports.gate_report import write_gate_report

        result.report_dir = write_gate_report(out, report)
    finally:
        signal.signal(signal.SIGTERM, previous)
        held.close()
    return result


def _data_set(project, path: Path, data: str | Path | None):
    """The [data.NAME] set to gate on: named, a folder given directly (the set's defaults), or the first."""
    from tokq.api.compare import data_set_settings, given_data_set
    from tokq.longctx.builtin_sets import BUILTIN_SETS

    if data is not None and str(data) not in project.data:
        given = given_data_set(data)
        if given is None:
            raise ConfigError(f"{path}: --data {data} is neither a [data.NAME] table (known: "
                              f"{', '.join(project.data) or 'none'}), a built-in set ({', '.join(BUILTIN_SETS)}) "
                              "nor a folder")
        return given
    if not project.data:
        raise ConfigError(f"{path}: add a [data.NAME] table with path = \"<your documents>\"")
    chosen = project.data[str(data)] if data is not None else next(iter(project.data.values()))
    if chosen.builtin is not None:
        data_set_settings(chosen)  # this machine's copy, built now if this is its first use
    if not chosen.path.is_dir():
        raise project.error(f"data.{chosen.name}", "path", f"= {chosen.path} is not a folder: point it at your "
                                                           "documents")
    return chosen


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("tokq", "torch", "triton", "transformers", "safetensors", "numpy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def display_name(model: str) -> str:
    """A zoo name as it is; a checkpoint path by its folder's name (reports name models, never absolute paths)."""
    return Path(model).name if ("/" in model or model.startswith(".")) else model


def _context(config: Path, base: Path) -> dict:
    """What a reviewer needs beside the numbers: the commit gated and the base model's true source."""
    import json
    import os
    import subprocess

    commit = os.environ.get("GITHUB_SHA") or os.environ.get("CI_COMMIT_SHA")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=config.parent, capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            commit = None
    provenance = base / "provenance.json"
    source = None
    if provenance.is_file():
        try:
            source = json.loads(provenance.read_text()).get("source")
        except (OSError, ValueError):
            source = None
    return {"commit": commit, "base_source": source}


def base_checkpoint(project) -> Path:
    """[base] model resolved up front: a missing base is a config error naming its line, before any work.
    load_project made a path absolute against tokq.toml's folder; a zoo name stays one (never a variant)."""
    from tokq.errors import ModelError
    from tokq.zoo import resolve_model

    try:
        return resolve_model(project.base, variants=False)
    except ModelError as exc:
        raise project.error("base", "model", f"= {project.base!r}: {exc}") from None


def variant_target(project, name: str) -> Path:
    v = project.variants[name]
    return v.path or project.path.parent / "tokq_out" / name


def _check_variant(project, name: str, base: Path) -> None:
    """Before any work: the checkpoint exists or can be built, a recipe's checkpoint was built from a recipe, and
    the variant is not the base itself (a symlink to it or a copy: it would pass every quality rule)."""
    from tokq.evalsuite.baseline_cache import model_hash
    from tokq.quantization.pipeline import recorded_recipe_sha256

    if project.variants[name].url:
        return  # a served model: compared over HTTP, nothing to build or check on disk
    target = variant_target(project, name)
    recipe = project.variants[name].recipe
    if not target.is_dir() and recipe is None:
        raise project.error("variants", name, f"points at {target}, which does not exist, and has no recipe to "
                                              "build it: quantize it first or add recipe = { method = ... }")
    if target.is_dir() and recipe is not None and recorded_recipe_sha256(target) is None:
        raise _foreign_checkpoint(project, name, target)
    if target.is_dir() and model_hash(target) == model_hash(base):
        raise project.error("variants", name, f"points at {target}, whose weights and config are the base's "
                                              f"({display_name(project.base)}) byte for byte (a link to it or a "
                                              "copy): gating it would pass every rule without testing anything; "
                                              "point it at the quantized checkpoint")


def _foreign_checkpoint(project, name: str, target: Path):
    from tokq.quantization.pipeline import recipe_record_problem

    problem = recipe_record_problem(target)
    if problem is not None:
        return project.error("variants", name, f"has a recipe, but its checkpoint {target} cannot be trusted to "
                                               f"follow it: {problem}; delete the checkpoint so the gate rebuilds "
                                               "it from the recipe")
    return project.error("variants", name, f"has a recipe, but its checkpoint {target} was not built from a recipe "
                                           "by tokq gate (its tokq_quantization.json records no recipe hash), so "
                                           "nothing says it follows this one: delete the checkpoint so the gate "
                                           "rebuilds it from the recipe, or drop the recipe to gate it as it is")


def _checkpoint(project, name: str, threads: int | None, data_set, runtime, seed: int) -> Path:
    """The variant's checkpoint; one with a recipe is built with tokq.api.quantize when missing, reused when it
    records this recipe's hash (recipe table + base model content), rebuilt when it records another."""
    from tokq.outputs import output_lock

    target = variant_target(project, name)
    recipe = project.variants[name].recipe
    if recipe is None:
        return target
    # Held from reading the recorded hash to the end of the build (the quantization takes it again, from this
    # process): another gate building the same variant is refused, not raced.
    with output_lock(target, f"path for variant {name} in {project.path.name}"):
        return _from_recipe(project, name, recipe, target, threads, data_set, runtime, seed)


def _from_recipe(project, name: str, recipe: dict, target: Path, threads: int | None, data_set, runtime,
                 seed: int) -> Path:
    from tokq.api.quantize import run_quantize
    from tokq.evalsuite.baseline_cache import model_hash
    from tokq.quantization.pipeline import recipe_sha256, recorded_recipe_sha256
    from tokq.quantization.recipe import split_recipe
    from tokq.settings import QuantizeSettings

    base = base_checkpoint(project)
    searched = recipe.get("target") == "gate"
    compare_settings = gate_compare_settings(project, data_set, seed)
    # A searched build also follows the gate's rules and its data set (the search judges builds by them): those go
    # into the hash with the recipe, so editing [gate.quality] or the documents rebuilds it.
    wanted = recipe_sha256({**recipe, "gate": _search_inputs(project, data_set, compare_settings)} if searched
                           else recipe, model_hash(base))
    recorded = recorded_recipe_sha256(target) if target.is_dir() else None
    if target.is_dir() and recorded is None:
        raise _foreign_checkpoint(project, name, target)
    if recorded == wanted:
        console.print(escape(f"variant {name}: {target} follows its recipe (sha256 {wanted[:12]}); reusing it"),
                      highlight=False, soft_wrap=True)
        return target
    settings, runtime_keys = split_recipe(recipe)
    if "calib" in settings:  # a folder, relative to tokq.toml like every path in it
        calib = Path(settings["calib"]).expanduser()
        settings["calib"] = calib if calib.is_absolute() else project.path.parent / calib
    if recorded is not None:
        console.print(escape(f"variant {name}: the recipe or the base changed since {target} was built (recipe "
                             f"sha256 {recorded[:12]} -> {wanted[:12]}); rebuilding it (the old checkpoint stays "
                             "until the new one is complete)"), highlight=False, soft_wrap=True)
    console.print(escape(f"building variant {name} from its recipe: {_recipe_text(recipe)}"), highlight=False)
    try:
        if searched:
            from tokq.api.gate_search import build_for_gate

            build_for_gate(base, name, {**recipe, **({"calib": settings["calib"]} if "calib" in settings else {})},
                           target, data_set, compare_settings, runtime, wanted, force=recorded is not None,
                           threads=threads, device=runtime_keys.get("device", "auto"))
            return target
        # force: save_quantized replaces the old checkpoint only once the new one is complete
        run_quantize(str(base), target, QuantizeSettings(**settings), force=recorded is not None,
                     recipe_sha256=wanted, threads=threads, device=runtime_keys.get("device", "auto"))
    except TokqError as exc:
        raise project.error("variants", name, f"has a recipe that failed ({exc.message}): fix the recipe") from None
    return target


def gate_compare_settings(project, data, seed: int):
    """The CompareSettings the gate judges a variant with: the [data.NAME] table's keys, [gate.quality]'s rules."""
    from dataclasses import replace

    from tokq.api.compare import data_set_settings
    from tokq.evalsuite.gate_rules import quality_thresholds
    from tokq.settings import CompareSettings

    _folder, keys = data_set_settings(data)
    return replace(CompareSettings(**keys), thresholds=quality_thresholds(project.quality),
                   threshold_on=project.threshold_on, dtype=project.dtype, seed=seed)


def _search_inputs(project, data, settings) -> dict:
    """What a `target = "gate"` build depends on besides its recipe and base: the rules, the data set's settings and
    its files' content (sha256 over relative names and bytes)."""
    import dataclasses

    from tokq.api.compare import data_set_settings

    folder, _keys = data_set_settings(data)
    h = hashlib.sha256()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    fields = dataclasses.asdict(settings)
    fields["thresholds"] = {rule: {str(k): v for k, v in by.items()} for rule, by in settings.thresholds.items()}
    return {"settings": fields, "data_sha256": h.hexdigest()}


def _recipe_text(recipe: dict) -> str:
    return ", ".join(f"{k} = {v!r}" for k, v in recipe.items())


def _gate_variant(project, name: str, checkpoint: Path, base: Path, data, runtime, seed: int,
                  no_speed: bool, timeout: float = 600.0) -> dict:

    from dataclasses import replace

    from tokq.api.compare import data_set_settings, run_compare_settings
    from tokq.evalsuite.gate_rules import overall_result, speed_verdicts
    from tokq.remote.urls import redact

    console.print(f"[bold]gate {escape(name)}[/]: quality on {escape(f'[data.{data.name}]')}", highlight=False)
    folder, _keys = data_set_settings(data)
    settings = replace(gate_compare_settings(project, data, seed), timeout=timeout)
    quality = run_compare_settings(str(base), str(checkpoint), folder, settings, runtime).data
    quality["a"]["name"], quality["b"]["name"] = display_name(project.base), name  # names, never absolute paths
    rules = [{"kind": "quality", **t, "result": t.get("result") or (
        "pass" if t["passed"] else "inconclusive" if t.get("inconclusive") else "fail")} for t in quality["thresholds"]]
    bench = None
    if project.speed and not no_speed and project.variants[name].url:
        # a served variant: both sides measured over HTTP by the same client (the base served in this process)
        console.print(f"[bold]gate {escape(name)}[/]: speed on the {escape('[bench]')} workload over HTTP against "
                      f"{escape(redact(project.variants[name].url))}, paired blocks of requests, "
                      f"{project.bench.max_seconds:g} s", highlight=False)
        from tokq.api.gate_bench import http_speed_verdicts, paired_http_bench

        bench = paired_http_bench(project, {"base": base, "variant": checkpoint}, runtime, seed, timeout)
        rules += http_speed_verdicts(project.speed, bench.pop("_analysis"))
    elif project.speed and not no_speed:
        console.print(f"[bold]gate {escape(name)}[/]: speed on the {escape('[bench]')} workload, paired and "
                      f"interleaved, {project.bench.max_seconds:g} s", highlight=False)
        from tokq.api.gate_bench import paired_bench

        bench = paired_bench(project, checkpoint, base, runtime, seed)
        analysis = bench.pop("_analysis")
        rules += speed_verdicts(project.speed, analysis, bench["memory"])
    result = overall_result([r["result"] for r in rules])
    return {"checkpoint": str(checkpoint), "compare": quality, "bench": bench, "rules": rules, "result": result,
            "passed": result == "pass", "search": _recorded_search(checkpoint)}


def _recorded_search(checkpoint) -> dict | None:
    """The mixed-precision search a `target = "gate"` build records in its tokq_quantization.json (None otherwise)."""
    try:
        record = json.loads((Path(checkpoint) / "tokq_quantization.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return None
    return record.get("gate_search") if isinstance(record, dict) else None
