"""The request bodies of the OpenAI-compatible API (vLLM's dialect) and its error shape.

Requests are pydantic models so a malformed body (a string where an integer goes) is a 400 naming the
field. Unknown fields are accepted and ignored, as vLLM and OpenAI clients expect (clients send fields a
server may not know, e.g. `user`). Responses are plain dicts built in `openai_format`: their shape is
fixed by the API, not by this code.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """A refusal that reaches the client as OpenAI's error JSON with `status` as the HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    @property
    def type(self) -> str:
        return {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}.get(
            self.status, "InternalServerError")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


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
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    tool_choice: Literal["none"] | str | dict | None = None
