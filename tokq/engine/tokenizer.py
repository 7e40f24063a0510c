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
