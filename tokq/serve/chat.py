"""Chat messages -> one prompt string, through the tokenizer's own chat template (Jinja, from the checkpoint).

A model without a chat template is refused with a 400 naming the fix (/v1/completions takes raw prompts):
guessing a template would silently produce prompts the model was never trained on.

What a request may change is narrow. A template of its own (`chat_template`, or one hidden in
`chat_template_kwargs`) is refused unless the operator started the server with
--trust-request-chat-template: a template is a program (one request's nested loops stalled a server for
minutes). `chat_template_kwargs` reach the template as variables (e.g. `enable_thinking`), never as
arguments of `apply_chat_template` itself (tokenize, tools, padding...), and only as short scalars.
Rendering runs off the event loop with a time limit (app.py).
"""

from __future__ import annotations

from typing import Any

from tokq.serve.protocol import ChatMessage, bad_request

# apply_chat_template's own parameters: not template variables, so never taken from a request
_RESERVED_KWARGS = frozenset({
    "chat_template", "tools", "documents", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "continue_final_message",
    "add_generation_prompt", "conversation"})
MAX_KWARG_CHARS = 1000


def _content(message: ChatMessage) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise bad_request(f"message content of type {part.get('type')!r}: tokq serve takes text parts only",
                              "messages")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def template_variables(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The request's chat_template_kwargs as template variables, or a 400 naming the first one refused."""
    out = {}
    for name, value in (kwargs or {}).items():
        if name in _RESERVED_KWARGS or not name.isidentifier():
            raise bad_request(f"chat_template_kwargs.{name[:40]}: not accepted from a request (only template "
                              "variables such as enable_thinking are)", "chat_template_kwargs")
        if not (value is None or isinstance(value, (bool, int, float)) or
                isinstance(value, str) and len(value) <= MAX_KWARG_CHARS):
            raise bad_request(f"chat_template_kwargs.{name}: must be a boolean, a number or a string of at most "
                              f"{MAX_KWARG_CHARS} characters", "chat_template_kwargs")
        out[name] = value
    return out


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                template_kwargs: dict | None = None, request_template: str | None = None,
                trust_request_template: bool = False) -> str:
    if request_template is not None and not trust_request_template:
        raise bad_request("chat_template: this server does not take templates from requests (start it with "
                          "--trust-request-chat-template to allow them)", "chat_template")
    variables = template_variables(template_kwargs)
    template = request_template if request_template is not None else getattr(tokenizer, "chat_template", None)
    if tokenizer is None or not template:
        raise bad_request("this model's tokenizer has no chat template (tokenizer_config.json chat_template): "
                          "use /v1/completions with a formatted prompt, or serve a chat model", "messages")
    conversation = [{"role": m.role, "content": _content(m)} for m in messages]
    try:
        return tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **variables)
    except Exception as exc:  # jinja2 raises TemplateError subclasses, and templates raise_exception(...)
        raise bad_request(f"the chat template refused the messages: {exc}", "messages") from None


MAX_TEMPLATE_BYTES = 1 << 20


def read_chat_template(value: str) -> str:
    """`tokq serve --chat-template` as vLLM takes it: a file holding a Jinja chat template, or the template itself;
    checked to parse before the model loads (ConfigError naming the problem)."""
    from pathlib import Path

    import jinja2

    from tokq.errors import ConfigError

    path = Path(value).expanduser()
    if path.is_file():
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise ConfigError(f"--chat-template {path}: {path.stat().st_size} bytes, more than a chat template "
                              f"({MAX_TEMPLATE_BYTES} bytes at most)")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"--chat-template {path}: not UTF-8 text; give a Jinja template file") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ConfigError(f"--chat-template {value}: no such file; give a Jinja template file, or the template "
                          "itself (it holds {{ ... }} or {% ... %})")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"--chat-template: line {exc.lineno}: {exc.message}; fix the template") from None
    return text

