"""Sensitivity: what quantizing each decoder Linear (and each block) costs in quality, alone, and what keeping
it wide buys when everything else is quantized; per format, with document-clustered 95% intervals.

The model is a dense fp32 tokq CausalLM (`engine.checkpoint.load_model(path, dtype="fp32")`). A unit at a
format is fake-quantized: its weight rounded with RTN (`quantization.methods.block_ops.quantize_weight`) and
dequantized back to a dense matrix (`kernels.reference`), activations fake-quantized per token for a W8A8
scheme, swapped into the Linear for the run and swapped out after (the engine's `Linear.set_method` seam).

How it stays fast (SmolLM2-135M, 30 blocks x 4 Linears, 2 formats, alone + keep-wide for 150 units each:
600 runs): all windows run as one right-padded batch (causal attention: padding never reaches a real
position), and each block's input hidden states are computed once, for the dense model and for each
all-quantized model. A unit in block b then re-runs only blocks b..L-1, the final norm and the LM head from
the cached input of block b: half the blocks on average, and nothing is recomputed for the base. On this
2-core CPU, quiet, the parts measured for 8 windows x 128 tokens (the API's default): 27 ms per block, 0.25 s
per LM head + logsumexp; 600 runs of 15.5 blocks on average make about 7 minutes for both formats (an
estimate from the parts; a run's own time is `seconds` in the result).

Metrics per scored token (evalsuite.ab.token_metrics, the compare's definitions): KL(base‖candidate) over the
base's top-k plus one bucket, with the full-vocabulary tail measured exactly on a systematic sample of rows
(evalsuite.full_kl, `full_kl_rows`; kl = the compare's estimate), top-1 agreement and ΔNLL. Means and 95%
intervals come from the paired document bootstrap (evalsuite.stats.bootstrap.paired_bootstrap): documents are
the clusters. The base is run through the same path, so an unquantized candidate gives KL 0 exactly (the
result's `floor`); its top-k (and its whole rows at the sampled positions) are kept in the baseline cache
under a key naming this path, so a rerun on the same windows reads them back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokq.engine.layers import DENSE as DENSE_METHOD
from tokq.engine.layers import Linear
from tokq.engine.models import CausalLM
from tokq.errors import ModelError
from tokq.evalsuite.ab import BaselineWindow, _tail_estimate, non_finite_rows, scored_rows, token_metrics
from tokq.evalsuite.full_kl import ATail, a_tail, kind_of, systematic_sample
from tokq.evalsuite.stats.aggregation import METRIC_RANGES
from tokq.evalsuite.stats.bootstrap import paired_bootstrap
from tokq.evalsuite.stats.estimate import DEFAULT_CONFIDENCE, Estimate
from tokq.kernels.reference import fake_quantize_activations
from tokq.longctx.windows import TokenWindow, WindowSet
from tokq.mixed.sensitivity_result import METRICS, SensitivityResult, UnitCost
from tokq.quantization.layer_schemes import DENSE, candidate_linears, linear_bytes
from tokq.quantization.methods.block_ops import quantize_weight
from tokq.quantization.scheme import QuantScheme

__all__ = ["SensitivityResult", "UnitCost", "measure_sensitivity"]

CACHE_PATH = "sensitivity: dense fp32, blocks re-run from cached inputs"  # the baseline cache key's "path"
_LOGIT_ELEMENTS = 1 << 24  # logits computed this many at a time (64 MB fp32): Gemma 3's 262K vocabulary too
OnStep = Callable[[int, int, str], None]  # (steps done, steps in all, what was just measured)


class _FakeQuant:
    """A Linear's forward with its weight rounded to a format and dequantized (and, for W8A8, its input
    rounded per token): what the quantized kernel computes, up to the kernel's own arithmetic."""

    def __init__(self, weight: torch.Tensor, act: str | None, fmt: str):
        self.weight, self.act, self.name = weight, act, f"fake-{fmt}"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if self.act is not None:
            x = fake_quantize_activations(x, self.act).to(x.dtype)
        return F.linear(x, self.weight, layer.bias)


class _Batch:
    """The windows as one right-padded batch, the model's stack run from any block, and the scored rows."""

    def __init__(self, model: CausalLM, windows: Sequence[TokenWindow]):
        self.model, self.windows = model, list(windows)
        length = max(len(w.tokens) for w in self.windows)
        ids = torch.zeros(len(self.windows), length, dtype=torch.long)
        for i, w in enumerate(self.windows):
            ids[i, : len(w.tokens)] = torch.tensor(w.tokens)
        self.ids = ids.to(model.device)
        positions = torch.arange(length, device=model.device).expand(len(self.windows), length)
        with torch.inference_mode():
            self.ropes = {kind: rot.cos_sin(positions, model.dtype) for kind, rot in model.rotary.items()}
        from tokq.engine.attention import DenseCausalAttention

        self.backend = DenseCausalAttention()
        # flat row r of the [W * T] hidden states predicts flat token r + 1: the scored rows, window by window
        rows, targets = [], []
        for i, w in enumerate(self.windows):
            s = scored_rows(w)
            rows.append(torch.arange(s.start, s.stop) + i * length)
            targets.append(torch.tensor(w.tokens[s.start + 1: s.stop + 1]))
        self.rows = torch.cat(rows).to(model.device)
        self.targets = torch.cat(targets).to(model.device)
        self.counts = [len(r) for r in rows]

    def block_inputs(self) -> list[torch.Tensor]:
        """The input hidden states of every block, and the last block's output (L + 1 tensors)."""
        model = self.model
        hidden = model.model.embed_tokens(self.ids)
        if model.config.embed_scale != 1.0:
            hidden = hidden * torch.tensor(model.config.embed_scale, dtype=hidden.dtype)
        out = [hidden]
        for i, layer in enumerate(model.model.layers):
            out.append(layer(out[-1], self.ropes[model.config.layer_types[i]], self.backend))
        return out

    def run_from(self, block: int, hidden: torch.Tensor) -> torch.Tensor:
        """Blocks `block`..L-1 from that block's input; the final norm's output at the scored rows [N, H]."""
        model = self.model
        for i in range(block, len(model.model.layers)):
            hidden = model.model.layers[i](hidden, self.ropes[model.config.layer_types[i]], self.backend)
        return model.model.norm(hidden).flatten(0, 1)[self.rows]

    def logits(self, hidden: torch.Tensor):
        """fp32 logits of the scored rows and their logsumexp, a chunk of rows at a time: (row offset, [n, vocab],
        [n, 1]). A log-probability is logit - logsumexp, taken only where a metric reads one: a whole
        log_softmax tensor per run would cost more memory traffic than the LM head's matmul."""
        step = max(1, _LOGIT_ELEMENTS // self.model.config.vocab_size)
        for lo in range(0, hidden.shape[0], step):
            logits = self.model.compute_logits(hidden[lo: lo + step]).float()
            yield lo, logits, logits.logsumexp(dim=-1, keepdim=True)


@dataclass
class _Baseline:
    """The base's scores of all scored rows as one BaselineWindow (metrics are per row), and per window."""

    rows: BaselineWindow
    windows: list[BaselineWindow]


def _base_scores(batch: _Batch, hidden: torch.Tensor, topk: int, full_kl_rows: int, seed: int) -> list[BaselineWindow]:
    """The base's BaselineWindow per window: its top-k, the actual token's log-probability, and at a systematic
    sample of `full_kl_rows` rows what the full-vocabulary KL needs of its whole distribution (as compare keeps)."""
    sample = systematic_sample(batch.counts, full_kl_rows, seed)
    offsets = _offsets(batch.counts)
    picked = torch.cat([r + off for r, off in zip(sample.rows, offsets, strict=True)]).to(hidden.device)
    logprob, ids, values, full = [], [], [], []
    for lo, logits, lse in batch.logits(hidden):
        n = logits.shape[0]
        top = logits.topk(topk, dim=-1)
        logprob.append((logits.gather(1, batch.targets[lo: lo + n, None]) - lse)[:, 0].cpu())
        ids.append(top.indices.cpu())
        values.append((top.values - lse).cpu())
        here = picked[(picked >= lo) & (picked < lo + n)] - lo
        full.append((logits[here] - lse[here]).cpu())
    logprob, ids, values, picked = torch.cat(logprob), torch.cat(ids), torch.cat(values), picked.cpu()
    tail = a_tail(torch.cat(full), ids[picked]) if sample.size else None
    out = []
    for off, n in zip(offsets, batch.counts, strict=True):
        base = BaselineWindow(logprob[off: off + n].clone(), ids[off: off + n].clone(), values[off: off + n].clone())
        if tail is not None:
            mine = (picked >= off) & (picked < off + n)
            base.full_rows, base.full_prob = picked[mine] - off, sample.prob
            base.tail = ATail(tail.probs[mine], tail.plogp[mine], tail.lognorm[mine])
        out.append(base)
    return out


def _offsets(counts: Sequence[int]) -> list[int]:
    out, total = [], 0
    for n in counts:
        out.append(total)
        total += n
    return out


def _joined(windows: Sequence[BaselineWindow], counts: Sequence[int]) -> BaselineWindow:
    """The windows' scores as one run of rows (full_rows shifted to it)."""
    base = BaselineWindow(torch.cat([w.logprob for w in windows]), torch.cat([w.topk_ids for w in windows]),
                          torch.cat([w.topk_logprobs for w in windows]))
    if windows[0].full_rows is not None:
        base.full_rows = torch.cat([w.full_rows + off for w, off in zip(windows, _offsets(counts), strict=True)])
        base.tail = ATail(torch.cat([w.tail.probs for w in windows]), torch.cat([w.tail.plogp for w in windows]),
                          torch.cat([w.tail.lognorm for w in windows]))
        base.full_prob = windows[0].full_prob
    return base


class _Scorer:
    """Per-token metrics of a candidate's final hidden states against the base, and their estimates."""

    def __init__(self, batch: _Batch, base: BaselineWindow, doc_index: torch.Tensor, num_docs: int,
                 resamples: int, seed: int, confidence: float):
        self.batch, self.base, self.doc_index, self.num_docs = batch, base, doc_index, num_docs
        self.resamples, self.seed, self.confidence = resamples, seed, confidence
        self.non_finite = 0

    def tokens(self, hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        base, device = self.base, self.batch.targets.device
        logprob, top, gathered, full = [], [], [], []
        full_rows = base.full_rows.to(device) if base.full_rows is not None else None
        for lo, logits, lse in self.batch.logits(hidden):
            n = logits.shape[0]
            logprob.append((logits.gather(1, self.batch.targets[lo: lo + n, None]) - lse)[:, 0].cpu())
            top.append((logits.max(dim=-1, keepdim=True).values - lse)[:, 0].cpu())
            gathered.append((logits.gather(1, base.topk_ids[lo: lo + n].to(device)) - lse).cpu())
            if full_rows is not None:
                here = full_rows[(full_rows >= lo) & (full_rows < lo + n)] - lo
                full.append((logits[here] - lse[here]).cpu())
        logprob, gathered = torch.cat(logprob), torch.cat(gathered)
        metrics = token_metrics(base, logprob, torch.cat(top), gathered, self.batch.model.config.vocab_size)
        metrics.update(_tail_estimate(base, metrics["kl_topk"], gathered, torch.cat(full) if full else None))
        self.non_finite += int(non_finite_rows(logprob, gathered).sum())
        return {k: metrics[k] for k in METRICS}

    def estimates(self, values: dict[str, torch.Tensor], ranged: bool = True) -> dict[str, Estimate]:
        return paired_bootstrap(values, self.doc_index, self.num_docs, None, self.resamples, self.seed,
                                self.confidence, ranges=METRIC_RANGES if ranged else None)

    def gain(self, everything: dict[str, torch.Tensor], but_one: dict[str, torch.Tensor]) -> dict[str, Estimate]:
        """What keeping a unit wide buys, per token (positive: better), as the UnitCost docstring defines it."""
        return self.estimates({"kl": everything["kl"] - but_one["kl"], "top1": but_one["top1"] - everything["top1"],
                               "delta_nll": everything["delta_nll"] - but_one["delta_nll"]}, ranged=False)


def _units(linears: dict[str, Linear], blocks: bool) -> list[tuple[str, str, int, list[str]]]:
    """(unit, kind, block index, its Linears) in layer order: a block's Linears, then the block."""
    by_block: dict[int, list[str]] = {}
    for name in linears:
        by_block.setdefault(int(name.split(".")[2]), []).append(name)
    out = []
    for b in sorted(by_block):
        out.extend((name, "linear", b, [name]) for name in by_block[b])
        if blocks:
            out.append((f"model.layers.{b}", "block", b, by_block[b]))
    return out


def _cached_base(batch: _Batch, model: CausalLM, windows: Sequence[TokenWindow], hidden: torch.Tensor,
                 topk: int, full_kl_rows: int, seed: int, use_cache: bool, notes: list[str]) -> list[BaselineWindow]:
    """The base's scores from the baseline cache, or computed (and stored) from its final hidden states."""
    checkpoint = Path(str(getattr(model, "name", "")))
    if not (use_cache and checkpoint.is_dir()):
        return _base_scores(batch, hidden, topk, full_kl_rows, seed)
    from tokq.evalsuite import baseline_cache

    parts = {"model_sha256": baseline_cache.model_hash(checkpoint), "data_sha256": baseline_cache.data_hash(windows),
             "path": CACHE_PATH, "topk": topk, "full_kl_rows": full_kl_rows, "seed": seed,
             "dtype": str(model.dtype).removeprefix("torch."), "device": model.device.type}
    key = baseline_cache.cache_key(**parts)
    cached = baseline_cache.load(key, key_parts=parts)
    if cached is not None and len(cached[0]) == len(windows):
        notes.append(f"base scores read from the baseline cache ({key})")
        return cached[0]
    scores = _base_scores(batch, hidden, topk, full_kl_rows, seed)
    baseline_cache.store(key, scores, {"path": CACHE_PATH, "topk": topk}, key_parts=parts)
    return scores


def measure_sensitivity(model: CausalLM, windows: WindowSet | Sequence[TokenWindow], schemes: dict[str, QuantScheme],
                        *, wide_gain: bool = True, blocks: bool = True, on_step: OnStep | None = None,
                        topk: int = 256, full_kl_rows: int = 256, resamples: int = 1000, seed: int = 0,
                        confidence: float = DEFAULT_CONFIDENCE, use_cache: bool = True,
                        weights: dict[str, dict[str, torch.Tensor]] | None = None) -> SensitivityResult:
    """Every candidate Linear's (and, with `blocks`, every block's) cost at every format of `schemes` (format
    name -> resolved scheme), alone and, with `wide_gain`, as the gain of keeping it wide (module docstring).
    `weights` (format -> Linear -> dense matrix, e.g. mixed.method_weights.dequantized_linears of a uniform
    GPTQ build) replaces RTN rounding for the formats it names. `on_step(done, total, label)` is called after
    each measurement. The model is left as it was given."""
    started = time.perf_counter()
    window_list = list(windows.windows if isinstance(windows, WindowSet) else windows)
    if not window_list:
        raise ValueError("measure_sensitivity needs at least one window")
    if not schemes:
        raise ValueError("measure_sensitivity needs at least one format")
    linears = {name: model.get_submodule(name) for name in candidate_linears(model)}
    quantized = [n for n, m in linears.items() if m.method is not DENSE_METHOD]
    if quantized:
        raise ModelError(f"{model.name}: sensitivity needs the 16-bit model, but {quantized[0]} is already "
                         "quantized; give the base checkpoint")
    vocab = model.config.vocab_size
    topk = min(topk, vocab)
    full_kl_rows = 0 if topk >= vocab else full_kl_rows  # top-k = the vocabulary: the KL is exact already
    units = _units(linears, blocks)
    total = len(schemes) * (1 + len(units))
    notes: list[str] = []
    docs = list(dict.fromkeys(w.doc_id for w in window_list))
    batch = _Batch(model, window_list)
    doc_index = torch.cat([torch.full((n,), docs.index(w.doc_id), dtype=torch.long)
                           for w, n in zip(window_list, batch.counts, strict=True)])
    done = 0
    try:
        with torch.inference_mode():
            base_inputs = batch.block_inputs()
            base_hidden = model.model.norm(base_inputs[-1]).flatten(0, 1)[batch.rows]
            base_windows = _cached_base(batch, model, window_list, base_hidden, topk, full_kl_rows, seed, use_cache,
                                        notes)
            scorer = _Scorer(batch, _joined(base_windows, batch.counts), doc_index, len(docs), resamples, seed,
                             confidence)
            floor = scorer.estimates(scorer.tokens(batch.run_from(0, base_inputs[0])))
            all_quantized, costs = {}, []
            for fmt, scheme in schemes.items():
                act = scheme.activations.name if scheme.activations else None
                fake = {n: _FakeQuant(_rounded(m, n, scheme, (weights or {}).get(fmt)), act, fmt)
                        for n, m in linears.items()}
                _set(linears, fake, set(linears))
                quant_inputs = batch.block_inputs() if wide_gain else None
                everything = scorer.tokens(batch.run_from(len(model.model.layers), quant_inputs[-1])) if wide_gain \
                    else scorer.tokens(batch.run_from(0, base_inputs[0]))
                all_quantized[fmt] = scorer.estimates(everything)
                done += 1
                if on_step:
                    on_step(done, total, f"all Linears at {fmt}")
                for unit, kind, b, members in units:
                    _set(linears, fake, set(members))
                    alone = scorer.estimates(scorer.tokens(batch.run_from(b, base_inputs[b])))
                    gain = None
                    if wide_gain:
                        _set(linears, fake, set(linears) - set(members))
                        gain = scorer.gain(everything, scorer.tokens(batch.run_from(b, quant_inputs[b])))
                    costs.append(UnitCost(unit, kind, fmt, alone, gain))
                    done += 1
                    if on_step:
                        on_step(done, total, f"{unit} at {fmt}")
                _set(linears, fake, set())
                del fake, quant_inputs
    finally:
        _set(linears, {}, set())
    if scorer.non_finite:
        notes.append(f"{scorer.non_finite} scored rows had NaN or infinite log-probabilities: their metrics are NaN")
    sizes = {name: {DENSE: linear_bytes(m.out_features, m.in_features, None, shards=_shards(m)),
                    **{fmt: linear_bytes(m.out_features, m.in_features, s, shards=_shards(m))
                       for fmt, s in schemes.items()}} for name, m in linears.items()}
    given = sorted(set(weights or {}) & set(schemes))
    notes.append("formats applied by RTN rounding (fake-quantized: rounded, then dequantized into the Linear)"
                 + (f", except {', '.join(given)}: the given weights (a build's own rounding)" if given else ""))
    if len(docs) < 20:
        notes.append(f"{len(docs)} documents: the intervals rest on few clusters; give more windows for firmer ones")
    scored = int(sum(batch.counts))
    described = {"count": len(window_list), "window": max(len(w.tokens) for w in window_list),
                 "documents": len(docs), "scored_tokens": scored, "topk": topk, "vocab": vocab,
                 "full_kl_rows": min(full_kl_rows, scored), "resamples": resamples, "seed": seed,
                 "kl": kind_of(topk, vocab, min(full_kl_rows, scored) / scored if full_kl_rows else None)}
    if isinstance(windows, WindowSet):
        described["set"] = windows.to_dict()
    return SensitivityResult(model=str(getattr(model, "name", "")), checkpoint=str(getattr(model, "name", "")),
                             formats=list(schemes), schemes=dict(schemes), units=costs, bytes=sizes,
                             all_quantized=all_quantized, windows=described,
                             seconds=round(time.perf_counter() - started, 3), notes=notes, floor=floor)


def _rounded(m: Linear, name: str, scheme: QuantScheme, given: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """The dense weight `m` runs at a format: the given one (checked for shape), else RTN's rounding."""
    if given is None:
        return quantize_weight(m.weight, scheme, name).dequantize(m.weight.dtype).to(m.weight.device)
    if name not in given:
        raise ModelError(f"sensitivity weights name no {name}: give every candidate Linear's weight for a format")
    w = given[name]
    if tuple(w.shape) != tuple(m.weight.shape):
        raise ModelError(f"sensitivity weight for {name} is {tuple(w.shape)}, the Linear is {tuple(m.weight.shape)}")
    return w.to(dtype=m.weight.dtype, device=m.weight.device)


def _shards(linear: Linear) -> list[int]:
    return [s.size for s in linear.shards]


def _set(linears: dict[str, Linear], fake: dict[str, _FakeQuant], names: set[str]) -> None:
    """Linears in `names` run their fake-quantized weight, every other one its own dense weight."""
    for name, module in linears.items():
        module.set_method(fake[name] if name in names else DENSE_METHOD)
