"""One background thread owns the `LLMEngine`; HTTP handlers reach it only through queues.

The engine is not thread-safe and every step runs the model, so one thread does everything to it:
add_request, abort and step, in a loop. Handlers (on the asyncio event loop) `submit` a `Group` (one HTTP
request's prompts) and read its events from an asyncio.Queue that the engine thread fills through
`loop.call_soon_threadsafe`; a handler whose client went away `cancel`s its group and the engine thread
aborts its requests between two steps, freeing their KV blocks. All requests of all clients share the
engine's continuous batch.

The loop never dies of one request: a request the engine refuses (EngineError, SamplingError) fails only
its own group; an exception inside a step fails the requests that were in flight (their groups get the
error) and the loop carries on with the next ones.

`max_queue` bounds the requests the engine holds (running + waiting): `submit` raises QueueFull beyond it,
which the app answers with 503 + Retry-After instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from tokq.serve.jobs import Job

log = logging.getLogger("tokq.serve")


class QueueFull(Exception):
    """The engine holds max_queue requests already."""


@dataclass
class Output:
    """New tokens of prompt `index` of a group (one engine step), with their logprobs when asked."""

    index: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    logprobs: list | None = None  # TokenLogprob per new token
    prompt_logprobs: list | None = None  # set once: [None, TokenLogprob, ...] per prompt token


@dataclass
class Accepted:
    """Every request of the group is in the engine (the first event of a group that was not refused)."""


@dataclass
class Failed:
    error: Exception


class Group:
    """One HTTP request's engine requests, as the event loop sees them."""

    def __init__(self, jobs: list[Job], loop: asyncio.AbstractEventLoop):
        self.jobs = jobs
        self.events: asyncio.Queue = asyncio.Queue()
        self._loop = loop
        self.cancelled = False  # set by the handler; the engine thread aborts what is left
        self.done = False  # set by the engine thread when every request finished (or failed)

    def push(self, event: Accepted | Output | Failed) -> None:
        try:
            self._loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed (shutdown): nobody is listening any more
            pass


@dataclass
class _Live:
    """A request inside the engine: its group, index, and the times behind TTFT / ITL / TPOT."""

    group: Group
    index: int
    arrival: float
    num_prompt: int
    token_times: list[float] = field(default_factory=list)


class EngineLoop:
    def __init__(self, engine, *, max_queue: int, metrics=None, idle_wait_s: float = 0.5):
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}
        self._lock = threading.Lock()
        self._held = 0  # requests submitted and not yet finished (the queue limit counts these)
        self._stop = threading.Event()
        self._idle_wait_s = idle_wait_s
        self._thread = threading.Thread(target=self._run, name="tokq-engine", daemon=True)
        self._last_preemptions = 0

    # The event loop's side ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def held(self) -> int:
        return self._held

    def submit(self, jobs: list[Job]) -> Group:
        """Queue one HTTP request's jobs; raises QueueFull when the engine holds max_queue requests."""
        with self._lock:
            if self._held + len(jobs) > self.max_queue:
                raise QueueFull(f"{self._held} requests are running or waiting (--max-queue {self.max_queue})")
            self._held += len(jobs)
        group = Group(jobs, asyncio.get_running_loop())
        self._commands.put(("add", group))
        return group

    def cancel(self, group: Group) -> None:
        """Abort what is left of the group (its client went away)."""
        if not group.done and not group.cancelled:
            group.cancelled = True
            self._commands.put(("abort", group))

    def _release(self, n: int) -> None:
        with self._lock:
            self._held -= n

    # The engine thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self.engine.has_unfinished()
            self._take_commands(block=not busy)
            if self._stop.is_set():
                break
            if self.engine.has_unfinished():
                self._step()
        self._fail_all(RuntimeError("the server is shutting down"))

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, group = command
            if kind == "add":
                self._add(group)
            elif kind == "abort":
                self._abort(group)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, group: Group) -> None:
        if group.cancelled:
            group.done = True
            self._release(len(group.jobs))
            return
        added: list[int] = []
        try:
            for index, job in enumerate(group.jobs):
                seq_id = self.engine.add_request(job.prompt_ids, job.params)
                added.append(seq_id)
                self._live[seq_id] = _Live(group, index, time.perf_counter(), len(job.prompt_ids))
        except Exception as exc:  # refused (EngineError, SamplingError) or a bug: this group only
            if not _is_request_error(exc):
                log.exception("adding a request failed")
            for seq_id in added:
                self._drop(seq_id, abort=True)
            group.done = True
            self._release(len(group.jobs) - len(added))
            group.push(Failed(exc))
            return
        group.push(Accepted())
        self._update_gauges()

    def _abort(self, group: Group) -> None:
        for seq_id in [s for s, live in self._live.items() if live.group is group]:
            self._finish_metrics(self._drop(seq_id, abort=True), "abort")
        group.done = True
        self._update_gauges()

    def _drop(self, seq_id: int, abort: bool) -> _Live | None:
        """Forget a request here (and in the engine); with `abort`, first remove it from the engine."""
        live = self._live.pop(seq_id, None)
        if abort:
            try:
                self.engine.abort(seq_id)
            except Exception:  # an abort that fails must not take the loop down
                log.exception("aborting request %d failed", seq_id)
        self.engine.forget([seq_id])
        if live is not None:
            self._release(1)
        return live

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("an engine step failed; failing the requests in flight")
            self._fail_all(exc)
            return
        now = time.perf_counter()
        for out in outputs:
            live = self._live.get(out.seq_id)
            if live is None:  # not one of ours (cannot happen: the loop owns the engine)
                continue
            if out.error is not None:  # this sequence's sampling failed: its request fails, the others go on
                self._fail_group(live.group, out.error)
                continue
            if out.new_token_ids:
                live.token_times.extend([now] * len(out.new_token_ids))
            reason = out.finish_reason
            live.group.push(Output(live.index, list(out.new_token_ids), out.finished, reason, out.logprobs,
                                   out.prompt_logprobs))
            if out.finished:
                self._drop(out.seq_id, abort=False)
                self._finish_metrics(live, reason or "stop")
                if not any(v.group is live.group for v in self._live.values()):
                    live.group.done = True
        self._update_gauges()

    def _fail_group(self, group: Group, exc: Exception) -> None:
        for seq_id, live in list(self._live.items()):
            if live.group is group:
                self._drop(seq_id, abort=True)  # not counted as a success in /metrics
        group.done = True
        group.push(Failed(exc))

    def _fail_all(self, exc: Exception) -> None:
        groups = {id(live.group): live.group for live in self._live.values()}
        for seq_id in list(self._live):
            self._drop(seq_id, abort=True)
        for group in groups.values():
            group.done = True
            group.push(Failed(exc))
        while True:  # groups never added (shutdown): tell them too
            try:
                kind, group = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._release(len(group.jobs))
                group.done = True
                group.push(Failed(exc))
        self._update_gauges()

    # Metrics ------------------------------------------------------------------------------------------

    def _update_gauges(self) -> None:
        if self.metrics is None:
            return
        sched = self.engine.scheduler
        preemptions = sched.num_preemptions
        self.metrics.engine_state(running=len(sched.running), waiting=len(sched.waiting),
                                  kv_usage=self.engine.blocks.num_used / max(self.engine.num_blocks, 1),
                                  new_preemptions=preemptions - self._last_preemptions)
        self._last_preemptions = preemptions

    def _finish_metrics(self, live: _Live | None, reason: str) -> None:
        if self.metrics is None or live is None:
            return
        self.metrics.request_finished(reason, live.arrival, live.token_times, live.num_prompt)


def _is_request_error(exc: Exception) -> bool:
    from tokq.errors import TokqError

    return isinstance(exc, (TokqError, ValueError))

