"""The HTTP client for OpenAI-compatible endpoints: JSON calls and SSE streaming, with retries and one-line errors.

Retried: HTTP 429 and 503 (a busy server; its Retry-After header is honoured) and failures to connect or read
(a server still starting, a dropped connection), with exponential backoff and jitter so that many clients do not
retry in lockstep. Everything else (400, 404, ...) fails at once: retrying a bad request cannot fix it.
`timeout_s` bounds one call in total, retries included; past it, or past `retries`, the call raises an
`EndpointError` whose message is one line naming the URL, the status, the server's own error message and the fix.

`base_url` may be given with or without the trailing `/v1` (OpenAI's clients want it, vLLM's bench does not):
paths are written in full (`/v1/completions`) and the duplicate is dropped. A user:password in it is sent as
basic auth and never appears in a message (remote/urls.py).

A server cannot hold a call past its deadline or flood memory: httpx's timeouts are per read (a server trickling
a byte a second never trips them), so JSON answers are read in chunks against the call's own deadline, and a
decoded (gunzipped) answer above `max_response_bytes` is refused (a gzip bomb took a client to 982 MB): both in
remote/bounded_body.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from tokq.errors import TokqError
from tokq.remote.bounded_body import Deadline, Encoding, TooLarge, aread_bounded, read_bounded

RETRY_STATUSES = (429, 503)
# A scored window's answer: 32K prompt tokens x 21 entries of ~70 bytes is ~50 MB; four times that is a bomb.
MAX_RESPONSE_BYTES = 256 * 2**20


class EndpointError(TokqError):
    """An endpoint that could not be reached or refused a request; `status` is the HTTP status (None when no
    answer came)."""

    def __init__(self, message: str, status: int | None = None, url: str = ""):
        super().__init__(" ".join(message.split()))  # one line whatever the server put in its message
        self.status = status
        self.url = url


@dataclass
class StreamChunk:
    """One server-sent event of a streaming completion: the parsed JSON and when it arrived (perf_counter)."""

    data: dict
    arrival_s: float


def _fix(status: int | None) -> str:
    """What the user can do about a failure with this status."""
    return {
        None: "start the server or check --base-url",
        400: "fix the request (see the server's message)",
        401: "set OPENAI_API_KEY to a key the server accepts",
        403: "set OPENAI_API_KEY to a key the server accepts",
        404: "check the path and --model against GET /v1/models",
        429: "lower --max-concurrency or --request-rate",
        503: "lower --max-concurrency or --request-rate, or give the server a longer queue",
    }.get(status, "check the server's log")


def _server_message(response: httpx.Response, content: bytes | None = None) -> str:
    """The server's error message: OpenAI's {"error": {"message": ...}}, FastAPI's {"detail": ...} or the text.
    `content`: the body when it was read in chunks (else the response's own)."""
    content = response.content if content is None else content
    try:
        body = json.loads(content)
    except (ValueError, UnicodeDecodeError):
        return content.decode("utf-8", "replace").strip()[:300] or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if body.get("detail"):
            return str(body["detail"])
        if body.get("message"):
            return str(body["message"])
    return json.dumps(body)[:300]


def _retry_after(response: httpx.Response | None) -> float | None:
    if response is None:
        return None
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:  # an HTTP date: rare, and a plain backoff is a fine stand-in
        return None


class _Retrying:
    """The retry schedule of one call: how long to wait before attempt n, and whether there is time left."""

    def __init__(self, client: EndpointClient, url: str):
        self.client, self.url = client, url
        self.start = time.monotonic()
        self.attempt = 0
        self.out_of_time = False  # gave up for the deadline rather than the number of retries

    def remaining(self) -> float:
        return self.client.timeout_s - (time.monotonic() - self.start)

    def attempt_timeout(self) -> httpx.Timeout:
        left = max(0.05, self.remaining())
        return httpx.Timeout(left, connect=min(left, self.client.connect_timeout_s))

    def next_wait(self, response: httpx.Response | None) -> float | None:
        """Seconds to sleep before retrying, or None when the call must give up."""
        self.attempt += 1
        if self.attempt > self.client.retries:
            return None
        backoff = min(self.client.max_backoff_s, self.client.backoff_s * 2 ** (self.attempt - 1))
        wait = backoff * random.uniform(0.5, 1.5)
        after = _retry_after(response)
        if after is not None:
            wait = max(wait, after + random.uniform(0, self.client.backoff_s))
        if wait >= self.remaining():
            self.out_of_time = True
            return None
        return wait

    def give_up(self, status: int | None, what: str) -> EndpointError:
        return self.timeout_error(status, what) if self.out_of_time else self.error(status, what)

    def error(self, status: int | None, what: str) -> EndpointError:
        tries = f" after {self.attempt} {'try' if self.attempt == 1 else 'tries'}" if self.attempt > 1 else ""
        head = f"HTTP {status}" if status is not None else "no answer"
        return EndpointError(f"{self.url}: {head}{tries}: {what}; {_fix(status)}", status, self.url)

    def timeout_error(self, status: int | None, what: str) -> EndpointError:
        return EndpointError(
            f"{self.url}: no success within the {self.client.timeout_s:g} s timeout ({self.attempt} "
            f"{'try' if self.attempt == 1 else 'tries'}; last: {'HTTP ' + str(status) + ': ' if status else ''}"
            f"{what}); {_fix(status)}, or raise --timeout",
            status, self.url)


def _describe(exc: Exception) -> str:
    if isinstance(exc, httpx.ConnectError):
        return f"connection failed ({exc or type(exc).__name__})"
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"


class EndpointClient:
    """One endpoint: sync calls (`post_json`, `get_json`, `list_models`) and async ones (`apost_json`,
    `aget_json`, `stream_completion`). Close it (or use it as a context manager) to free its connections."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 600.0, retries: int = 6,
                 backoff_s: float = 0.25, max_backoff_s: float = 8.0, connect_timeout_s: float = 10.0,
                 max_response_bytes: int = MAX_RESPONSE_BYTES):
        from tokq.errors import ConfigError
        from tokq.remote.urls import check_http_url, split_credentials

        try:
            check_http_url(base_url, "the server address")
        except ConfigError as exc:
            raise EndpointError(exc.message) from None
        if not (timeout_s > 0 and timeout_s != float("inf")):
            raise EndpointError(f"timeout {timeout_s}: must be a finite number of seconds > 0")
        base_url, self._auth = split_credentials(base_url)
        self.base_url = base_url.rstrip("/")
        self.max_response_bytes = max_response_bytes
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.timeout_s, self.retries = timeout_s, retries
        self.backoff_s, self.max_backoff_s, self.connect_timeout_s = backoff_s, max_backoff_s, connect_timeout_s
        self._sync: httpx.Client | None = None
        self._async: httpx.AsyncClient | None = None

    # -- plumbing ---------------------------------------------------------------------------------------------
    def url(self, path: str) -> str:
        if not path.startswith("/"):
            path = "/" + path
        if self.base_url.endswith("/v1") and path.startswith("/v1/"):
            path = path[3:]
        return self.base_url + path

    def _headers(self) -> dict[str, str]:
        accept = {"Accept-Encoding": "gzip, deflate"}  # what bounded_body reads, a piece at a time
        return {**accept, "Authorization": f"Bearer {self.api_key}"} if self.api_key else accept

    def _client(self) -> httpx.Client:
        if self._sync is None:
            self._sync = httpx.Client(headers=self._headers(), auth=self._auth)
        return self._sync

    def _aclient(self) -> httpx.AsyncClient:
        if self._async is None:
            # No pool limit: --max-concurrency is the bench's to set, not the connection pool's.
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._async = httpx.AsyncClient(headers=self._headers(), limits=limits, auth=self._auth)
        return self._async

    def _read(self, response: httpx.Response, retry: _Retrying) -> bytes:
        return read_bounded(response, self.max_response_bytes, retry.remaining)

    async def _aread(self, response: httpx.Response, retry: _Retrying) -> bytes:
        return await aread_bounded(response, self.max_response_bytes, retry.remaining)

    def _refusal(self, exc: Exception, retry: _Retrying, status: int) -> EndpointError:
        if isinstance(exc, Encoding):
            return retry.error(status, f"the answer is in content encoding {str(exc)[:40]!r}, which was not asked "
                                       "for (gzip or deflate)")
        if isinstance(exc, zlib.error):
            return retry.error(status, f"the answer's compressed body is corrupt ({exc})")
        if isinstance(exc, TooLarge):
            return retry.error(status, f"the answer is larger than {self.max_response_bytes} bytes decoded; nothing "
                                       "was kept")
        return EndpointError(f"{retry.url}: the answer was still arriving when the {self.timeout_s:g} s timeout "
                             "passed (a server sending slowly); check the server, or raise --timeout", status, retry.url)

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None

    async def aclose(self) -> None:
        if self._async is not None:
            await self._async.aclose()
            self._async = None

    def __enter__(self) -> EndpointClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> EndpointClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    @staticmethod
    def _json(status: int, content: bytes, retry: _Retrying) -> dict:
        try:
            return json.loads(content)
        except (ValueError, UnicodeDecodeError) as e:
            raise retry.error(status, f"the answer is not JSON ({str(e)[:100]}): is this an OpenAI-compatible "
                                      "server?") from None

    # -- sync -------------------------------------------------------------------------------------------------
    def request_json(self, method: str, path: str, body: dict | None = None) -> dict:
        retry = _Retrying(self, self.url(path))
        while True:
            response, what = None, ""
            try:
                request = self._client().build_request(method, retry.url, json=body, timeout=retry.attempt_timeout())
                response = self._client().send(request, stream=True)
                try:
                    content = self._read(response, retry)
                except (TooLarge, Deadline, Encoding, zlib.error) as exc:
                    raise self._refusal(exc, retry, response.status_code) from None
                finally:
                    response.close()
                if response.is_success:
                    return self._json(response.status_code, content, retry)
                what = _server_message(response, content)
                if response.status_code not in RETRY_STATUSES:
                    raise retry.error(response.status_code, what)
            except httpx.TransportError as e:
                what = _describe(e)
            wait = retry.next_wait(response)
            if wait is None:
                raise retry.give_up(response.status_code if response is not None else None, what)
            time.sleep(wait)

    def post_json(self, path: str, body: dict) -> dict:
        return self.request_json("POST", path, body)

    def get_json(self, path: str) -> dict:
        return self.request_json("GET", path)

    def list_models(self) -> list[dict]:
        """GET /v1/models: the served models, each a dict with at least "id"."""
        answer = self.get_json("/v1/models")
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and "id" in m for m in data):
            raise EndpointError(f"{self.url('/v1/models')}: the answer has no 'data' list of models with an 'id'; is "
                                "this an OpenAI-compatible server?")
        return data

    def first_model_id(self) -> str:
        models = self.list_models()
        if not models:
            raise EndpointError(f"{self.url('/v1/models')}: the server lists no model; name one with --model")
        return str(models[0]["id"])

    # -- async ------------------------------------------------------------------------------------------------
    async def arequest_json(self, method: str, path: str, body: dict | None = None) -> dict:
        retry = _Retrying(self, self.url(path))
        while True:
            response, what = None, ""
            try:
                request = self._aclient().build_request(method, retry.url, json=body, timeout=retry.attempt_timeout())
                response = await self._aclient().send(request, stream=True)
                try:
                    content = await self._aread(response, retry)
                except (TooLarge, Deadline, Encoding, zlib.error) as exc:
                    raise self._refusal(exc, retry, response.status_code) from None
                finally:
                    await response.aclose()
                if response.is_success:
                    return self._json(response.status_code, content, retry)
                what = _server_message(response, content)
                if response.status_code not in RETRY_STATUSES:
                    raise retry.error(response.status_code, what)
            except httpx.TransportError as e:
                what = _describe(e)
            wait = retry.next_wait(response)
            if wait is None:
                raise retry.give_up(response.status_code if response is not None else None, what)
            await asyncio.sleep(wait)

    async def apost_json(self, path: str, body: dict) -> dict:
        return await self.arequest_json("POST", path, body)

    async def aget_json(self, path: str) -> dict:
        return await self.arequest_json("GET", path)

    async def stream_completion(self, body: dict, path: str = "/v1/completions") -> AsyncIterator[StreamChunk]:
        """POST `body` with stream=true; yield each SSE `data:` event, parsed, with its arrival time.

        Retried like any call until the server has accepted the request (a 2xx status); once chunks flow a
        failure raises, since a half-streamed completion cannot be replayed without counting its tokens twice.
        A chunk with an "error" key (servers report mid-stream failures that way) raises too.
        """
        retry = _Retrying(self, self.url(path))
        body = {**body, "stream": True}
        while True:
            status, what = None, ""
            try:
                request = self._aclient().build_request("POST", retry.url, json=body,
                                                        timeout=retry.attempt_timeout())
                response = await self._aclient().send(request, stream=True)
                try:
                    status = response.status_code
                    if response.is_success:
                        async for line in response.aiter_lines():
                            now = time.perf_counter()
                            if retry.remaining() <= 0:  # a stream that trickles past the call's deadline
                                raise self._refusal(Deadline(), retry, status)
                            if not line.startswith("data:"):
                                continue  # blank separators, comments, event: lines
                            payload = line[5:].strip()
                            if payload == "[DONE]":
                                return
                            try:
                                data = json.loads(payload)
                            except ValueError:
                                raise retry.error(status, f"a stream event is not JSON: {payload[:100]!r}") from None
                            if isinstance(data, dict) and "error" in data:
                                err = data["error"]
                                message = err.get("message", err) if isinstance(err, dict) else err
                                raise retry.error(status, f"the server failed mid-stream: {message}")
                            yield StreamChunk(data, now)
                        return
                    await response.aread()
                    what = _server_message(response)
                    if status not in RETRY_STATUSES:
                        raise retry.error(status, what)
                    wait = retry.next_wait(response)
                finally:
                    await response.aclose()
            except httpx.TransportError as e:
                if status is not None and 200 <= status < 300:  # the stream broke after it started
                    raise retry.error(status, f"the stream broke: {_describe(e)}") from None
                what = _describe(e)
                wait = retry.next_wait(None)
            if wait is None:
                raise retry.give_up(status, what)
            await asyncio.sleep(wait)
