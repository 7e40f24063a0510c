"""`build_app(engine, tokenizer, served_name)`: the OpenAI-compatible FastAPI app over one `LLMEngine`.

Routes: POST /v1/completions and /v1/chat/completions (streaming as server-sent events, `data: {...}`
chunks then `data: [DONE]`), GET /v1/models, /health and /metrics. Every request becomes `Job`s (jobs.py:
tokenized, checked against vLLM's limits), goes to the one engine thread (engine_loop.py) and comes back as
JSON (openai_format.py). Errors are OpenAI's error JSON: 400 for a bad request or one the engine refuses,
404 for a model this server does not serve, 503 + Retry-After when --max-queue requests are already held.

Each request is checked on its own before it reaches the engine (guards.py: the API key and the body size
cap; protocol.py: fields tokq does not implement; jobs.py: vLLM's limits), and the CPU-heavy part of
taking it in (rendering the chat template, tokenizing) runs in a worker thread with a time limit, so that
one client's huge or slow request neither stalls the event loop nor delays anyone else's tokens.

A client that goes away has its requests aborted (their KV blocks freed): a stream's generator is cancelled
by Starlette when the connection closes, and a non-streaming handler polls `request.is_disconnected()`
while it waits. The engine thread starts with the app (lifespan) and stops after uvicorn's graceful
shutdown has let in-flight requests finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokq.serve import openai_format as fmt
from tokq.serve.chat import render_chat
from tokq.serve.engine_loop import Accepted, EngineLoop, Failed, Group, Output, QueueFull
from tokq.serve.errors import add_error_handlers
from tokq.serve.guards import DEFAULT_MAX_BODY_BYTES, BearerAuth, BodyLimit
from tokq.serve.jobs import Job, Limits, chat_job, completion_jobs
from tokq.serve.metrics import ServerMetrics
from tokq.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, refuse_unsupported

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming handler checks that its client is still there
RETRY_AFTER_S = 1


PREPARE_TIMEOUT_S = 30.0  # the most a request's template rendering + tokenizing may take


@dataclass
class ServeOptions:
    served_name: str
    max_logprobs: int = 20
    max_queue: int | None = None  # None: 4 x the engine's max_num_seqs
    root: str | None = None  # where the model came from (GET /v1/models "root")
    api_key: str | None = None  # Bearer key every /v1 request must carry (None: open)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    trust_request_chat_template: bool = False
    prepare_timeout_s: float = PREPARE_TIMEOUT_S


@dataclass
class _Result:
    """What one prompt of a request has produced so far."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None
    finish_reason: str | None = None
    finished: bool = False

    def add(self, out: Output) -> None:
        self.token_ids += out.new_token_ids
        if out.logprobs:
            self.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.finished, self.finish_reason = out.finished, out.finish_reason


def _error_of(exc: Exception) -> APIError:
    from tokq.errors import TokqError

    if isinstance(exc, TokqError):
        return APIError(400, exc.message)
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    return APIError(500, f"internal error ({type(exc).__name__}: {exc})")


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


class _Server:
    """The app's state: the engine loop, the tokenizer, the limits; one method per route."""

    def __init__(self, engine, tokenizer, options: ServeOptions):
        self.engine, self.tokenizer, self.options = engine, tokenizer, options
        self.decoder = fmt.Decoder(tokenizer)
        self.limits = Limits(engine.max_model_len, options.max_logprobs)
        self.metrics = ServerMetrics(options.served_name)
        max_queue = options.max_queue or 4 * engine.config.max_num_seqs
        self.loop = EngineLoop(engine, max_queue=max_queue, metrics=self.metrics)

    # Shared steps -------------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.options.served_name:
            raise APIError(404, f"The model `{model}` does not exist (this server serves "
                                f"`{self.options.served_name}`).", "model")

    async def prepare(self, what: str, fn, *args):
        """fn(*args) (template rendering, tokenizing) in a worker thread, within the time limit: the event loop
        keeps serving other requests meanwhile. A worker past the limit is left to finish on its own (a thread
        cannot be stopped); the body cap bounds how long that can be."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, *args), self.options.prepare_timeout_s)
        except TimeoutError:
            raise APIError(400, f"{what} took longer than {self.options.prepare_timeout_s:g} s: send a shorter "
                                "request") from None

    async def submit(self, jobs: list[Job]) -> Group:
        """The jobs in the engine, or the refusal (503 when full, 400 when the engine refuses one)."""
        if not self.loop.alive:
            raise APIError(503, "the engine is not running", headers={"Retry-After": str(RETRY_AFTER_S)})
        try:
            group = self.loop.submit(jobs)
        except QueueFull as exc:
            raise APIError(503, f"the server is busy: {exc}; retry later",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        try:
            event = await group.events.get()
        except asyncio.CancelledError:
            self.loop.cancel(group)
            raise
        if isinstance(event, Failed):
            raise _error_of(event.error)
        assert isinstance(event, Accepted)
        return group

    async def collect(self, group: Group, request: Request) -> list[_Result] | None:
        """Wait for every prompt of the group to finish; None when the client went away (aborted)."""
        results = [_Result() for _ in group.jobs]
        get = asyncio.ensure_future(group.events.get())
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_POLL_S
        try:
            while not all(r.finished for r in results):
                # by the clock, not only when idle: a running request sends an event every engine step
                if loop.time() >= next_check:
                    if await request.is_disconnected():
                        return None
                    next_check = loop.time() + DISCONNECT_POLL_S
                done, _ = await asyncio.wait({get}, timeout=DISCONNECT_POLL_S)
                if not done:
                    continue
                event = get.result()
                get = asyncio.ensure_future(group.events.get())
                if isinstance(event, Failed):
                    raise _error_of(event.error)
                results[event.index].add(event)
            return results
        finally:
            get.cancel()
            self.loop.cancel(group)  # nothing to do when the group is done

    # Completions ------------------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        refuse_unsupported(req)
        jobs = await self.prepare("tokenizing the prompt", completion_jobs, req, self.tokenizer, self.limits)
        group = await self.submit(jobs)
        if req.stream:
            return StreamingResponse(self._stream_completion(req, group), media_type="text/event-stream")
        results = await self.collect(group, request)
        if results is None:
            return Response(status_code=499)
        choices = [self._completion_choice(req, i, job, r) for i, (job, r) in enumerate(zip(jobs, results,
                                                                                             strict=True))]
        body = {"id": fmt.new_id("cmpl"), "object": "text_completion", "created": fmt.now(),
                "model": self.options.served_name, "choices": choices,
                "usage": fmt.usage(sum(len(j.prompt_ids) for j in jobs), sum(len(r.token_ids) for r in results))}
        return JSONResponse(body)

    def _prompt_text(self, job: Job) -> str:
        return job.prompt_text if job.prompt_text is not None else self.decoder.text(job.prompt_ids)

    def _completion_choice(self, req: CompletionRequest, index: int, job: Job, r: _Result) -> dict:
        as_id = req.return_tokens_as_token_ids
        text = fmt.final_text(self.decoder, r.token_ids, job.params.stop, r.finish_reason)
        logprobs = None
        if req.echo:
            text = self._prompt_text(job) + text
        if job.logprobs is not None:
            ids, entries = r.token_ids, r.logprobs
            if req.echo:
                ids = job.prompt_ids + ids
                entries = list(r.prompt_logprobs or [None] * len(job.prompt_ids)) + list(entries)
            logprobs = fmt.completion_logprobs(self.decoder, ids, entries, job.logprobs, as_id)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": r.finish_reason,
                "stop_reason": None, **self._prompt_extras(req, job, r)}

    def _prompt_extras(self, req, job: Job, r: _Result) -> dict:
        asked = req.prompt_logprobs is not None
        return {"prompt_logprobs": fmt.prompt_logprobs_json(self.decoder, r.prompt_logprobs, req.prompt_logprobs)
                if asked else None,
                "prompt_token_ids": job.prompt_ids if asked or getattr(req, "return_token_ids", False) else None,
                "token_ids": r.token_ids if getattr(req, "return_token_ids", False) else None}

    async def _events(self, group: Group) -> AsyncIterator[Output]:
        """The group's outputs until all its prompts finished; a failure ends the stream with an error."""
        left = len(group.jobs)
        while left:
            event = await group.events.get()
            if isinstance(event, Failed):
                raise _error_of(event.error)
            if event.finished:
                left -= 1
            yield event

    async def _stream_completion(self, req: CompletionRequest, group: Group) -> AsyncIterator[str]:
        rid, created, name = fmt.new_id("cmpl"), fmt.now(), self.options.served_name
        jobs = group.jobs
        streams = [fmt.TextStream(self.decoder, job.params.stop) for job in jobs]
        offsets = [0] * len(jobs)
        started = [False] * len(jobs)
        generated = [0] * len(jobs)
        try:
            async for out in self._events(group):
                i, job = out.index, jobs[out.index]
                generated[i] += len(out.new_token_ids)
                text = streams[i].add(out.new_token_ids, out.finished)
                ids, entries = out.new_token_ids, out.logprobs or []
                choice = {"index": i, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}
                if not started[i]:
                    started[i] = True
                    if req.echo:
                        choice["text"] = self._prompt_text(job) + text
                        ids = job.prompt_ids + ids
                        entries = list(out.prompt_logprobs or [None] * len(job.prompt_ids)) + list(entries)
                    if req.prompt_logprobs is not None or req.return_token_ids:
                        r = _Result(prompt_logprobs=out.prompt_logprobs)
                        choice.update({k: v for k, v in self._prompt_extras(req, job, r).items() if k != "token_ids"})
                if job.logprobs is not None and ids:
                    lp = fmt.completion_logprobs(self.decoder, ids, entries, job.logprobs,
                                                 req.return_tokens_as_token_ids, offsets[i])
                    offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                    choice["logprobs"] = lp
                if req.return_token_ids:
                    choice["token_ids"] = out.new_token_ids
                if out.finished:
                    choice["finish_reason"] = out.finish_reason
                # a chunk per step that made tokens (one may decode to no text yet), as vLLM streams
                if choice["text"] or out.new_token_ids or out.finished or "prompt_logprobs" in choice:
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                                "choices": [choice]})
            if req.stream_options and req.stream_options.include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                            "choices": [], "usage": fmt.usage(sum(len(j.prompt_ids) for j in jobs), sum(generated))})
        except APIError as exc:
            yield _sse(exc.body())
        finally:
            self.loop.cancel(group)  # the client went away (the generator was cancelled): free its blocks
        yield _sse("[DONE]")

    # Chat -------------------------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(req.model)
        refuse_unsupported(req)
        job = await self.prepare("rendering the chat template and tokenizing", self._chat_job, req)
        group = await self.submit([job])
        if req.stream:
            return StreamingResponse(self._stream_chat(req, group), media_type="text/event-stream")
        results = await self.collect(group, request)
        if results is None:
            return Response(status_code=499)
        r = results[0]
        logprobs = None
        if job.logprobs is not None:
            logprobs = fmt.chat_logprobs(self.decoder, r.token_ids, r.logprobs, job.logprobs,
                                         req.return_tokens_as_token_ids)
        text = fmt.final_text(self.decoder, r.token_ids, job.params.stop, r.finish_reason)
        body = {"id": fmt.new_id("chatcmpl"), "object": "chat.completion", "created": fmt.now(),
                "model": self.options.served_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                             "finish_reason": r.finish_reason, "stop_reason": None}],
                "usage": fmt.usage(len(job.prompt_ids), len(r.token_ids))}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = fmt.prompt_logprobs_json(self.decoder, r.prompt_logprobs, req.prompt_logprobs)
        return JSONResponse(body)

    def _chat_job(self, req: ChatCompletionRequest) -> Job:
        prompt = render_chat(self.tokenizer, req.messages, req.add_generation_prompt, req.chat_template_kwargs,
                             req.chat_template, self.options.trust_request_chat_template)
        return chat_job(req, prompt, self.tokenizer, self.limits)

    async def _stream_chat(self, req: ChatCompletionRequest, group: Group) -> AsyncIterator[str]:
        rid, created, name = fmt.new_id("chatcmpl"), fmt.now(), self.options.served_name
        job = group.jobs[0]
        stream = fmt.TextStream(self.decoder, job.params.stop)
        generated = 0

        def chunk(delta: dict, logprobs=None, finish_reason=None) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                         "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": finish_reason}]})

        try:
            yield chunk({"role": "assistant", "content": ""})
            async for out in self._events(group):
                generated += len(out.new_token_ids)
                text = stream.add(out.new_token_ids, out.finished)
                logprobs = None
                if job.logprobs is not None and out.new_token_ids:
                    logprobs = fmt.chat_logprobs(self.decoder, out.new_token_ids, out.logprobs or [], job.logprobs,
                                                 req.return_tokens_as_token_ids)
                if text or logprobs or out.finished:
                    yield chunk({"content": text} if text or not out.finished else {}, logprobs,
                                out.finish_reason if out.finished else None)
            if req.stream_options and req.stream_options.include_usage:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                            "choices": [], "usage": fmt.usage(len(job.prompt_ids), generated)})
        except APIError as exc:
            yield _sse(exc.body())
        finally:
            self.loop.cancel(group)
        yield _sse("[DONE]")

    # The rest ---------------------------------------------------------------------------------------

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.options.served_name, "object": "model", "created": fmt.now(),
                                            "owned_by": "tokq", "root": self.options.root or self.options.served_name,
                                            "max_model_len": self.engine.max_model_len}]}


def build_app(engine, tokenizer, served_name: str, *, max_logprobs: int = 20, max_queue: int | None = None,
              root: str | None = None, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              trust_request_chat_template: bool = False, prepare_timeout_s: float = PREPARE_TIMEOUT_S) -> FastAPI:
    """The app serving `engine` (an LLMEngine; its thread starts and stops with the app's lifespan)."""
    server = _Server(engine, tokenizer, ServeOptions(served_name, max_logprobs, max_queue, root, api_key,
                                                     max_body_bytes, trust_request_chat_template, prepare_timeout_s))

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        server.loop.start()
        try:
            yield
        finally:
            server.loop.stop()

    app = FastAPI(title="tokq serve", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)  # added last: runs first, before the body is read

    add_error_handlers(app)

    @app.get("/version")
    async def version() -> dict:
        from tokq import __version__

        return {"version": __version__}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await server.completions(req, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(req, request)

    @app.get("/v1/models")
    async def models() -> dict:
        return server.models()

    @app.get("/health")
    async def health() -> Response:
        if not server.loop.alive:
            return JSONResponse(APIError(503, "the engine thread is not running").body(), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
