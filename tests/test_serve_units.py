"""tokq serve in-process (`build_app` + `serve_in_thread` on a tiny llama): the engine thread survives a request
the engine refuses and a step that raises, a non-streaming client that gives up is aborted, batches, stop
strings (streamed and not), and a model without a chat template."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.test_models_vs_hf import make_hf_checkpoint
from tests.test_quantize_cli import save_word_tokenizer

PROMPT = "w1 w2 w3 w4"


def tiny_engine(path, chat_template: str | None = None):
    """A tiny llama with the word tokenizer at `path` (with `chat_template` when given), loaded for serving: fp32,
    a 16 MiB cache, 4 sequences."""
    from tokq.serve.launch import load_engine

    if not path.exists():
        make_hf_checkpoint("llama", path)
        save_word_tokenizer(path)
        if chat_template is not None:
            config = path / "tokenizer_config.json"
            config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": chat_template}))
    return load_engine(str(path), dtype="fp32", device="cpu", kv_memory="16MiB", max_num_seqs=4)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return tiny_engine(tmp_path_factory.mktemp("units") / "tiny")


@pytest.fixture(scope="module")
def http(loaded):
    from tokq.serve.app import build_app
    from tokq.serve.testing import serve_in_thread

    with serve_in_thread(build_app(loaded.engine, loaded.tokenizer, "tiny")) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        yield client


def _complete(http, **body) -> httpx.Response:
    return http.post("/v1/completions", json={"temperature": 0, "ignore_eos": True, **body})


def _metric(http, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name + "".join(f"[{v}]" for k, v in sample.labels.items() if k != "model_name") == name:
                return sample.value
    raise KeyError(name)


def test_a_refused_request_is_400_and_the_loop_carries_on(http):
    bad = _complete(http, prompt=[1, 5000], max_tokens=2)  # 5000 is outside the tiny vocabulary of 211
    assert bad.status_code == 400 and "vocabulary" in bad.json()["error"]["message"]
    assert _complete(http, prompt=PROMPT, max_tokens=3).json()["usage"]["completion_tokens"] == 3


def test_a_step_that_raises_fails_its_requests_only(http, loaded, monkeypatch):
    engine = loaded.engine
    real_step = engine.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected step failure")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    failed = _complete(http, prompt=PROMPT, max_tokens=3)
    assert failed.status_code == 500 and "injected step failure" in failed.json()["error"]["message"]
    assert _complete(http, prompt=PROMPT, max_tokens=3).status_code == 200
    assert http.get("/health").status_code == 200 and engine.blocks.num_used == 0


def test_a_client_that_gives_up_is_aborted(http):
    aborted = _metric(http, "tokq:request_success_total[abort]")
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that stops waiting and hangs up
        http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}, timeout=0.5)
    deadline = time.monotonic() + 30  # the handler polls for the disconnect; the abort lands between steps
    while _metric(http, "tokq:request_success_total[abort]") < aborted + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(http, "tokq:request_success_total[abort]") == aborted + 1
    assert _metric(http, "tokq:kv_cache_usage_perc") == 0


def test_a_batch_of_prompts_has_one_choice_each(http):
    one = [_complete(http, prompt=p, max_tokens=4).json()["choices"][0]["text"] for p in ("w1 w2", "w3 w4 w5")]
    batch = _complete(http, prompt=["w1 w2", "w3 w4 w5"], max_tokens=4).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert [c["text"] for c in batch["choices"]] == one
    assert batch["usage"]["completion_tokens"] == 8


def test_stop_strings_cut_the_text_streamed_or_not(http):
    full = _complete(http, prompt=PROMPT, max_tokens=12).json()["choices"][0]["text"]
    words = full.split()
    stop = words[3] if len(words) > 3 else words[-1]
    cut = full[: full.index(stop)]
    plain = _complete(http, prompt=PROMPT, max_tokens=12, stop=[stop]).json()["choices"][0]
    assert plain["text"] == cut and plain["finish_reason"] == "stop"
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                                      "ignore_eos": True, "stop": stop, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == cut
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_without_a_template_is_400(http):
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "w1"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_read_chat_template_takes_a_file_or_the_template_and_refuses_the_rest(tmp_path):
    from tokq.errors import ConfigError
    from tokq.serve.chat import read_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert read_chat_template(str(path)) == path.read_text()
    assert read_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    with pytest.raises(ConfigError, match=r"--chat-template nosuch.jinja: no such file"):
        read_chat_template("nosuch.jinja")
    path.write_text("{% for m in messages %}\n{{ m['content'] }")
    with pytest.raises(ConfigError, match=r"--chat-template: line 2: .*fix the template"):
        read_chat_template(str(path))
    path.write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_chat_template(str(path))


def test_serve_refuses_a_bad_chat_template_before_loading(tmp_path, capsys):
    from tokq.cli import main

    assert main(["serve", str(tmp_path / "no-model"), "--chat-template", "nosuch.jinja"]) == 2
    assert "--chat-template nosuch.jinja: no such file" in capsys.readouterr().err
