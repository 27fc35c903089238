"""Options records: the options each planned job runs with, one small JSON file per job group, an input
of that group's rule (torch-free, written at parse time by ``rules/common.smk``).

Snakemake reruns a job whose ``params`` changed only by comparing them with its metadata
(``.snakemake/metadata``, the ``params`` rerun trigger). Results copied to another host, a fresh clone
over old results or ``rm -rf .snakemake`` lose that metadata, and an edited option (``n``,
``ddtree_budgets``, ``max_new_tokens``) then reran nothing: the old tau stayed in ``tau.csv`` as if
it were the new setting's. The records make the change visible to the one check that needs no
metadata, file modification times: each record is rewritten (new mtime) only when its content
changes, so its jobs and everything downstream are older than an input and rerun. It is the
"params as a file input" idiom of Snakemake workflows; ``results/<run>/planned_evaluations.txt``
(:meth:`dflash_eval.plan.Plan.write_planned_evaluations`) does the same for the set of evaluations.

Layout: ``results/<run>/options/<stage>/<key>.json`` with ``<key>`` the prompt set (``prompts``,
``completions``, ``hidden_states``, ``evaluate``), the checkpoint (``strip_drafter``) or ``run`` (the
run-level stages). A record holds the values of its rule's ``params`` that can change outputs
(:meth:`~dflash_eval.plan.Plan.stage_flags`, and the layer ids, target folder and checkpoint arguments),
so the two triggers agree: with metadata both fire on the same jobs.

Two rules keep the records from rerunning what they should not:

- a record written for the first time gets modification time 0 (1970): it reports no change, so a
  run that already had its outputs (made before the records existed) is not rerun by their creation;
- a rerun without the ``params`` trigger (``--rerun-triggers mtime input``: "I know this change is
  harmless") leaves existing records as they are.

The prompts record has a second reader: the prompts stage stores its sha256 in ``<set>.meta.json`` and
the completions stage compares it (:mod:`dflash_eval.prompts_meta`), so a validly sealed prompts file of
other settings copied over the run's is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from .io import write_text_if_changed

if TYPE_CHECKING:  # pragma: no cover
    from .plan import Plan

#: folder of the records below ``results/<run>/``
RECORDS_DIR = "options"
#: ``<key>`` of the stages that run once per run
RUN_KEY = "run"
#: stages whose rule runs once per prompt set (``<key>`` = the prompt set)
PER_PROMPT_SET = ("prompts", "completions", "hidden_states", "evaluate")
#: stages whose rule runs once per run (each optional: ``Plan.<stage>_outputs()``)
PER_RUN = ("target_costs", "kernel_parity", "engine_parity", "validate_online", "validate_engine", "trackers")


def record_path(run: str, stage: str, key: str = RUN_KEY) -> str:
    """``results/<run>/options/<stage>/<key>.json``: the record an input of ``stage``'s rule names."""
    return os.path.join("results", run, RECORDS_DIR, stage, f"{key}.json")


def record_values(plan: "Plan", stage: str, key: str = RUN_KEY) -> dict:
    """The values of one record: what its rule's ``params`` pass that can change outputs.

    Raises:
        KeyError: an unknown ``stage``, prompt set or checkpoint.
    """
    target = {"target": plan.target.dir}
    if stage == "prompts":
        return {**target, "source": plan.prompt_set_options(key)["source"], "path": plan.prompts_path_arg(key),
                "options": plan.stage_flags(stage, key)}
    if stage == "completions":
        return {**target, "options": plan.stage_flags(stage, key), "fingerprint": plan.completions_fingerprint_arg()}
    if stage == "hidden_states":
        return {**target, "layer_ids": list(plan.cache_layer_ids), "shards": plan.cache_shards,
                "options": plan.stage_flags(stage, key)}
    if stage == "evaluate":
        return {**target, "options": plan.stage_flags(stage, key)}
    if stage == "strip_drafter":
        return {**target, "checkpoint": plan.checkpoints[key]["path"], "args": plan.strip_args(key)}
    if stage in PER_RUN:
        layers = {"layer_ids": list(plan.cache_layer_ids)} if stage in ("kernel_parity", "engine_parity") else {}
        return {**target, **layers, "options": plan.stage_flags(stage)}
    raise KeyError(f"no options record for stage {stage!r}")


def planned_records(plan: "Plan") -> dict[str, str]:
    """``{record path: text}`` of every job group of the plan (canonical JSON, one key per line); the run-level
    stages only when their rule is planned (``Plan.<stage>_outputs()``)."""
    keys = [(s, p) for s in PER_PROMPT_SET for p in plan.prompt_sets]
    keys += [("strip_drafter", c) for c in plan.checkpoints]
    keys += [(s, RUN_KEY) for s in PER_RUN if getattr(plan, f"{s}_outputs")()]  # the optional stages that are on
    return {record_path(plan.run, s, k): json.dumps(record_values(plan, s, k), indent=1, sort_keys=True) + "\n"
            for s, k in keys}


def write_records(plan: "Plan", rewrite: bool = True) -> list[str]:
    """Write :func:`planned_records`: a missing record with modification time 0, a changed one (only with
    ``rewrite``, i.e. when Snakemake's ``params`` rerun trigger is on) with the current time.

    Returns:
        the records whose content changed (their jobs rerun).
    """
    changed = []
    for path, text in planned_records(plan).items():
        if not Path(path).is_file():
            write_text_if_changed(path, text)
            os.utime(path, (0, 0))  # no change known: outputs made before the record are not rerun
        elif rewrite and write_text_if_changed(path, text):
            changed.append(path)
    return changed
