"""tau aggregation on hand-computed cases (dflash_eval.metrics is the only place tau is computed)."""

from __future__ import annotations

import math

import pytest

from dflash_eval.metrics import aggregate, sample_tau


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
