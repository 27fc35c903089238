"""The hidden_states stage at users' scale: streaming, resume after real kills, refusals, disk full.

Real ``python -m dflash_eval hidden-states`` processes are stopped mid-run (SIGTERM, then
SIGKILL, then a file-size limit standing in for a full disk) and rerun; the finished cache's
datasets must equal those of an uninterrupted run byte for byte, and the logs' counts must
show that committed samples were kept, not recomputed. Every process runs with one torch
thread, so the float32 CPU numerics are the same in all of them.
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from dflash_eval.cache.format import FILE_DATASETS
from dflash_eval.core.errors import InputError

REPO = Path(__file__).resolve().parents[2]
N_SAMPLES = 240
LAYERS = "1,3"
BATCH_TOKENS = 128
KEPT = re.compile(r"(\d+) verified in the partial file and kept, (\d+) to compute")
COMMITTED = re.compile(r"committed (\d+) samples")


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"  # identical float32 numerics in every process
    return env


def write_completions(path: Path, n: int, seed: int = 0, vocab: int = 300) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for i in range(n):
            p, c = rng.randint(8, 40), rng.randint(1, 60)
            fh.write(json.dumps({"id": f"s{i}", "prompt_ids": [rng.randrange(4, vocab) for _ in range(p)],
                                 "completion_ids": [rng.randrange(4, vocab) for _ in range(c)],
                                 "stop_reason": "length", "max_new_tokens": 60}) + "\n")
    return path


def cli(wd: Path, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dflash_eval", "hidden-states", "--target", "target", "--completions",
            "completions.jsonl", "--layer-ids", LAYERS, "--batch-tokens", str(BATCH_TOKENS), "--device", "cpu",
            "--dtype", "float32", "--out", out, *extra]


def start(wd: Path, out: str, log: str, **kw) -> subprocess.Popen:
    fh = open(wd / log, "w")
    return subprocess.Popen(cli(wd, out), cwd=wd, env=_env(), stdout=fh, stderr=subprocess.STDOUT, **kw)


def wait_for_commits(proc: subprocess.Popen, log: Path, n: int, timeout: float = 600) -> None:
    t0 = time.monotonic()
    while len(COMMITTED.findall(log.read_text())) < n:
        if proc.poll() is not None:
            pytest.fail(f"process ended (rc {proc.returncode}) before {n} commits:\n{log.read_text()[-3000:]}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            pytest.fail(f"no {n} commits in {timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.01)


def kept(log: Path) -> tuple[int, int]:
    m = KEPT.findall(log.read_text())
    assert len(m) == 1, log.read_text()[-3000:]
    return int(m[0][0]), int(m[0][1])


def committed(log: Path) -> int:
    return sum(int(x) for x in COMMITTED.findall(log.read_text()))


def datasets(path: Path) -> dict:
    """Every dataset's bytes and every sample attribute of a cache, keyed by name."""
    out = {}
    with h5py.File(path, "r", locking=False) as f:
        out["sample_ids"] = [s.decode() if isinstance(s, bytes) else s for s in f["sample_ids"][()]]
        for name in FILE_DATASETS:  # per-sample arrays (argmax_agreement included)
            arr = f[name][()]
            out[name] = (arr.dtype.str, arr.shape, arr.tobytes()) if arr.dtype.kind != "O" else arr.tolist()
        for name, g in f["samples"].items():
            for ds in ("input_ids", "hidden", "target_argmax"):
                arr = g[ds][()]
                out[f"{name}/{ds}"] = (arr.dtype.str, arr.shape, arr.tobytes())
            out[f"{name}/attrs"] = {k: (v.item() if hasattr(v, "item") else v) for k, v in g.attrs.items()}
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny target, N_SAMPLES synthetic completions and the cache of one uninterrupted run."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny import make_tiny_target

    wd = tmp_path_factory.mktemp("resume")
    make_tiny_target(wd / "target", arch="llama", num_layers=4, hidden=64, seed=0)
    write_completions(wd / "completions.jsonl", N_SAMPLES)
    proc = subprocess.run(cli(wd, "ref.h5"), cwd=wd, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert kept_text(proc.stderr) == (0, N_SAMPLES)
    return wd


def kept_text(text: str) -> tuple[int, int]:
    (a, b), = KEPT.findall(text)
    return int(a), int(b)


def leftovers(wd: Path, name: str) -> list[str]:
    return sorted(p.name for p in wd.iterdir() if p.name.startswith(f".{name}") or p.name == f"{name}.partial")


@pytest.mark.slow
def test_sigterm_then_kill9_resume_is_bit_identical(work):
    wd = work
    # 1. SIGTERM (a SLURM time limit): clean stop, exit 143, committed work kept, no temporaries.
    p1 = start(wd, "c.h5", "run1.log")
    wait_for_commits(p1, wd / "run1.log", 2)
    p1.send_signal(signal.SIGTERM)
    assert p1.wait(timeout=300) == 143, (wd / "run1.log").read_text()[-3000:]
    log1 = (wd / "run1.log").read_text()
    assert "interrupted by SIGTERM" in log1
    assert not (wd / "c.h5").exists()
    assert leftovers(wd, "c.h5") == ["c.h5.partial"]
    c1 = committed(wd / "run1.log")
    assert 0 < c1 < N_SAMPLES

    # 2. SIGKILL mid-run of the resumed job: everything committed by run 1 is kept, nothing recomputed.
    p2 = start(wd, "c.h5", "run2.log")
    wait_for_commits(p2, wd / "run2.log", 2)
    p2.kill()
    assert p2.wait(timeout=60) == -signal.SIGKILL
    k2, todo2 = kept(wd / "run2.log")
    assert (k2, todo2) == (c1, N_SAMPLES - c1)
    c2 = committed(wd / "run2.log")
    assert c2 > 0 and not (wd / "c.h5").exists()

    # 3. To the end: kept = run 1 + run 2's commits (a flush may have landed after the last log line).
    proc = subprocess.run(cli(wd, "c.h5"), cwd=wd, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    k3, todo3 = kept_text(proc.stderr)
    assert c1 + c2 <= k3 < N_SAMPLES and k3 + todo3 == N_SAMPLES
    assert f"computed {todo3} samples" in proc.stderr
    assert datasets(wd / "c.h5") == datasets(wd / "ref.h5")
    assert leftovers(wd, "c.h5") == []  # the sidecar became the cache; no temporaries
    with h5py.File(wd / "c.h5", "r", locking=False) as f:
        runs = json.loads(f.attrs["extraction_runs"])
        assert [r["reused"] for r in runs] == [0, c1, k3]
        assert sum(r["computed"] for r in runs) >= N_SAMPLES
        assert runs[-1]["computed"] == todo3


@pytest.mark.slow
def test_disk_full_keeps_partial_and_resumes(work):
    """A file-size limit (EFBIG, as ENOSPC on a full disk): clear error, partial kept, nothing done."""
    wd = work
    limit = (wd / "ref.h5").stat().st_size // 3

    def limited():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run(cli(wd, "full.h5"), cwd=wd, env=_env(), capture_output=True, text=True, timeout=900,
                          preexec_fn=limited)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "no room left to write the cache" in proc.stderr and "rerun: the job resumes" in proc.stderr
    assert not (wd / "full.h5").exists()
    assert (wd / "full.h5.partial").exists()
    proc = subprocess.run(cli(wd, "full.h5"), cwd=wd, env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    k, todo = kept_text(proc.stderr)
    assert 0 < k < N_SAMPLES and k + todo == N_SAMPLES
    assert datasets(wd / "full.h5") == datasets(wd / "ref.h5")


def _unfinished_copy(src: Path, dst: Path, drop: list[int]) -> None:
    """A partial file as a killed run of src's settings leaves it: no n_samples, some samples missing."""
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        del f.attrs["n_samples"]
        for i in drop:
            del f[f"samples/{i:06d}"]


@pytest.mark.slow
def test_partial_of_other_settings_is_refused_never_mixed(work, tmp_path, caplog):
    from dflash_eval.stages.hidden_states import extract_hidden_states

    wd = work
    out = tmp_path / "c.h5"
    _unfinished_copy(wd / "ref.h5", tmp_path / "c.h5.partial", drop=[0, 5])
    base = dict(target_dir=wd / "target", completions_path=wd / "completions.jsonl", out=out, layer_ids=[1, 3],
                batch_tokens=BATCH_TOKENS, device="cpu", dtype="float32")
    with pytest.raises(InputError, match=r"target_layer_ids: partial \[1, 3\] vs now \[1, 2\]"):
        extract_hidden_states(**{**base, "layer_ids": [1, 2]})
    other = write_completions(tmp_path / "other.jsonl", N_SAMPLES, seed=1)
    with pytest.raises(InputError, match="completions_sha256: partial"):
        extract_hidden_states(**{**base, "completions_path": other})
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny import make_tiny_target

    make_tiny_target(tmp_path / "target2", arch="llama", num_layers=4, hidden=64, seed=1)
    with pytest.raises(InputError, match="target_sha256: partial") as err:
        extract_hidden_states(**{**base, "target_dir": tmp_path / "target2"})
    assert "delete" in err.value.fix and str(tmp_path / "c.h5.partial") in err.value.fix
    with pytest.raises(InputError, match=r"batch_tokens: partial 128 vs now 256"):
        extract_hidden_states(**{**base, "batch_tokens": 256})
    assert (tmp_path / "c.h5.partial").exists() and not out.exists()  # refusals touch nothing

    # The matching run keeps the 238 verified samples and computes the 2 missing ones.
    caplog.set_level("INFO")
    extract_hidden_states(**base)
    assert "238 verified in the partial file and kept, 2 to compute" in caplog.text
    assert datasets(out) == datasets(wd / "ref.h5")

    # A *finished* sidecar of other settings (a kept link whose output was deleted for a rerun) is replaced.
    shutil.copy(wd / "ref.h5", tmp_path / "d.h5.partial")
    caplog.clear()
    extract_hidden_states(**{**base, "out": tmp_path / "d.h5", "layer_ids": [0, 3]})
    assert "finished cache of other settings (target_layer_ids)" in caplog.text
    assert "0 verified in the partial file and kept, 240 to compute" in caplog.text

    # A covered attribute outside the identity edited in an unfinished sidecar: its header check fails, so
    # none of its samples is trusted (started over), and the cache equals the reference.
    _unfinished_copy(wd / "ref.h5", tmp_path / "e.h5.partial", drop=[3])
    with h5py.File(tmp_path / "e.h5.partial", "r+") as f:
        f.attrs["vocab_size"] = int(f.attrs["vocab_size"]) + 1
    caplog.clear()
    extract_hidden_states(**{**base, "out": tmp_path / "e.h5"})
    assert "fails its header check (vocab_size: file attribute vocab_size is" in caplog.text
    assert "0 verified in the partial file and kept, 240 to compute" in caplog.text
    assert datasets(tmp_path / "e.h5") == datasets(wd / "ref.h5")


@pytest.mark.slow
def test_kept_link_is_reused_without_loading_the_model(work, tmp_path, caplog, monkeypatch):
    """--keep-partial: the finished sidecar is a hard link of the cache; with the cache deleted (what
    Snakemake does before rerunning an orphaned job) the next run verifies and reuses it, loading nothing."""
    from dflash_eval.target import model as target_mod
    from dflash_eval.core.errors import remove_done_links
    from dflash_eval.stages.hidden_states import extract_hidden_states

    wd = work
    out = tmp_path / "k.h5"
    shutil.copy(wd / "ref.h5", tmp_path / "k.h5.partial")
    base = dict(target_dir=wd / "target", completions_path=wd / "completions.jsonl", out=out, layer_ids=[1, 3],
                batch_tokens=BATCH_TOKENS, device="cpu", dtype="float32", keep_partial=True)

    def no_load(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(target_mod, "load_target", no_load)
    caplog.set_level("INFO")
    extract_hidden_states(**base)
    assert f"{N_SAMPLES} verified in the partial file and kept, 0 to compute" in caplog.text
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "samples were taken" in r.getMessage()]
    assert warned == [f"{out}: all {N_SAMPLES} samples were taken, verified, from {out}.partial, the cache an earlier "
                      "job finished (kept because its Snakemake did not record it); nothing was recomputed. If you "
                      f"forced this rerun to recompute the states (e.g. after a code change), delete {out}.partial "
                      "and rerun"]  # never silent: a forced rerun after a code change must delete it
    assert os.path.samefile(out, tmp_path / "k.h5.partial")
    assert datasets(out) == datasets(wd / "ref.h5")
    assert remove_done_links([out, tmp_path / "missing.h5"]) == [tmp_path / "k.h5.partial"]
    assert out.exists() and not (tmp_path / "k.h5.partial").exists()


@pytest.mark.slow
def test_host_memory_holds_two_batches_whatever_the_sample_count(work, tmp_path, caplog):
    """Streaming: the states held in host memory at once never exceed two batches, for 1x and 4x the samples."""
    from dflash_eval.stages.hidden_states import extract_hidden_states
    from dflash_eval.core.runtime import length_batches

    for n in (60, 240):
        comp = write_completions(tmp_path / f"c{n}.jsonl", n, seed=2)
        rows = [json.loads(line) for line in comp.read_text().splitlines()]
        lengths = [len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows]
        sizes = sorted(len(b) for b in length_batches(lengths, max_tokens=BATCH_TOKENS, packed=True))
        caplog.clear()
        caplog.set_level("INFO")
        extract_hidden_states(work / "target", comp, tmp_path / f"c{n}.h5", [1, 3], batch_tokens=BATCH_TOKENS,
                              device="cpu", dtype="float32")
        (samples, tokens), = re.findall(r"peak host memory: states of (\d+) samples \((\d+) tokens\)", caplog.text)
        assert int(tokens) <= 2 * BATCH_TOKENS < sum(lengths) // 10  # two batches, never the whole set
        assert int(samples) <= sizes[-1] + sizes[-2]


def test_packed_batches_never_exceed_the_token_budget():
    from dflash_eval.core.runtime import length_batches

    lengths = [50, 10, 70, 30, 30, 200, 5]
    batches = length_batches(lengths, max_tokens=100, packed=True)
    assert sorted(i for b in batches for i in b) == list(range(7))
    assert batches[0] == [5]  # longer than the budget: alone
    assert all(sum(lengths[i] for i in b) <= 100 for b in batches[1:])
    assert batches == length_batches(lengths, max_tokens=100, packed=True)  # deterministic (resume)
    assert np.diff([max(lengths[i] for i in b) for b in batches]).max() <= 0  # longest first


@pytest.mark.slow
def test_full_disk_is_seen_before_writing(work, tmp_path, monkeypatch):
    """Free space below the next batch's size (statvfs): stop before HDF5 writes, commit kept, resume."""
    import shutil as _shutil

    from dflash_eval.cache import disk_room as cache_mod  # the writer's room check (require_room)
    from dflash_eval.stages.hidden_states import extract_hidden_states

    calls = {"n": 0}
    real = _shutil.disk_usage

    def filling(path):
        calls["n"] += 1
        u = real(path)
        return u._replace(free=u.free if calls["n"] <= 3 else 10 << 20)  # full after 3 batches

    monkeypatch.setattr(cache_mod.shutil, "disk_usage", filling)
    base = dict(target_dir=work / "target", completions_path=work / "completions.jsonl", out=tmp_path / "c.h5",
                layer_ids=[1, 3], batch_tokens=BATCH_TOKENS, device="cpu", dtype="float32")
    with pytest.raises(InputError, match=r"no room left .* No space left on device") as err:
        extract_hidden_states(**base)
    assert "samples are committed in this partial file and kept" in err.value.problem
    assert "10 MB free" in err.value.problem and "and 10 MB are free in" in err.value.fix  # one figure, both places
    assert "free at least" in err.value.fix and "rerun: the job resumes" in err.value.fix
    assert not (tmp_path / "c.h5").exists()
    monkeypatch.setattr(cache_mod.shutil, "disk_usage", real)
    extract_hidden_states(**base)
    assert datasets(tmp_path / "c.h5") == datasets(work / "ref.h5")


@pytest.mark.slow
def test_a_sigkilled_shard_resumes_and_the_merge_equals_one_job(work):
    """cache.shards: shard 1/2 SIGKILLed mid-run resumes from its committed samples; merged with shard 0/2 the
    prompt set's cache holds every dataset byte for byte as the one-job cache (read through the links)."""
    from dflash_eval.cache.shards import merge_shards

    wd = work
    fh = open(wd / "shard1.log", "w")
    p = subprocess.Popen(cli(wd, "sh1.h5", "--shard", "1/2"), cwd=wd, env=_env(), stdout=fh, stderr=subprocess.STDOUT)
    wait_for_commits(p, wd / "shard1.log", 2)
    p.kill()
    assert p.wait(timeout=60) == -signal.SIGKILL
    c1 = committed(wd / "shard1.log")
    assert c1 > 0 and not (wd / "sh1.h5").exists() and (wd / "sh1.h5.partial").exists()
    for k in (1, 0):
        proc = subprocess.run(cli(wd, f"sh{k}.h5", "--shard", f"{k}/2"), cwd=wd, env=_env(), capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        kept_n, todo = kept_text(proc.stderr)
        assert (kept_n >= c1) if k == 1 else (kept_n == 0)
    merged = merge_shards([wd / "sh0.h5", wd / "sh1.h5"], wd / "completions.jsonl", wd / "merged.h5")
    assert datasets(merged) == datasets(wd / "ref.h5")
