"""ASGI guards in front of the app: the API key (Bearer auth on /v1/*) and the request body size cap.

Both answer before any route runs, so a stranger or an oversized body costs the server no parsing, no
tokenizing and no engine time. The body is read here, counted, and replayed to the app in one piece: a
body past the cap (by its Content-Length, or by what actually arrives when the client sends none) is a
413 naming the limit, and the app never sees it.
"""

from __future__ import annotations

import hmac
import json

DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # 8 MiB: a 32K-token prompt is ~150 KB of text, or of token ids


async def _send_error(send, status: int, message: str, error_type: str, headers: list | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": error_type, "param": None, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class BearerAuth:
    """Requests to /v1/* must carry `Authorization: Bearer <api_key>` (as vLLM's --api-key); /health and
    /metrics stay open for probes and scrapers."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await _send_error(send, 401, "missing or wrong API key: send the header `Authorization: Bearer <key>` "
                                             "with the key the server was started with (--api-key)",
                                  "AuthenticationError", [(b"www-authenticate", b"Bearer")])
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """A request body above `max_bytes` is answered 413 before the app reads any of it."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def _too_large(self, send, size: str) -> None:
        await _send_error(send, 413, f"the request body is {size}, above this server's limit of {self.max_bytes} "
                                     "bytes: send a shorter prompt, or start the server with a larger --max-body-mb",
                          "PayloadTooLargeError")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(send, f"{int(declared)} bytes")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send, f"more than {self.max_bytes} bytes")
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # afterwards: the client's disconnect, as the app expects

        await self.app(scope, replay, send)
