"""Tokenizers come from the checkpoint directory through transformers (no hub, no remote code)."""

from __future__ import annotations

import logging
from pathlib import Path

from tokq.errors import ModelError

log = logging.getLogger("tokq")


def load_tokenizer(checkpoint_dir: Path):
    """The checkpoint's own tokenizer (tokenizer.json / tokenizer_config.json)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    checkpoint_dir = Path(checkpoint_dir)
    if not any((checkpoint_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ModelError(f"{checkpoint_dir} has no tokenizer files (tokenizer.json): copy them from the original checkpoint")
    hf_logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(checkpoint_dir), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # transformers raises many types for broken tokenizer files
        raise ModelError(f"{checkpoint_dir}: the tokenizer could not be loaded ({exc})") from exc


def model_adds_bos(tokenizer) -> bool:
    """Whether the model expects a BOS token at the start of every sequence (Gemma does, SmolLM2 does not)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == bos


def token_id_error(model: str, token_id: int, vocab_size: int, tokenizer=None) -> ModelError:
    """The error for an id the model's embedding has no row for: a tokenizer from another model (or a bigger
    one), or ids given directly. Without this check it is an IndexError deep in torch, or a CUDA assert."""
    tok = f"the tokenizer holds {len(tokenizer)} tokens, " if tokenizer is not None else ""
    return ModelError(f"token id {token_id} is outside the vocabulary of {model} ({tok}its embedding has "
                      f"{vocab_size} rows, ids 0..{vocab_size - 1}): use the tokenizer of this checkpoint, or ids "
                      "below its vocab_size")


def check_token_ids(ids, vocab_size: int, model: str, tokenizer=None) -> None:
    """Raise token_id_error for the first id outside [0, vocab_size); `ids`: a tensor or a sequence of ints."""
    import torch

    if isinstance(ids, torch.Tensor):
        if ids.numel() == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
    else:
        if not ids:
            return
        lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        raise token_id_error(model, hi if hi >= vocab_size else lo, vocab_size, tokenizer)


def check_windows_fit(windows, vocab_size: int, model: str, tokenizer) -> None:
    """Every window's ids (TokenWindow.tokens) inside the model's embedding: a cheap check on the host, made
    before the weights are read, so a tokenizer bigger than the embedding fails with its sizes named."""
    for window in windows:
        check_token_ids(window.tokens, vocab_size, model, tokenizer)

