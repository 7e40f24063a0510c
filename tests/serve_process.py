"""`tokq serve` in a subprocess on a free localhost port, for the tests that talk to a real server over HTTP
(test_serve_api, test_bench_serve, test_gate_url): started with the real CLI, ready once GET /health answers."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
# fp32 for exact comparisons with the in-process engine; one thread each: several servers share 2 cores
BASE_ARGS = ("--dtype", "fp32", "--threads", "1", "--log-level", "warning")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`tokq serve CHECKPOINT *extra`; `url` answers once the constructor returns. Its log is `log`."""

    def __init__(self, checkpoint: Path, *extra: str, home: Path | None = None, start_timeout_s: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (home or checkpoint.parent) / f"serve-{self.port}.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        if home is not None:
            env["TOKQ_HOME"] = str(home)
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "tokq", "serve", str(checkpoint), "--port",
                                          str(self.port), *BASE_ARGS, *extra],
                                         cwd=checkpoint.parent, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tokq serve exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"tokq serve did not answer /health in {start_timeout_s:.0f} s: "
                                   f"{self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        """GET /metrics as {sample name[finished_reason]: value}."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=10).text):
            for sample in family.samples:
                reason = sample.labels.get("finished_reason")
                out[sample.name + (f"[{reason}]" if reason else "")] = sample.value
        return out

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, float]:
        """The metrics once nothing runs, waits or holds KV blocks (aborts land between engine steps)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if m["tokq:num_requests_running"] == 0 and m["tokq:num_requests_waiting"] == 0 \
                    and m["tokq:kv_cache_usage_perc"] == 0:
                return m
            assert time.monotonic() < deadline, f"the server never went idle: {m}"
            time.sleep(0.1)

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (the server drains), then its exit status; killed if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@contextlib.contextmanager
def tokq_serve(checkpoint: Path, *extra: str, start_timeout_s: float = 300.0) -> Iterator[str]:
    """`tokq serve CHECKPOINT *extra` for the duration; yields its base URL."""
    server = ServeProcess(checkpoint, *extra, start_timeout_s=start_timeout_s)
    try:
        yield server.url
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.stop(30)
