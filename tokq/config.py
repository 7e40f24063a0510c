"""tokq.toml, read whole and checked: base model, variants, data sets, the bench workload, gate rules.

Over 400 lines: every table's checks live here, beside the dataclasses they fill, so that one file says what
tokq.toml may hold and what each refusal names.

    [base]
    model = "smollm2-135m"          # zoo name, or checkpoint directory (relative to this file)
    dtype = "auto"

    [variants]
    int4 = "tokq_out/smollm2-awq-int4"                                     # a checkpoint
    w8a8 = { recipe = { method = "smoothquant", scheme = "w8a8-int8" } }   # built by `tokq quantize` when missing

    [data.default]
    builtin = "default"             # tokq's own long-document set, built on this machine at first use
    window = 2048

    [data.mine]
    path = "docs"                   # a folder of your documents (relative to this file)
    sample_windows = 16
    max_doc_mb = 64                 # read caps, as `tokq compare --max-doc-mb / --max-file-mb`
    max_file_mb = 1024

    [bench]
    prompt_len = 512
    gen_len = 256
    concurrency = 16

    [gate.quality]
    max_kl = 0.05
    min_top1 = { overall = 0.9, "4K-8K" = 0.85 }

    [gate.speed]
    min_tpot_speedup = 1.2

Every key is checked when the file is loaded, before any work: an unknown key (a variant takes path and
recipe; a recipe only `tokq quantize` options; a per-bucket rule only "overall" and the position buckets of
evalsuite.stats), a value of the wrong type, a threshold that is nan or inf, or a gate without any rule is
an error naming the file, the line and the fix (`ConfigError`, exit 2). Relative paths ([base] model unless
it is a zoo name, variant paths, data paths, a recipe's calib) are relative to this file's folder, never the
working directory.

This module is the one reader of tokq.toml: `find_config` / `load_config` / `find_variant` (the [variants]
lookup every command uses) and `load_project` (the whole file, checked; `tokq.config_checker` names the
line of a bad key). `tokq.config_edit` adds a variant to the file (`tokq quantize --name`);
`tokq.config_starter` holds the starter `tokq init` writes. Light: no torch at import.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokq.config_checker import Checker, check_url_variant, table_error, url_side
from tokq.errors import ConfigError
from tokq.evalsuite.rule_defs import POSITION_BUCKETS, QUALITY_RULES, SPEED_RULES, UNBUCKETED_RULES
from tokq.longctx.builtin_sets import builtin_problem, builtin_set_path
from tokq.longctx.read_limits import DEFAULT_MAX_DOC_MB, DEFAULT_MAX_FILE_MB
from tokq.quantization.recipe import METHOD_NAMES, gate_target_problem, recipe_options
from tokq.zoo_catalog import ZOO

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger("tokq")

CONFIG_NAME = "tokq.toml"
DATA_KEYS = {"path", "builtin", "window", "stride", "max_tokens", "sample_windows", "probe_max_context",
             "probe_depths", "probe_repeats", "max_doc_mb", "max_file_mb"}
# [data.NAME] keys in MiB, as the --max-doc-mb / --max-file-mb flags take them: any positive finite number.
DATA_MIB_KEYS = {"max_doc_mb", "max_file_mb"}
# Rule names: evalsuite.rule_defs (QUALITY_RULES for [gate.quality] and [compare.thresholds], SPEED_RULES for
# [gate.speed], each rule -> "max" or "min"), the table compare and the gate's verdicts read too.


def find_config(start: Path | None = None) -> Path | None:
    """$TOKQ_CONFIG, else tokq.toml in the working directory or one of its parents."""
    if os.environ.get("TOKQ_CONFIG"):
        return Path(os.environ["TOKQ_CONFIG"])
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / CONFIG_NAME).is_file():
            return folder / CONFIG_NAME
    return None


def load_config(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}; fix the file or run `tokq init` for a starter") from exc
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read ({exc.strerror})") from exc


def variants_table(path: Path) -> dict:
    """tokq.toml's [variants] ({} when it has none); `variants = 5` or a list is an error naming file:line."""
    variants = load_config(path).get("variants", {})
    if not isinstance(variants, dict):
        raise table_error(path, "", "variants", f"= {variants!r} must be a table: fix the file, e.g. [variants] "
                                                "with one `name = \"path\"` line per checkpoint")
    return variants


def find_variant(name: str) -> Path | None:
    """The checkpoint path of variant `name` in tokq.toml, or None if there is no such variant."""
    path = find_config()
    if path is None:
        return None
    variants = variants_table(path)
    if name not in variants:
        return None
    entry = variants[name]
    if isinstance(entry, dict) and "url" in entry:
        return None  # a served model, not a checkpoint (find_url_variant)
    target = entry.get("path") if isinstance(entry, dict) else entry
    if not isinstance(target, str):
        raise ConfigError(f"{path}: variant {name!r} needs a checkpoint path (a string or {{ path = \"...\" }})")
    resolved = Path(target).expanduser()
    return resolved if resolved.is_absolute() else path.parent / resolved


def find_url_variant(name: str) -> str | None:
    """The compare side (`url=...#model=...`, tokq.remote.endpoint_scoring) of a url variant in tokq.toml, or None."""
    path = find_config()
    entry = variants_table(path).get(name) if path is not None else None
    return url_side(entry["url"], entry.get("model")) if isinstance(entry, dict) and "url" in entry else None


@dataclass(frozen=True)
class Rule:
    name: str  # e.g. max_kl, min_tpot_speedup
    direction: str  # "max" or "min"
    threshold: float
    bucket: str | None = None  # quality rules: a position bucket, None = overall


@dataclass
class DataSet:
    name: str
    path: Path  # the folder read; for a built-in set, where this machine keeps it (built at first use)
    window: int = 2048
    stride: int | None = None
    max_tokens: int | None = None
    sample_windows: int | None = None
    probe_max_context: int | None = None  # longest passkey probe context (default: the window)
    probe_depths: int = 5  # needle depths per probe context, evenly spaced 0..1
    probe_repeats: int = 1  # probes (each its own key) per (context, depth)
    max_doc_mb: float = DEFAULT_MAX_DOC_MB  # read caps (documents.ReadLimits), as `compare --max-doc-mb`
    max_file_mb: float = DEFAULT_MAX_FILE_MB
    builtin: str | None = None  # a tokq built-in set's name (longctx.builtin_sets), instead of a path


@dataclass
class Variant:
    name: str
    path: Path | None = None
    recipe: dict[str, Any] | None = None  # `tokq quantize` options (method, scheme, group_size, ...)
    url: str | None = None  # a served model (OpenAI-compatible endpoint): compared over HTTP, never built
    model: str | None = None  # its served model name (default: the endpoint's first)

    @property
    def side(self) -> str | None:
        """The compare side of a url variant (None: a checkpoint)."""
        return url_side(self.url, self.model) if self.url else None


@dataclass
class BenchWorkload:
    prompt_len: int = 512
    gen_len: int = 256
    concurrency: int = 16
    num_prompts: int | None = None
    gen_len_range: float = 0.0
    arrival_rate: float | None = None  # None: all at once
    max_seconds: float = 60.0  # time budget of the paired speed experiment, per variant
    block_steps: int = 8  # engine steps per block: base and variant alternate block by block


@dataclass
class Project:
    path: Path
    base: str
    dtype: str = "auto"
    variants: dict[str, Variant] = field(default_factory=dict)
    data: dict[str, DataSet] = field(default_factory=dict)
    bench: BenchWorkload = field(default_factory=BenchWorkload)
    quality: list[Rule] = field(default_factory=list)
    threshold_on: str = "bound"  # [gate.quality] threshold_on: the CI's unfavourable bound decides, or the estimate
    speed: list[Rule] = field(default_factory=list)
    checker: Checker | None = field(default=None, repr=False, compare=False)

    def error(self, table: str, key: str | None, message: str) -> ConfigError:
        """A ConfigError naming this file and the line of [table] key (for checks made after loading)."""
        if self.checker is None:
            return ConfigError(f"{self.path}: [{table}] {key or ''} {message}")
        return self.checker.fail(table, key, message)


def load_project(path: Path) -> Project:
    """Read and check tokq.toml (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: run `tokq init` for a commented starter")
    raw = load_config(path)
    check = Checker(path, path.read_text(encoding="utf-8"))
    for key in raw:
        if key not in ("base", "variants", "data", "bench", "gate", "compare"):
            raise check.fail("", key, "is not a known table; known: base, variants, data, bench, gate, compare")
    base_table = check.table(raw, "base", {"model", "dtype"})
    if "model" not in base_table:
        raise check.fail("base", None, "needs model = \"<zoo name or checkpoint directory>\"")
    project = Project(path, _base_model(path, check.string("base", "model", base_table["model"])),
                      check.string("base", "dtype", base_table.get("dtype", "auto")), checker=check)
    for name, entry in check.table(raw, "variants").items():
        project.variants[name] = _variant(check, path, name, entry)
    for name, entry in check.table(raw, "data").items():
        if not isinstance(entry, dict):
            raise check.fail("data", name, "must be a table: [data.NAME] with path = ... or builtin = ...")
        project.data[name] = _data_set(check, path, name, entry)
    bench = check.table(raw, "bench", {"prompt_len", "gen_len", "concurrency", "num_prompts", "gen_len_range",
                                       "arrival_rate", "max_seconds", "block_steps", "rounds"})
    if "rounds" in bench:
        raise check.fail("bench", "rounds", "was replaced by max_seconds (the paired speed experiment runs as many "
                                            "interleaved passes as fit): write max_seconds = 60 instead")
    workload = BenchWorkload()
    for key in ("prompt_len", "gen_len", "concurrency", "num_prompts", "block_steps"):
        if key in bench:
            setattr(workload, key, int(check.number("bench", key, bench[key], integer=True, minimum=1)))
    if "gen_len_range" in bench:
        workload.gen_len_range = float(check.number("bench", "gen_len_range", bench["gen_len_range"], minimum=0,
                                                    below=1, finite=True))
    if "max_seconds" in bench:
        # finite: inf would run the paired bench forever, nan compares false and would run no pass at all
        workload.max_seconds = float(check.number("bench", "max_seconds", bench["max_seconds"], minimum=1,
                                                  finite=True))
    if "arrival_rate" in bench:
        rate = check.number("bench", "arrival_rate", bench["arrival_rate"], finite=True)
        if rate <= 0:
            raise check.fail("bench", "arrival_rate", "must be > 0 requests per second (leave it out: all at once)")
        workload.arrival_rate = float(rate)
    project.bench = workload
    gate = check.table(raw, "gate", {"quality", "speed"})
    quality = check.table(gate, "gate.quality", set(QUALITY_RULES) | {"threshold_on", "ci"})
    key = "threshold_on"
    if "ci" in quality:  # the key's former name: one name per concept now, as `tokq compare --threshold-on`
        if "threshold_on" in quality:
            raise check.fail("gate.quality", "ci", "and threshold_on are the same setting: keep threshold_on only")
        log.warning(f"{path}: [gate.quality] ci is now called threshold_on (as `tokq compare --threshold-on`): "
                    "rename it")
        key = "ci"
    if key in quality:
        if quality[key] not in ("bound", "point"):
            raise check.fail("gate.quality", key, f"= {quality[key]!r} must be \"bound\" (the 95% CI decides: pass, "
                                                  "fail or inconclusive) or \"point\" (the estimate decides)")
        project.threshold_on = quality[key]
    project.quality = _rules(check, {"quality": {k: v for k, v in quality.items() if k not in ("threshold_on", "ci")}},
                             "gate.quality", QUALITY_RULES, buckets=True)
    project.speed = _rules(check, gate, "gate.speed", SPEED_RULES, buckets=False)
    if not project.quality and not project.speed:
        table = next((t for t in ("gate.quality", "gate.speed") if check.line_of(t)), "gate.quality")
        other = "[gate.speed]" if table == "gate.quality" else "[gate.quality]"
        raise check.fail(table, None, f"holds no rule and neither does {other}: a gate without rules would pass any "
                                      "variant; add one, e.g. max_kl = 0.05 under [gate.quality] or "
                                      "min_tpot_speedup = 1.2 under [gate.speed]")
    # `tokq compare` reads [compare.thresholds] itself; checked here too so a gate run never carries a bad one.
    compare = check.table(raw, "compare", {"thresholds"})
    _rules(check, compare, "compare.thresholds", QUALITY_RULES, buckets=True)
    from tokq.evalsuite.power import check_project

    check_project(project)  # a rule its sample cannot decide (too few probes, an impossible limit): its line
    return project


def _base_model(path: Path, model: str) -> str:
    """A zoo name stays one; anything else is a checkpoint directory, made absolute against tokq.toml's folder
    (never the working directory, and never looked up as a [variants] name)."""
    if model in ZOO:
        return model
    folder = Path(model).expanduser()
    return os.path.normpath(folder if folder.is_absolute() else path.absolute().parent / folder)


def _variant(check: Checker, path: Path, name: str, entry: Any) -> Variant:
    if isinstance(entry, str):
        entry = {"path": entry}
    if not isinstance(entry, dict):
        raise check.fail("variants", name, "must be a path string or a table { path = ..., recipe = {...} }")
    if "url" in entry:
        url, model = check_url_variant(check, name, entry)
        return Variant(name, url=url, model=model)
    for key in entry:
        if key not in ("path", "recipe"):
            raise check.fail("variants", name, f"has an unknown key {key!r}: a variant takes path and recipe "
                                               f"(`tokq quantize` options go inside recipe = {{ ... }}), or url "
                                               "and model (a served model)")
    if "path" not in entry and "recipe" not in entry:
        raise check.fail("variants", name, "needs a path (a checkpoint) or a recipe (how to build it)")
    target = None
    if "path" in entry:
        target = Path(check.string("variants", name, entry["path"])).expanduser()
        target = target if target.is_absolute() else path.parent / target
    recipe = entry.get("recipe")
    if recipe is not None and (not isinstance(recipe, dict) or "method" not in recipe):
        raise check.fail("variants", name, "recipe must be a table with at least method = \"awq\" (rtn, awq, gptq, "
                                           "smoothquant, fp8)")
    if recipe is not None:
        _check_recipe(check, name, recipe)
    return Variant(name, target, recipe)


def _check_recipe(check: Checker, name: str, recipe: dict) -> None:
    """Every recipe key is a `tokq quantize` option the gate may pass, with a value of its type."""
    options = recipe_options()
    for key, value in recipe.items():
        option = options.get(key)
        if option is None:
            raise check.fail("variants", name, f"recipe key {key!r} is not a `tokq quantize` option a recipe can set; "
                                               f"known: {', '.join(sorted(options))}")
        if not option.accepts(value):
            raise check.fail("variants", name, f"recipe {key} = {value!r} must be {option.describe()} "
                                               f"(as `tokq quantize {option.flag}` takes it)")
        if key == "calib" and not (isinstance(value, str) and value):  # the gate makes a Path of it
            raise check.fail("variants", name, f"recipe calib = {value!r} must be a folder path (a string)")
    if recipe["method"] not in METHOD_NAMES:
        raise check.fail("variants", name, f"recipe method = {recipe['method']!r} is not a method; choose one of "
                                           f"{', '.join(METHOD_NAMES)}")
    problem = gate_target_problem(recipe)
    if problem:
        raise check.fail("variants", name, problem)


def _data_set(check: Checker, path: Path, name: str, entry: dict) -> DataSet:
    table = f"data.{name}"
    for key in entry:
        if key not in DATA_KEYS:
            raise check.fail(table, key, f"is not a known key; known: {', '.join(sorted(DATA_KEYS))}")
    if ("path" in entry) == ("builtin" in entry):
        raise check.fail(table, None, "needs one of path = \"<folder of documents>\" (relative to this file) or "
                                      f"builtin = \"default\" (tokq's own set), not {'both' if 'path' in entry else 'neither'}")
    if "builtin" in entry:
        problem = builtin_problem(entry["builtin"])
        if problem:
            raise check.fail(table, "builtin", problem)
        data = DataSet(name, builtin_set_path(entry["builtin"]), builtin=entry["builtin"])
    else:
        folder = Path(check.string(table, "path", entry["path"])).expanduser()
        data = DataSet(name, folder if folder.is_absolute() else path.parent / folder)
    for key in sorted(DATA_KEYS - {"path", "builtin"} - DATA_MIB_KEYS):
        if key in entry:
            setattr(data, key, int(check.number(table, key, entry[key], integer=True, minimum=1)))
    for key in sorted(DATA_MIB_KEYS & set(entry)):
        # finite and > 0, as the flags: 0 would skip every document, inf or nan cap nothing
        mib = check.number(table, key, entry[key], finite=True)
        if mib <= 0:
            raise check.fail(table, key, f"= {mib!r} must be a positive number of MiB")
        setattr(data, key, float(mib))
    return data


def _rules(check: Checker, gate: dict, table: str, known: dict[str, str], buckets: bool) -> list[Rule]:
    entries = check.table(gate, table, set(known))
    rules = []
    labels = _bucket_labels() if buckets else []
    for name, value in entries.items():
        per = value if isinstance(value, dict) and buckets else {"overall": value}
        if not per:
            raise check.fail(table, name, "is an empty table: give a threshold, or { overall = ..., \"BUCKET\" = ... }")
        for bucket, threshold in per.items():
            problem = bucket_problem(name, bucket, labels)
            if problem:
                raise check.fail(table, name, problem)
            number = check.number(table, name, threshold, finite=True)
            rules.append(Rule(name, known[name], float(number), None if bucket == "overall" else bucket))
    return rules


def _bucket_labels() -> list[str]:

    return [label for _, _, label in POSITION_BUCKETS]


def compare_thresholds(path: Path) -> dict[str, dict[str | None, float]]:
    """tokq.toml's [compare.thresholds] for `tokq compare` (name -> {bucket or None: threshold}), checked as
    `tokq gate` checks them: an unknown rule, a bucket label that is no position bucket, or a value that is
    not a finite number is an error naming file:line, before any scoring."""
    path = Path(path)
    raw = load_config(path)
    check = Checker(path, path.read_text(encoding="utf-8"))
    out: dict[str, dict[str | None, float]] = {}
    for rule in _rules(check, check.table(raw, "compare"), "compare.thresholds", QUALITY_RULES, buckets=True):
        out.setdefault(rule.name, {})[rule.bucket] = rule.threshold
    return out


def bucket_problem(rule: str, bucket: str, labels: list[str] | None = None) -> str | None:
    """Why `bucket` cannot label a threshold of `rule` (None: it can): only "overall" and the position buckets
    of evalsuite.stats are labels. A free-form label would be copied into every report (report.html is a CI
    artifact: no markup from a PR's tokq.toml may reach it) and matches no bucket."""
    if bucket == "overall":
        return None
    if rule in UNBUCKETED_RULES:
        return (f"names bucket {bucket!r}, but {rule} has no position buckets (the retrieval probes are not "
                "split by position): give one number")
    labels = _bucket_labels() if labels is None else labels
    if bucket not in labels:
        return f"names bucket {bucket!r}, which is not a position bucket; use overall or one of {', '.join(labels)}"
    return None

