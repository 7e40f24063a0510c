"""Sampling: greedy, seeded reproducibility, the sampled distribution, top-k/top-p, validation, stops."""

import math

import pytest
import torch

from tokq.engine.sampling import (
    SamplingError,
    SamplingParams,
    check_stop,
    make_generator,
    processed_logprobs,
    sample,
    truncate_at_stop_string,
)
from tokq.errors import TokqError

DRAWS = 20000


def _draw_counts(logits: torch.Tensor, params: SamplingParams, draws: int = DRAWS, seed: int = 0) -> torch.Tensor:
    """Counts per token over `draws` rows of the same logits, all on the global RNG in one batch."""
    torch.manual_seed(seed)
    batch = logits[None, :].expand(draws, -1)
    tokens = sample(batch, [params] * draws, [None] * draws)
    return torch.bincount(tokens, minlength=logits.shape[0]).double()


def _max_z(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Largest per-bin deviation in standard errors of a binomial count (bins with p=0 must be empty)."""
    n = counts.sum()
    p = expected_probs.double()
    assert counts[p == 0].sum() == 0, f"sampled tokens outside the support: {counts.tolist()}"
    z = (counts - n * p)[p > 0] / (n * p * (1 - p)).sqrt()[p > 0]
    return float(z.abs().max())


def _seeded_row(seed: int, i: int, vocab: int = 50) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed * 1000 + i))


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_equals_argmax() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=1)] * 3
    assert torch.equal(sample(logits, params, [None] * 6), logits.argmax(dim=-1))


def test_greedy_ties_pick_lowest_index() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert sample(logits, [SamplingParams()], [None]).item() == 1
    lp = processed_logprobs(logits, [SamplingParams()])
    assert lp[0, 1] == 0 and torch.isinf(lp[0, [0, 2, 3]]).all()


def test_processed_logprobs_greedy_row_is_one_hot_and_rows_independent() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [0.1, 2.0, -1.0, 0.5]])
    lp = processed_logprobs(logits, [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)])
    assert lp.dtype == torch.float32
    assert torch.equal(lp[0], torch.tensor([-math.inf, 0.0, -math.inf, -math.inf]))
    # The sampled row next to it is the plain softmax, untouched by the greedy row.
    torch.testing.assert_close(lp[1], torch.log_softmax(logits[1], dim=-1))


def test_top_k_1_is_greedy_at_any_temperature() -> None:
    params = SamplingParams(temperature=1.5, top_k=1)
    assert params.greedy and not SamplingParams(temperature=1.5, top_k=2).greedy
    lp = processed_logprobs(torch.tensor([[0.0, 1.0, 0.9]]), [params])
    assert torch.equal(lp[0], torch.tensor([-math.inf, 0.0, -math.inf]))


# --- seeded reproducibility ---------------------------------------------------------------------


def _seeded_sequence(seed: int, steps: int, batch_with_others: bool) -> list[int]:
    """The tokens one seeded request draws over `steps` steps, alone or at row 2 of a mixed batch."""
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    gen = make_generator(seed, "cpu")
    others = [
        (SamplingParams(temperature=0.9, seed=7), make_generator(7, "cpu")),
        (SamplingParams(temperature=1.2), None),
        (SamplingParams(), None),
    ]
    tokens = []
    for step in range(steps):
        row = _seeded_row(seed, step)
        if not batch_with_others:
            out = sample(row[None, :], [mine], [gen])
            tokens.append(int(out[0]))
            continue
        other_rows = [_seeded_row(99, step * 3 + k) for k in range(3)]
        logits = torch.stack([other_rows[0], other_rows[1], row, other_rows[2]])
        params = [others[0][0], others[1][0], mine, others[2][0]]
        gens = [others[0][1], others[1][1], gen, others[2][1]]
        tokens.append(int(sample(logits, params, gens)[2]))
    return tokens


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    alone = _seeded_sequence(1234, 30, batch_with_others=False)
    assert alone == _seeded_sequence(1234, 30, batch_with_others=False)
    torch.manual_seed(5)  # the global RNG state must not matter to a seeded row
    assert alone == _seeded_sequence(1234, 30, batch_with_others=True)
    # A different seed draws a different sequence (50 near-uniform tokens, 30 steps: a match is ~impossible).
    assert alone != _seeded_sequence(4321, 30, batch_with_others=False)


def test_make_generator() -> None:
    assert make_generator(None, "cpu") is None
    a, b = make_generator(3, "cpu"), make_generator(3, torch.device("cpu"))
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_sample_rejects_mismatched_lengths() -> None:
    with pytest.raises(SamplingError, match="generators"):
        sample(torch.zeros(2, 4), [SamplingParams(temperature=1.0)] * 2, [None])


# --- the sampled distribution -------------------------------------------------------------------


def test_temperature_frequencies_match_softmax() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    counts = _draw_counts(logits, SamplingParams(temperature=0.7))
    assert _max_z(counts, torch.softmax(logits / 0.7, dim=-1)) < 4.5
    # The test has power: the same draws are far from the untempered distribution.
    assert _max_z(counts, torch.softmax(logits, dim=-1)) > 10


def test_seeded_rows_sample_the_same_distribution() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.5])
    params = SamplingParams(temperature=0.7, seed=11)
    gen = make_generator(11, "cpu")
    tokens = sample(logits[None, :].expand(4000, -1), [params] * 4000, [gen] * 4000)
    counts = torch.bincount(tokens, minlength=5).double()
    assert _max_z(counts, torch.softmax(logits / 0.7, dim=-1)) < 4.5


def test_top_k_never_leaves_top_k_and_renormalizes() -> None:
    logits = torch.tensor([0.0, 2.0, -1.0, 1.2, 0.9])
    params = SamplingParams(temperature=1.0, top_k=2)
    expected = torch.zeros(5)
    expected[[1, 3]] = torch.softmax(logits[[1, 3]], dim=-1)
    torch.testing.assert_close(processed_logprobs(logits[None, :], [params])[0].exp(), expected)
    counts = _draw_counts(logits, params)
    assert counts[[0, 2, 4]].sum() == 0
    assert _max_z(counts, expected) < 4.5


def _kept(probs: list[float], **kw: float) -> list[int]:
    logits = torch.tensor(probs).log()[None, :]
    kw.setdefault("temperature", 1.0)
    lp = processed_logprobs(logits, [SamplingParams(**kw)])
    return torch.isfinite(lp[0]).nonzero().flatten().tolist()


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.4, [0]), (0.5, [0]), (0.6, [0, 1]), (0.8, [0, 1]), (0.81, [0, 1, 2]), (0.96, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_the_minimal_nucleus(top_p: float, kept: list[int]) -> None:
    assert _kept([0.5, 0.3, 0.15, 0.05], top_p=top_p) == kept


@pytest.mark.parametrize(("probs", "top_p"), [([0.85, 0.1, 0.05], 0.85), ([0.6, 0.35, 0.05], 0.6)])
def test_top_p_exact_mass_survives_float32_rounding(probs: list[float], top_p: float) -> None:
    # softmax(log(probs)) puts the first token's float32 probability a rounding step below top_p; it
    # still reaches top_p on paper, so the nucleus is that one token.
    assert _kept(probs, top_p=top_p) == [0]


def test_top_k_ties_keep_the_lowest_indices() -> None:
    assert _kept([0.4, 0.2, 0.2, 0.2], top_k=2) == [0, 1]
    assert _kept([0.2, 0.2, 0.4, 0.2], top_k=3) == [0, 1, 2]


def test_top_p_works_on_unsorted_vocab_and_renormalizes() -> None:
    probs = [0.15, 0.5, 0.05, 0.3]
    assert _kept(probs, top_p=0.6) == [1, 3]
    lp = processed_logprobs(torch.tensor(probs).log()[None, :], [SamplingParams(temperature=1.0, top_p=0.6)])
    torch.testing.assert_close(lp[0].exp(), torch.tensor([0.0, 0.625, 0.0, 0.375]))


def test_top_p_applies_after_top_k_and_temperature() -> None:
    # Top-k=2 renormalizes [0.5, 0.3] to [0.625, 0.375]: 0.625 alone reaches top_p=0.6.
    assert _kept([0.5, 0.3, 0.15, 0.05], top_k=2, top_p=0.6) == [0]
    # Temperature 2 flattens [0.5, 0.3, 0.15, 0.05] to about [0.38, 0.29, 0.21, 0.12]: top_p=0.7 then
    # needs three tokens where at temperature 1 two reach it.
    assert _kept([0.5, 0.3, 0.15, 0.05], top_p=0.7) == [0, 1]
    assert _kept([0.5, 0.3, 0.15, 0.05], temperature=2.0, top_p=0.7) == [0, 1, 2]


def test_top_p_frequencies_match_nucleus() -> None:
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3, 0.0001])
    counts = _draw_counts(probs.log(), SamplingParams(temperature=1.0, top_p=0.6))
    assert _max_z(counts, torch.tensor([0.0, 0.625, 0.0, 0.375, 0.0])) < 4.5


# --- validation ---------------------------------------------------------------------------------


def test_valid_params_pass_and_lists_become_tuples() -> None:
    params = SamplingParams(
        max_tokens=8, temperature=0.7, top_k=5, top_p=0.9, seed=1, stop_token_ids=[2, 3], stop=["\n\n"], min_tokens=8
    )
    params.validate()
    assert params.stop_token_ids == (2, 3) and params.stop == ("\n\n",)
    assert SamplingParams(stop="END").stop == ("END",)
    hash(params)
    SamplingParams(max_tokens=0).validate()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", -1),
        ("max_tokens", 2.5),
        ("temperature", -1.0),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", "hot"),
        ("top_k", -1),
        ("top_k", 1.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("seed", 1.5),
        ("min_tokens", -1),
        ("min_tokens", 17),
        ("stop_token_ids", (-1,)),
        ("stop_token_ids", ("a",)),
        ("stop", ("",)),
        ("stop", (3,)),
    ],
)
def test_validate_names_the_bad_parameter(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(SamplingError) as info:
        params.validate()
    message = str(info.value)
    assert message.startswith(f"{field}=") and "must" in message and "\n" not in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, TokqError)


def test_validate_min_tokens_message_gives_the_range() -> None:
    with pytest.raises(SamplingError, match=r"min_tokens=9: .*max_tokens=4"):
        SamplingParams(max_tokens=4, min_tokens=9).validate()
    with pytest.raises(SamplingError, match=r"temperature=-1.0: .*>= 0 \(0 = greedy\)"):
        SamplingParams(temperature=-1.0).validate()


# --- stops --------------------------------------------------------------------------------------

PROMPT = [101, 102, 103]
EOS = 2


def test_check_stop_length() -> None:
    params = SamplingParams(max_tokens=3)
    assert check_stop(PROMPT + [5, 6], 3, params, EOS) is None
    assert check_stop(PROMPT + [5, 6, 7], 3, params, EOS) == "length"
    assert check_stop(PROMPT, 3, SamplingParams(max_tokens=0), EOS) == "length"


def test_check_stop_eos_and_ignore_eos() -> None:
    assert check_stop(PROMPT + [5, EOS], 3, SamplingParams(), EOS) == "stop"
    assert check_stop(PROMPT + [5, EOS], 3, SamplingParams(ignore_eos=True), EOS) is None
    assert check_stop(PROMPT + [5, EOS], 3, SamplingParams(), None) is None
    # EOS on the last allowed token is the model's stop, not the budget's.
    assert check_stop(PROMPT + [5, EOS], 3, SamplingParams(max_tokens=2), EOS) == "stop"
    assert check_stop(PROMPT + [5, EOS], 3, SamplingParams(max_tokens=2, ignore_eos=True), EOS) == "length"


def test_check_stop_token_ids_apply_even_with_ignore_eos() -> None:
    params = SamplingParams(stop_token_ids=[7, 8], ignore_eos=True)
    assert check_stop(PROMPT + [5, 8], 3, params, EOS) == "stop"
    assert check_stop(PROMPT + [8, 5], 3, params, EOS) is None  # only the latest token counts


def test_check_stop_string() -> None:
    params = SamplingParams(stop=["###"])
    assert check_stop(PROMPT + [5, 6], 3, params, EOS, text_tail="answer ##") is None
    assert check_stop(PROMPT + [5, 6], 3, params, EOS, text_tail="answer ### more") == "stop"
    assert check_stop(PROMPT + [5, 6], 3, params, EOS) is None


def test_check_stop_prompt_tokens_do_not_count() -> None:
    # The prompt ends in EOS and a stop id; nothing has been generated yet.
    assert check_stop([1, EOS], 2, SamplingParams(stop_token_ids=[1]), EOS) is None


def test_min_tokens_holds_back_everything_but_length() -> None:
    params = SamplingParams(max_tokens=5, min_tokens=3, stop_token_ids=[9], stop=["x"])
    assert check_stop(PROMPT + [EOS], 3, params, EOS) is None
    assert check_stop(PROMPT + [5, 9], 3, params, EOS, text_tail="x") is None
    assert check_stop(PROMPT + [5, 6, EOS], 3, params, EOS) == "stop"
    assert check_stop(PROMPT + [5, 6, 9], 3, params, EOS) == "stop"
    assert check_stop(PROMPT + [5, 6, 7], 3, params, EOS, text_tail="abx") == "stop"
    same = SamplingParams(max_tokens=2, min_tokens=2)
    assert check_stop(PROMPT + [5, 6], 3, same, EOS) == "length"


def test_truncate_at_stop_string() -> None:
    assert truncate_at_stop_string("hello world", ["o w"]) == ("hell", True)
    assert truncate_at_stop_string("a END b STOP c", ("STOP", "END")) == ("a ", True)  # earliest wins
    assert truncate_at_stop_string("no stop here", ["###"]) == ("no stop here", False)
    assert truncate_at_stop_string("###start", ["###"]) == ("", True)
    assert truncate_at_stop_string("text", []) == ("text", False)
