"""tokq.toml recipe keys: a [variants] recipe is a QuantizeSettings (tokq.settings), key for key.

    int4 = { path = "built/int4", recipe = { method = "awq", group_size = 64, sym = false } }
    -> tokq.quantize(base, method="awq", group_size=64, sym=False, out="built/int4")

`tokq.config` checks a recipe's keys and value types against this table when tokq.toml is loaded; `tokq gate`
builds the variant with those keys. The table is read from the QuantizeSettings dataclass, so the recipe keys,
the `tokq quantize` flags and the Python keywords are one list; `device` (where blocks are quantized) is the one
runtime option a recipe may set. Light on purpose (no torch, no CLI import): tokq.toml parsing imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from tokq.settings import QuantizeSettings

# The methods `tokq quantize --method` takes, in its order (quantization.pipeline.METHODS maps each to its
# module; tests/test_recipe.py keeps the two equal). Here so that tokq.toml is checked without loading torch.
METHOD_NAMES = ("rtn", "awq", "gptq", "smoothquant", "fp8")
RUNTIME_KEYS = {"device": str}  # not a setting of the method: passed to tokq.quantize as device=
# Read by the gate only: target = "gate" asks for the smallest mix (the recipe's `mix`) that passes [gate.quality]
# (tokq.mixed.gate_search), instead of a --target-kl or --max-size-ratio the user picks.
GATE_KEYS = {"target": str}
GATE_TARGETS = ("gate",)


@dataclass(frozen=True)
class RecipeOption:
    """One QuantizeSettings field as a tokq.toml recipe key: group_size = 64 is `tokq quantize --group-size 64`."""

    key: str
    kind: type  # bool, int, float or str

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    def accepts(self, value: Any) -> bool:
        if self.kind is bool or isinstance(value, bool):
            return self.kind is bool and isinstance(value, bool)
        if self.kind is int:
            return isinstance(value, int)
        if self.kind is float:
            return isinstance(value, (int, float))
        return isinstance(value, (str, int, float)) and str(value) != ""

    def describe(self) -> str:
        return {bool: "true or false", int: "an integer", float: "a number"}.get(self.kind, "a string")


def _kind(annotation: str) -> type:
    """The TOML type a field takes, from its annotation ("int | None" -> int; paths and unions -> str)."""
    parts = {part.strip() for part in str(annotation).split("|")} - {"None"}
    return {"bool": bool, "int": int, "float": float}.get(parts.pop(), str) if len(parts) == 1 else str


def recipe_options() -> dict[str, RecipeOption]:
    """Recipe key -> option: every QuantizeSettings field, then the runtime keys."""
    options = {f.name: RecipeOption(f.name, _kind(f.type)) for f in fields(QuantizeSettings)}
    options.update({key: RecipeOption(key, kind) for key, kind in (RUNTIME_KEYS | GATE_KEYS).items()})
    return options


def split_recipe(recipe: dict) -> tuple[dict, dict]:
    """(QuantizeSettings keys, runtime keys) of a checked recipe; the gate's own keys (GATE_KEYS) are in neither."""
    return ({k: v for k, v in recipe.items() if k not in RUNTIME_KEYS and k not in GATE_KEYS},
            {k: v for k, v in recipe.items() if k in RUNTIME_KEYS})


def gate_target_problem(recipe: dict) -> str | None:
    """What is wrong with a recipe's `target` key (None: nothing, or no target): it must be "gate", with a mix to
    search over and no size goal of its own."""
    if "target" not in recipe:
        return None
    if recipe["target"] not in GATE_TARGETS:
        return (f"recipe target = {recipe['target']!r} is not a target; the one target is \"gate\" (the smallest "
                "mix that passes [gate.quality])")
    if not recipe.get("mix"):
        return 'recipe target = "gate" searches over the formats of the recipe\'s mix: add mix = "w4a16,w8a16,bf16"'
    if recipe.get("target_kl") is not None or recipe.get("max_size_ratio") is not None:
        return 'recipe target = "gate" takes its size from [gate.quality]: drop target_kl / max_size_ratio'
    return None
