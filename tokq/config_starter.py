"""The starter tokq.toml `tokq init` writes: every table, commented (tokq.config reads and checks it)."""

from __future__ import annotations

import re

_TEMPLATE = '''# tokq.toml: what `tokq gate` checks before a quantized build may ship.
# Paths are relative to this file. Every key below is optional except [base] model.

[base]
model = @MODEL@        # zoo name (`tokq models list`) or a checkpoint directory
dtype = "auto"                # compute dtype: auto (bf16 on CPU, fp16 on CUDA), fp32, bf16, fp16

[variants]
# A checkpoint, or a recipe `tokq quantize` can rebuild (method, scheme, group_size, ...):
int4 = { path = "tokq_out/@SHORT@-awq-int4", recipe = { method = "awq", scheme = "w4a16"@GROUP@ } }
# w8a8 = { recipe = { method = "smoothquant", scheme = "w8a8-int8" } }

[data.@DATA_NAME@]
@DATA_LINE@
window = 2048                          # tokens per scored window
sample_windows = 16                    # windows spread evenly over the documents
probe_repeats = 2                      # passkey probes per (context, depth): 2 contexts x 5 depths x 2 = 20
# max_doc_mb = 64                      # skip a document (a file, a .jsonl line, a table row) over 64 MiB
# max_file_mb = 1024                   # skip a file holding more than 1024 MiB, decompressed

[bench]
# Sized for a 2-core CI runner: one pass of this workload takes a few seconds there, so 60 s holds enough paired
# passes to decide the speed rules (512 / 256 / 16 took 47 s a pass: 2 passes, every speed rule inconclusive).
# On a GPU or a larger runner, make it your serving workload (e.g. gen_len = 256, concurrency = 16).
prompt_len = 512
gen_len = 64
concurrency = 4
# arrival_rate = 4.0          # Poisson arrivals per second (default: all at once)
max_seconds = 60              # paired speed experiment per variant: base and variant alternate every few steps;
                              # a speed rule passes when its whole 95% interval meets it, fails when the whole
                              # interval misses it, and is "inconclusive" (exit 3) otherwise

[gate.quality]
# A rule passes when the whole 95% confidence interval meets it, fails when the whole interval misses it,
# and is inconclusive (exit 3) when the interval holds it
# (threshold_on = "point": when the estimate does; the CI is still reported).
threshold_on = "bound"
max_kl = 0.05                 # mean KL(base || variant), or per bucket: { overall = 0.05, "4K-8K" = 0.1 }
min_top1 = 0.85               # top-1 agreement with the base
max_ppl_ratio = 1.10          # perplexity ratio variant / base
max_flip_rate = 0.20          # passkey probes the base answers and the variant misses (exact upper bound:
                              # 0.20 needs >= 17 probes even with no flip; the gate refuses fewer)

[gate.speed]
min_tpot_speedup = 1.2        # TPOT(base) / TPOT(variant) on the [bench] workload
max_ttft_p50_ratio = 1.5      # median TTFT variant / base (prefill regressions)
# min_throughput_speedup = 1.0
# max_memory_ratio = 0.8       # (weights + KV cache) variant / base
# max_weights_ratio = 0.5      # weights alone
'''

_BUILTIN_LINES = {
    "default": """builtin = "default"                    # tokq's own long-document set, built on each machine at first use;
                                       # for yours: path = "docs" (a folder relative to this file: txt, md,
                                       # rst, jsonl, .gz; parquet, arrow)""",
    "code": """builtin = "code"                       # tokq's code set (PyTorch and transformers sources), built on each
                                       # machine at first use; for yours: path = "src" (a folder relative
                                       # to this file: txt, md, rst, jsonl, .gz; parquet, arrow)""",
}


def starter(model: str = "smollm2-135m", data: str = "default") -> str:
    """The starter for `model` (a zoo name gets its int4 group size from the zoo's table; another model the 128 that
    quantize falls back from where a layer does not divide) judged on `data`: a built-in set's name, or a folder
    relative to the file."""
    from tokq.zoo_catalog import ZOO

    zoo = ZOO.get(model)
    short = zoo.short_name if zoo is not None else re.sub(r"[^A-Za-z0-9._-]+", "-", model.rstrip("/").rsplit("/", 1)[-1])
    group = f", group_size = {zoo.int4_group_size}" if zoo is not None else ""
    if data in _BUILTIN_LINES:
        data_name, data_line = data, _BUILTIN_LINES[data]
    else:
        data_name = "docs"
        data_line = (f'path = {_toml_string(data)}' + " " * max(1, 39 - len(_toml_string(data)) - 7)
                     + "# your documents, relative to this file (txt, md, rst, jsonl, .gz; parquet, arrow)")
    return (_TEMPLATE.replace("@MODEL@", _toml_string(model)).replace("@SHORT@", short).replace("@GROUP@", group)
            .replace("@DATA_NAME@", data_name).replace("@DATA_LINE@", data_line))


def _toml_string(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


STARTER = starter()  # the default starter: SmolLM2-135M judged on tokq's default set
