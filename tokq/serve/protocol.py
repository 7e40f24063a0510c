"""The request bodies of the OpenAI-compatible API (vLLM's dialect) and its error shape.

Requests are pydantic models so a malformed body (a string where an integer goes) is a 400 naming the
field. Unknown fields are accepted and ignored, as vLLM and OpenAI clients expect (clients send fields a
server may not know, e.g. `user`), except those that would change what comes back: structured output,
tools, penalties, logit bias, beam search. tokq implements none of them, and ignoring one silently would hand
the client output it did not ask for, so `refuse_unsupported` answers 400 naming the field unless its value
is the neutral one. Responses are plain dicts built in `openai_format`: their shape is fixed by the API, not
by this code.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """A refusal that reaches the client as OpenAI's error JSON with `status` as the HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    @property
    def type(self) -> str:
        return {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "BadRequestError",
                413: "PayloadTooLargeError", 503: "ServiceUnavailableError"}.get(self.status, "InternalServerError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


ROUTES = "/v1/completions, /v1/chat/completions, /v1/models, /version, /health and /metrics"


def route_error(method: str, path: str, status: int, detail: object) -> APIError:
    """The framework's own refusal (an unknown route or method) as OpenAI's error JSON, not its {"detail": ...}."""
    if status in (404, 405):
        return APIError(status, f"{method} {path}: no such route (this server answers {ROUTES})")
    return APIError(status, str(detail))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields completions and chat share (OpenAI's, then vLLM's extensions)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    temperature: float | None = None  # None: 1.0, OpenAI's default
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension; -1 or 0: off
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False  # vLLM: tokens in logprobs as "token_id:<id>"


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    return_token_ids: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: what the context leaves after the prompt (vLLM)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None  # vLLM: a template of the request's own (refused unless the operator allows)
    chat_template_kwargs: dict[str, Any] | None = None


# Fields tokq does not implement, with the values that mean "not used" (what a client sends by default).
_NEUTRAL: dict[str, tuple] = {
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "min_p": (None, 0, 0.0),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "suffix": (None, ""),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structured_outputs": (None,),
    "prompt_embeds": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
}


def refuse_unsupported(req: BaseModel) -> None:
    """400 naming the first field that asks for something tokq serve does not do (see the module docstring)."""
    given = {**(req.model_extra or {}), **{k: getattr(req, k) for k in type(req).model_fields}}
    for name, neutral in _NEUTRAL.items():
        value = given.get(name)
        if name in given and not any(type(value) is type(n) and value == n for n in neutral):  # True is not 1
            raise bad_request(f"{name}={str(value)[:80]!r}: tokq serve does not support {name} (it would be "
                              f"ignored, changing what you get back); leave it out", name)
