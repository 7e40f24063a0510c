"""`tokq serve` end to end: the real CLI in a subprocess on a tiny llama, driven by the official `openai` client.

Every answer is checked against tokq's engine run in-process on the same checkpoint (fp32, greedy):
texts, generated logprobs, prompt logprobs (= LLMEngine.score within 1e-4). Also: streaming (deltas add
up to the text, the usage chunk), chat through the tokenizer's chat template, vLLM's 400s and 404, a
streaming client that hangs up (its request is aborted and the KV cache is empty again), 503 +
Retry-After when --max-queue is reached, and SIGTERM draining an in-flight request before exit 0.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import openai
import pytest

from tests.serve_process import ServeProcess
from tests.test_models_vs_hf import make_hf_checkpoint
from tests.test_quantize_cli import save_word_tokenizer

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w9{% endif %}"
PROMPT = "w1 w2 w3 w4 w5 w6 w7 w8"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serve") / "tiny"
    make_hf_checkpoint("llama", path)
    save_word_tokenizer(path)
    config = path / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": CHAT_TEMPLATE}))
    return path


def Server(checkpoint: Path, home: Path, *extra: str) -> ServeProcess:
    """This file's server: a 16 MiB cache, 4 sequences, served as "tiny"."""
    return ServeProcess(checkpoint, "--kv-memory", "16MiB", "--max-num-seqs", "4", "--served-model-name", "tiny",
                        *extra, home=home, start_timeout_s=120)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    srv = Server(checkpoint, tmp_path_factory.mktemp("home"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(checkpoint):
    from tokq import LLM

    return LLM(checkpoint, dtype="fp32", device="cpu", kv_memory="16MiB", max_num_seqs=4)


def _greedy(**kw):
    from tokq import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def test_models_and_health(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["max_model_len"] == 512
    assert httpx.get(server.url + "/health").status_code == 200


def test_completion_text_and_logprobs_equal_the_engine(client, llm):
    expected = llm.generate(PROMPT, _greedy(max_tokens=12, logprobs=3))[0]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = got.choices[0]
    assert choice.model_extra["token_ids"] == expected.token_ids
    assert choice.text == expected.text and choice.finish_reason == "length"
    assert got.usage.completion_tokens == 12 and got.usage.prompt_tokens == len(expected.prompt_token_ids)
    lp = choice.logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    # tokens as "token_id:<id>": several ids of the tiny model decode to the same (empty) text
    by_id = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3,
                                      extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp_ids = by_id.choices[0].logprobs
    assert lp_ids.tokens == [f"token_id:{t}" for t in expected.token_ids]
    for top, entry in zip(lp_ids.top_logprobs, expected.logprobs, strict=True):
        want = {f"token_id:{t}": v for t, v in [*entry.top, (entry.token_id, entry.logprob)]}
        assert top == pytest.approx(want, abs=1e-4)  # the top 3, plus the sampled token (in them when greedy)
    assert lp.text_offset == sorted(lp.text_offset)


def test_prompt_logprobs_equal_engine_score(client, llm):
    ids = llm.tokenizer(PROMPT)["input_ids"]
    score = llm.score([ids], topk=5)[0]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, extra_body={"prompt_logprobs": 5})
    choice = got.choices[0]
    assert choice.model_extra["prompt_token_ids"] == ids
    entries = choice.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for i in range(1, len(ids)):
        entry = entries[i]
        assert entry[str(ids[i])]["logprob"] == pytest.approx(score.logprobs[i - 1].item(), abs=1e-4)
        top = {int(t): v for t, v in entry.items() if v["rank"] <= 5}
        assert sorted(top) == sorted(score.topk_ids[i - 1].tolist())
        for t, lp in zip(score.topk_ids[i - 1].tolist(), score.topk_logprobs[i - 1].tolist(), strict=True):
            assert top[t]["logprob"] == pytest.approx(lp, abs=1e-4)


def test_echo_with_logprobs_reports_the_prompt(client, llm):
    ids = llm.tokenizer(PROMPT)["input_ids"]
    score = llm.score([ids])[0]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, echo=True,
                                    logprobs=1, extra_body={"ignore_eos": True})
    choice = got.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 2 and lp.tokens[:len(ids)] == PROMPT.split()
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(score.logprobs.tolist(), abs=1e-4)


def test_streaming_adds_up_to_the_text(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_goes_through_the_chat_template(client, llm):
    messages = [{"role": "user", "content": "w3 w4 w5"}]
    # the template renders "w3 w4 w5 w9": the same tokens as a completion of that prompt
    expected = llm.generate("w3 w4 w5 w9", _greedy(max_tokens=6))[0].text
    got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == expected and got.choices[0].message.role == "assistant"
    content = got.choices[0].logprobs.content
    assert len(content) == 6 and all(len(c.top_logprobs) == 2 for c in content)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected


@pytest.mark.parametrize("kw, param", [
    (dict(max_tokens=600), "max_tokens"),  # 1 + 600 tokens > the context of 512
    (dict(logprobs=21), "logprobs"),  # > --max-logprobs 20
    (dict(max_tokens=0, extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
    (dict(n=2), "n"),
])
def test_bad_requests_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt="w1", **kw)
    assert exc.value.status_code == 400 and exc.value.body["param"] == param and exc.value.body["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="nope", prompt="w1", max_tokens=1)
    assert exc.value.body["type"] == "NotFoundError" and "nope" in exc.value.body["message"]


def test_a_client_that_hangs_up_is_aborted(server, client):
    before = server.wait_idle()
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=500, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _chunk in enumerate(stream):
        if i == 2:
            break
    assert server.metrics()["tokq:kv_cache_usage_perc"] > 0  # still generating: its blocks are held
    stream.close()
    after = server.wait_idle()
    assert after["tokq:request_success_total[abort]"] == before["tokq:request_success_total[abort]"] + 1
    assert after["tokq:generation_tokens_total"] - before["tokq:generation_tokens_total"] < 500


def test_metrics_text_parses(server, client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    m = server.metrics()
    for name in ("tokq:time_to_first_token_seconds_count", "tokq:time_per_output_token_seconds_count",
                 "tokq:inter_token_latency_seconds_count", "tokq:num_requests_running", "tokq:num_requests_waiting",
                 "tokq:kv_cache_usage_perc", "tokq:num_preemptions_total", "tokq:request_success_total[length]"):
        assert name in m, name
    assert m["tokq:time_to_first_token_seconds_count"] >= 1 and m["tokq:request_success_total[length]"] >= 1


def test_full_queue_is_503_and_sigterm_drains(checkpoint, tmp_path):
    srv = Server(checkpoint, tmp_path, "--max-queue", "1")
    try:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        with httpx.Client(base_url=srv.url, timeout=120) as http, http.stream("POST", "/v1/completions",
                                                                             json=body) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert len(json.loads(first[6:])["choices"][0]["token_ids"]) == 1
            busy = httpx.post(srv.url + "/v1/completions", json={"prompt": "w1", "max_tokens": 1}, timeout=30)
            assert busy.status_code == 503 and int(busy.headers["Retry-After"]) >= 1
            assert busy.json()["error"]["type"] == "ServiceUnavailableError"
            srv.proc.send_signal(signal.SIGTERM)  # mid-stream: the request must still finish
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: ")
                    and line != "data: [DONE]"]
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"][0]["token_ids"]) for c in rest) == 59  # all 60 tokens: 1 before SIGTERM
        assert srv.proc.wait(60) == 0, srv.log.read_text()
    finally:
        srv.stop()


def test_chat_template_and_kv_cache_dtype_flags_as_vllm_names_them(checkpoint, llm, tmp_path):
    """--chat-template FILE replaces the tokenizer's template; --kv-cache-dtype is vLLM's name of --kv-dtype."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}w7 {{ m['content'] }} {% endfor %}w8")
    (tmp_path / "home").mkdir()
    srv = Server(checkpoint, tmp_path / "home", "--chat-template", str(template), "--kv-cache-dtype", "auto")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
        got = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w3 w4"}],
                                             max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].message.content == llm.generate("w7 w3 w4 w8", _greedy(max_tokens=5))[0].text
    finally:
        srv.stop()


def test_unknown_routes_answer_openai_error_json_and_version_answers(server):
    for method, path in (("GET", "/tokenize"), ("POST", "/v1/embeddings"), ("DELETE", "/v1/models")):
        got = httpx.request(method, server.url + path, timeout=10)
        error = got.json()["error"]
        assert got.status_code in (404, 405) and error["code"] == got.status_code, (path, got.text)
        assert f"{method} {path}: no such route" in error["message"]
    from tokq import __version__

    assert httpx.get(server.url + "/version", timeout=10).json() == {"version": __version__}
