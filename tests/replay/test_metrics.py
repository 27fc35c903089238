"""tau aggregation on hand-computed cases (dflash_eval.replay.metrics is the only place tau is computed)."""

from __future__ import annotations

import math

import pytest

from dflash_eval.replay.metrics import aggregate, position_bin_labels, sample_tau


def test_macro_and_micro_differ_and_are_exact():
    # response A: 2 steps committing 4 + 4 -> mean 4.0; response B: 6 steps of 1 -> mean 1.0
    s = aggregate([[4, 4], [1, 1, 1, 1, 1, 1]], block_size=4)
    assert s.tau == 2.5  # (4.0 + 1.0) / 2, the reference's mean of per-response means
    assert s.tau_tokens_per_step == 14 / 8  # pooled: 14 tokens over 8 verify steps
    assert (s.n_samples, s.n_skipped, s.verify_steps, s.committed_tokens) == (2, 0, 8, 14)
    assert s.histogram == {1: 6, 2: 0, 3: 0, 4: 2}


def test_skipped_responses_are_counted_not_averaged():
    s = aggregate([[3, 1], [], [1, 1, 1, 1]], block_size=3)
    assert s.tau == 1.5  # (2.0 + 1.0) / 2; the empty response is not a zero
    assert s.tau_tokens_per_step == 8 / 6
    assert (s.n_samples, s.n_skipped) == (2, 1)
    assert s.histogram == {1: 5, 2: 0, 3: 1}
    assert s.as_dict()["histogram"] == {"1": 5, "2": 0, "3": 1}


def test_no_verify_step_at_all_is_nan():
    s = aggregate([[], []], block_size=8)
    assert math.isnan(s.tau) and math.isnan(s.tau_tokens_per_step)
    assert (s.n_samples, s.n_skipped, s.verify_steps) == (0, 2, 0)
    assert math.isnan(sample_tau([]))


def test_out_of_range_length_is_a_bug():
    with pytest.raises(ValueError, match="outside 1..4"):
        aggregate([[5]], block_size=4)
    with pytest.raises(ValueError, match="outside 1..4"):
        aggregate([[0, 1]], block_size=4)


def test_three_tau_conventions_side_by_side():
    # A: [4, 4] -> 8 tokens in 2 steps + the prefill token = 9 completion tokens
    # B: six steps of 1 -> 6 tokens + the prefill token = 7 completion tokens
    s = aggregate([[4, 4], [1, 1, 1, 1, 1, 1]], block_size=4)
    assert s.tau == (4.0 + 1.0) / 2  # reference: mean of per-response means, prefill token not counted
    assert s.tau_tokens_per_step == 14 / 8  # pooled
    assert s.tau_sglang == (9 / 2 + 7 / 6) / 2  # SGLang: completion_tokens / verify_ct per request, then mean
    assert math.isnan(aggregate([[]], 4).tau_sglang)


def test_slot_acceptance_by_hand():
    # B = 4, one response, steps commit 3, 1, 4, 2 -> 11 completion tokens (prefill included)
    # step 0 (pos 0, 10 left): slots 1, 2 accepted, slot 3 compared and refused
    # step 1 (pos 3, 7 left): slot 1 refused
    # step 2 (pos 4, 6 left): slots 1-3 accepted, the block was full: nothing refused
    # step 3 (pos 8, 2 left): slot 1 accepted, slot 2 censored (the response ended inside the block)
    s = aggregate([[3, 1, 4, 2]], block_size=4)
    assert s.slot_compared == {1: 4, 2: 2, 3: 2}
    assert s.slot_acceptance == {1: 3 / 4, 2: 2 / 2, 3: 1 / 2}
    # a slot never compared has no rate
    s = aggregate([[1, 1]], block_size=4)
    assert s.slot_compared == {1: 1, 2: 0, 3: 0}  # the last step's slot 1 is censored (1 token left)
    assert s.slot_acceptance[1] == 0.0 and math.isnan(s.slot_acceptance[2])
    assert s.as_dict()["slot_acceptance"] == {"1": 0.0, "2": None, "3": None}


def test_position_bins_by_hand():
    # 20 steps of 4 (anchors at completion positions 0, 4, ..., 76), then 10 steps of 1 (80..89)
    s = aggregate([[4] * 20 + [1] * 10], block_size=4)
    assert s.position_steps["0-64"] == 16 and s.position_tau["0-64"] == 4.0
    assert s.position_steps["64-128"] == 14 and s.position_tau["64-128"] == (4 * 4 + 10) / 14
    assert s.position_steps["128-256"] == 0 and math.isnan(s.position_tau["128-256"])
    assert list(s.position_tau) == position_bin_labels() and position_bin_labels()[-1] == "4096-inf"
    assert sum(s.position_steps.values()) == s.verify_steps


def test_prompt_length_bins_hand_built():
    from dflash_eval.replay.metrics import PROMPT_BINS

    # three responses: prompts of 10, 200 and 127 tokens; taus 2.0, 1.5 and 3.0; one with no verify step
    s = aggregate([[2, 2], [1, 2], [3, 3, 3], []], 4, prompt_lens=[10, 200, 127, 5000])
    assert position_bin_labels(PROMPT_BINS)[:3] == ["0-128", "128-256", "256-512"]
    assert s.prompt_tau["0-128"] == (2.0 + 3.0) / 2 and s.prompt_samples["0-128"] == 2
    assert s.prompt_tau["128-256"] == 1.5 and s.prompt_samples["128-256"] == 1
    assert math.isnan(s.prompt_tau["4096-8192"]) and s.prompt_samples["4096-8192"] == 0  # no verify step: skipped
    assert list(s.prompt_tau)[-1] == "32768-inf"
    unknown = aggregate([[2, 2]], 4)
    assert all(math.isnan(v) for v in unknown.prompt_tau.values()) and sum(unknown.prompt_samples.values()) == 0
    with pytest.raises(ValueError, match="1 prompt lengths for 2 responses"):
        aggregate([[1], [1]], 4, prompt_lens=[3])


def test_standard_error_over_prompts_hand_computed():
    """tau_se = sample sd of the per-response taus / sqrt(n): taus 1.0, 2.0, 3.0 -> sd 1 -> 1/sqrt(3); per prompt-length
    bin the same over the bin's responses; NaN below 2 responses."""
    from dflash_eval.replay.metrics import standard_error

    # taus 1.0 ([1, 1]), 2.0 ([2, 2, 2]) and 3.0 ([3]); prompts of 100, 300 and 400 tokens; one with no verify step
    s = aggregate([[1, 1], [2, 2, 2], [3], []], 4, prompt_lens=[100, 300, 400, 50])
    assert s.tau == 2.0 and s.tau_se == pytest.approx(1 / math.sqrt(3), abs=1e-15)
    # bin 256-512 holds taus 2.0 and 3.0: sd sqrt(0.5), SE sqrt(0.5) / sqrt(2) = 0.5
    assert s.prompt_samples["256-512"] == 2 and s.prompt_se["256-512"] == pytest.approx(0.5, abs=1e-15)
    assert s.prompt_samples["0-128"] == 1 and math.isnan(s.prompt_se["0-128"])  # one response: no SE
    assert math.isnan(s.prompt_se["128-256"])  # none
    assert math.isnan(aggregate([[2, 2]], 4).tau_se)  # n = 1
    assert aggregate([[2, 2]], 4).as_dict()["tau_se"] is None  # JSON: NaN as None
    assert standard_error([4.0, 4.0]) == 0.0 and math.isnan(standard_error([]))
