import os

import pytest
import torch

# Tests run on 2 shared cores; fixed threads make timings and reductions repeatable.
torch.set_num_threads(int(os.environ.get("TOKQ_TEST_THREADS", "2")))


@pytest.fixture(autouse=True)
def _isolated_tokq_home(tmp_path_factory, monkeypatch, request):
    """Unit tests never touch the user's cache; integration tests share one pulled-model cache."""
    if request.node.get_closest_marker("integration"):
        return
    monkeypatch.setenv("TOKQ_HOME", str(tmp_path_factory.mktemp("tokq_home")))
