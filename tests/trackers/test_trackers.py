"""Trackers: one tau point per checkpoint, metric and step in TensorBoard, W&B (offline) and MLflow (file
store), read back with each tracker's own reader; no duplicate after re-logging or a rerun."""

from __future__ import annotations

import json
import shutil
import math
import sys
from pathlib import Path

import pandas as pd
import pytest

from dflash_eval.core.errors import InputError
from dflash_eval.trackers.log import (NEW_RUN_FIELD, log_table, table_points, tensorboard_run_dir, write_tensorboard)
from tracker_files import mlflow_points, tensorboard_scalars, wandb_points

pytest.importorskip("tensorboard")

# values exactly representable in float32 (TensorBoard stores float32)
ROWS = [  # checkpoint, step, prompt set, tau, tau_ddtree_8, accept_slot_1, accept_slot_2
    ("ck-a", 100, "humaneval", 1.5, 2.25, 0.5, 0.25),
    ("ck-a", 100, "gsm8k", 1.75, 2.5, 0.625, math.nan),
    ("ck-b", 200, "humaneval", 2.0, 3.0, 0.75, 0.375),
    ("ck-b", 200, "gsm8k", 2.125, 3.125, 0.8125, 0.5),
    ("ck-c", 300, "humaneval", 2.5, 3.5, 0.875, 0.5625),
    ("ck-c", 300, "gsm8k", 2.75, 3.75, 0.9375, 0.625),
    ("nostep", None, "humaneval", 9.0, 9.0, 0.5, 0.5),
]


def table(upto: int = 300) -> pd.DataFrame:
    rows = [r for r in ROWS if r[1] is None or r[1] <= upto]
    df = pd.DataFrame(rows, columns=["checkpoint", "step", "prompt_set", "tau", "tau_ddtree_8", "accept_slot_1",
                                     "accept_slot_2"])
    df["step"] = df["step"].astype("Int64")
    df["n_samples"] = 4  # not a metric column
    return df


def expected(upto: int = 300, prefix: str = "dflash_eval") -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list] = {}
    for ck, step, ps, *vals in ROWS:
        if step is None or step > upto:
            continue
        for col, v in zip(["tau", "tau_ddtree_8", "accept_slot_1", "accept_slot_2"], vals):
            if not math.isnan(v):
                out.setdefault(f"{prefix}/{ps}/{col}", []).append((step, v))
    return {k: sorted(v) for k, v in out.items()}


def as_points(points) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list] = {}
    for p in points:
        out.setdefault(p.tag, []).append((p.step, p.value))
    return {k: sorted(v) for k, v in out.items()}


def test_table_points_are_one_per_checkpoint_metric_and_step(caplog):
    pts = table_points(table())
    assert as_points(pts) == expected()
    assert len(pts) == 23 and "n_samples" not in {p.tag.rsplit("/", 1)[1] for p in pts}
    assert "no training step known for nostep" in caplog.text
    # a later column (e.g. a sampling setting's tau) is logged without code changes
    df = table().assign(tau_T1_0=1.25)
    assert {p.tag for p in table_points(df)} >= {"dflash_eval/humaneval/tau_T1_0"}
    # two checkpoints at one step: the first by name is kept, the other is named
    dup = pd.concat([table(100), table(100).assign(checkpoint="ck-z", tau=7.0)])
    notes: list[str] = []
    assert as_points(table_points(dup, notes=notes))["dflash_eval/humaneval/tau"] == [(100, 1.5)]
    assert "ck-a and ck-z are both at step 100" in caplog.text
    # both also go into trackers.json (the workflow prints them at its end)
    assert notes == ["trackers: no training step known for ck-z, nostep: not logged (a step comes from the checkpoint's own "
                     "'step' / 'global_step', its folder's trainer_state.json / training_state.json, or its name, e.g. "
                     "step1500)", "trackers: ck-a and ck-z are both at step 100: its points are logged from ck-a only "
                     "(give each checkpoint its own step: checkpoints.list 'step', or its name)"]


def test_trackers_json_holds_the_checkpoints_left_out_and_the_workflow_prints_them(tmp_path, monkeypatch):
    import os
    from types import SimpleNamespace

    from dflash_eval.trackers.log import run_warnings

    monkeypatch.chdir(tmp_path)
    record = log_table(table(100), {"tensorboard": {"enabled": True}}, "demo")
    assert record["warnings"] == [table_points(table(100), notes=(n := [])) and n[0]]
    out = tmp_path / "trackers.json"
    out.write_text(json.dumps(record))
    plan = SimpleNamespace(trackers_outputs=lambda: [str(out)])
    assert run_warnings(plan, since=out.stat().st_mtime - 1) == record["warnings"]
    os.utime(out, (1000, 1000))  # written by an earlier run: not printed again
    assert run_warnings(plan, since=2000) == []


def test_table_points_tag_each_sampling_setting():
    """One tau-table row per sampling setting: the first configured setting keeps the plain tags, the
    others carry their label, so a T = 1 tau is never dropped or mistaken for the greedy one."""
    df = pd.DataFrame([("ck-a", 100, "humaneval", "T0", 1.5), ("ck-a", 100, "humaneval", "T1_p0.95_k20", 1.25),
                       ("ck-b", 200, "humaneval", "T0", 2.0), ("ck-b", 200, "humaneval", "T1_p0.95_k20", 1.75)],
                      columns=["checkpoint", "step", "prompt_set", "sampling", "tau"])
    df["step"] = df["step"].astype("Int64")
    got = {(p.step, p.tag): p.value for p in table_points(df)}
    assert got == {(100, "dflash_eval/humaneval/tau"): 1.5, (100, "dflash_eval/humaneval/T1_p0.95_k20/tau"): 1.25,
                   (200, "dflash_eval/humaneval/tau"): 2.0, (200, "dflash_eval/humaneval/T1_p0.95_k20/tau"): 1.75}


def test_tensorboard_each_point_once_after_relogging_and_a_live_reader_agrees(tmp_path):
    run_dir = tmp_path / "tb" / "demo"
    first = write_tensorboard(table_points(table(200)), run_dir)
    assert (first["logged"], first["already"]) == (15, 0)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    live = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})  # a TensorBoard already running
    live.Reload()
    assert [e.step for e in live.Scalars("dflash_eval/humaneval/tau")] == [100, 200]
    again = write_tensorboard(table_points(table(200)), run_dir)  # a rerun re-logs the same table
    assert again == {"file": None, "logged": 0, "already": 15}
    third = write_tensorboard(table_points(table(300)), run_dir)  # a third checkpoint
    assert (third["logged"], third["already"]) == (8, 15)
    files = sorted(p.name for p in run_dir.iterdir())
    assert files == [Path(first["file"]).name, Path(third["file"]).name]  # the new file sorts after the first
    assert all(f.startswith("events.out.tfevents.") and f.endswith(".dflash-eval") for f in files)
    assert tensorboard_scalars(run_dir) == expected()
    live.Reload()
    assert [(e.step, e.value) for e in live.Scalars("dflash_eval/humaneval/tau")] == [(100, 1.5), (200, 2.0), (300, 2.5)]


def test_tensorboard_partial_file_of_a_killed_writer_is_ignored_and_removed(tmp_path):
    run_dir = tmp_path / "demo"
    run_dir.mkdir()
    (run_dir / ".000001.999.dflash-eval.partial").write_bytes(b"\x00" * 10)  # TensorBoard skips it: no 'tfevents'
    out = write_tensorboard(table_points(table(100)), run_dir)
    assert out["logged"] == 7 and sorted(p.name for p in run_dir.iterdir()) == [Path(out["file"]).name]
    assert tensorboard_scalars(run_dir) == expected(100)


def test_wandb_offline_run_files_hold_each_point_once(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = {"wandb": {"enabled": True}}
    out = log_table(table(100), cfg, "demo")
    assert out["wandb"] == {"run_id": "dflash-eval-demo", "mode": "offline", "dir": "results/demo", "logged": 7,
                            "already": 0}
    assert log_table(table(100), cfg, "demo")["wandb"]["logged"] == 0  # nothing new: no W&B run opened
    out = log_table(table(300), cfg, "demo")
    assert (out["wandb"]["logged"], out["wandb"]["already"]) == (16, 7)
    got = wandb_points(tmp_path / "results/demo/wandb", "dflash-eval-demo", "dflash_eval/step")
    assert {k: sorted(v) for k, v in got.items()} == expected()
    ledger = json.loads((tmp_path / "results/demo/trackers/wandb-dflash-eval-demo.json").read_text())
    assert sorted(ledger["logged"]) == ["100", "200", "300"] and len(ledger["logged"]["100"]) == 7


def test_wandb_run_id_and_prefix_are_configurable(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = {"prefix": "tau", "wandb": {"enabled": True, "run_id": "train-run-7", "dir": "wb", "project": "p"}}
    assert log_table(table(100), cfg, "demo")["wandb"]["run_id"] == "train-run-7"
    got = wandb_points(tmp_path / "wb/wandb", "train-run-7", "tau/step")
    assert {k: sorted(v) for k, v in got.items()} == expected(100, prefix="tau")


def test_mlflow_file_store_holds_each_point_once(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    cfg = {"mlflow": {"enabled": True}}
    first = log_table(table(200), cfg, "demo")["mlflow"]
    assert first["tracking_uri"] == (tmp_path / "results/demo/mlruns").as_uri() and first["logged"] == 15
    again = log_table(table(300), cfg, "demo")["mlflow"]
    assert again["run_id"] == first["run_id"] and (again["logged"], again["already"]) == (8, 15)
    assert log_table(table(300), cfg, "demo")["mlflow"]["logged"] == 0
    assert mlflow_points(first["tracking_uri"], first["run_id"]) == expected()
    # attach to an existing run (e.g. the training run) by id
    with pytest.raises(InputError, match="trackers.mlflow.run_id: run 'nope' not found"):
        log_table(table(), {"mlflow": {"enabled": True, "run_id": "nope"}}, "demo")


def test_off_by_default_and_a_missing_library_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert log_table(table(), {}, "demo") == {}
    assert log_table(table(), {"tensorboard": {"enabled": False}}, "demo") == {}
    assert not (tmp_path / "results").exists()
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(InputError, match="trackers.mlflow.enabled: the mlflow client library is not installed.*"
                                         "requirements-trackers.txt"):
        log_table(table(), {"mlflow": {"enabled": True}}, "demo")


def test_log_table_reads_the_tau_table_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    table().to_parquet(tmp_path / "tau.parquet")
    table().to_csv(tmp_path / "tau.csv", index=False)
    cfg = {"tensorboard": {"enabled": True}}
    for name in ("tau.parquet", "tau.csv"):
        out = log_table(tmp_path / name, cfg, "demo")
        assert out["points"] == 23
    assert tensorboard_scalars(tensorboard_run_dir(cfg, "demo")) == expected()
    with pytest.raises(InputError, match="tau table not found"):
        log_table(tmp_path / "missing.parquet", cfg, "demo")


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "mlflow"])
def test_a_value_that_changed_since_it_was_logged_is_refused(tmp_path, monkeypatch, tracker):
    """After a rerun that changed tau (max_new_tokens 48 -> 40: tau.csv 1.2782 -> 1.2850),
    TensorBoard kept the old value with 'already: 30, logged: 0' and no word. A tracker run holds one value per
    (step, tag): a changed one is refused before anything is sent, naming the point, both values and the fix."""
    pytest.importorskip(tracker)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = {tracker: {"enabled": True}}
    assert log_table(table(200), cfg, "demo")[tracker]["logged"] == 15
    assert log_table(table(200), cfg, "demo")[tracker]["logged"] == 0  # the same values again: nothing to do
    rerun = table(300)
    rerun.loc[(rerun["step"] == 200) & (rerun["prompt_set"] == "humaneval"), "tau"] += 0.0068  # a re-evaluation moved one checkpoint's tau
    with pytest.raises(InputError) as err:
        log_table(rerun, cfg, "demo")
    e = err.value
    assert e.field == "step 200: dflash_eval/humaneval/tau" and "logged as 2, but the tau table now says 2.0068" in e.problem
    assert "1 point(s) changed" in e.problem and "a tracker run holds one value per step and tag" in e.problem
    new_run = {"tensorboard": "run_name", "wandb": "run_id", "mlflow": "experiment"}[tracker]
    assert f"trackers.{tracker}.{new_run}" in e.fix
    if tracker == "tensorboard":
        assert tensorboard_scalars(tensorboard_run_dir(cfg, "demo")) == expected(200)  # nothing was sent
    cfg[tracker][new_run] = "demo-v2"  # a new run takes the new values
    assert log_table(rerun, cfg, "demo")[tracker]["logged"] == 23
    assert log_table(table(300), {tracker: {"enabled": True}}, "demo")[tracker]["logged"] == 8  # unchanged: logged


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "mlflow"])
def test_points_the_table_no_longer_has_are_named(tmp_path, monkeypatch, tracker):
    """Two configs sharing one run name (or a checkpoint removed from the run) left the other's
    step-2000 point in the TensorBoard and W&B runs, in no row of tau.csv, with trackers.json saying "already 13"
    and no word. A tracker cannot take a point back: trackers.json warns (printed at the end of the run)."""
    pytest.importorskip(tracker)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = {tracker: {"enabled": True}}
    first = log_table(table(300), cfg, "demo")
    assert first[tracker]["logged"] == 23 and "stale" not in first[tracker] and "warnings" in first  # nostep only
    out = log_table(table(200), cfg, "demo")  # ck-c (step 300) no longer in the run
    assert (out[tracker]["logged"], out[tracker]["stale"], out[tracker]["stale_steps"]) == (0, 8, [300])
    assert out["warnings"][-1] == (
        f"{tracker}: the tracker run holds 8 point(s) at step(s) 300 that the tau table no longer has (a checkpoint "
        "removed from the run, or another config logging under the same run name): a tracker cannot take them back; "
        f"to see only this table's, log to a new run (trackers.{tracker}.{NEW_RUN_FIELD[tracker]})")


def test_a_damaged_tensorboard_event_file_is_an_error_not_nothing_logged(tmp_path):
    """One byte flipped in a dflash-eval event file made TensorBoard's loader stop there
    without a word, so the run read as empty and a changed tau was logged beside the old one. The records'
    CRC32C checks are errors now, naming the file."""
    run_dir = tmp_path / "tb" / "demo"
    first = write_tensorboard(table_points(table(200)), run_dir)
    f = Path(first["file"])
    data = bytearray(f.read_bytes())
    head = 12 + int.from_bytes(data[:8], "little") + 4  # the second record: the first scalar
    data[head + 12 + 5] ^= 0xFF
    f.write_bytes(bytes(data))
    changed = table(200)
    changed.loc[0, "tau"] += 0.5
    for points in (table_points(table(200)), table_points(changed)):
        with pytest.raises(InputError) as err:
            write_tensorboard(points, run_dir)
        assert Path(err.value.file) == f and "a damaged TensorBoard event file" in err.value.problem
        assert "failed event crc32 check" in err.value.problem and "run_name" in err.value.fix
    f.write_bytes(bytes(data[: head + 6]))  # truncated inside a record
    with pytest.raises(InputError, match="truncated record"):
        write_tensorboard(table_points(table(200)), run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == [f.name]  # nothing written beside it


def test_wandb_ledger_missing_beside_its_runs_is_refused(tmp_path, monkeypatch):
    """The ledger deleted while results/<run>/wandb holds the run: every point would go to the same W&B run again
    (a second value per step). Refused."""
    pytest.importorskip("wandb")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = {"wandb": {"enabled": True}}
    assert log_table(table(100), cfg, "demo")["wandb"]["logged"] == 7
    ledger = tmp_path / "results/demo/trackers/wandb-dflash-eval-demo.json"
    saved = ledger.read_text()
    ledger.unlink()
    with pytest.raises(InputError) as err:
        log_table(table(200), cfg, "demo")
    assert Path(err.value.file).resolve() == ledger and "holds 1 local run folder(s) of W&B run 'dflash-eval-demo'" in (
        err.value.problem) and "trackers.wandb.run_id" in err.value.fix
    ledger.write_text(saved)
    assert log_table(table(200), cfg, "demo")["wandb"]["logged"] == 8
    # the offline run folders removed (synced, or lost): said, not silently taken as logged
    shutil.move(tmp_path / "results/demo/wandb", tmp_path / "wandb-moved")
    got = log_table(table(200), cfg, "demo")["wandb"]
    assert got["logged"] == 0 and "holds no folder of that run: if it was not synced" in got["warning"]




def test_tau_se_is_logged_beside_tau(tmp_path, monkeypatch):
    """tau_se (the standard error of tau over prompts) gets its own point at the checkpoint's step, beside tau, in
    every setting's scope; read back from TensorBoard and from the MLflow file store."""
    df = pd.DataFrame([("ck-a", 100, "humaneval", "T0", 1.5, 0.25), ("ck-a", 100, "humaneval", "T1", 1.25, 0.125),
                       ("ck-b", 200, "humaneval", "T0", 2.0, 0.375), ("ck-b", 200, "humaneval", "T1", 1.75, math.nan)],
                      columns=["checkpoint", "step", "prompt_set", "sampling", "tau", "tau_se"])
    df["step"] = df["step"].astype("Int64")
    want = {"dflash_eval/humaneval/tau": [(100, 1.5), (200, 2.0)],
            "dflash_eval/humaneval/tau_se": [(100, 0.25), (200, 0.375)],
            "dflash_eval/humaneval/T1/tau": [(100, 1.25), (200, 1.75)],
            "dflash_eval/humaneval/T1/tau_se": [(100, 0.125)]}  # an empty SE (one response) is not logged
    assert as_points(table_points(df)) == want
    write_tensorboard(table_points(df), tmp_path / "tb")
    assert tensorboard_scalars(tmp_path / "tb") == want
    pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)
    out = log_table(df, {"mlflow": {"enabled": True}}, "demo")["mlflow"]
    assert mlflow_points(out["tracking_uri"], out["run_id"]) == want
