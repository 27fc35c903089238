"""Files damaged between stages are refused, naming the file, not with a raw library error.

* a byte flipped in the metadata of a hidden-state cache is the catalogue's ``damaged HDF5 file`` error;
* the validations that did not pass are named at the end of the run (the Snakefile's hooks).

Flipped bytes in a sample, NaN drafters and foreign caches: tests/cache/test_reliability.py and tests/cache/test_cache.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_reliability import pipeline  # noqa: E402,F401  (the module-scoped fixture)

from dflash_eval.core.errors import InputError  # noqa: E402


def test_a_damaged_hdf5_structure_is_named_not_a_raw_h5py_error(pipeline, tmp_path):  # noqa: F811
    """One byte flipped in the cache's object headers gave evaluate h5py's raw
    ``OSError: Can't synchronously read data`` / ``KeyError: Unable to synchronously open object``, naming no
    file. Every offset of the file's metadata region that h5py itself cannot read is now the catalogue's
    ``damaged HDF5 file`` InputError naming the cache (or a sample), with the re-extract fix."""
    import shutil

    import h5py

    from dflash_eval.cache.reader import CacheReader

    src = pipeline["dir"] / "c.h5"
    c = tmp_path / "c.h5"
    raw_errors = 0
    for off in range(512, 6000, 61):
        shutil.copy(src, c)
        with open(c, "r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
        try:  # what h5py does with it on its own
            with h5py.File(c, "r") as f:
                dict(f.attrs), f["sample_ids"][()], [f[f"samples/{i:06d}/input_ids"][()] for i in range(len(f["samples"]))]
        except (OSError, KeyError, RuntimeError, ValueError, TypeError):
            raw_errors += 1
        else:
            continue
        with pytest.raises(InputError) as err:
            with CacheReader(c) as r:
                with r.verified_samples(list(range(len(r))), r.layer_ids):
                    pass
        assert Path(err.value.file) == c, off
        assert "re-extract" in err.value.fix, (off, err.value.problem)  # damaged, or a checked field gone wrong
    assert raw_errors >= 10  # the region holds object headers: many flips are unreadable to h5py


def test_a_validation_that_did_not_pass_is_named_at_the_end_of_the_run(tmp_path):
    """A validation that failed is not only an "ok: no" row of the report: the Snakefile's
    onsuccess prints each failed check of the validations this run wrote (and none of an earlier run's)."""
    import time

    from dflash_eval.core.errors import failed_checks

    vo = tmp_path / "validate_online.json"
    vo.write_text(json.dumps({"checkpoints": [
        {"checkpoint": "ckA", "modes": {"chain": {"ok": True, "samples": [{"ok": False}]}, "ddtree_4": {"ok": False}},
         "sampling": {"T=1": {"within_goal": False}, "T=0.6": {"within_goal": True}}},
        {"checkpoint": "ckB", "modes": {"chain": {"ok": True}}}]}))
    ve = tmp_path / "validate_engine.json"
    ve.write_text(json.dumps({"checkpoints": [{"checkpoint": "ckB", "ok": False, "requests": [{"ok": False}]}]}))
    assert failed_checks([vo, ve, tmp_path / "gone.json"], since=0) == [
        f"{vo}: ckA ddtree_4: did not pass (see the report)",
        f"{vo}: ckA T=1: sampled online tau differs from offline beyond the goal (see the report)",
        f"{ve}: ckB: did not pass (see the report)"]
    assert failed_checks([vo, ve], since=time.time() + 10) == []  # written before this run: not repeated
