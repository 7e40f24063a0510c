"""Multi-key passkey probes (RULER's MK-NIAH shape) on the user's own documents, built so that one long prefill
serves many probes.

A context of exactly C tokens holds N needles, "The pass key of <label> is <5 digits>. ...", at evenly spaced
depths 0 .. 1 of a filler made of the documents (concatenated in a seeded order; each needle moved at most
SNAP_TOKENS to sit right after a line break). Each needle is asked for in its own request, context + "What is the
pass key of <label>? The pass key of <label> is" + MAX_NEW_TOKENS greedy tokens; correct = the first 5-digit number
of the answer is the key. The context's first request runs alone and the other N - 1 together, so they hit the
engine's prefix cache: a C-token prefill yields N probes, which is what makes grids at 32K contexts affordable on
a CPU. Single-needle probes (longctx.probes) stay what `tokq compare` runs; these are harder (N keys to tell apart)
and their results feed the same flip comparison (evalsuite.compare's probe comparison: context, depth, correct).
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

from tokq.engine.sampling import SamplingParams
from tokq.longctx.probe_scoring import extract_key

MAX_NEW_TOKENS = 8  # " 48213." and a little room
INSTRUCTION = ("Several pass keys, each with a name, are hidden inside a lot of irrelevant text. Find them and "
               "memorize them. I will quiz you about them.\n\n")
NEEDLE = "\nThe pass key of {label} is {key}. Remember it. {key} is the pass key of {label}.\n"
QUESTION = "\n\nWhat is the pass key of {label}? The pass key of {label} is"
LABELS = ("Alder", "Birch", "Cedar", "Daisy", "Ember", "Falcon", "Garnet", "Heron", "Iris", "Juniper", "Kestrel",
          "Lilac", "Maple", "Nutmeg", "Otter", "Pepper")
SNAP_TOKENS = 64  # a needle moves at most this far to sit at a line break


@dataclass(frozen=True)
class MultiKeyContext:
    """One probe context: `ids` (exactly `context` tokens) holding one needle per label."""

    context: int
    filler: int  # which seeded filler order
    ids: list[int]
    labels: tuple[str, ...]
    keys: tuple[str, ...]
    needle_starts: tuple[int, ...]  # token index of each needle in `ids`
    depths: tuple[float, ...]  # each needle's actual depth in the filler, 0 .. 1


def snap(position: int, breaks: list[int], reach: int = SNAP_TOKENS) -> int:
    """The line-break position nearest `position` within `reach` tokens (`position` itself when none is)."""
    i = bisect.bisect_left(breaks, position)
    near = [b for b in breaks[max(0, i - 1): i + 1] if abs(b - position) <= reach]
    return min(near, key=lambda b: abs(b - position)) if near else position


def multi_key_context(context: int, filler_ids: list[int], breaks: list[int], header: list[int], encode,
                      needles: int, seed: int, filler: int = 0) -> MultiKeyContext:
    """Header + filler with `needles` needles at evenly spaced depths, exactly `context` tokens. `filler_ids` must
    hold enough tokens; `breaks`: ascending filler positions right after a line break; `encode`: text -> ids."""
    if needles < 1 or needles > len(LABELS):
        raise ValueError(f"needles must be 1..{len(LABELS)}, got {needles}")
    rng = random.Random(f"{seed}:{context}:{filler}")
    keys = []
    while len(keys) < needles:
        k = str(rng.randint(10_000, 99_999))
        if k not in keys:
            keys.append(k)
    labels = LABELS[:needles]
    needle_ids = [encode(NEEDLE.format(label=lab, key=k)) for lab, k in zip(labels, keys, strict=True)]
    budget = context - len(header) - sum(map(len, needle_ids))
    if budget < needles or len(filler_ids) < budget:
        raise ValueError(f"context {context}: needs {budget} filler tokens, has {len(filler_ids)}")
    fill = filler_ids[:budget]
    depths = [i / (needles - 1) if needles > 1 else 0.5 for i in range(needles)]
    cuts, last = [], 0
    for d in depths:
        cut = min(max(snap(round(d * budget), [b for b in breaks if b <= budget]), last), budget)
        cuts.append(cut)
        last = cut
    ids, starts, prev = list(header), [], 0
    for cut, nid in zip(cuts, needle_ids, strict=True):
        ids += fill[prev:cut]
        starts.append(len(ids))
        ids += nid
        prev = cut
    ids += fill[prev:]
    assert len(ids) == context, (len(ids), context)
    return MultiKeyContext(context, filler, ids, tuple(labels), tuple(keys), tuple(starts),
                           tuple(c / budget for c in cuts))


def probe_filler(documents, tokenizer, need: int, filler: int, seed: int) -> tuple[list[int], list[int]]:
    """The evaluation documents' tokens in a seeded order (repeated if short), `need` of them, and the positions
    right after a line break."""
    order = [d for d in documents if d.text.strip()]
    if not order:
        raise ValueError("probe filler: no document has text")
    random.Random(f"{seed}:filler:{filler}").shuffle(order)
    ids: list[int] = []
    sep = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    while len(ids) < need:
        for d in order:
            ids += tokenizer(d.text, add_special_tokens=False)["input_ids"] + sep
            if len(ids) >= need:
                break
    ids = ids[:need]
    pieces = tokenizer.convert_ids_to_tokens(ids)
    breaks = [i + 1 for i, piece in enumerate(pieces) if "\n" in piece or "Ċ" in piece]
    return ids, breaks


def run_multi_key_probes(engine, contexts: list[MultiKeyContext], tokenizer) -> tuple[list[dict], float]:
    """Every needle of every context asked in its own request; the context's first request alone, the rest
    together (prefix-cache hits). Returns the per-probe results and the prefix-cache hit rate."""
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
    results = []
    stats = engine.blocks.stats
    hit0, query0 = stats.prefix_hit_tokens, stats.prefix_query_tokens
    for ctx in contexts:
        prompts = [ctx.ids + tokenizer(QUESTION.format(label=lab), add_special_tokens=False)["input_ids"]
                   for lab in ctx.labels]
        outs = engine.generate(prompts[:1], params) + engine.generate(prompts[1:], params)
        for i, out in enumerate(outs):
            text = out.text or tokenizer.decode(out.token_ids, skip_special_tokens=True)
            predicted = extract_key(text)
            results.append({"context": ctx.context, "depth": round(ctx.depths[i], 2), "filler": ctx.filler,
                            "label": ctx.labels[i], "key": ctx.keys[i], "predicted": predicted,
                            "correct": predicted == ctx.keys[i], "output": text[:40]})
    stats = engine.blocks.stats
    hits, queries = stats.prefix_hit_tokens - hit0, stats.prefix_query_tokens - query0
    return results, hits / queries if queries else 0.0


def by_context(results: list[dict]) -> dict[str, float]:
    out: dict[str, list[bool]] = {}
    for r in results:
        out.setdefault(str(r["context"]), []).append(bool(r["correct"]))
    return {c: sum(v) / len(v) for c, v in out.items()}


def accuracy_grid(results: list[dict]) -> dict[str, dict[str, float]]:
    """context -> depth (2 decimals) -> fraction right, over the probes of that cell."""
    cells: dict[str, dict[str, list[bool]]] = {}
    for r in results:
        cells.setdefault(str(r["context"]), {}).setdefault(f"{r['depth']:.2f}", []).append(bool(r["correct"]))
    return {c: {d: sum(v) / len(v) for d, v in sorted(row.items())} for c, row in cells.items()}


def build_contexts(documents, tokenizer, contexts: list[int], needles: int, fillers: int, seed: int,
                   add_bos: bool) -> list[MultiKeyContext]:
    """`fillers` contexts (filler orders) of each length in `contexts`, `needles` needles each."""
    header = ([tokenizer.bos_token_id] if add_bos else []) + tokenizer(INSTRUCTION, add_special_tokens=False)[
        "input_ids"]

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    out = []
    for c in contexts:
        for f in range(fillers):
            fill, breaks = probe_filler(documents, tokenizer, c, f, seed)
            out.append(multi_key_context(c, fill, breaks, header, encode, needles, seed, f))
    return out
