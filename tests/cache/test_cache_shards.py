"""N-shard extraction of one prompt set: per-sample states bit-identical to one job, a killed shard resumes,
and the merged cache reads as one (CacheReader, what evaluate uses)."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import h5py
import pytest
import torch

from dflash_eval.cache.reader import CacheReader
from dflash_eval.cache.shards import merge_shards, parse_shard, shard_plan
from dflash_eval.core.errors import InputError
from dflash_eval.stages.hidden_states import extract_hidden_states
from tiny import make_tiny_target

LAYERS = [0, 2, 3]


def test_shard_plan_by_batches():
    batches = [[4], [0, 7], [2, 5, 6], [1, 3]]  # a longest-first plan
    assert shard_plan(batches, 0, 2) == ([2, 4, 5, 6], [[1], [0, 2, 3]])
    assert shard_plan(batches, 1, 2) == ([0, 1, 3, 7], [[0, 3], [1, 2]])
    assert shard_plan(batches, 3, 4) == ([1, 3], [[0, 1]])
    assert shard_plan(batches, 0, 8) == ([4], [[0]]) and shard_plan(batches, 5, 8) == ([], [])
    assert parse_shard("1/3") == (1, 3)
    for bad in ("3/3", "-1/2", "1", "a/b"):
        with pytest.raises(Exception):
            parse_shard(bad)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    wd = tmp_path_factory.mktemp("shards")
    make_tiny_target(wd / "target", num_layers=4, hidden=64)
    rng = random.Random(0)
    with open(wd / "c.jsonl", "w") as fh:
        for i in range(10):
            p, c = rng.randint(2, 12), rng.randint(1, 14)
            fh.write(json.dumps({"id": f"s{i}", "prompt_ids": [rng.randrange(4, 380) for _ in range(p)],
                                 "completion_ids": [rng.randrange(4, 380) for _ in range(c)],
                                 "stop_reason": "length", "max_new_tokens": 14}) + "\n")
    return wd


def _extract(wd, out, **kw):
    return extract_hidden_states(wd / "target", wd / "c.jsonl", wd / out, LAYERS, device="cpu", batch_tokens=40, **kw)


def _states(path) -> dict:
    with CacheReader(path) as rd:
        return {rd.sample_ids[i]: rd.sample(i) for i in range(len(rd))}


@pytest.mark.parametrize("packing", ["auto", "off"])
def test_three_shards_merge_bit_identical_to_one_job(work, packing, tmp_path, monkeypatch):
    one = _extract(work, f"one-{packing}.h5", packing=packing)
    shards = [_extract(work, f"sh{packing}{k}.h5", packing=packing, shard=(k, 3)) for k in range(3)]
    sizes = [len(CacheReader(s)) for s in shards]
    assert sum(sizes) == 10 and min(sizes) >= 1
    merged = merge_shards(shards, work / "c.jsonl", work / f"merged-{packing}.h5")
    monkeypatch.chdir(tmp_path)  # the links resolve next to the merged file, not in the working directory
    ref, got = _states(one), _states(merged)
    with CacheReader(merged) as rd, CacheReader(one) as r1:
        assert rd.sample_ids == r1.sample_ids == [f"s{i}" for i in range(10)]
        assert rd.verify() == [] and json.loads(rd.attrs["shards"]) == [s.name for s in shards]
        for k in ("target_sha256", "batching", "completions_sha256", "target_layer_ids"):
            assert rd.attrs[k] == r1.attrs[k]
        assert [rd.length(i) for i in range(10)] == [r1.length(i) for i in range(10)]
        assert [rd.sample_attrs(i) for i in range(10)] == [r1.sample_attrs(i) for i in range(10)]
        # each linked sample's checksummed meta (in its shard) is the one-job file's
        assert [rd._f[f"samples/{i:06d}"].attrs["meta"] for i in range(10)] == [
            r1._f[f"samples/{i:06d}"].attrs["meta"] for i in range(10)]
    for sid, a in ref.items():
        b = got[sid]
        assert torch.equal(a.hidden, b.hidden) and torch.equal(a.target_argmax, b.target_argmax)
        assert torch.equal(a.input_ids, b.input_ids) and a.prompt_len == b.prompt_len


def test_a_killed_shard_resumes_and_merge_refuses_incomplete_sets(work, caplog):
    done = _extract(work, "k1.h5", shard=(1, 2))
    # what a SIGKILLed run leaves: the sidecar without n_samples and with a sample group missing
    partial = work / "k1b.h5.partial"
    shutil.copy(done, partial)
    with h5py.File(partial, "r+") as f:
        del f.attrs["n_samples"]
        del f["samples/000001"]
    with caplog.at_level("INFO"):
        again = _extract(work, "k1b.h5", shard=(1, 2))
    assert "1 to compute" in caplog.text and not partial.exists()
    a, b = _states(done), _states(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k].hidden, b[k].hidden) for k in a)
    with pytest.raises(InputError, match="sample\\(s\\) in no shard"):
        merge_shards([again], work / "c.jsonl", work / "half.h5")
    with pytest.raises(InputError, match="also in shard"):
        merge_shards([done, again], work / "c.jsonl", work / "twice.h5")
    assert not (work / "half.h5").exists() and not (work / "twice.h5").exists()
    os.makedirs(work / "elsewhere", exist_ok=True)
    with pytest.raises(InputError, match="not in the merged cache's folder"):
        merge_shards([done], work / "c.jsonl", work / "elsewhere" / "m.h5")


@pytest.mark.slow  # 5-7 s on 2 cores
def test_merge_cli(work, tmp_path):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    shards = [_extract(work, f"cli{k}.h5", shard=(k, 2)) for k in range(2)]
    proc = subprocess.run([sys.executable, "-m", "dflash_eval", "merge-cache-shards", "--shards", *map(str, shards),
                           "--completions", str(work / "c.jsonl"), "--out", str(work / "cli.h5")],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(repo)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    with CacheReader(work / "cli.h5") as rd:
        assert len(rd) == 10 and rd.attrs["n_samples"] == 10
    bad = subprocess.run([sys.executable, "-m", "dflash_eval", "merge-cache-shards", "--shards", str(shards[0]),
                          "--completions", str(work / "c.jsonl"), "--out", str(work / "bad.h5")],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(repo)}, timeout=300)
    assert bad.returncode == 2 and "sample(s) in no shard" in bad.stderr


def test_workflow_with_cache_shards_runs_n_jobs_and_a_merge(tmp_path):
    """Dry-run with cache.shards: 2: per prompt set two hidden_states_shard jobs (--shard 0/2, 1/2) and one merge."""
    import re

    from test_workflow import copy_workflow, dflash_eval_argv, job_counts, shell_commands, smk

    from dflash_eval.cli import build_parser

    wd = copy_workflow(tmp_path / "wf")
    (wd / "shards.yaml").write_text("cache: {shards: 2}\n")
    out = smk(wd, "-n", "-p", "--configfile", "config/demo.yaml", "shards.yaml").stdout
    counts = job_counts(out)
    cmds = [dflash_eval_argv(c) for c in shell_commands(out)]
    shard_cmds = [build_parser().parse_args(a) for a in cmds if a[0] == "hidden-states-shard"]
    merges = [a for a in cmds if a[0] == "merge-cache-shards"]
    sets = {Path(a.completions).stem for a in shard_cmds}
    assert len(sets) >= 1 and len(shard_cmds) == 2 * len(sets) and len(merges) == len(sets)
    assert sorted((Path(a.completions).stem, a.shard) for a in shard_cmds) == sorted(
        (s, (k, 2)) for s in sets for k in (0, 1))
    assert all(a.keep_partial and re.search(r"\.shard[01]\.h5$", a.out) for a in shard_cmds)
    assert not any(a[0] == "hidden-states" for a in cmds) and "hidden_states" not in counts
    assert counts["hidden_states_shard"] == 2 * len(sets) and counts["merge_cache_shards"] == len(sets)
