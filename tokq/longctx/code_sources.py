"""The sources of the built-in code set (`--data code`): real, licence-clean source files from distribution
packages that every tokq install has, because tokq itself depends on them.

Sources, in order (each used only where present):

- `torch-python`: PyTorch's own Python sources (BSD-3-Clause); its vendored third-party code, generated
  stubs and test helpers are left out.
- `torch-cpp`: PyTorch's hand-written C++ headers shipped in the wheel (ATen, c10, torch/csrc; BSD-3-Clause);
  the generated per-operator headers and the bundled third-party libraries (oneDNN, fmt, pybind11...) are
  left out.
- `transformers-python`: Hugging Face transformers' Python sources (Apache-2.0): model files, trainer,
  tokenizers, generation.

Code models are gated on code: this set is what the code models of the zoo (Qwen2.5-Coder) are judged and
calibrated on, beside the prose of the default set (whose own code is the CPython standard library, so
the two sets share no file). The packages are located without being imported; versions come from their
installed metadata.
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .default_sources import SourceSpec

_MISSING = Path("/nonexistent-package-folder")  # reported as "not found; install <package>" by the builder


def _package_root(module: str) -> Path:
    """The folder of an installed top-level package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return _MISSING
    return Path(next(iter(spec.submodule_search_locations)))


def _version(distribution: str) -> str | None:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def code_sources() -> list[SourceSpec]:
    """The code set's source specs for this machine, in a fixed order."""
    torch_root = _package_root("torch")
    return [
        SourceSpec(
            name="torch-python",
            package="torch",
            version=_version("torch"),
            root=torch_root,
            patterns=("**/*.py",),
            licence="BSD-3-Clause",
            exclude=(
                "_vendor/*", "*/_vendor/*", "testing/*", "*/testing/*", "include/*", "share/*", "lib/*", "bin/*",
                "*/__pycache__/*", "_C/*", "*_generated*", "*/generated/*", "_inductor/fx_passes/serialized_patterns/*",
                # Tables of data, not code.
                "utils/hipify/cuda_to_hip_mappings.py", "sparse/_triton_ops_meta.py",
            ),
        ),
        SourceSpec(
            name="torch-cpp",
            package="torch",
            version=_version("torch"),
            root=torch_root / "include",
            patterns=("ATen/**/*.h", "c10/**/*.h", "torch/csrc/**/*.h"),
            licence="BSD-3-Clause",
            # Generated headers (one per operator, or long lists of declarations) are not code anyone wrote.
            exclude=(
                "ATen/ops/*", "ATen/*Functions.h", "ATen/*Functions_inl.h", "ATen/MethodOperators.h",
                "ATen/Operators.h", "ATen/RegistrationDeclarations.h", "ATen/core/TensorBody.h",
                "ATen/core/aten_interned_strings.h", "ATen/VmapGeneratedPlumbing.h", "ATen/*/generated/*",
                "torch/csrc/autograd/generated/*", "torch/csrc/lazy/generated/*", "ATen/core/enum_tag.h",
                "torch/csrc/inductor/aoti_torch/generated/*", "*generated*",
            ),
        ),
        SourceSpec(
            name="transformers-python",
            package="transformers",
            version=_version("transformers"),
            root=_package_root("transformers"),
            patterns=("**/*.py",),
            licence="Apache-2.0",
            # modular_*.py and the modeling_*.py generated from it say the same twice: the modeling file is kept.
            exclude=("*/__pycache__/*", "*dummy_*_objects.py", "*/convert_*.py", "commands/*", "testing_utils.py",
                     "*_pb2.py", "models/*/modular_*.py", "__init__.py", "*/__init__.py"),
        ),
    ]
