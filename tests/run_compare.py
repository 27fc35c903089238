"""Compare two runs of the tiny workflow (tests/workflow/test_workflow.py ``make_tiny_workdir``): the
reference local run and a run elsewhere (SLURM, a container) must give the same numbers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_same_completions(ref: Path, other: Path) -> None:
    """Same prompt and completion token ids per sample id (greedy decoding is deterministic)."""
    a = {r["id"]: (r["prompt_ids"], r["completion_ids"]) for r in read_jsonl(ref)}
    b = {r["id"]: (r["prompt_ids"], r["completion_ids"]) for r in read_jsonl(other)}
    assert a and a == b, f"{other} differs from {ref}"


def assert_same_cache(ref: Path, other: Path) -> None:
    """Every dataset of the two HDF5 caches is bitwise equal (same code, dtype and thread count)."""
    import h5py

    def arrays(path):
        out = {}
        with h5py.File(path, "r") as f:
            f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
        return out

    a, b = arrays(ref), arrays(other)
    assert a and set(a) == set(b), (sorted(a)[:5], sorted(b)[:5])
    for name in a:
        assert np.array_equal(a[name], b[name]), f"{other}: dataset {name} differs from {ref}"


def assert_runs_match(ref_wd: Path, wd: Path, run: str, checkpoints: list[str], prompt_sets: list[str]) -> None:
    """Completions, caches, per-sample acceptance lengths and the tau.csv rows of ``wd`` equal the
    reference run's for the given checkpoints and prompt sets (``wd`` may hold a subset)."""
    import pandas as pd

    ref, res = ref_wd / "results" / run, wd / "results" / run
    for ps in prompt_sets:
        assert_same_completions(ref / "completions" / f"{ps}.jsonl", res / "completions" / f"{ps}.jsonl")
        assert_same_cache(ref / "cache" / f"{ps}.h5", res / "cache" / f"{ps}.h5")
        for ckpt in checkpoints:
            a = json.loads((ref / "eval" / ckpt / f"{ps}.json").read_text())
            b = json.loads((res / "eval" / ckpt / f"{ps}.json").read_text())
            for key in ("n_samples", "n_skipped", "tau", "verify_steps", "committed_tokens", "histogram"):
                assert a[key] == b[key], (ckpt, ps, key, a[key], b[key])
    tau_ref = pd.read_csv(ref / "tau.csv")
    tau = pd.read_csv(res / "tau.csv")
    assert sorted(zip(tau.checkpoint, tau.prompt_set)) == sorted((c, p) for c in checkpoints for p in prompt_sets)
    keep = tau_ref.checkpoint.isin(checkpoints) & tau_ref.prompt_set.isin(prompt_sets)
    key = ["checkpoint", "prompt_set"]
    # the speedup estimate's columns come from each run's own target_costs timings (wall clock): left out
    timed = [c for c in tau.columns if c.startswith("speedup_") or c == "estimate_reliable"]
    assert timed, "tau.csv lost its speedup columns"
    pd.testing.assert_frame_equal(tau_ref[keep].drop(columns=timed).sort_values(key).reset_index(drop=True),
                                  tau.drop(columns=timed).sort_values(key).reset_index(drop=True))
