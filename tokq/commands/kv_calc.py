"""`tokq kv-calc MODEL --context L --seqs N`: the KV cache arithmetic, and the concurrency a budget allows."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from tokq import __version__

console = Console(stderr=True)


def kv_plan(config, kv_dtype, context: int, seqs: int, block_size: int, budget: int | None,
            chunk: int = 2048) -> dict:
    """Every number kv-calc prints, as data (bytes).

    The engine keeps one pool per group of layers sharing a window (engine/kv_pools.py): a sliding group
    holds at most its window plus one step's `chunk` (--max-num-batched-tokens) of each sequence, a global
    one the whole context. `bytes_per_seq`, `bytes_total` and the budget's numbers are the engine's (pooled);
    `bytes_per_seq_every_layer_full` is what one sequence would take if every layer kept every block (what
    the engine held for a hybrid model such as Gemma 3 before it had a pool per group). `groups` has each
    group's share."""
    from tokq.dtypes import dtype_name
    from tokq.engine.block_manager import blocks_held_at_most
    from tokq.engine.kv_cache import KVCacheSpec, group_spec, layer_groups, split_budget

    spec = KVCacheSpec.of(config, kv_dtype, block_size)
    per_token = spec.bytes_per_token
    without_gqa = per_token * config.num_heads // config.num_kv_heads
    blocks_per_seq = spec.blocks_for(context)
    every_layer_full = blocks_per_seq * spec.bytes_per_block
    groups = layer_groups(config)
    specs = [group_spec(spec, g) for g in groups]
    held = [blocks_held_at_most(context, block_size, g.window, chunk) for g in groups]
    per_seq = sum(n * s.bytes_per_block for n, s in zip(held, specs, strict=True))
    rows = [{"name": g.name, "window": g.window, "layers": len(g.layers), "layer_ids": list(g.layers),
             "bytes_per_token": s.bytes_per_token, "blocks_per_seq": n, "bytes_per_seq": n * s.bytes_per_block,
             "bytes_total": n * s.bytes_per_block * seqs}
            for g, s, n in zip(groups, specs, held, strict=True)]
    plan = {
        "layers": config.num_layers, "kv_heads": config.num_kv_heads, "heads": config.num_heads,
        "head_dim": config.head_dim, "kv_dtype": dtype_name(kv_dtype), "bytes_per_value": spec.bytes_per_value,
        "bytes_per_token": per_token, "bytes_per_token_without_gqa": without_gqa, "block_size": block_size,
        "context": context, "seqs": seqs, "blocks_per_seq": blocks_per_seq, "bytes_per_seq": per_seq,
        "bytes_total": per_seq * seqs, "budget_bytes": budget,
        "max_num_batched_tokens": chunk, "groups": rows, "pooled_blocks_per_seq": sum(held),
        "bytes_per_seq_every_layer_full": every_layer_full,
        "pooled_fraction": per_seq / every_layer_full,
    }
    if budget is not None:
        blocks = split_budget(budget, held, [s.bytes_per_block for s in specs])
        for row, n in zip(rows, blocks, strict=True):
            row["budget_blocks"] = n
        # whole sequences that fit every pool at once; tokens: what the first pool (the global layers' when
        # the model has any) holds
        plan.update(budget_blocks=sum(blocks), max_concurrency=budget // per_seq,
                    max_tokens_in_budget=blocks[0] * block_size)
    return plan


def kv_calc_cmd(
    model: str = typer.Argument(..., help="Checkpoint directory, zoo name or tokq.toml variant (only its config is read)."),
    context: int = typer.Option(..., "--context", help="Tokens per sequence (prompt + generated)."),
    seqs: int = typer.Option(1, "--seqs", help="Sequences held at once."),
    kv_dtype: str = typer.Option("bf16", "--kv-dtype", help="KV cache dtype: fp32, bf16, fp16, fp8."),
    block_size: int = typer.Option(16, "--block-size", help="Tokens per KV block."),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens",
                                               help="Token budget of one step (a sliding-window layer group "
                                                    "holds its window plus one step's tokens)."),
    kv_memory: str = typer.Option(None, "--kv-memory",
                                  help="A KV budget (e.g. 4GiB) to turn into a max concurrency (default: 80% of "
                                       "this device's free memory)."),
    device: str = typer.Option("auto", "--device", help="Device whose memory sets the default budget: auto, cpu, cuda."),
    json_path: Path = typer.Option(None, "--json", help="Also write the numbers as JSON to this path."),
) -> None:
    """Print the KV cache size of MODEL for N sequences of L tokens (with GQA) and the concurrency a budget allows."""
    import torch

    from tokq.engine.config import read_config
    from tokq.engine.kv_cache import default_kv_budget, format_bytes, kv_dtype_named, parse_bytes
    from tokq.errors import ConfigError
    from tokq.reports.json_io import check_json_target, write_json
    from tokq.runtime import resolve_device
    from tokq.zoo import resolve_model

    check_json_target(json_path)
    if context < 1 or seqs < 1 or block_size < 1 or max_num_batched_tokens < 1:
        raise ConfigError(f"--context {context}, --seqs {seqs}, --block-size {block_size}, --max-num-batched-tokens "
                          f"{max_num_batched_tokens}: all must be >= 1")
    config = read_config(resolve_model(model))
    dtype = kv_dtype_named(kv_dtype, torch.bfloat16)  # 'auto': the 16-bit cache models are served with
    if context > config.max_position_embeddings:
        console.print(f"[yellow]warning:[/] --context {context} is beyond {model}'s context of "
                      f"{config.max_position_embeddings} tokens")
    budget = parse_bytes(kv_memory) if kv_memory else default_kv_budget(resolve_device(device))
    plan = kv_plan(config, dtype, context, seqs, block_size, budget, max_num_batched_tokens)
    b = plan
    out = Console()
    out.print(f"[bold]{model}[/]: KV cache in {b['kv_dtype']}, blocks of {block_size} tokens")
    out.print(f"  bytes per token = 2 (K and V) x {b['layers']} layers x {b['kv_heads']} KV heads x {b['head_dim']} "
              f"head dim x {b['bytes_per_value']} B = [bold]{format_bytes(b['bytes_per_token'])}[/]"
              f"  (GQA {b['heads']}/{b['kv_heads']}: without it {format_bytes(b['bytes_per_token_without_gqa'])})")
    if len(b["groups"]) == 1:
        out.print(f"  one sequence of {context} tokens = {b['pooled_blocks_per_seq']} blocks held at once = "
                  f"[bold]{format_bytes(b['bytes_per_seq'])}[/]")
    else:
        for g in b["groups"]:
            reach = "every block" if g["window"] is None else f"window {g['window']} + one step's tokens"
            out.print(f"  {g['name']} layers ({g['layers']}, {reach}): {g['blocks_per_seq']} blocks = "
                      f"{format_bytes(g['bytes_per_seq'])} per sequence")
        out.print(f"  one sequence of {context} tokens = [bold]{format_bytes(b['bytes_per_seq'])}[/] "
                  f"({b['pooled_fraction']:.1%} of {format_bytes(b['bytes_per_seq_every_layer_full'])} with every "
                  f"layer keeping every block)")
    out.print(f"  {seqs} sequences = [bold]{format_bytes(b['bytes_total'])}[/]")
    source = f"--kv-memory {kv_memory}" if kv_memory else "80% of this device's free memory"
    table = Table(title=f"concurrency in {format_bytes(budget)} ({source})")
    for col in ("context", "blocks per seq", "max sequences", "tokens in budget"):
        table.add_column(col, justify="right")
    for ctx in sorted({context, *(c for c in (512, 2048, 8192, 32768) if c <= config.max_position_embeddings)}):
        row = kv_plan(config, dtype, ctx, seqs, block_size, budget, max_num_batched_tokens)
        table.add_row(str(ctx), str(row["pooled_blocks_per_seq"]), str(row["max_concurrency"]),
                      str(row["max_tokens_in_budget"]))
    out.print(table)
    if plan["max_concurrency"] < seqs:
        out.print(f"[yellow]{seqs} sequences of {context} tokens need {format_bytes(b['bytes_total'])}; the budget holds "
                  f"{plan['max_concurrency']}[/]")
    if json_path:
        write_json(json_path, {"tokq_version": __version__, "command": "kv-calc", "model": model, **plan})

