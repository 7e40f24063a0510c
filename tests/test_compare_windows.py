"""api.compare_windows.engine_loader: a window longer than MAX_PREFILL_STEP is prefilled in steps (memory bounded
by the step, not the window), and its scores equal those of one whole-window step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.test_models_vs_hf import make_hf_checkpoint
from tokq.api import compare_windows
from tokq.engine.tokenizer import load_tokenizer


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    from tests.test_quantize_cli import save_word_tokenizer

    make_hf_checkpoint("llama", tmp_path)
    save_word_tokenizer(tmp_path)
    return tmp_path


def test_long_windows_are_prefilled_in_bounded_steps_with_the_same_scores(checkpoint: Path, monkeypatch) -> None:
    assert compare_windows.prefill_step(1024) == 2048  # short windows: one step (the engine's floor)
    assert compare_windows.prefill_step(3000) == 3000
    assert compare_windows.prefill_step(32768) == compare_windows.MAX_PREFILL_STEP
    window = 96
    tokens = torch.randint(0, 64, (window,), generator=torch.Generator().manual_seed(0)).tolist()

    def scores(step_cap: int) -> torch.Tensor:
        monkeypatch.setattr(compare_windows, "MAX_PREFILL_STEP", step_cap)
        monkeypatch.setattr(compare_windows, "prefill_step", lambda w: min(w, step_cap))
        engine = compare_windows.engine_loader(checkpoint, load_tokenizer(checkpoint), dtype="fp32", device="cpu",
                                               max_model_len=window, kv_memory=None, kv_dtype="fp32",
                                               window=window)()
        assert engine.config.max_num_batched_tokens == min(window, step_cap)
        return engine.score([tokens], topk=4)[0].logprobs

    whole, stepped = scores(window), scores(32)  # 1 step vs 3 steps of 32 tokens
    torch.testing.assert_close(stepped, whole, rtol=1e-4, atol=1e-5)
