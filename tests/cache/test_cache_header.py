"""Format 6: the file attributes are under a checksum (``header`` / ``header_sha256``).

* every writer (fresh extraction, resume, shard merge) leaves a header that verifies;
* an attribute edited with h5py (``target_layer_ids``, ``hidden_size``, ``completion_sampling``, ``target_sha256``,
  ``dtype``) fails ``evaluate`` naming the file and that attribute (they used to pass silently, or read as another
  error); a deleted header is refused; a ``format_version`` edited down is refused as such, not as a checksum
  mismatch;
* a format-5 cache still reads, and the log says its file attributes are unverified.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import make_tiny_pipeline  # noqa: E402

from dflash_eval.cache.format import FORMAT_VERSION, UNCOVERED_ATTRS  # noqa: E402
from dflash_eval.cache.reader import CacheReader  # noqa: E402
from dflash_eval.cache.shards import merge_shards  # noqa: E402
from dflash_eval.core.errors import InputError  # noqa: E402
from dflash_eval.stages.hidden_states import extract_hidden_states  # noqa: E402

LAYERS = [1, 3]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny target, a random drafter for it, 4 prompts, their completions and cache."""
    p = make_tiny_pipeline(tmp_path_factory.mktemp("header"), LAYERS, block_size=4, max_new_tokens=12,
                           prompt_ids=[[1, 40 + i, 41, 2, 1, 50] for i in range(4)])
    _extract(p["dir"], "c.h5")
    return p


def _extract(d: Path, out: str, **kw) -> Path:
    return extract_hidden_states(d / "target", d / "c.jsonl", d / out, LAYERS, device="cpu", dtype="float32",
                                 batch_tokens=30, **kw)


def _evaluate(w, cache: Path, out: str = "ev.json"):
    from dflash_eval.stages.evaluate import evaluate

    d = w["dir"]
    return evaluate(d / "drafter", cache, w["target_dir"], d / out, device="cpu", dtype="float32", ddtree_budgets=[])


def _assert_header_verifies(path: Path) -> None:
    with h5py.File(path, "r") as f:
        assert int(f.attrs["format_version"]) == FORMAT_VERSION == 6
        text = f.attrs["header"]
        assert hashlib.sha256(text.encode()).hexdigest() == f.attrs["header_sha256"]
        covered = json.loads(text)
        assert set(covered) == set(f.attrs) - set(UNCOVERED_ATTRS)
        assert {"target_layer_ids", "hidden_size", "completion_sampling", "target_sha256", "dtype"} <= set(covered)
    with CacheReader(path) as rd:  # the reader verifies it on open
        assert len(rd) == 4


def _copy(w, tmp_path: Path, name: str = "edited.h5") -> Path:
    bad = tmp_path / name
    shutil.copy(w["dir"] / "c.h5", bad)
    return bad


def test_a_fresh_cache_has_a_header_that_verifies(work):
    _assert_header_verifies(work["dir"] / "c.h5")
    _evaluate(work, work["dir"] / "c.h5", out="intact.json")


SAMPLED = json.dumps({"temperature": 0.8, "top_p": 0.95, "top_k": 0, "seed": 1})


@pytest.mark.parametrize("name, value", [
    ("target_layer_ids", np.array([0, 3])), ("hidden_size", 65), ("completion_sampling", SAMPLED),
    ("target_sha256", "00" * 32), ("dtype", "bfloat16"),
])
def test_an_edited_file_attribute_fails_evaluate_naming_it(work, tmp_path, name, value):
    bad = _copy(work, tmp_path)
    with h5py.File(bad, "r+") as f:
        f.attrs[name] = value
    with pytest.raises(InputError) as err:
        _evaluate(work, bad)
    e = err.value
    assert Path(e.file) == bad and e.field == name
    assert f"file attribute {name} is" in e.problem and "checksummed header" in e.problem
    assert "re-extract" in e.fix and "hidden-states" in e.fix and "intact copy" in e.fix


def test_an_added_or_deleted_attribute_is_refused(work, tmp_path):
    bad = _copy(work, tmp_path)
    with h5py.File(bad, "r+") as f:
        del f.attrs["last_layer_normed"]
    with pytest.raises(InputError, match="last_layer_normed: file attribute last_layer_normed is \\(absent\\)"):
        CacheReader(bad)
    bad = _copy(work, tmp_path, "added.h5")
    with h5py.File(bad, "r+") as f:
        f.attrs["shards"] = "[]"
    with pytest.raises(InputError, match="shards: file attribute shards is"):
        CacheReader(bad)


def test_an_edited_sample_count_or_an_added_group_is_refused(work, tmp_path):
    """n_samples (outside the header: it marks a finished file) must equal the sample_ids and the groups."""
    bad = _copy(work, tmp_path)
    with h5py.File(bad, "r+") as f:
        f.attrs["n_samples"] = 3
    with pytest.raises(InputError, match="n_samples is 3 and samples/ holds 4 groups, but the file lists 4 sample_ids"):
        CacheReader(bad)
    bad = _copy(work, tmp_path, "added.h5")
    with h5py.File(bad, "r+") as f:
        f.copy(f["samples/000000"], f["samples"], name="000004")
    with pytest.raises(InputError, match="n_samples is 4 and samples/ holds 5 groups"):
        CacheReader(bad)


@pytest.mark.parametrize("key", ["header", "header_sha256"])
def test_a_deleted_header_is_refused(work, tmp_path, key):
    bad = _copy(work, tmp_path)
    with h5py.File(bad, "r+") as f:
        del f.attrs[key]
    with pytest.raises(InputError, match=f"{key}: missing \\(every file of format 6 has it"):
        CacheReader(bad)


def test_an_edited_header_is_refused(work, tmp_path):
    bad = _copy(work, tmp_path)
    with h5py.File(bad, "r+") as f:
        f.attrs["header"] = f.attrs["header"].replace('"hidden_size":64', '"hidden_size":65')
    with pytest.raises(InputError, match="header: the file attributes' header does not match its header_sha256"):
        CacheReader(bad)


def test_resume_and_shard_merge_leave_a_header_that_verifies(work):
    d = work["dir"]
    # what a SIGKILLed run leaves: the sidecar without n_samples, a sample group missing, runs recorded
    partial = d / "resumed.h5.partial"
    shutil.copy(d / "c.h5", partial)
    with h5py.File(partial, "r+") as f:
        del f.attrs["n_samples"]
        del f["samples/000002"]
    again = _extract(d, "resumed.h5")
    assert not partial.exists()
    with h5py.File(again, "r") as f:
        assert len(json.loads(f.attrs["extraction_runs"])) == 2  # rewritten by the resume, outside the header
    _assert_header_verifies(again)
    shards = [_extract(d, f"sh{k}.h5", shard=(k, 2)) for k in range(2)]
    merged = merge_shards(shards, d / "c.jsonl", d / "merged.h5")
    _assert_header_verifies(merged)
    with h5py.File(merged, "r") as f:
        assert json.loads(json.loads(f.attrs["header"])["shards"]) == ["sh0.h5", "sh1.h5"]
    _evaluate(work, merged, out="merged.json")
