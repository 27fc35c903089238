"""watch without Snakemake: the config it reads, the generated per-checkpoint config, the order of
pending checkpoints, state from the results folder (done / failed records), stop conditions."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import yaml

from dflash_eval.core.errors import InputError
from dflash_eval.watch import Watcher, WatchOptions, load_config


def _ckpt(path, step):
    torch.save({"model": {"layers.0.fc.weight": torch.ones(2, 2)}, "step": step}, path)
    old = time.time() - 3600
    os.utime(path, (old, old))


@pytest.fixture
def wd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train").mkdir()
    (tmp_path / "my.yaml").write_text(yaml.safe_dump({
        "run": "r", "prompt_sets": {"b": {"source": "humaneval"}, "a": {"source": "sharegpt"}},
        "watch": {"dir": "train", "settle_s": 5, "overrides": {"target_layer_ids": [1, 2]}}}))
    return tmp_path


def _watcher(wd, **cli):
    cfg = load_config(["my.yaml"])
    return Watcher(["my.yaml"], WatchOptions.from_config(cfg, **cli), cfg)


def test_config_defaults_and_cli_overrides(wd):
    w = _watcher(wd, until_step=50)
    assert (w.opts.dir, w.opts.poll_s, w.opts.settle_s, w.opts.until_step) == ("train", 60, 5, 50)
    assert w.opts.snakemake_args == ["--cores", "all", "--resources", "gpu=1"]
    assert w.prompt_sets == ["a", "b"] and w.run == "r"
    assert w.cfg["trackers"]["tensorboard"]["enabled"] is False  # schema defaults filled
    (wd / "bad.yaml").write_text("watch: {poll_s: 0}\n")
    with pytest.raises(InputError, match="watch.poll_s"):
        load_config(["bad.yaml"])
    (wd / "nodir.yaml").write_text("run: r\n")
    with pytest.raises(InputError, match="watch.dir: not set"):
        WatchOptions.from_config(load_config(["nodir.yaml"]))


def test_pending_order_done_and_failed_records(wd):
    for step in (300, 100, 200):
        _ckpt(wd / "train" / f"step{step}.pt", step)
    (wd / "train" / "step400.pt").write_bytes(b"PK\x03\x04half")  # being written
    w = _watcher(wd)
    assert [c.name for c in w.pending()] == ["step100", "step200", "step300"]
    w._write(w.record("done", "step100"), {"name": "step100", "step": 100})
    failed = [c for c in w.pending() if c.name == "step200"][0]
    w._write(w.record("failed", "step200"), {"signature": failed.signature})
    assert [c.name for c in w.pending()] == ["step300"]  # done: never again; failed: not with the same files
    _ckpt(wd / "train" / "step200.pt", 200)  # the trainer rewrote it: tried again
    os.utime(wd / "train" / "step200.pt", (time.time() - 60, time.time() - 60))
    assert [c.name for c in w.pending()] == ["step200", "step300"]
    # a restarted watch reads the same state from the results folder
    assert [c.name for c in _watcher(wd).pending()] == ["step200", "step300"]


def test_overlay_names_the_checkpoint_alone(wd):
    _ckpt(wd / "train" / "step100.pt", 100)
    w = _watcher(wd)
    cand = w.pending()[0]
    overlay = yaml.safe_load(w.overlay(cand).read_text())
    assert overlay == {"checkpoints": {"glob": "", "demo": [], "list": [
        {"name": "step100", "path": str((wd / "train" / "step100.pt").resolve()), "overrides": {"target_layer_ids": [1, 2]}}]}}
    assert w.targets("step100") == ["results/r/eval/step100/a.json", "results/r/eval/step100/b.json"]


def test_stop_conditions_and_the_lock(wd):
    _ckpt(wd / "train" / "step100.pt", 100)
    cand = _watcher(wd).pending()[0]
    assert _watcher(wd, until_step=100).stop_after(cand) and not _watcher(wd, until_step=101).stop_after(cand)
    (wd / "final.yaml").write_text(yaml.safe_dump({"watch": {"final_checkpoint": "step1*"}}))
    cfg = load_config(["my.yaml", "final.yaml"])
    assert Watcher(["my.yaml"], WatchOptions.from_config(cfg), cfg).stop_after(cand)
    first = _watcher(wd)
    first.lock()
    with pytest.raises(InputError, match="another watch of run 'r' is running"):
        _watcher(wd).lock()
    assert (wd / "results/r/watch/lock").read_text().strip() == str(os.getpid())


def test_once_with_nothing_complete_returns_and_a_stop_already_done(wd, capsys):
    (wd / "train" / "step1.pt").write_bytes(b"")
    assert _watcher(wd, once=True).run_forever() == 0
    w = _watcher(wd, until_step=100)
    w._write(w.record("done", "step100"), {"name": "step100", "step": 100, "path": "train/step100.pt"})
    assert w.run_forever() == 0  # returns at once: the stop checkpoint is already evaluated
    assert capsys.readouterr().out == ""
    assert json.loads(w.record("done", "step100").read_text())["step"] == 100
