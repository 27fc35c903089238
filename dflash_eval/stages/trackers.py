"""Stage ``trackers`` (rule ``trackers``): the tau table -> TensorBoard / W&B / MLflow, each point at its
checkpoint's training step, each (step, metric) once.

What is logged, under which names, and how re-logging avoids duplicates: :mod:`dflash_eval.trackers.log`.
Options: config section ``trackers`` (each tracker off by default). Writes ``results/<run>/trackers.json``:
what each tracker received now and what it already held.
"""

from __future__ import annotations

import dataclasses
import json

from dflash_eval.core.errors import atomic_path
from dflash_eval.trackers.log import log_table, read_table

STAGE = "trackers"


def add_arguments(p) -> None:
    p.add_argument("--table", required=True, help="the tau table (results/<run>/tau.parquet or tau.csv)")
    p.add_argument("--run", required=True, help="the run name (default W&B run id dflash-eval-<run>, default folders)")
    p.add_argument("--out", required=True, help="JSON record of what was logged (results/<run>/trackers.json)")


def main(args, opts) -> None:
    cfg = dataclasses.asdict(opts) if dataclasses.is_dataclass(opts) else dict(opts or {})
    table = read_table(args.table)
    logged = log_table(table, cfg, args.run)
    with atomic_path(args.out) as tmp:
        tmp.write_text(json.dumps(logged, indent=1, sort_keys=True))
