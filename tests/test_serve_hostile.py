"""tokq serve against hostile requests (issue 34), in-process on a tiny llama: each request is judged on its own.

A temperature or top_p that underflows samples as greedy instead of failing the step; a sampling failure ends
its own request only (a concurrent stream runs to its end); request-supplied chat templates and
apply_chat_template's own arguments are refused unless the operator allows them; fields tokq does not implement
are a 400 naming the field; a body above the cap is a 413 before anything is parsed; --api-key guards /v1; a
template that renders for too long is cut off by the time limit while another client is served.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.test_serve_units import tiny_engine

PROMPT = "w1 w2 w3 w4"
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}"


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("hostile-serve") / "tiny", TEMPLATE)


def _serve(loaded, own_engine: bool = True, **options):
    """A server with `options`; on an engine of its own (one engine loop per engine: the module's server keeps
    running on `loaded.engine`)."""
    from tokq.serve.app import build_app
    from tokq.serve.testing import serve_in_thread

    engine = tiny_engine(Path(loaded.checkpoint)).engine if own_engine else loaded.engine
    return serve_in_thread(build_app(engine, loaded.tokenizer, "tiny", **options))


@pytest.fixture(scope="module")
def http(loaded):
    with _serve(loaded, own_engine=False) as url, httpx.Client(base_url=url, timeout=60) as client:
        yield client


def _complete(http, **body) -> httpx.Response:
    return http.post("/v1/completions", json={"ignore_eos": True, "max_tokens": 6, "prompt": PROMPT, **body})


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_underflowing_temperature_and_top_p_sample_as_greedy(http):
    greedy = _text(_complete(http, temperature=0))
    for body in ({"temperature": 1e-300}, {"temperature": 1e-40}, {"temperature": 0.8, "top_p": 1e-30},
                 {"temperature": 1e-6, "top_k": 5}):
        assert _text(_complete(http, **body)) == greedy, body


def test_a_seed_outside_the_generator_range_is_400(http):
    r = _complete(http, temperature=1.0, seed=2**70)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("seed=")


def test_one_requests_sampling_failure_ends_that_request_only(http, monkeypatch):
    """A request whose sampling raises (injected for seed 666) gets a 500; a greedy stream decoding next to it
    runs to its last token."""
    import tokq.engine.llm_engine as engine_module

    real = engine_module.sample

    batches_with_both = []

    def sample(logits, params, generators):
        time.sleep(0.005)  # a step takes a few ms: the two requests surely share steps
        if any(p.seed == 666 for p in params):
            batches_with_both.append(len(params) > 1)
            raise RuntimeError("injected sampling failure")
        return real(logits, params, generators)

    monkeypatch.setattr(engine_module, "sample", sample)
    alone = _text(_complete(http, temperature=0, max_tokens=120))
    streamed: list[str] = []
    first_chunk = threading.Event()

    def stream_greedy():
        with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 120, "temperature": 0,
                                                          "ignore_eos": True, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(line)
                    first_chunk.set()

    worker = threading.Thread(target=stream_greedy)
    worker.start()
    assert first_chunk.wait(30)
    failed = _complete(http, temperature=1.0, seed=666, max_tokens=30)
    worker.join(60)
    assert any(batches_with_both), "the failing request never shared a step with the stream"
    assert failed.status_code == 500 and "injected sampling failure" in failed.json()["error"]["message"]
    chunks = [json.loads(line[6:]) for line in streamed]
    assert all("error" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == alone
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_the_engine_api_raises_its_own_sampling_failure(loaded, monkeypatch):
    """Offline (no server thread): generate() raises the failure of its own batch, and the engine goes on."""
    import tokq.engine.llm_engine as engine_module
    from tokq.engine.llm_engine import EngineError
    from tokq.engine.sampling import SamplingParams

    engine = tiny_engine(Path(loaded.checkpoint)).engine
    real = engine_module.sample
    monkeypatch.setattr(engine_module, "sample", lambda *a: (_ for _ in ()).throw(RuntimeError("bad row")))
    with pytest.raises(EngineError, match="sampling failed for prompt 0: bad row"):
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    assert engine.blocks.num_used == 0
    monkeypatch.setattr(engine_module, "sample", real)
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids) == 2


@pytest.mark.parametrize("body, param", [
    ({"chat_template": "{{ 'x' }}"}, "chat_template"),
    ({"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"flag": list(range(5000))}}, "chat_template_kwargs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
])
def test_what_tokq_does_not_do_is_a_400_naming_the_field(http, body, param):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w3"}], "max_tokens": 2,
                                                **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_neutral_values_of_unsupported_fields_are_accepted(http):
    neutral = {"response_format": {"type": "text"}, "tool_choice": "none", "presence_penalty": 0,
               "frequency_penalty": 0.0, "logit_bias": {}, "user": "someone",
               "chat_template_kwargs": {"enable_thinking": False}}
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w3"}], "max_tokens": 2,
                                                "temperature": 0, **neutral})
    assert r.status_code == 200, r.text
    assert _complete(http, temperature=0, presence_penalty=0.0, best_of=1).status_code == 200
    assert _complete(http, temperature=0, presence_penalty=True).status_code == 400  # True is no 0


def test_body_cap_is_413_before_parsing(loaded):
    with _serve(loaded, max_body_bytes=4096) as url, httpx.Client(base_url=url, timeout=60) as http:
        assert _complete(http, temperature=0).status_code == 200
        big = "w1 " * 3000
        r = _complete(http, prompt=big)
        assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]

        def chunked():  # no Content-Length: the cap counts what arrives
            yield b'{"prompt": "'
            for _ in range(100):
                yield b"w1 " * 30
            yield b'", "max_tokens": 1}'

        r = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert http.get("/health").status_code == 200


def test_api_key_guards_v1_only(loaded):
    with _serve(loaded, api_key="s3cret") as url, httpx.Client(base_url=url, timeout=60) as http:
        assert _complete(http, temperature=0).status_code == 401
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1},
                      headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1},
                       headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200


def test_a_slow_template_is_cut_off_while_others_are_served(loaded):
    """With request templates allowed, one that loops for seconds gets a 400 at the time limit; a completion sent
    meanwhile is answered without waiting for it."""
    slow = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}x"  # ~3 s
    with _serve(loaded, trust_request_chat_template=True, prepare_timeout_s=0.5) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        own = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w3"}],
                                                      "max_tokens": 2, "chat_template": "{{ 'w5 w6' }}"})
        assert own.status_code == 200, own.text  # the operator allowed request templates
        result: dict = {}

        def render_slowly():
            result["slow"] = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "w3"}], "max_tokens": 2, "chat_template": slow})

        worker = threading.Thread(target=render_slowly)
        worker.start()
        time.sleep(0.1)
        started = time.perf_counter()
        quick = _complete(http, temperature=0, max_tokens=2)
        quick_s = time.perf_counter() - started
        worker.join(120)
        assert quick.status_code == 200 and quick_s < 5.0, quick_s
        assert result["slow"].status_code == 400 and "took longer than 0.5 s" in result["slow"].json()["error"]["message"]
