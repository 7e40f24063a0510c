"""An HTTP request's body -> the engine requests it asks for (`Job`s), refusing what cannot be served.

The refusals follow vLLM's limits so clients written against vLLM see the same 400s: n other than 1,
logprobs / top_logprobs / prompt_logprobs above the server's --max-logprobs, and a prompt plus max_tokens
beyond the model's context. Prompts are tokenized here, on the event loop's thread (the engine's thread
never tokenizes a prompt), with the model's special tokens as the engine does.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokq.engine.sampling import SamplingError, SamplingParams
from tokq.serve.protocol import ChatCompletionRequest, CompletionRequest, bad_request


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    max_logprobs: int = 20


@dataclass
class Job:
    """One prompt's engine request: its token ids, its params and what the response must report."""

    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None  # the prompt as text (echo), None for token-id prompts
    logprobs: int | None = None  # top alternatives per generated token (None: no logprobs)
    prompt_logprobs: int | None = None  # top alternatives per prompt token (None: none)


def _check_logprobs(name: str, value: int | None, limits: Limits) -> None:
    if value is None:
        return
    if value < 0:
        raise bad_request(f"{name}={value}: must be >= 0", name)
    if value > limits.max_logprobs:
        raise bad_request(f"Requested {name} of {value}, which is greater than max allowed: {limits.max_logprobs} "
                          "(the server's --max-logprobs)", name)


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None) -> SamplingParams:
    """The engine's SamplingParams for the request (top_k -1 is vLLM's "off", our 0)."""
    if req.n != 1:
        raise bad_request(f"n={req.n}: tokq serve returns one choice per prompt (n=1)", "n")
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    params = SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_k=top_k, top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
        stop=tuple(req.stop) if isinstance(req.stop, list) else (req.stop or ()),
        stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    try:
        params.validate()
    except SamplingError as exc:
        raise bad_request(exc.message) from None
    return params


def tokenize(prompt: str | list[int], tokenizer) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise bad_request("this server has no tokenizer: give the prompt as token ids", "prompt")
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    return [int(t) for t in prompt]


def check_context(num_prompt: int, max_tokens: int, limits: Limits, what: str = "prompt") -> None:
    if num_prompt == 0:
        raise bad_request("the prompt is empty: give at least one token", "prompt")
    if num_prompt + max_tokens > limits.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the {what}, {max_tokens} in the completion). "
            f"Please reduce the length of the {what} or completion (max_tokens).", "max_tokens")


def completion_jobs(req: CompletionRequest, tokenizer, limits: Limits) -> list[Job]:
    """One Job per prompt of a /v1/completions body (a batch is a list of texts or of token-id lists)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompts = list(prompt)
    else:
        prompts = [prompt]
    if not prompts or prompts == [[]]:
        raise bad_request("the prompt is empty: give a text or a list of token ids", "prompt")
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    if max_tokens < 0:
        raise bad_request(f"max_tokens={max_tokens}: must be >= 0", "max_tokens")
    _check_logprobs("logprobs", req.logprobs, limits)
    _check_logprobs("prompt_logprobs", req.prompt_logprobs, limits)
    # echo with logprobs reports the prompt's logprobs too (vLLM asks the engine for them)
    prompt_lp = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_lp = max(req.logprobs, prompt_lp or 0)
    params = sampling_params(req, max_tokens, req.logprobs, prompt_lp)
    jobs = []
    for p in prompts:
        ids = tokenize(p, tokenizer)
        check_context(len(ids), max_tokens, limits)
        jobs.append(Job(ids, params, p if isinstance(p, str) else None, req.logprobs, prompt_lp))
    return jobs


def chat_job(req: ChatCompletionRequest, prompt: str, tokenizer, limits: Limits) -> Job:
    """The Job of a /v1/chat/completions body whose messages rendered to `prompt` (chat.py)."""
    # The template already holds the special tokens (BOS): tokenizing adds none, as vLLM does.
    ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    _check_logprobs("top_logprobs", req.top_logprobs, limits)
    _check_logprobs("prompt_logprobs", req.prompt_logprobs, limits)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = max(limits.max_model_len - len(ids), 0)
    if max_tokens < 0:
        raise bad_request(f"max_tokens={max_tokens}: must be >= 0", "max_tokens")
    check_context(len(ids), max_tokens, limits, "messages")
    params = sampling_params(req, max_tokens, logprobs, req.prompt_logprobs)
    return Job(ids, params, prompt, logprobs, req.prompt_logprobs)
