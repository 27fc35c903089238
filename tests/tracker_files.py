"""Read back what the trackers wrote, with each tracker's own reader (tests only).

- TensorBoard: ``tensorboard.backend.event_processing.event_accumulator.EventAccumulator``.
- W&B offline run files (``<dir>/wandb/offline-run-*/run-<id>.wandb``): W&B's datastore is a
  LevelDB-style log (a 7-byte ``:W&B`` header, 32 KiB blocks, records of crc32 (4) + length (2) +
  type (1: full, 2: first, 3: middle, 4: last)) of ``wandb_internal_pb2.Record`` protobufs; wandb 0.30
  has no Python reader of its own any more (its Go core writes the files), so this is one.
- MLflow: ``MlflowClient.get_metric_history``.
"""

from __future__ import annotations

import json
import struct
from collections import defaultdict
from pathlib import Path


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` in file order, as TensorBoard loads ``run_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def wandb_records(path):
    """The ``Record`` protobufs of one ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B datastore file"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            yield rec
            buf = b""


def wandb_history(wandb_dir, run_id: str) -> list[dict]:
    """Every history row of run ``run_id`` over all its offline run folders under ``wandb_dir``."""
    rows = []
    # one folder per wandb.init: offline-run-<time>-<id>, with a -1, -2 ... suffix when two start in the same second
    for f in sorted(Path(wandb_dir).glob(f"offline-run-*/run-{run_id}.wandb")):
        for rec in wandb_records(f):
            if rec.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return rows


def wandb_points(wandb_dir, run_id: str, step_key: str) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of the logged metrics against the custom x axis ``step_key``."""
    out: dict[str, list] = defaultdict(list)
    for row in wandb_history(wandb_dir, run_id):
        for k, v in row.items():
            if not k.startswith("_") and k != step_key:
                out[k].append((row[step_key], v))
    return dict(out)


def mlflow_points(tracking_uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    import os

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    keys = client.get_run(run_id).data.metrics
    return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in keys}
