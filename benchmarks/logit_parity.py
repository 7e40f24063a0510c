"""Logit agreement of tokq's runtime with HF transformers, fp32: every tiny architecture and the real models.

    python benchmarks/logit_parity.py [--real smollm2-135m gemma3-270m] [--tokens 512]
    python benchmarks/logit_parity.py --no-tiny --real out/smollm2-mixed --out mixed-hf-parity.json   # a quantized one

Prints a table (max |dlogit|, mean |dlogit|, top-1 agreement) and writes
benchmarks/results/logit-parity.json. The tiny models are the test suite's random configs; the
real models run on a real document (a CPython stdlib module's source).
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.test_models_vs_hf import BASE, CASES, make_hf_checkpoint  # noqa: E402
from tokq import __version__  # noqa: E402
from tokq.engine.checkpoint import load_model  # noqa: E402
from tokq.engine.tokenizer import load_tokenizer, model_adds_bos  # noqa: E402
from tokq.zoo import resolve_model  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def agreement(ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    diff = (ours.float() - theirs.float()).abs()
    return {
        "max_abs_dlogit": diff.max().item(),
        "mean_abs_dlogit": diff.mean().item(),
        "top1_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
        "positions": int(ours.shape[-2]),
    }


def tiny_rows() -> list[dict]:
    rows = []
    for case in sorted(CASES):
        with tempfile.TemporaryDirectory() as tmp:
            hf = make_hf_checkpoint(case, tmp)
            ours = load_model(tmp)
            ids = torch.randint(0, BASE["vocab_size"], (2, 64), generator=torch.Generator().manual_seed(7))
            with torch.no_grad():
                rows.append({"model": f"tiny-{case}", **agreement(ours.logits(ids), hf(ids).logits)})
    return rows


def real_row(name: str, tokens: int) -> dict:
    from transformers import AutoModelForCausalLM

    checkpoint = resolve_model(name)
    tokenizer = load_tokenizer(checkpoint)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=model_adds_bos(tokenizer))["input_ids"][:tokens]
    ids = torch.tensor([ids])
    ours = load_model(checkpoint, dtype="fp32")
    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        row = {"model": Path(name).name if Path(name).is_dir() else name, **agreement(ours.logits(ids), hf(ids).logits)}
    qc = (hf.config.to_dict().get("quantization_config") or {})
    if qc:  # a quantized checkpoint: what HF read, and which kernel tokq runs each kind of Linear on
        row["quantization"] = {"format": qc.get("format"), "config_groups": len(qc.get("config_groups") or {}),
                               "ignored": len(qc.get("ignore") or [])}
        row["tokq_kernels"] = sorted({m.name for m in ours.modules() if hasattr(m, "kernel_name")})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real", nargs="*", default=["smollm2-135m", "gemma3-270m"])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--no-tiny", action="store_true", help="skip the tiny random architectures")
    parser.add_argument("--out", default="logit-parity.json", help="file name under benchmarks/results/")
    args = parser.parse_args()
    rows = ([] if args.no_tiny else tiny_rows()) + [real_row(name, args.tokens) for name in args.real]
    print(f"{'model':28s} {'positions':>9s} {'max|dlogit|':>12s} {'mean|dlogit|':>13s} {'top-1':>7s}")
    for r in rows:
        print(f"{r['model']:28s} {r['positions']:9d} {r['max_abs_dlogit']:12.2e} {r['mean_abs_dlogit']:13.2e} "
              f"{100 * r['top1_agreement']:6.2f}%")
    import transformers

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / args.out
    out.write_text(json.dumps({"benchmark": "logit-parity", "tokq_version": __version__, "dtype": "fp32",
                               "transformers": transformers.__version__, "torch": torch.__version__,
                               "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
