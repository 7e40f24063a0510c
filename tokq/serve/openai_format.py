"""Engine outputs -> the OpenAI / vLLM JSON shapes: texts, logprobs, prompt logprobs, usage.

Logprobs come from the engine as `TokenLogprob`s (token_id, logprob, rank, top: [(id, logprob)]); here they
become the legacy completions shape ({tokens, token_logprobs, top_logprobs, text_offset}), the chat shape
({content: [{token, logprob, bytes, top_logprobs}]}) or vLLM's prompt_logprobs ([None, {"<id>": {logprob,
rank, decoded_token}}]). A -inf logprob is written as -9999.0 (JSON has no infinity), as vLLM does. With
`return_tokens_as_token_ids` a token is written "token_id:<id>" (vLLM), so a client can compare tokens
across tokenizers exactly.

`TextStream` turns a growing list of token ids into text deltas for streaming: it holds back a trailing
partial character (U+FFFD from an incomplete UTF-8 sequence) and, while the request runs, the last
characters that could still begin a stop string, so no client ever sees text the final answer cuts.
"""

from __future__ import annotations

import time
import uuid

from tokq.engine.sampling import truncate_at_stop_string

MIN_LOGPROB = -9999.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def clamp(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


class Decoder:
    """Token ids -> strings with the server's tokenizer (or "token_id:<id>" without one / when asked)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token(self, token_id: int, as_id: bool = False) -> str:
        if as_id or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def text(self, token_ids: list[int]) -> str:
        if self.tokenizer is None or not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def final_text(decoder: Decoder, token_ids: list[int], stops: tuple[str, ...], finish_reason: str | None) -> str:
    text = decoder.text(token_ids)
    if stops and finish_reason == "stop":
        text, _ = truncate_at_stop_string(text, stops)
    return text


class TextStream:
    """Text deltas of a growing output (see the module docstring)."""

    def __init__(self, decoder: Decoder, stops: tuple[str, ...]):
        self.decoder, self.stops = decoder, stops
        self.ids: list[int] = []
        self.sent = 0
        self._hold = max((len(s) for s in stops), default=1) - 1

    def add(self, token_ids: list[int], finished: bool) -> str:
        self.ids.extend(token_ids)
        text = self.decoder.text(self.ids)
        found = False
        if self.stops:
            text, found = truncate_at_stop_string(text, self.stops)
        end = len(text)
        if not finished and not found:
            end -= self._hold
            while end > 0 and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta


# Logprobs -----------------------------------------------------------------------------------------


def _top_with_actual(entry, k: int) -> list[tuple[int, float]]:
    """The top-k (id, logprob) pairs, plus the actual token when it is not among them (k or k + 1 pairs)."""
    top = list(entry.top)[:k]
    if all(t != entry.token_id for t, _ in top):
        top = [(entry.token_id, entry.logprob), *top]
    return top


def completion_logprobs(decoder: Decoder, token_ids: list[int], entries: list, k: int, as_id: bool = False,
                        offset: int = 0) -> dict:
    """The legacy completions logprobs of `token_ids` (entries: TokenLogprob or None per token, None for the
    echoed first prompt token); text offsets count from `offset`."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = decoder.token(token_id, as_id)
        out["tokens"].append(token)
        out["text_offset"].append(offset)
        offset += len(token)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(clamp(entry.logprob))
        out["top_logprobs"].append({decoder.token(t, as_id): clamp(lp) for t, lp in _top_with_actual(entry, k)})
    return out


def merge_completion_logprobs(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {key: a[key] + b[key] for key in a}


def prompt_logprobs_json(decoder: Decoder, entries: list | None, k: int) -> list | None:
    """vLLM's prompt_logprobs: None for the first token, then {"<id>": {logprob, rank, decoded_token}} holding
    the actual prompt token and the top-k."""
    if entries is None:
        return None
    out: list = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {t: (lp, r + 1) for r, (t, lp) in enumerate(list(entry.top)[:k])}
        ranked[entry.token_id] = (entry.logprob, entry.rank)
        out.append({str(t): {"logprob": clamp(lp), "rank": rank, "decoded_token": decoder.token(t)}
                    for t, (lp, rank) in ranked.items()})
    return out


def chat_logprobs(decoder: Decoder, token_ids: list[int], entries: list, k: int, as_id: bool = False) -> dict:
    """The chat completions logprobs: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""

    def item(token_id: int, logprob: float) -> dict:
        token = decoder.token(token_id, as_id)
        return {"token": token, "logprob": clamp(logprob), "bytes": list(token.encode("utf-8"))}

    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        content.append({**item(token_id, entry.logprob),
                        "top_logprobs": [item(t, lp) for t, lp in list(entry.top)[:k]]})
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
