"""tokq.toml recipe keys (tokq.quantization.recipe) are the QuantizeSettings fields, which are `tokq quantize`'s
options by the same names: one name per concept in the CLI, tokq.toml and Python."""

from __future__ import annotations

import inspect
from dataclasses import fields

from tokq.commands.quantize import quantize_cmd
from tokq.quantization.recipe import GATE_KEYS, RUNTIME_KEYS, recipe_options, split_recipe
from tokq.settings import QuantizeSettings


def test_every_setting_is_a_quantize_flag_of_the_same_name():
    params = inspect.signature(quantize_cmd).parameters
    for f in fields(QuantizeSettings):
        assert f.name in params, f"QuantizeSettings.{f.name} is not a `tokq quantize` option"
        flag = params[f.name].default.param_decls[0].partition("/")[0]
        assert flag == "--" + f.name.replace("_", "-")


def test_recipe_keys_are_the_settings_and_the_runtime_keys():
    assert set(recipe_options()) == {f.name for f in fields(QuantizeSettings)} | set(RUNTIME_KEYS) | set(GATE_KEYS)


def test_recipe_option_types():
    options = recipe_options()
    assert options["group_size"].kind is int and options["sym"].kind is bool and options["damp"].kind is float
    assert options["calib"].kind is str and options["alpha"].kind is str  # a number or "search"
    assert options["group_size"].accepts(64) and not options["group_size"].accepts("64")
    assert not options["group_size"].accepts(True) and options["sym"].accepts(False)
    assert options["damp"].accepts(1) and options["alpha"].accepts(0.5) and not options["alpha"].accepts("")
    assert options["group_size"].flag == "--group-size"


def test_split_recipe_keeps_device_apart():
    settings, runtime = split_recipe({"method": "rtn", "group_size": 32, "device": "cpu"})
    assert settings == {"method": "rtn", "group_size": 32} and runtime == {"device": "cpu"}
    QuantizeSettings(**settings)  # the rest builds the settings object the gate quantizes with


def test_method_names_are_the_pipeline_methods():
    from tokq.quantization.pipeline import METHODS
    from tokq.quantization.recipe import METHOD_NAMES

    assert tuple(METHODS) == METHOD_NAMES
