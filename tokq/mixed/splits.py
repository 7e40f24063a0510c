"""Split documents into a choice side (sensitivities and calibration: where the mix is chosen) and a held-out
side (where the chosen build is verified), so that no choice is tuned on the windows that judge it.

A document's side depends only on a hash of its name (`doc_id`, its path in the data folder) and the seed, not
on its position: adding, removing or reordering other documents never moves it. Documents with the same text
under two names go to one side (the first name's, by sort order), so a copy cannot leak across.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from tokq.errors import ConfigError, DataError
from tokq.longctx.documents import Document


def _unit(name: str, seed: int) -> float:
    """A number in [0, 1) from the name and seed alone (sha256: stable across runs and Python versions)."""
    digest = hashlib.sha256(f"tokq-mix-split\0{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_documents(documents: Iterable[Document], held_out_fraction: float = 0.5,
                    seed: int = 0) -> tuple[list[Document], list[Document]]:
    """(choice, held_out): each document on one side, about `held_out_fraction` of them held out, both sides
    non-empty (with few documents the fraction is approximate: the extreme hash moves over to fill an empty side).
    Each side keeps the input order."""
    if not 0.0 < held_out_fraction < 1.0:
        raise ConfigError(f"held_out_fraction {held_out_fraction}: give a number strictly between 0 and 1")
    docs = list(documents)
    groups: dict[str, str] = {}  # text sha256 -> the name that decides its side
    for doc in sorted(docs, key=lambda d: d.doc_id):
        groups.setdefault(doc.sha256, doc.doc_id)
    if len(groups) < 2:
        raise DataError(f"choosing a mix needs at least 2 different documents (one to choose on, one to verify "
                        f"on); got {len(groups)}: add documents to the data folder")
    key = {sha: _unit(name, seed) for sha, name in groups.items()}
    held = {sha for sha, u in key.items() if u < held_out_fraction}
    if not held:  # everything landed on the choice side: hold out the one whose hash came closest
        held = {min(key, key=key.__getitem__)}
    elif len(held) == len(key):
        held.discard(max(key, key=key.__getitem__))
    choice = [d for d in docs if d.sha256 not in held]
    held_out = [d for d in docs if d.sha256 in held]
    return choice, held_out
