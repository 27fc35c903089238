"""Continuous evaluation end to end: a fake trainer writes three checkpoints over time (one half-written
for a while) while `watch` follows its folder on the tiny workflow; a kill -9 in the middle of an
evaluation and a restart; the trackers hold one tau point per checkpoint at its step."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from test_workflow import CI_PROFILE, REPO, _demo_checkpoint, make_tiny_workdir
from tracker_files import mlflow_points, tensorboard_scalars, wandb_points

pytestmark = pytest.mark.slow


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["WANDB_SILENT"] = "true"
    return env


def _start(wd: Path, out: Path, *extra: str) -> subprocess.Popen:
    fh = open(out, "a")
    return subprocess.Popen([sys.executable, "-m", "dflash_eval", "watch", "--configfile", "watch.yaml", *extra],
                            cwd=wd, env=_env(), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def _wait(cond, what: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        if proc is not None and proc.poll() is not None and not cond():
            pytest.fail(f"watch exited {proc.returncode} while waiting for {what}\n{log.read_text()[-6000:] if log else ''}")
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}\n{log.read_text()[-6000:] if log else ''}")


def _lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("watch: ")]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_watch_evaluates_each_complete_checkpoint_once_across_a_kill(tmp_path):
    wd = make_tiny_workdir(
        tmp_path / "wf", prompt_sets={"set_a": {"source": "file", "path": "prompts/a.jsonl"}},
        checkpoints={"demo": []}, evaluate={"device": "cpu", "dtype": "float32", "batch_size": 4, "ddtree_budgets": [2, 4]})
    staged = wd / "ckpts"
    _demo_checkpoint(wd, "ckpts/step300.pt", step=300, seed=3)
    train = wd / "train"  # the trainer's output folder
    train.mkdir()
    (wd / "watch.yaml").write_text(yaml.safe_dump({
        "watch": {"dir": "train", "poll_s": 1, "settle_s": 1, "until_step": 300,
                  "snakemake_args": ["--workflow-profile", str(CI_PROFILE)]},
        "trackers": {"tensorboard": {"enabled": True}, "wandb": {"enabled": True}, "mlflow": {"enabled": True}},
    }))
    log_a, log_b = tmp_path / "watch-a.log", tmp_path / "watch-b.log"
    a = _start(wd, log_a)
    try:
        # the trainer saves step100, then starts step200 and stops half-way for a while
        shutil.copy2(staged / "step100.pt", train / "step100.pt")
        whole = (staged / "step200.pt").read_bytes()
        with open(train / "step200.pt", "wb") as fh:
            fh.write(whole[: len(whole) // 2])
        _wait(lambda: any(" step100:" in x for x in _lines(log_a)), "step100 evaluated", 900, a, log_a)
        # a second watch of the same run is refused while the first one runs
        second = subprocess.run([sys.executable, "-m", "dflash_eval", "watch", "--configfile", "watch.yaml", "--once"],
                                cwd=wd, env=_env(), capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "another watch of run 'tiny' is running" in second.stderr
        time.sleep(4)  # several polls: the half-written checkpoint is still not taken
        assert not (wd / "results/tiny/watch/configs/step200.yaml").exists()
        assert not (wd / "results/tiny/eval/step200").exists()
        assert "waiting for train/step200.pt: step200.pt: not a whole zip archive yet" in log_a.read_text()
        with open(train / "step200.pt", "ab") as fh:  # the trainer finishes the file
            fh.write(whole[len(whole) // 2:])
        _wait(lambda: any(" step200:" in x for x in _lines(log_a)), "step200 evaluated", 600, a, log_a)
        done_mtimes = {p: p.stat().st_mtime_ns for p in (wd / "results/tiny/eval").rglob("*.json")}
        assert len(done_mtimes) == 2
        # step300: kill -9 the watch while Snakemake evaluates it
        shutil.copy2(staged / "step300.pt", train / "step300.pt")
        _wait(lambda: (wd / "results/tiny/watch/configs/step300.yaml").exists(), "step300 started", 300, a, log_a)
        time.sleep(2)
        a.send_signal(signal.SIGKILL)
        a.wait(30)
        assert not (wd / "results/tiny/watch/done/step300.json").exists()
        b = _start(wd, log_b)
        assert b.wait(600) == 0, log_b.read_text()[-6000:]
    finally:
        for p in (a, locals().get("b")):
            if p is not None and p.poll() is None:
                p.kill()
    lines = _lines(log_a) + _lines(log_b)
    assert [x.split(":")[1].split()[-1] for x in lines] == ["step100", "step200", "step300"], lines
    assert all(" step300:" in x for x in _lines(log_b))  # the restart evaluated only what was not done
    assert {p: p.stat().st_mtime_ns for p in done_mtimes} == done_mtimes
    assert sorted(p.stem for p in (wd / "results/tiny/watch/done").glob("*.json")) == ["step100", "step200", "step300"]
    # the trainer's files were only read
    assert sorted(p.name for p in train.iterdir()) == ["step100.pt", "step200.pt", "step300.pt"]
    assert all(_sha(train / n) == _sha(staged / n) for n in ("step100.pt", "step200.pt", "step300.pt"))
    # one tau point per checkpoint, at its training step, in each tracker
    tau = pd.read_csv(wd / "results/tiny/watch/tau.csv")
    assert sorted(zip(tau["checkpoint"], tau["step"])) == [("step100", 100), ("step200", 200), ("step300", 300)]
    want = sorted(zip(tau["step"].astype(int), tau["tau"]))

    def same(points):
        points = sorted(points)
        return [s for s, _ in points] == [100, 200, 300] and all(abs(v - w) < 1e-4 for (_, v), (_, w) in zip(points, want))

    assert same(tensorboard_scalars(wd / "results/tiny/tensorboard/tiny")["dflash_eval/set_a/tau"])
    assert same(wandb_points(wd / "results/tiny/wandb", "dflash-eval-tiny", "dflash_eval/step")["dflash_eval/set_a/tau"])
    rec = json.loads((wd / "results/tiny/watch/done/step300.json").read_text())
    ml = mlflow_points(rec["trackers"]["mlflow"]["tracking_uri"], rec["trackers"]["mlflow"]["run_id"])
    assert same(ml["dflash_eval/set_a/tau"])
    assert [s for s, _ in ml["dflash_eval/set_a/tau_ddtree_2"]] == [100, 200, 300]


def test_watch_line_names_each_sampling_setting_and_ranks_by_the_first():
    """The per-checkpoint line with two sampling settings per prompt set: the second is labelled, and the
    best-so-far is ranked by the first configured setting (T0 here), not by whichever row is larger."""
    from types import SimpleNamespace

    from dflash_eval.watch import Watcher

    df = pd.DataFrame([("step100", 100, "humaneval", "T0", 1.5), ("step100", 100, "humaneval", "T1_p0.95_k20", 2.5),
                       ("step200", 200, "humaneval", "T0", 2.0), ("step200", 200, "humaneval", "T1_p0.95_k20", 1.25)],
                      columns=["checkpoint", "step", "prompt_set", "sampling", "tau"])
    line = Watcher.line(None, SimpleNamespace(name="step100", step=100), df)
    assert line == "watch: step 100 step100: tau humaneval 1.500 humaneval@T1_p0.95_k20 2.500 | best humaneval 2.000 (step 200)"
