"""Chat messages -> one prompt string, through the tokenizer's own chat template (Jinja, from the checkpoint).

A model without a chat template is refused with a 400 naming the fix (/v1/completions takes raw prompts):
guessing a template would silently produce prompts the model was never trained on.
"""

from __future__ import annotations

from tokq.serve.protocol import ChatMessage, bad_request


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


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                template_kwargs: dict | None = None) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model's tokenizer has no chat template (tokenizer_config.json chat_template): "
                          "use /v1/completions with a formatted prompt, or serve a chat model", "messages")
    conversation = [{"role": m.role, "content": _content(m)} for m in messages]
    try:
        return tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **(template_kwargs or {}))
    except Exception as exc:  # jinja2 raises TemplateError subclasses, and templates raise_exception(...)
        raise bad_request(f"the chat template refused the messages: {exc}", "messages") from None
