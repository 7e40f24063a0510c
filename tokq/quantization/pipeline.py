"""`quantize_model`: run a method block by block over a loaded model, in place.

The model must be loaded in fp32 (or the dtype the method should search in); every quantized
Linear is swapped for its quantized form, so the same object can be scored right away or written
out by `quantization.formats`. `recipe_sha256` identifies a tokq.toml recipe applied to one base model: the gate
records it in the checkpoint it builds and rebuilds when it changes.
"""

from __future__ import annotations

import hashlib
import json
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from tokq.engine.models import CausalLM
from tokq.errors import ConfigError
from tokq.quantization.calibration import (
    BlockContext,
    BlockSource,
    BlockwiseRunner,
    CalibrationSet,
    micro_batch_size,
)
from tokq.quantization.layer_schemes import LayerSchemes, candidate_linears
from tokq.quantization.methods import awq, gptq, rtn, smoothquant
from tokq.quantization.methods.options import MethodOptions
from tokq.quantization.resolve import DEFAULT_SCHEMES, check_method_scheme, linear_input_sizes, resolve_scheme
from tokq.quantization.scheme import QuantScheme, preset

# Re-exported: they lived here first (quantization.resolve holds them so that layer_schemes can use them).
__all__ = ["DEFAULT_SCHEMES", "METHODS", "MethodRun", "NEEDS_CALIBRATION", "check_layer_schemes", "check_method_scheme",
           "linear_input_sizes", "quantize_model", "recipe_sha256", "recorded_recipe_sha256", "resolve_scheme"]

METHODS: dict[str, ModuleType] = {"rtn": rtn, "awq": awq, "gptq": gptq, "smoothquant": smoothquant, "fp8": rtn}
NEEDS_CALIBRATION = {"awq", "gptq", "smoothquant"}


@dataclass
class MethodRun:
    method: str
    scheme: QuantScheme | LayerSchemes | None  # None: no weight was quantized (a KV-cache-only build)
    options: MethodOptions
    calibration: dict | None
    seconds: float
    peak_rss_mib: float
    blocks: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "method": self.method, "scheme": None if self.scheme is None else self.scheme.to_json(),
            "options": self.options.to_json(),
            "calibration": self.calibration, "seconds": self.seconds, "peak_rss_mib": self.peak_rss_mib,
            "blocks": self.blocks,
        }


def quantize_model(
    model: CausalLM,
    method: str,
    scheme: QuantScheme | LayerSchemes | str | None = None,
    calibration: CalibrationSet | None = None,
    options: MethodOptions | None = None,
    on_block: Callable[[int], None] | None = None,
    batch_size: int | None = None,
    blocks: BlockSource | None = None,
) -> MethodRun:
    """Quantize `model` in place with `method`: one scheme for every Linear, or a `LayerSchemes` giving each
    decoder Linear its own (or leaving it 16-bit). With `blocks` (quantization/streamed.py) the model holds no
    weights: each block is loaded from it when reached and handed back to it once quantized."""
    if isinstance(scheme, LayerSchemes):
        check_layer_schemes(model, method, scheme)
    else:
        scheme = preset(scheme or DEFAULT_SCHEMES.get(method, "w4a16")) if not isinstance(scheme, QuantScheme) else scheme
        check_method_scheme(method, scheme)
    options = options or MethodOptions()
    module = METHODS[method]
    if batch_size is None:  # calibration windows per block forward: fewer for wide models (calibration.py)
        batch_size = micro_batch_size(model.config, calibration.seq_len) if calibration is not None else 8
    if method in NEEDS_CALIBRATION and calibration is None:
        raise ConfigError(f"{method} needs calibration data (--calib DIR)")
    started = time.perf_counter()
    stats: list[dict] = []
    last = [started]

    def quantize_block(ctx: BlockContext) -> None:
        stats.append({"block": ctx.index, **module.quantize_block(ctx, scheme, options)})

    def block_done(i: int) -> None:  # a block's seconds: its quantization and its calibration forward
        now = time.perf_counter()
        stats[-1]["seconds"] = round(now - last[0], 3)
        last[0] = now
        if on_block:
            on_block(i)

    if calibration is None:  # RTN / fp8: no activations needed, visit blocks directly
        for i in range(model.config.num_layers):
            block = model.model.layers[i] if blocks is None else blocks.load(i)
            quantize_block(BlockContext(i, block, None, None, batch_size))
            if blocks is not None:
                blocks.done(i, block)
                del block
            block_done(i)
    else:
        BlockwiseRunner(model, calibration, batch_size, blocks).run(quantize_block, block_done)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return MethodRun(method, scheme, options, calibration.to_json() if calibration else None,
                          time.perf_counter() - started, peak, stats)


def check_layer_schemes(model: CausalLM, method: str, schemes: LayerSchemes) -> None:
    """Every scheme of the mix fits `method`, and every Linear it assigns is one of the model's decoder Linears."""
    if method == "smoothquant":
        raise ConfigError("smoothquant does not take a per-layer mix (its smoothing serves one W8A8 scheme per "
                          "block): quantize with rtn, awq or gptq, or give one scheme")
    for key in schemes.used():
        check_method_scheme(method, schemes.schemes[key])
    unknown = sorted(set(schemes.assignment) - set(candidate_linears(model)))
    if unknown:
        raise ConfigError(f"the mix assigns {', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}, not a "
                          f"decoder Linear of {model.name}; names look like model.layers.0.self_attn.qkv_proj "
                          "(layer_schemes.candidate_linears lists them)")


def recipe_sha256(recipe: dict, base_sha256: str) -> str:
    """sha256 of the canonical JSON (sorted keys, no spaces) of a tokq.toml recipe table and the content hash of
    the base model it is applied to: an edited recipe or a changed base gives another hash."""
    text = json.dumps({"recipe": recipe, "base_sha256": base_sha256}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _provenance(checkpoint: Path) -> dict | None:
    try:
        record = json.loads((Path(checkpoint) / "tokq_quantization.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def seal_recipe(checkpoint: Path) -> None:
    """Record the content hash of the weights just built beside their recipe hash (tokq_quantization.json), so
    that `recorded_recipe_sha256` can tell these weights from any others the record is later found with."""
    from tokq.evalsuite.baseline_cache import model_hash
    from tokq.paths import atomic_write_text

    path = Path(checkpoint) / "tokq_quantization.json"
    record = _provenance(checkpoint) or {}
    record["weights_sha256"] = model_hash(Path(checkpoint))
    atomic_write_text(path, json.dumps(record, indent=2) + "\n")


def recorded_recipe_sha256(checkpoint: Path) -> str | None:
    """The recipe hash a checkpoint's tokq_quantization.json records, if the weights beside it are the ones that
    recipe built (their content hash is the recorded `weights_sha256`); None when it records none (not built by
    the gate from a recipe), cannot be read, or the weights are not the ones sealed (a record copied from another
    build, or weights changed since: `recipe_record_problem` says which)."""
    record = _provenance(checkpoint)
    value = record.get("recipe_sha256") if record else None
    if not isinstance(value, str) or recipe_record_problem(checkpoint) is not None:
        return None
    return value


def recipe_record_problem(checkpoint: Path) -> str | None:
    """Why a checkpoint's recorded recipe hash cannot be trusted for its weights (None: it can, or it has none)."""
    from tokq.evalsuite.baseline_cache import model_hash

    record = _provenance(checkpoint)
    if not record or not isinstance(record.get("recipe_sha256"), str):
        return None
    sealed = record.get("weights_sha256")
    if not isinstance(sealed, str):
        return "its tokq_quantization.json records a recipe hash but no hash of the weights it built"
    if sealed != model_hash(Path(checkpoint)):
        return ("its weights are not the ones its recipe hash was recorded with (the record was copied from another "
                "build, or the files changed since)")
    return None
