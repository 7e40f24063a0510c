"""KV pools per layer group on a tiny hybrid Gemma 3 (2 sliding layers, window 6, and 2 global ones): outputs
and scores equal the dense full-sequence reference with prompts far beyond the window (chunked prefill with
blocks of 4, preemption in a tiny pool, prefix sharing, static batching); the sliding pool holds only its
window while the global one holds everything; the pools are sized per group (bytes below one pool's); a
prefix hit across pools needs the sliding pool's window blocks; kv-calc's per-group arithmetic."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_engine import reference_greedy, reference_logprobs
from tests.test_models_vs_hf import BASE, CASES, make_hf_checkpoint
from tokq.cli import main
from tokq.engine.block_manager import DROPPED, BlockManager, blocks_held_at_most
from tokq.engine.checkpoint import load_model
from tokq.engine.kv_cache import KVCacheSpec
from tokq.engine.kv_pools import KVPools
from tokq.engine.llm_engine import EngineConfig, LLMEngine
from tokq.engine.sampling import SamplingParams
from tokq.engine.sequence import Sequence

VOCAB = BASE["vocab_size"]
WINDOW = CASES["gemma3"][2]["sliding_window"]  # 6
MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    make_hf_checkpoint("gemma3", path)
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint)


def prompts(lengths, seed=0, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def live(table: list[int]) -> int:
    return sum(b != DROPPED for b in table)


def layer_bytes_per_block(model, block_size: int) -> int:
    """K and V of one layer for one block."""
    return KVCacheSpec.of(model.config, model.dtype, block_size).bytes_per_block // model.config.num_layers


def watch_sliding(engine: LLMEngine) -> list[tuple[int, int, int]]:
    """After every step: (tokens computed, live sliding blocks, live global blocks) per running sequence."""
    seen: list[tuple[int, int, int]] = []
    step = engine.step

    def wrapped():
        out = step()
        for seq in engine.scheduler.running:
            seen.append((seq.num_computed, live(seq.table(1)), live(seq.table(0))))
        return out
    engine.step = wrapped
    return seen


def test_the_model_is_hybrid(model):
    engine = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=128, block_size=4))
    assert [(g.name, g.window, g.layers) for g in engine.layer_groups] == [("full", None, (1, 3)),
                                                                           ("sliding", WINDOW, (0, 2))]


CONFIGS = {
    "chunked-7-tokens-block-4": dict(max_num_batched_tokens=7, block_size=4),
    "chunked-16-block-4-two-seats": dict(max_num_batched_tokens=16, block_size=4, max_num_seqs=2),
    "static-2-block-4": dict(static=True, max_num_seqs=2, block_size=4, max_num_batched_tokens=12),
    "no-prefix-cache-block-8": dict(enable_prefix_caching=False, block_size=8, max_num_batched_tokens=9),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_equals_reference_while_the_sliding_pool_drops(model, name):
    batch = prompts([5, 45, 70, 23, 1])
    expected = [reference_greedy(model, p, MAX_NEW) for p in batch]
    config = CONFIGS[name]
    engine = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=128, **config))
    seen = watch_sliding(engine)
    outputs = engine.generate(batch, GREEDY)
    for i, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == ref, f"{name}: prompt {i} ({len(batch[i])} tokens) diverges from the reference"
    bound = blocks_held_at_most(128, config["block_size"], WINDOW, config["max_num_batched_tokens"])
    assert max(s for _, s, _ in seen) <= bound < max(f for _, _, f in seen), "the sliding pool kept old blocks"
    assert engine.blocks.num_used == 0, "finished sequences must give back every block in every pool"


def test_score_equals_reference(model):
    windows = prompts([60, 2, 33], seed=5)
    engine = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=128, max_num_batched_tokens=8,
                                           block_size=4))
    for decode_from in (None, 20):
        scores = engine.score(windows, topk=3, decode_from=decode_from)
        for window, score in zip(windows, scores, strict=True):
            err = (score.logprobs - reference_logprobs(model, window)).abs().max().item()
            assert err < 1e-4, f"decode_from={decode_from}, {len(window)} tokens: {err:.2e}"
    assert engine.blocks.num_used == 0


def test_preemption_in_a_tiny_pool_keeps_output_exact(model):
    """The smallest budget the engine accepts: one sequence of max_model_len in each pool (16 global blocks,
    the window plus a chunk in the sliding pool); four prompts must take turns."""
    batch = prompts([30, 22, 35, 9], seed=1)
    expected = [reference_greedy(model, p, MAX_NEW) for p in batch]
    per_layer = layer_bytes_per_block(model, 4)
    one_seq = 2 * 16 * per_layer + 2 * blocks_held_at_most(64, 4, WINDOW, 16) * per_layer
    engine = LLMEngine(model, EngineConfig(kv_memory=one_seq, max_model_len=64, block_size=4,
                                           max_num_batched_tokens=16))
    assert engine.group_blocks == [16, blocks_held_at_most(64, 4, WINDOW, 16)] == [16, 7]
    outputs = engine.generate(batch, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    assert engine.metrics().preemptions > 0, "the pool was meant to force preemption"
    assert engine.blocks.num_used == 0


def test_sliding_pool_holds_only_the_window(model):
    """A 100-token prompt read in chunks of 8: at every step the sliding table holds at most the window plus
    a chunk while the global table holds every block; the pools and caches are sized per group, below what
    one pool for every layer would take."""
    per_layer = layer_bytes_per_block(model, 4)
    engine = LLMEngine(model, EngineConfig(kv_memory=64 << 20, max_model_len=128, block_size=4,
                                           max_num_batched_tokens=8, max_num_seqs=4))
    full_seq, sliding_seq = 128 // 4, blocks_held_at_most(128, 4, WINDOW, 8)
    assert sliding_seq == 5
    assert engine.group_blocks == [full_seq * 4 + 1, sliding_seq * 4 + 1]
    for layer, (k, v) in enumerate(engine.caches):
        assert k.shape[0] == v.shape[0] == engine.group_blocks[0 if layer in (1, 3) else 1]
    assert engine.kv_cache_bytes == 2 * per_layer * (full_seq * 4 + 1) + 2 * per_layer * (sliding_seq * 4 + 1)
    single_pool = 4 * per_layer * (full_seq * 4 + 1)  # every layer's blocks from one pool, as before
    assert engine.kv_cache_bytes < 0.6 * single_pool
    seen = watch_sliding(engine)
    prompt = prompts([100], seed=3)[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.token_ids == reference_greedy(model, prompt, 4)
    assert len(seen) >= 12
    for computed, sliding, full in seen:
        assert sliding <= blocks_held_at_most(computed, 4, WINDOW, 8) <= sliding_seq
        assert full == -(-computed // 4)
    assert seen[-1][1] <= 3 < seen[-1][2] == 26  # 103 tokens: 26 global blocks, the sliding window's 2 or 3


def test_prefix_sharing_across_pools_is_exact(model):
    """Prompts sharing a 32-token prefix hit it in both pools; once the sliding pool has reused the blocks
    of the prefix's window, a hit can only be as long as the sliding pool still serves (here none), while
    the global pool still caches the prefix; outputs stay exact either way."""
    shared = prompts([32], seed=7)[0]
    engine = LLMEngine(model, EngineConfig(kv_memory=1 << 20, max_model_len=64, block_size=4,
                                           max_num_batched_tokens=8, max_num_seqs=2))
    engine.generate(prompts([6], seed=8, prefix=shared), GREEDY)  # fills both pools' caches with the prefix
    rest = prompts([3, 11], seed=9, prefix=shared)
    outputs = engine.generate(rest, GREEDY)
    assert [o.token_ids for o in outputs] == [reference_greedy(model, p, MAX_NEW) for p in rest]
    assert [o.metrics.cached_prompt_tokens for o in outputs] == [32, 32]
    # unrelated prompts cycle the small sliding pool (2 x 5 + 1 blocks) but not the global one (2 x 16 + 1)
    sliding, full = engine.blocks.groups[1], engine.blocks.groups[0]
    assert (sliding.num_blocks, full.num_blocks) == (11, 33)
    engine.generate(prompts([13, 13], seed=10), SamplingParams(max_tokens=1, ignore_eos=True))
    late = prompts([5], seed=11, prefix=shared)
    out = engine.generate(late, GREEDY)[0]
    assert out.token_ids == reference_greedy(model, late[0], MAX_NEW)
    assert out.metrics.cached_prompt_tokens == 0
    h = None
    for i in range(8):  # the global pool does still hold all 8 of the prefix's blocks
        chunk = tuple(shared[4 * i: 4 * i + 4])
        h = full._chain(h, chunk)
        assert full.lookup(h, chunk) is not None
    assert engine.blocks.num_used == 0


def seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams())


@pytest.mark.parametrize("evicted,hit", [(4, 28), (6, 0)])
def test_a_hit_needs_only_the_sliding_window_blocks(evicted, hit):
    """Pools (global, window 6) with blocks of 4: a 30-token prompt computed, then freed. With the sliding
    pool's first `evicted` blocks reused, a prompt extending it hits 7 blocks when the sliding pool still
    holds blocks 5 and 6 (what position 28 sees: 23 onwards), else nothing."""
    pools = KVPools([BlockManager(16, 4, group=0), BlockManager(8, 4, group=1, window=WINDOW)])
    a = seq(0, range(30))
    assert pools.admit(a) == 0
    pools.append_slots(a, 30)
    a.num_computed = 30
    pools.computed(a)
    assert pools.drop_outside_windows(a) == 6 and live(a.table(1)) == 2 and live(a.table(0)) == 8
    pools.release(a)
    assert pools.num_used == 0
    other = seq(1, [1000 + i for i in range(4 * evicted)])
    pools.groups[1].append_slots(other, 4 * evicted)  # takes the least recently freed: a's blocks 0 ..
    b = seq(2, list(range(30)) + [7, 7, 7, 7, 7])
    assert pools.admit(b) == hit
    assert b.num_computed == hit and b.num_cached_tokens == hit
    if hit:
        assert live(b.table(0)) == 7 and b.table(1)[:5] == [DROPPED] * 5 and live(b.table(1)) == 2
    else:
        assert b.table(0) == b.table(1) == []
    assert pools.stats.prefix_hit_tokens == hit and pools.stats.prefix_query_tokens == 30 + 35
    pools.undo_admit(b, hit)
    assert pools.stats.prefix_hit_tokens == 0 and b.num_cached_tokens == 0
    assert pools.groups[0].num_used == 0 and pools.groups[1].num_used == evicted


def test_kv_calc_per_group_arithmetic(checkpoint, tmp_path):
    out = tmp_path / "kv.json"
    assert main(["kv-calc", str(checkpoint), "--context", "100", "--seqs", "3", "--kv-memory", "1MiB",
                 "--block-size", "4", "--max-num-batched-tokens", "8", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    per_layer_token = 2 * BASE["num_key_value_heads"] * 32 * 2  # K and V, head_dim 32, bf16
    block = 4 * per_layer_token  # one layer's block
    assert plan["bytes_per_token"] == 4 * per_layer_token
    full, sliding = plan["groups"]
    assert (full["name"], full["window"], full["layers"], full["blocks_per_seq"]) == ("full", None, 2, 25)
    assert (sliding["name"], sliding["window"], sliding["layers"]) == ("sliding", WINDOW, 2)
    assert sliding["blocks_per_seq"] == -(-(WINDOW - 1 + 8) // 4) + 1 == 5
    assert full["bytes_per_seq"] == 25 * 2 * block and sliding["bytes_per_seq"] == 5 * 2 * block
    assert plan["bytes_per_seq_every_layer_full"] == 25 * 4 * block  # every layer keeping every block
    assert plan["bytes_per_seq"] == (25 + 5) * 2 * block and plan["bytes_total"] == 3 * (25 + 5) * 2 * block
    assert plan["pooled_fraction"] == pytest.approx(30 / 50)
    assert plan["blocks_per_seq"] == 25 and plan["pooled_blocks_per_seq"] == 30
    assert plan["max_concurrency"] == (1 << 20) // ((25 + 5) * 2 * block)
    assert full["budget_blocks"] == (1 << 20) * 25 // (60 * block)
    assert sliding["budget_blocks"] == (1 << 20) * 5 // (60 * block)
