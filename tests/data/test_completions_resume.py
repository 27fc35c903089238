"""Resumable completions: real ``python -m dflash_eval completions`` processes killed mid-run (SIGKILL, SIGTERM),
directly and under Snakemake, then rerun: every prompt exactly once, the prompts already done are not generated
again (counted in the log), and the output has the same bytes as an uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dflash_eval.data.prompts import build_prompt_set, write_prompts
from tiny import make_tiny_target

REPO = Path(__file__).resolve().parents[2]
N_PROMPTS = 40
ARGS = ["--source", "transformers", "--device", "cpu", "--dtype", "float32", "--batch-size", "2",
        "--max-new-tokens", "48"]
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def cli(*args, cwd, log=None) -> subprocess.Popen:
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-m", "dflash_eval", "completions", *map(str, args)], cwd=cwd,
                            env=_env(), stdout=out, stderr=subprocess.STDOUT)


def rows_in(partial: Path) -> int:
    """Complete rows in a partial file (its first line is the header)."""
    if not partial.exists():
        return 0
    return max(0, partial.read_bytes().count(b"\n") - 1)


def kill_when(proc: subprocess.Popen, partial: Path, n: int, sig: int, timeout: float = 600) -> int:
    """Send ``sig`` once ``partial`` holds >= n rows; returns the rows there at that moment."""
    t0 = time.time()
    while rows_in(partial) < n:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        assert time.time() - t0 < timeout
        time.sleep(0.01)
    k = rows_in(partial)
    os.kill(proc.pid, sig)
    proc.wait(timeout=120)
    return k


def log_counts(text: str) -> tuple[int, int]:
    """(prompts already done at start, prompts generated) from a completions log."""
    done = int(re.search(r"completions: \d+ prompts, (\d+) already done", text).group(1))
    gen = int(re.search(r"completions done: generated (\d+) prompts", text).group(1))
    return done, gen


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    target = make_tiny_target(root / "target", arch="llama", seed=1)
    txt = root / "p.txt"
    txt.write_text("".join(f"Tell me about {WORDS[i % 12]} and {WORDS[(i * 5) % 12]} number {i}.\n"
                           for i in range(N_PROMPTS)))
    prompts = write_prompts(build_prompt_set("file", target, n=0, seed=0, path=txt), root / "prompts.jsonl")
    ref = root / "ref.jsonl"
    p = cli("--target", target, "--prompts", prompts, *ARGS, "--out", ref, cwd=root, log=root / "ref.log")
    assert p.wait(timeout=900) == 0, (root / "ref.log").read_text()[-3000:]
    assert log_counts((root / "ref.log").read_text()) == (0, N_PROMPTS)
    return root, target, prompts, ref.read_bytes()


@pytest.mark.slow
def test_sigkill_then_rerun_resumes(tiny, tmp_path):
    root, target, prompts, ref = tiny
    out = tmp_path / "c.jsonl"
    partial = tmp_path / ".c.jsonl.partial"
    p = cli("--target", target, "--prompts", prompts, *ARGS, "--out", out, cwd=tmp_path, log=tmp_path / "1.log")
    k = kill_when(p, partial, 4, signal.SIGKILL)
    assert p.returncode == -signal.SIGKILL
    assert not out.exists() and 4 <= rows_in(partial) < N_PROMPTS
    k = rows_in(partial)
    p = cli("--target", target, "--prompts", prompts, *ARGS, "--out", out, cwd=tmp_path, log=tmp_path / "2.log")
    assert p.wait(timeout=900) == 0, (tmp_path / "2.log").read_text()[-3000:]
    assert log_counts((tmp_path / "2.log").read_text()) == (k, N_PROMPTS - k)
    assert out.read_bytes() == ref  # every prompt once, same bytes as the uninterrupted run
    assert not partial.exists() and sorted(q.name for q in tmp_path.iterdir()) == ["1.log", "2.log", "c.jsonl", "c.meta.json"]  # + its meta


@pytest.mark.slow
def test_sigterm_keeps_work_refuses_other_settings_and_survives_a_torn_line(tiny, tmp_path):
    root, target, prompts, ref = tiny
    out = tmp_path / "c.jsonl"
    partial = tmp_path / ".c.jsonl.partial"
    p = cli("--target", target, "--prompts", prompts, *ARGS, "--out", out, cwd=tmp_path, log=tmp_path / "1.log")
    kill_when(p, partial, 4, signal.SIGTERM)
    assert p.returncode == 128 + signal.SIGTERM  # clean shutdown: handlers ran
    log1 = (tmp_path / "1.log").read_text()
    k = rows_in(partial)
    assert f"interrupted: {k} of {N_PROMPTS} prompts are done and kept in" in log1
    assert sorted(q.name for q in tmp_path.iterdir()) == [".c.jsonl.partial", "1.log"]  # no stray temp files

    # other settings: refused with the difference named, the partial work untouched
    before = partial.read_bytes()
    other = [a if a != "48" else "32" for a in ARGS]
    p = cli("--target", target, "--prompts", prompts, *other, "--out", out, cwd=tmp_path, log=tmp_path / "2.log")
    assert p.wait(timeout=900) == 2
    assert "max_new_tokens was 48, this run 32" in (tmp_path / "2.log").read_text()
    assert partial.read_bytes() == before

    # a write cut short by the kill: the torn line is dropped and its prompt generated again
    partial.write_text(partial.read_text() + '{"id": "3", "prompt_ids": [1, 2')
    p = cli("--target", target, "--prompts", prompts, *ARGS, "--out", out, cwd=tmp_path, log=tmp_path / "3.log")
    assert p.wait(timeout=900) == 0, (tmp_path / "3.log").read_text()[-3000:]
    log3 = (tmp_path / "3.log").read_text()
    assert "dropped a torn last line" in log3
    assert log_counts(log3) == (k, N_PROMPTS - k)
    assert out.read_bytes() == ref and not partial.exists()


@pytest.mark.slow
def test_snakemake_keeps_partial_work_of_a_killed_job(tiny, tmp_path):
    """kill -9 of the completions job under Snakemake: the job fails, Snakemake cleans its declared output but
    not the sidecar; the rerun of the workflow resumes and ends with the uninterrupted run's bytes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_workflow import CI_PROFILE, copy_workflow, smk

    root, target, prompts, ref = tiny
    wd = copy_workflow(tmp_path / "wf")
    (wd / "tiny_target").symlink_to(target, target_is_directory=True)
    (wd / "p.txt").write_text((root / "p.txt").read_text())
    cfg = yaml.safe_load((wd / "config" / "config.yaml").read_text())
    cfg.update({"run": "r", "target": {"name": "tiny", "path": "tiny_target"},
                "prompt_set": {"n": 0, "max_prompt_tokens": 0},
                "prompt_sets": {"set_a": {"source": "file", "path": "p.txt"}},
                "generation": {"max_new_tokens": 48, "batch_size": 2, "device": "cpu", "dtype": "float32"},
                "cache": {"target_layer_ids": [1, 2]},
                "checkpoints": {"demo": [{"name": "d", "step": 1, "random_init": True, "layer_ids": [1, 2],
                                          "block_size": 4, "seed": 0}]}})
    (wd / "config" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    goal = "results/r/completions/set_a.jsonl"
    out, partial = wd / goal, wd / "results/r/completions/.set_a.jsonl.partial"
    job_log = wd / "logs/completions/r/set_a.log"
    run = subprocess.Popen([sys.executable, "-m", "snakemake", "--workflow-profile", str(CI_PROFILE), goal], cwd=wd,
                           env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t0 = time.time()
    while rows_in(partial) < 4:
        assert run.poll() is None and time.time() - t0 < 900, run.stdout.read() if run.poll() is not None else ""
        time.sleep(0.01)
    job = next(pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
               if _argv(pid)[1:4] == ["-m", "dflash_eval", "completions"] and _cwd(pid) == str(wd))
    os.kill(job, signal.SIGKILL)
    text = run.communicate(timeout=300)[0]
    assert run.returncode != 0, text
    assert not out.exists() and partial.exists()
    k = rows_in(partial)
    assert 4 <= k < N_PROMPTS
    smk(wd, "--workflow-profile", str(CI_PROFILE), goal)
    assert log_counts(job_log.read_text()) == (k, N_PROMPTS - k)
    # same prompts file as the direct run (same tokenizer, same file): same bytes
    assert (wd / "results/r/prompts/set_a.jsonl").read_bytes() == prompts.read_bytes()
    assert out.read_bytes() == ref and not partial.exists()


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return ""
