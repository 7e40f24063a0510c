"""The life of a generation request outside the loop that runs it: accepted or refused, stopped, reported.

`LLMEngine` (scheduler, continuous batching) and `SpeculativeDecoder` (draft and verify) run requests
differently but treat them the same way through these, so a request is refused with the same message,
stops on the same token and comes back as the same `RequestOutput` whichever one serves it:

- `pair_params`: one SamplingParams for every prompt, or one per prompt.
- `validate_request`: the sampling parameters in range, stop strings only with a tokenizer, a non-empty
  prompt whose ids are inside the model's vocabulary; gives the prompt's token ids.
- `prompt_too_long`, `check_blocks`: refusing a request the context or the KV pool cannot hold (each
  caller counts what it needs: the decoder holds a request in two pools, the engine frees blocks that
  leave a sliding window).
- `record_token`, `stop_reason`, `finish`: a generated token with its time; the stop rules (stop token
  ids and strings, eos unless ignore_eos, none before min_tokens, max_tokens); the finished text cut at
  its stop string.
- `request_output`: a sequence's `RequestOutput` (with its logprobs and prompt_logprobs when asked).
- `TokenLogprob` (defined with the sequence that holds them) is re-exported here: it is the API's.

`who` in the messages names the engine the user should give a tokenizer to ("the engine", or "the
target engine" for speculative decoding).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from tokq.engine.metrics import RequestMetrics
from tokq.engine.sampling import SamplingError, SamplingParams, check_stop, truncate_at_stop_string
from tokq.engine.sequence import Sequence, TokenLogprob
from tokq.engine.tokenizer import check_token_ids
from tokq.errors import ModelError, TokqError


class EngineError(TokqError):
    """A request or engine setting that cannot be served: the message names it and the fix."""


@dataclass
class RequestOutput:
    seq_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    metrics: RequestMetrics
    prompt: str | None = None  # the prompt's text when it was given as text (`tokq.LLM` fills it in)
    logprobs: list[TokenLogprob] | None = None  # one per generated token when params.logprobs is not None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (entry 0: None)


# Accepting a request ------------------------------------------------------------------------------


def pair_params(prompts: Iterable, params: SamplingParams | Seq[SamplingParams] | None,
                ) -> tuple[list, list[SamplingParams | None]]:
    """(prompts, one params entry per prompt): `params` is one for all (None: the defaults) or a list/tuple."""
    prompts = list(prompts)
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(plist) != len(prompts):
        raise EngineError(f"{len(plist)} sampling params for {len(prompts)} prompts: give one, or one per prompt")
    return prompts, plist


def prompt_tokens(prompt: str | Seq[int] | torch.Tensor, tokenizer, who: str = "the engine") -> list[int]:
    """A prompt's token ids: text through the tokenizer (special tokens added), ids (list or tensor) as given."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise EngineError(f"a text prompt needs a tokenizer: pass token ids or give {who} one")
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, torch.Tensor):
        return [int(t) for t in prompt.reshape(-1).tolist()]
    return [int(t) for t in prompt]


def validate_request(prompt: str | Seq[int] | torch.Tensor, params: SamplingParams | None, model, tokenizer,
                  who: str = "the engine") -> tuple[SamplingParams, list[int]]:
    """(params, prompt token ids) of a request `model` can run, or EngineError / SamplingError naming what
    is wrong. Context and cache limits are the caller's (`prompt_too_long`, `check_blocks`)."""
    params = params or SamplingParams()
    params.validate()
    vocab = model.config.vocab_size
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > vocab:
            raise SamplingError(f"{name}={k}: must be at most the model's vocabulary size {vocab}")
    if params.stop and tokenizer is None:
        raise EngineError(f"stop strings {list(params.stop)} need a tokenizer to read the output: give {who} "
                          "the model's tokenizer or use stop_token_ids")
    tokens = prompt_tokens(prompt, tokenizer, who)
    if not tokens:
        raise EngineError("the prompt is empty: give at least one token")
    try:
        check_token_ids(tokens, model.config.vocab_size, model.name, tokenizer)
    except ModelError as exc:
        raise EngineError(f"the prompt's {exc.message}") from None
    return params, tokens


def prompt_too_long(num_tokens: int, max_tokens: int, context: str, room: int, fixes: str) -> EngineError:
    """The refusal of a prompt that leaves max_tokens no room: `context` names the context ("the model's
    context of 2048"), `room` is the most prompt tokens it leaves, `fixes` what the caller can change."""
    return EngineError(f"the prompt has {num_tokens} tokens; with max_tokens {max_tokens} {context} leaves room "
                       f"for {max(room, 0)}: {fixes}")


def check_blocks(need: int, num_blocks: int) -> None:
    """Refuse a request that needs more KV blocks than the whole pool holds (it could never run)."""
    if need > num_blocks:
        raise EngineError(f"the request needs {need} KV blocks but the cache has {num_blocks}: raise --kv-memory "
                          "or shorten the request")


# Generating ---------------------------------------------------------------------------------------


def record_token(seq: Sequence, token: int, now: float) -> None:
    """Append a generated token and its time (the first one's is the request's first-token time)."""
    seq.token_ids.append(token)
    seq.token_times.append(now)
    if seq.first_token_time is None:
        seq.first_token_time = now


def stop_reason(seq: Sequence, tokenizer, eos_ids: Iterable[int]) -> str | None:
    """"stop", "length" or None after the sequence's latest token: stop token ids and stop strings (the
    output is decoded into seq.text for those), eos (unless ignore_eos; not before min_tokens), max_tokens."""
    params = seq.params
    text = None
    if params.stop:
        seq.text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        text = seq.text
    reason = check_stop(seq.token_ids, seq.num_prompt_tokens, params, None, text)
    if reason != "stop" and not params.ignore_eos and seq.num_output_tokens >= params.min_tokens \
            and seq.token_ids[-1] in eos_ids:
        reason = "stop"
    return reason


def finish(seq: Sequence, reason: str, now: float) -> None:
    """Record the finish (reason, time) and cut the text before its stop string. The caller frees the
    sequence's seat and blocks."""
    seq.finish_reason = reason
    seq.finish_time = now
    if seq.params.stop and seq.text:
        seq.text, _ = truncate_at_stop_string(seq.text, seq.params.stop)


# Reporting ----------------------------------------------------------------------------------------


def request_output(seq: Sequence, tokenizer) -> RequestOutput:
    """The sequence's output: its prompt and generated ids, the text (decoded here unless a stop string
    already cut it), why it finished, its metrics."""
    text = seq.text
    if not text and tokenizer is not None:
        text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
    return RequestOutput(seq.seq_id, seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids, text,
                         seq.finish_reason, RequestMetrics.of(seq), logprobs=seq.logprobs,
                         prompt_logprobs=seq.prompt_logprobs)
