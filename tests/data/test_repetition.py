"""The repeated n-gram fraction of a completion (dflash_eval/data/repetition.py), by hand; the completions stage stores
it with every completion; files written before it are measured from their ids."""

from __future__ import annotations

import json

import pytest

from dflash_eval.data.repetition import (STORED_NGRAM, field_name, read_repetition, repeated_ngram_fraction,
                                         row_repetition)


def by_hand(ids: list[int], n: int) -> float:
    """The definition read literally: an n-gram at i counts when the same n ids start at some j < i."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    if not grams:
        return 0.0
    return sum(any(grams[j] == grams[i] for j in range(i)) for i in range(len(grams))) / len(grams)


def test_hand_computed_values():
    cycle = [1, 2, 3, 4, 5] * 4  # 20 tokens, 13 8-grams; the one at i equals the one at i - 5: 8 repeated
    assert repeated_ngram_fraction(cycle, 8) == pytest.approx(8 / 13)
    assert repeated_ngram_fraction(list(range(20)), 8) == 0.0  # no 8-gram twice
    assert repeated_ngram_fraction([3, 1, 4, 1, 5, 9, 2], 8) == 0.0  # 7 tokens: no 8-gram at all
    assert repeated_ngram_fraction(list(range(8)), 8) == 0.0  # exactly one 8-gram
    assert repeated_ngram_fraction([], 8) == 0.0
    # n = 2 on 1 2 1 2 1 2: grams 12 21 12 21 12, the last three seen before -> 3/5
    assert repeated_ngram_fraction([1, 2, 1, 2, 1, 2], 2) == pytest.approx(3 / 5)
    assert repeated_ngram_fraction([7, 7, 7], 1) == pytest.approx(2 / 3)
    # one block said twice: 0..9 0..9 -> 13 8-grams, those at 10, 11, 12 repeat the ones at 0, 1, 2
    assert repeated_ngram_fraction(list(range(10)) * 2, 8) == pytest.approx(3 / 13)
    for ids, n in [(cycle, 8), ([1, 2, 1, 2, 1, 2], 2), (list(range(10)) * 2, 8), ([5, 5, 6, 5, 5, 6, 5, 5], 3)]:
        assert repeated_ngram_fraction(ids, n) == pytest.approx(by_hand(ids, n))
    with pytest.raises(ValueError):
        repeated_ngram_fraction([1, 2], 0)


def test_stored_value_first_else_computed_from_the_ids(tmp_path):
    """A row with the field gives it; a row of an older file (no field) or another n is measured from its ids."""
    assert field_name(8) == "repeated_8gram_fraction" and STORED_NGRAM == 8
    ids = [1, 2, 3, 4, 5] * 4
    old = {"id": "a", "prompt_ids": [1], "completion_ids": ids, "max_new_tokens": 20}
    new = {**old, "id": "b", field_name(8): 0.25}  # a stored value wins over the ids (written from the same ids)
    assert row_repetition(old) == pytest.approx(8 / 13) and row_repetition(new) == 0.25
    assert row_repetition(new, 5) == pytest.approx(11 / 16)  # another n, from the ids: 16 5-grams, 5 distinct
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (old, new)))
    assert read_repetition(path) == {"a": pytest.approx(8 / 13), "b": 0.25}


def test_the_completions_stage_stores_it(tmp_path):
    """Greedy completions of a tiny random target (which loops readily): each row carries the measure of its own ids."""
    from dflash_eval.stages.completions import generate_completions
    from tiny import make_tiny_target

    target = make_tiny_target(tmp_path / "target", arch="llama", num_layers=2, hidden=32, seed=0)
    prompts = [{"id": f"p{i}", "source": "file", "prompt": "", "text": "", "prompt_ids": p}
               for i, p in enumerate([[5, 6, 7], [40, 41]])]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    out = generate_completions(target, tmp_path / "prompts.jsonl", tmp_path / "c.jsonl", max_new_tokens=24,
                               batch_size=2, device="cpu", dtype="float32")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["repeated_8gram_fraction"] == pytest.approx(by_hand(r["completion_ids"], 8))
    assert any(r["repeated_8gram_fraction"] > 0 for r in rows)  # the measure is exercised, not only 0.0
    assert read_repetition(out) == {r["id"]: r["repeated_8gram_fraction"] for r in rows}
