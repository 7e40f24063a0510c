import os

import pytest
import torch

# Triton kernels run on the CPU interpreter where there is no GPU; this must be set before anything
# imports triton (the registry imports Triton modules lazily when asked about a CUDA layer).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests run on 2 shared cores with tiny shapes: one thread avoids OpenMP threads spinning on each
# other (measured 6 s vs 118 s for test_methods.py while another job held the cores), and fixed
# threads make reductions repeatable.
torch.set_num_threads(int(os.environ.get("TOKQ_TEST_THREADS", "1")))

# Compiling the decode step (engine/compiled_decode.py) costs seconds per model and batch shape: the suite runs
# eagerly, except tests/test_compiled_decode.py, which checks the compiled path against the eager one.
os.environ.setdefault("TOKQ_COMPILE", "0")


@pytest.fixture(autouse=True)
def _isolated_tokq_home(tmp_path_factory, monkeypatch, request):
    """Unit tests never touch the user's cache; integration tests share one pulled-model cache."""
    if request.node.get_closest_marker("integration"):
        return
    monkeypatch.setenv("TOKQ_HOME", str(tmp_path_factory.mktemp("tokq_home")))
