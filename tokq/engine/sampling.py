"""Choosing the next token: sampling parameters, the distribution each request samples from, and stops.

`processed_logprobs` is the one definition of "the distribution a request samples from" (temperature,
then top-k, then top-p, then log_softmax); `sample` draws from it and speculative decoding's rejection
sampling compares draft and target through it, so both agree exactly. Greedy is a one-hot distribution
there, which makes rejection sampling accept a draft token exactly when it is the argmax.

Each seeded request owns a torch.Generator: its tokens then depend only on its seed and its logits,
not on which other requests share the batch or in which order (the batched global RNG would not give
that). The per-token work is batched; only the multinomial draw runs per seeded row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from tokq.errors import TokqError

# Top-p compares a float32 cumulative sum against top_p: without slack, probabilities that add up to
# top_p exactly on paper (0.5 + 0.3 against 0.8) can land a rounding step below it and pull in one
# more token than the smallest nucleus.
_TOP_P_SLACK = 1e-6
# Temperatures below this sample as greedy (vLLM's rule too): logits / 1e-40 overflow float32 to inf, and the
# NaNs that follow made a whole batch's sampling fail. The argmax is what such a temperature means anyway.
GREEDY_TEMPERATURE = 1e-5


class SamplingError(TokqError, ValueError):
    """A sampling parameter out of range: the message names the parameter, its value and the range."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops. Call `validate()` before using it."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # per-request generator: same tokens whatever the batch
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (need a tokenizer; the engine checks that)
    ignore_eos: bool = False
    min_tokens: int = 0  # stop conditions are ignored before this many generated tokens
    # Log-probabilities of the model's raw distribution (log_softmax of the fp32 logits, before temperature,
    # top-k and top-p). None: none; k >= 0: each generated token's / each prompt token's (after the first)
    # log-probability and rank, plus the top-k alternatives. The engine caps k at the vocabulary size.
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Callers (JSON requests, CLI flags) hand over lists or a single value; tuples keep the
        # params hashable and immutable. A lone string must not be split into characters.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        ids = (self.stop_token_ids,) if _is_int(self.stop_token_ids) else tuple(self.stop_token_ids)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", ids)

    def validate(self) -> None:
        """Raise SamplingError (one line) for the first parameter out of its range."""

        def bad(name: str, value: object, rule: str) -> SamplingError:
            return SamplingError(f"{name}={value!r}: {rule}")

        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 0")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise bad("temperature", t, "must be a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be an integer >= 0 (0 = off)")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:  # NaN fails too
            raise bad("top_p", p, "must be in (0, 1] (1 = off)")
        if self.seed is not None and (not _is_int(self.seed) or not -2**63 <= self.seed < 2**64):
            raise bad("seed", self.seed, "must be None or an integer in [-2^63, 2^64) (a torch generator's seed)")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if not all(_is_int(i) and i >= 0 for i in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "must be integers >= 0")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", self.stop, "must be non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or k < 0):
                raise bad(name, k, "must be None or an integer >= 0 (how many top alternatives to return)")

    @property
    def greedy(self) -> bool:
        """True when only the argmax can be picked (top_k=1 leaves one token at any temperature), or the temperature
        is below GREEDY_TEMPERATURE."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def processed_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """[B, V] logits -> [B, V] float32 log-probabilities each row samples from (-inf = never picked).

    Sampled rows: logits / temperature, keep the top_k, then the smallest set of most likely tokens
    whose probability reaches top_p (at least one), renormalized. Greedy rows: one-hot at the argmax
    (lowest index on ties), so exact comparisons (rejection sampling) treat greedy as deterministic.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise SamplingError(f"logits shape {tuple(logits.shape)}: must be [B, V] with B = {len(params)} params")
    logits = logits.float()
    batch, vocab = logits.shape
    dev = logits.device
    greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool, device=dev)
    # Greedy rows get temperature 1 here only to avoid dividing by 0; their rows are replaced below.
    temps = torch.tensor([1.0 if p.greedy else float(p.temperature) for p in params], device=dev)
    scaled = logits / temps[:, None]

    if any(p.top_k > 0 or p.top_p < 1 for p in params if not p.greedy):
        # One stable descending sort serves both filters; stable keeps ties in index order, like argmax.
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
        ranks = torch.arange(vocab, device=dev)
        sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= ks[:, None], -math.inf)
        # Top-p on the top-k-renormalized distribution: keep a token while the mass strictly before it
        # is still short of top_p; the first token always has 0 before it, so one token always stays.
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        top_p = torch.tensor([float(p.top_p) for p in params], device=dev)
        keep = (mass_before < top_p[:, None] - _TOP_P_SLACK) | (top_p[:, None] >= 1)
        keep[:, 0] = True  # a top_p below the slack (1e-30) would otherwise keep no token at all
        sorted_logits = sorted_logits.masked_fill(~keep, -math.inf)
        scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)

    out = scaled.log_softmax(dim=-1)
    if bool(greedy.any()):
        one_hot = torch.full_like(out, -math.inf)
        one_hot.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 0.0)
        out = torch.where(greedy[:, None], one_hot, out)
    return out


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded for one request on the logits' device, or None to use the global RNG."""
    if seed is None:
        return None
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """[B, V] logits -> [B] int64 next tokens. Row i draws with generators[i] (None: global RNG)."""
    if len(generators) != len(params):
        raise SamplingError(f"generators has {len(generators)} entries: must match params ({len(params)})")
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise SamplingError(f"logits shape {tuple(logits.shape)}: must be [B, V] with B = {len(params)} params")
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if len(greedy_rows) == len(params):  # every row greedy (most decode steps): no row gathered or scattered
        return logits.argmax(dim=-1)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if greedy_rows:
        # Argmax of the raw logits is the argmax of any temperature's softmax: no need to normalize.
        rows = torch.tensor(greedy_rows, device=logits.device)
        tokens[rows] = logits[rows].argmax(dim=-1)
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        probs = processed_logprobs(logits[rows], [params[i] for i in sampled_rows]).exp()
        # Rows on the global RNG share one draw; each seeded row draws alone from its own generator.
        unseeded = [j for j, i in enumerate(sampled_rows) if generators[i] is None]
        if unseeded:
            picked = torch.multinomial(probs[unseeded], 1).squeeze(-1)
            tokens[rows[unseeded]] = picked
        for j, i in enumerate(sampled_rows):
            if generators[i] is not None:
                tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return tokens


def check_stop(
    token_ids: list[int],
    num_prompt_tokens: int,
    params: SamplingParams,
    eos_token_id: int | None,
    text_tail: str | None = None,
) -> str | None:
    """The finish reason after the latest token: "stop", "length" or None (keep going).

    token_ids holds prompt then generated tokens; text_tail is the caller's decoded text of the
    generated tokens (enough of its end to hold a stop string). A stop on the very token that reaches
    max_tokens reports "stop": the model (or a stop rule) ended it, not the budget.
    """
    generated = len(token_ids) - num_prompt_tokens
    if generated >= params.min_tokens and generated > 0:
        last = token_ids[-1]
        if eos_token_id is not None and last == eos_token_id and not params.ignore_eos:
            return "stop"
        if last in params.stop_token_ids:
            return "stop"
        if text_tail and any(s in text_tail for s in params.stop):
            return "stop"
    if generated >= params.max_tokens:
        return "length"
    return None


def truncate_at_stop_string(text: str, stops: Iterable[str]) -> tuple[str, bool]:
    """Cut text before the earliest occurrence of any stop string; the flag says whether one was found."""
    positions = [pos for pos in (text.find(s) for s in stops if s) if pos >= 0]
    if not positions:
        return text, False
    return text[: min(positions)], True
