"""Stage ``trackers`` (rule ``trackers``): the tau table -> TensorBoard / W&B / MLflow, each point at its
checkpoint's training step, each (step, metric) once.

What is logged, under which names, and how re-logging avoids duplicates: :mod:`dflash_eval.trackers.log`.
Options: config section ``trackers`` (each tracker off by default). Writes ``results/<run>/trackers.json``:
what each tracker received now and what it already held. In the workflow the table is first compared
with the run's evaluate outputs (``--evals``): another run's table, or an edited one, logs nothing.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from dflash_eval.core.errors import atomic_path
from dflash_eval.trackers.log import log_table, read_table

STAGE = "trackers"


def add_arguments(p) -> None:
    p.add_argument("--table", required=True, help="the tau table (results/<run>/tau.parquet or tau.csv)")
    p.add_argument("--run", required=True, help="the run name (default W&B run id dflash-eval-<run>, default folders)")
    p.add_argument("--out", required=True, help="JSON record of what was logged (results/<run>/trackers.json)")
    p.add_argument("--evals", nargs="*", default=None,
                   help="the run's evaluate outputs: the table must be what summary makes of them (every cell; "
                        "the speedup columns with --costs, dflash_eval.report.tau_table.check_table), else nothing is logged; the workflow passes them")
    p.add_argument("--costs", default=None,
                   help="the run's target_costs.json: with --evals, the speedup columns are compared too (summary "
                        "--costs); the workflow passes it when target_costs is enabled")
    p.add_argument("--run-settings", nargs="*", default=None,
                   help="the run's target_costs options record, which --costs must name (summary --run-settings)")


def main(args, opts) -> None:
    cfg = dataclasses.asdict(opts) if dataclasses.is_dataclass(opts) else dict(opts or {})
    table = read_table(args.table)
    if args.evals is not None:
        from dflash_eval.target.costs import read_costs, with_speedups  # pandas: not at import (trackers --help stays light)
        from dflash_eval.report.tau_table import check_table, summary_frame

        bare = summary_frame(args.evals)
        costs = read_costs(args.costs, args.run_settings) if args.costs else None
        want = with_speedups(bare, costs)  # without target_costs.json its speedup columns are not compared
        text = Path(args.table).read_text() if str(args.table).endswith(".csv") else table  # a csv: as written
        check_table(text, args.table, want, skip=[] if costs else [c for c in want.columns if c not in bare.columns])
    logged = log_table(table, cfg, args.run)
    with atomic_path(args.out) as tmp:
        tmp.write_text(json.dumps(logged, indent=1, sort_keys=True))
    from dflash_eval.output_digests import record_outputs

    record_outputs("trackers", [args.out])  # compared at parse time (an edited or foreign copy is remade)
