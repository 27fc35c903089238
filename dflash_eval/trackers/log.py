"""Tau where trainers look: the tau table logged to TensorBoard, W&B and MLflow at each checkpoint's step.

Every tau-table row with a known ``step`` gives one point per metric column (:data:`METRIC_PREFIXES`),
tagged ``<prefix>/<prompt set>/<column>`` (other sampling settings: ``.../<sampling label>/<column>``).
Each (step, tag) is sent once; a changed value is refused (:func:`check_unchanged`).

Tags, deduplication and each tracker: docs/trainers.md, "Tags, no duplicate points, and each tracker in detail".
"""
from __future__ import annotations

import glob
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from dflash_eval.core.errors import InputError, atomic_path
from dflash_eval.core.io import read_json_object

log = logging.getLogger(__name__)

#: tau table columns logged as metrics (by name prefix): ``tau``, its standard error ``tau_se`` beside it, every other
#: ``tau_*`` column and ``accept_slot_<k>``
METRIC_PREFIXES = ("tau", "accept_slot_")
TB_SUFFIX = ".dflash-eval"
_TB_NAME = re.compile(r"^events\.out\.tfevents\.(\d+)\.(\d+)" + re.escape(TB_SUFFIX) + "$")


@dataclass(frozen=True)
class Point:
    """One scalar at one training step."""

    step: int
    tag: str  #: ``<prefix>/<prompt set>/<column>``
    value: float
    checkpoint: str


def read_table(path: str | Path):
    """The tau table at ``path`` (``.parquet`` or ``.csv``) as a DataFrame.

    Raises:
        InputError: missing file, an unreadable parquet file (:func:`dflash_eval.report.tau_table.read_parquet`),
            or no ``checkpoint`` / ``step`` / ``prompt_set`` column.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(path, None, "tau table not found", "run the summary stage first (results/<run>/tau.parquet)")
    from dflash_eval.report.tau_table import read_table_file  # deferred: pandas; this module is parse time and trackers --help stays pandas-free

    df = read_table_file(path)
    for col in ("checkpoint", "step", "prompt_set"):
        if col not in df.columns:
            raise InputError(path, col, "missing column: not a tau table", "pass results/<run>/tau.parquet or tau.csv")
    return df


def table_points(df, prefix: str = "dflash_eval", notes: list[str] | None = None) -> list[Point]:
    """The points of a tau table (see the module docstring), sorted by (step, tag).

    A checkpoint without a step is left out; two checkpoints at the same step would put two values on one
    (step, tag): the first by checkpoint name is kept. Both are warned about (the log) and, with ``notes``,
    appended there (:func:`log_table` puts them in ``trackers.json``, the workflow prints them at its end).
    """
    notes = [] if notes is None else notes
    cols = [c for c in df.columns if str(c).startswith(METRIC_PREFIXES)]
    points: dict[tuple[int, str], Point] = {}
    no_step = sorted({str(c) for c, s in zip(df["checkpoint"], df["step"].isna()) if s})
    if no_step:
        notes.append(f"trackers: no training step known for {', '.join(no_step)}: not logged (a step comes from the "
                     "checkpoint's own 'step' / 'global_step', its folder's trainer_state.json / training_state.json, "
                     "or its name, e.g. step1500)")
        log.warning("%s", notes[-1])
    shared: dict[tuple[str, str, int], None] = {}
    if "sampling" in df.columns:  # the first row of a (checkpoint, prompt set) is its first configured setting
        first = ~df.duplicated(["checkpoint", "prompt_set"])
        drafts = df["draft"] if "draft" in df.columns else ["reference"] * len(df)
        df = df.assign(tag_scope=[f"{ps}" if f else f"{ps}/{lab}" + ("" if d == "reference" else f"_{d}")
                               for ps, lab, d, f in zip(df["prompt_set"], df["sampling"], drafts, first)])
    else:
        df = df.assign(tag_scope=df["prompt_set"].astype(str))
    df = df[df["step"].notna()].sort_values(["checkpoint", "prompt_set"], kind="stable")
    for row, missing in zip(df.itertuples(index=False), df[cols].isna().itertuples(index=False)):
        rec = row._asdict()
        for col, gone in zip(cols, missing):
            v = rec.get(col)
            if v is None or gone:
                continue
            key = (int(rec["step"]), f"{prefix}/{rec['tag_scope']}/{col}")
            if key in points:
                if points[key].checkpoint != rec["checkpoint"]:
                    shared[(points[key].checkpoint, str(rec["checkpoint"]), key[0])] = None
                continue
            points[key] = Point(key[0], key[1], float(v), str(rec["checkpoint"]))
    for kept, other, step in shared:
        notes.append(f"trackers: {kept} and {other} are both at step {step}: its points are logged from {kept} only "
                     "(give each checkpoint its own step: checkpoints.list 'step', or its name)")
        log.warning("%s", notes[-1])
    return [points[k] for k in sorted(points)]


def check_unchanged(points: Iterable[Point], have: dict[tuple[int, str], float], where: str | Path,
                    new_run: str) -> None:
    """Refuse points whose (step, tag) the tracker run holds with another value.

    Args:
        have: ``{(step, tag): value}`` the run holds (the last one written per pair).
        where: the tracker run (folder, ledger or store URI) for the message.
        new_run: the config field that names another run (the fix).

    Raises:
        InputError: ``(where, "step <s>: <tag>", ...)`` for the first changed point, with both values and how
            many points changed (values compared at float32 precision: TensorBoard stores float32).
    """
    changed = [(p, have[(p.step, p.tag)]) for p in points if (p.step, p.tag) in have
               and not math.isclose(p.value, have[(p.step, p.tag)], rel_tol=1e-6, abs_tol=1e-7)]
    if changed:
        p, old = changed[0]
        raise InputError(where, f"step {p.step}: {p.tag}", f"logged as {old:.6g}, but the tau table now says "
                         f"{p.value:.6g} ({p.checkpoint}; {len(changed)} point(s) changed since they were logged: "
                         "a re-evaluation with other code or settings, or another checkpoint now at that step): a "
                         "tracker run holds one value per "
                         "step and tag", f"log to a new run (set {new_run}), or delete that run and log afresh (snakemake "
                         "--forcerun trackers: results/<run>/trackers.json alone says nothing of the trackers)")


def stale_points(points: Iterable[Point], have: Iterable[tuple[int, str]]) -> dict:
    """What a tracker run holds that the tau table no longer has: ``{"stale": n, "stale_steps": [steps]}`` (``{}``
    when none). A tracker cannot take a point back: a checkpoint removed from the run, or another config logging
    under the same run name, leaves its points there; :func:`log_table` warns."""
    now = {(p.step, p.tag) for p in points}
    gone = sorted({k for k in have if k not in now})
    return {"stale": len(gone), "stale_steps": sorted({s for s, _ in gone})} if gone else {}


def _by_step(points: Iterable[Point]) -> dict[int, list[Point]]:
    out: dict[int, list[Point]] = {}
    for p in points:
        out.setdefault(p.step, []).append(p)
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------- TensorBoard
def _tensorboard():
    """``(DecodeError, event_pb2, summary_pb2, errors, pywrap_tensorflow, RecordWriter)`` of tensorboard."""
    from google.protobuf.message import DecodeError  # deferred: optional package (tensorboard); parse-time module
    from tensorboard.compat.proto import event_pb2, summary_pb2  # deferred: optional package (tensorboard)
    from tensorboard.compat.tensorflow_stub import errors, pywrap_tensorflow  # deferred: optional package (tensorboard)
    from tensorboard.summary.writer.record_writer import RecordWriter  # deferred: optional package (tensorboard)

    return DecodeError, event_pb2, summary_pb2, errors, pywrap_tensorflow, RecordWriter


def tensorboard_logged(run_dir: str | Path) -> dict[tuple[int, str], float]:
    """``{(step, tag): value}`` of every scalar in the dflash-eval event files of ``run_dir`` (float32 values, the
    last file's where a pair repeats), read with tensorboard's record reader, whose CRC32C checks are errors here
    (TensorBoard's own loader stops at a damaged record silently, which would read as "nothing logged").

    Raises:
        InputError: a damaged or truncated event file (a record failing its checksum, or not an Event).
    """
    DecodeError, event_pb2, _, tb_errors, pywrap_tensorflow, _ = _tensorboard()

    run_dir = Path(run_dir)
    have = {}
    for f in sorted(run_dir.glob(f"events.out.tfevents.*{TB_SUFFIX}")) if run_dir.is_dir() else ():
        reader = pywrap_tensorflow.PyRecordReader_New(str(f))
        try:
            while True:
                try:
                    reader.GetNext()
                except tb_errors.OutOfRangeError:  # the end of the file
                    break
                event = event_pb2.Event.FromString(reader.record())
                for v in event.summary.value:
                    have[(int(event.step), v.tag)] = float(v.simple_value)
        except (tb_errors.DataLossError, DecodeError) as err:
            raise InputError(f, None, f"a damaged TensorBoard event file ({err}): what it holds cannot be compared "
                             "with the tau table", "delete that run folder and log afresh (snakemake --forcerun trackers), or log to a new run "
                             "(trackers.tensorboard.run_name)") from None
        finally:
            reader.file_handle.close()
    return have


def write_tensorboard(points: list[Point], run_dir: str | Path) -> dict:
    """Write the points the run folder's dflash-eval event files lack, as one new event file.

    The file is written complete under a name TensorBoard ignores (no ``tfevents`` in it), then
    renamed (``os.replace``) to ``events.out.tfevents.<time>.<n>.dflash-eval``, which sorts after
    the earlier ones, so that a TensorBoard already running reads it next. Uses tensorboard's own
    record writer and event protos (``tensorboard.summary.writer.record_writer``).

    Args:
        points: every point of the run (the whole table), any order.
        run_dir: the TensorBoard run folder (``<dir>/<run_name>``); created when missing.

    Returns:
        ``{"file": the new file or None, "logged": points written now, "already": points on disk}``.

    Raises:
        InputError: a point on disk with another value (:func:`check_unchanged`); a damaged event file
            (:func:`tensorboard_logged`).
    """
    _, event_pb2, summary_pb2, _, _, RecordWriter = _tensorboard()

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    have = tensorboard_logged(run_dir)
    check_unchanged(points, have, run_dir, "trackers.tensorboard.run_name")
    new = sorted((p for p in points if (p.step, p.tag) not in have), key=lambda p: (p.step, p.tag))
    out = {"file": None, "logged": len(new), "already": len(points) - len(new), **stale_points(points, have)}
    for stale in run_dir.glob(f".*{TB_SUFFIX}.partial"):  # left by a killed writer
        stale.unlink(missing_ok=True)
    if not new:
        return out
    old = sorted(int(m.group(2)) for m in map(_TB_NAME.match, (f.name for f in run_dir.iterdir())) if m)
    gen = old[-1] + 1 if old else 1
    wall = time.time()
    final = run_dir / f"events.out.tfevents.{int(wall):010d}.{gen:06d}{TB_SUFFIX}"
    tmp = run_dir / f".{gen:06d}.{os.getpid()}{TB_SUFFIX}.partial"
    with open(tmp, "wb") as fh:
        writer = RecordWriter(fh)
        writer.write(event_pb2.Event(wall_time=wall, file_version="brain.Event:2").SerializeToString())
        for p in new:
            value = summary_pb2.Summary.Value(tag=p.tag, simple_value=p.value)
            writer.write(event_pb2.Event(wall_time=wall, step=p.step,
                                         summary=summary_pb2.Summary(value=[value])).SerializeToString())
        writer.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    out["file"] = str(final)
    log.info("tensorboard: %d new points -> %s (%d already there)", len(new), final, out["already"])
    return out


def _with_files(out: dict, run_dir: Path) -> dict:
    """``out`` with ``files``: the dflash-eval event files of ``run_dir`` (names)."""
    return {**out, "run_dir": str(run_dir), "files": sorted(f.name for f in run_dir.iterdir() if _TB_NAME.match(f.name))}


# --------------------------------------------------------------------------- W&B
def _read_ledger(path: Path, wandb_dir: Path, run_id: str) -> tuple[dict[str, list[str]], dict[tuple[int, str], float]]:
    """The ledger's ``logged`` ({step: [tags]}) and its ``values`` as ``{(step, tag): value}``.

    Raises:
        InputError: an unreadable ledger; no ledger while ``wandb_dir`` holds runs of ``run_id`` (a deleted
            ledger would read as "nothing logged", and every point would go to that run again).
    """
    fix = f"restore {path}, or log to a new run (trackers.wandb.run_id)"
    if not path.is_file():
        runs = sorted(wandb_dir.glob(f"*run-*-{glob.escape(run_id)}")) if wandb_dir.is_dir() else []
        if runs:
            raise InputError(path, None, f"missing, but {wandb_dir} holds {len(runs)} local run folder(s) of W&B run "
                             f"{run_id!r} ({runs[-1].name}): what that run holds is unknown, and logging again would "
                             "give its steps a second value", fix + ", or delete those folders (and the run on the "
                             "W&B server) to log afresh")
        return {}, {}
    led = read_json_object(path, "W&B ledger", fix)
    values = {(int(step), str(tag)): float(v) for step, tags in (led.get("values") or {}).items()
              for tag, v in tags.items()}
    return {str(k): list(v) for k, v in (led.get("logged") or {}).items()}, values


def log_wandb(points: list[Point], cfg: dict, run: str, record_dir: str | Path, prefix: str = "dflash_eval") -> dict:
    """Log the points the ledger does not list yet to the W&B run (see the module docstring).

    Args:
        cfg: section ``trackers.wandb`` (``project``, ``entity``, ``run_id``, ``name``, ``mode``, ``dir``).
        run: the dflash-eval run name (default run id ``dflash-eval-<run>``, default dir ``results/<run>``).
        record_dir: where the ledger lives (``results/<run>/trackers``).

    Returns:
        ``{"run_id", "mode", "dir", "logged", "already"}`` (points sent now / skipped as already logged).

    Raises:
        InputError: a point the ledger lists with another value (:func:`check_unchanged`); a missing ledger
            (:func:`_read_ledger`).
    """
    import wandb  # deferred: optional package (wandb); parse-time module

    run_id = cfg.get("run_id") or f"dflash-eval-{run}"
    ledger_path = Path(record_dir) / f"wandb-{run_id}.json"
    done, values = _read_ledger(ledger_path, Path(cfg.get("dir") or os.path.join("results", run)) / "wandb", run_id)
    check_unchanged(points, values, ledger_path, "trackers.wandb.run_id")
    new = [p for p in points if p.tag not in set(done.get(str(p.step), ()))]
    out = {"run_id": run_id, "mode": cfg.get("mode", "offline"), "dir": cfg.get("dir") or os.path.join("results", run),
           "logged": len(new), "already": len(points) - len(new),
           **stale_points(points, {(int(step), tag) for step, tags in done.items() for tag in tags})}
    local = Path(out["dir"]) / "wandb"
    if out["mode"] == "offline" and done and not (local.is_dir() and any(local.glob(f"*run-*-{glob.escape(run_id)}"))):
        # offline points live in those folders until `wandb sync`; they are taken as logged
        out["warning"] = (f"the ledger {ledger_path} lists points logged offline to W&B run {run_id!r}, but {local} holds "
                          "no folder of that run: if it was not synced (wandb sync) before it was removed, those points "
                          "are lost; to log them again, delete the ledger (and the run on the W&B server, if any)")
        log.warning("%s", out["warning"])
    if not new:
        return out
    Path(out["dir"]).mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(console="off", x_disable_stats=True, silent=True)
    handle = wandb.init(project=cfg.get("project") or "dflash-eval", entity=cfg.get("entity") or None, id=run_id,
                        name=cfg.get("name") or None, resume="allow", mode=out["mode"],
                        dir=str(Path(out["dir"]).resolve()),  # W&B's service process has its own cwd
                        settings=settings)
    try:
        handle.define_metric(f"{prefix}/step")
        handle.define_metric(f"{prefix}/*", step_metric=f"{prefix}/step")
        for step, group in _by_step(new).items():
            handle.log({f"{prefix}/step": step, **{p.tag: p.value for p in group}})
    finally:
        handle.finish()
        wandb.teardown()  # stop W&B's service process too: a long-lived watch must not keep one per log
    for p in new:
        done.setdefault(str(p.step), []).append(p.tag)
        values[(p.step, p.tag)] = p.value
    by_step: dict[str, dict[str, float]] = {}
    for (step, tag), v in sorted(values.items()):
        by_step.setdefault(str(step), {})[tag] = v
    ledger_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(ledger_path) as tmp:
        tmp.write_text(json.dumps(
            {"run_id": run_id, "project": cfg.get("project") or "dflash-eval",
             "logged": {k: sorted(v) for k, v in sorted(done.items(), key=lambda kv: int(kv[0]))},
             "values": by_step}, indent=1))
    log.info("wandb (%s, run %s): %d new points, %d already logged", out["mode"], run_id, out["logged"], out["already"])
    return out


# --------------------------------------------------------------------------- MLflow
def default_mlflow_uri(run: str) -> str:
    """``file:`` URI of ``results/<run>/mlruns`` (absolute)."""
    return Path("results", run, "mlruns").resolve().as_uri()


def log_mlflow(points: list[Point], cfg: dict, run: str) -> dict:
    """Log the (step, tag) pairs the MLflow run lacks (see the module docstring).

    Args:
        cfg: section ``trackers.mlflow`` (``tracking_uri``, ``experiment``, ``run_id``, ``run_name``).
        run: the dflash-eval run name (tag ``dflash_eval.run``; default store ``results/<run>/mlruns``).

    Returns:
        ``{"tracking_uri", "run_id", "logged", "already"}``.

    Raises:
        InputError: a configured ``run_id`` the store does not know; a point the run holds with another value
            (:func:`check_unchanged`).
    """
    uri = cfg.get("tracking_uri") or default_mlflow_uri(run)
    if uri.startswith("file:") or "://" not in uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: the file store is opt-in
    import mlflow  # deferred: optional package (mlflow), after MLFLOW_ALLOW_FILE_STORE is set; parse-time module

    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    run_id = cfg.get("run_id")
    if run_id:
        try:
            client.get_run(run_id)
        except mlflow.exceptions.MlflowException as err:
            raise InputError(uri, "trackers.mlflow.run_id", f"run {run_id!r} not found ({err.message})",
                             "give the id of a run in that store, or leave run_id empty") from None
    else:
        name = cfg.get("experiment") or "dflash-eval"
        exp = client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else client.create_experiment(name)
        found = client.search_runs([exp_id], filter_string=f"tags.`dflash_eval.run` = '{run}'", max_results=1)
        run_id = found[0].info.run_id if found else client.create_run(
            exp_id, run_name=cfg.get("run_name") or run, tags={"dflash_eval.run": run}).info.run_id
    have: dict[str, set[int]] = {}
    values: dict[tuple[int, str], float] = {}
    for tag in sorted({p.tag for p in points}):
        history = sorted(client.get_metric_history(run_id, tag), key=lambda m: m.timestamp)
        have[tag] = {m.step for m in history}
        values.update({(int(m.step), tag): float(m.value) for m in history})  # the last logged per step
    check_unchanged(points, values, uri, "trackers.mlflow.experiment to a new experiment's name, or "
                    "trackers.mlflow.run_id")
    new = [p for p in points if p.step not in have.get(p.tag, set())]
    now = int(time.time() * 1000)
    metrics = [mlflow.entities.Metric(p.tag, p.value, now, p.step) for p in new]
    for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
        client.log_batch(run_id, metrics=metrics[i:i + 1000])
    log.info("mlflow (%s, run %s): %d new points, %d already logged", uri, run_id, len(new), len(points) - len(new))
    return {"tracking_uri": uri, "run_id": run_id, "logged": len(new), "already": len(points) - len(new),
            **stale_points(points, values)}


# --------------------------------------------------------------------------- all of them
#: the config field that names a new tracker run
NEW_RUN_FIELD = {"tensorboard": "run_name", "wandb": "run_id", "mlflow": "experiment"}


def enabled(cfg: dict | None) -> list[str]:
    """Names of the trackers switched on in config section ``trackers``."""
    cfg = cfg or {}
    return [n for n in ("tensorboard", "wandb", "mlflow") if (cfg.get(n) or {}).get("enabled")]


def tensorboard_run_dir(cfg: dict, run: str) -> Path:
    """``<trackers.tensorboard.dir or results/<run>/tensorboard>/<run_name or run>``."""
    tb = cfg.get("tensorboard") or {}
    return Path(tb.get("dir") or os.path.join("results", run, "tensorboard"), tb.get("run_name") or run)


def log_table(table, cfg: dict, run: str, record_dir: str | Path | None = None) -> dict:
    """Log a tau table (DataFrame or path) to every enabled tracker.

    Args:
        table: the tau table, or the path of ``tau.parquet`` / ``tau.csv``.
        cfg: config section ``trackers``.
        run: the dflash-eval run name.
        record_dir: ledger folder (default ``results/<run>/trackers``).

    Returns:
        ``{tracker: what it logged}`` plus ``points`` (the table's point count) and ``warnings`` (checkpoints left
        out: :func:`table_points`; absent when none); ``{}`` when none is on.

    Raises:
        InputError: an enabled tracker's client library is not installed (names the requirements
            file), a tracker's own configuration error, or a point its run holds with another value.
    """
    names = enabled(cfg)
    if not names:
        return {}
    df = read_table(table) if isinstance(table, (str, Path)) else table
    prefix = cfg.get("prefix") or "dflash_eval"
    notes: list[str] = []
    points = table_points(df, prefix, notes)
    record_dir = Path(record_dir or os.path.join("results", run, "trackers"))
    out: dict = {"points": len(points), **({"warnings": notes} if notes else {})}
    for name in names:
        module = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}[name]
        try:
            __import__(module)
        except ImportError:
            raise InputError("config", f"trackers.{name}.enabled", f"the {module} client library is not installed",
                             "pip install -r envs/requirements-trackers.txt (or switch the tracker off)") from None
        if name == "tensorboard":
            out[name] = _with_files(write_tensorboard(points, tensorboard_run_dir(cfg, run)), tensorboard_run_dir(cfg, run))
        elif name == "wandb":
            out[name] = log_wandb(points, cfg.get("wandb") or {}, run, record_dir, prefix)
        else:
            out[name] = log_mlflow(points, cfg.get("mlflow") or {}, run)
        if out[name].get("stale"):
            out.setdefault("warnings", []).append(
                f"{name}: the tracker run holds {out[name]['stale']} point(s) at step(s) "
                f"{', '.join(map(str, out[name]['stale_steps'][:8]))}{', ...' if len(out[name]['stale_steps']) > 8 else ''} "
                "that the tau table no longer has (a checkpoint removed from the run, or another config logging under "
                f"the same run name): a tracker cannot take them back; to see only this table's, log to a new run "
                f"(trackers.{name}.{NEW_RUN_FIELD[name]})")
    return out


def record_warnings(path: str | Path) -> list[str]:
    """The warnings a ``trackers.json`` holds (checkpoints left out, W&B points lost with their folders), which the
    workflow prints at its end when the trackers ran.
    ``[]`` when the file is missing or unreadable."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(record, dict):
        return []
    return [str(w) for w in record.get("warnings") or []] + [
        str(v["warning"]) for v in record.values() if isinstance(v, dict) and v.get("warning")]


def run_warnings(plan, since: float) -> list[str]:
    """:func:`record_warnings` of the run's ``trackers.json`` when a job of this Snakemake run wrote it (modified
    at or after ``since``, seconds since the epoch), else ``[]`` (the Snakefile's ``onsuccess``)."""
    outs = plan.trackers_outputs()
    if not outs or not os.path.isfile(outs[0]) or os.path.getmtime(outs[0]) < since:
        return []
    return record_warnings(outs[0])
