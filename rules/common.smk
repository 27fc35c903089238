# Shared set-up: config validation, the plan (dflash_eval/workflow/plan.py: every parse-time check and
# every rule's inputs and flags), the shell prefix, helpers every rule uses, and wildcard
# constraints. The other rule files hold only rules.
#
# Everything here runs at parse time and only looks at the file system; no model code
# is imported, so dry-runs and --lint work without torch.

import os
import re
import shlex
import sys
import time
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.logging import logger
from snakemake.settings.types import DeploymentMethod
from snakemake.utils import validate
from snakemake_interface_executor_plugins.settings import ExecMode

if (Path(workflow.basedir) / "dflash_eval" / "workflow" / "plan.py").is_file():
    sys.path.insert(0, workflow.basedir)  # a checkout: plan and CLI come from this commit
from dflash_eval.workflow.config import describe_validation_error, integral_numbers
from dflash_eval.core.io import non_finite_entry
from dflash_eval.core.errors import InputError, remove_done_links, reused_sidecar_note, sidecars
from dflash_eval.core.gpu_pool import POOL_ENV as GPU_POOL_ENV
from dflash_eval.job_records import (complete_records, demo_record_path, params_trigger_off, pending_note, plans_only, record_path,
                                     rewrite_allowed, run_level_records, target_record_path, touches,
                                     lost_target_outputs, write_planned_evaluations, write_records)
from dflash_eval.core.options import RUNTIME_ENV
from dflash_eval.row_checksum import SEALED_ENV
from dflash_eval.output_digests import failed_checks
from dflash_eval.trackers.log import run_warnings as trackers_run_warnings
from dflash_eval.workflow.plan import build_plan
from dflash_eval.workflow_guard import (
    check_config_files,
    forget_owner,
    owner_export,
    record_owner,
    release_stale_lock,
    metadata_gone,
    rerun_incomplete_argv,
)

def _shown(path):
    """A config file as the user would type it: relative to the working directory when inside it."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# in merge order: the Snakefile's config/config.yaml, then each --configfile (later ones win)
_CLI_CONFIG_FILES = [str(f) for f in workflow.overwrite_configfiles]
CONFIG_FILES = (
    ", ".join(
        _shown(f)
        for f in [f for f in map(str, workflow.configfiles) if f not in _CLI_CONFIG_FILES]
        + _CLI_CONFIG_FILES
    )
    or "the config"
)

# The main Snakemake process (not a cluster job's): a lock left by a killed run is released when its
# owner is provably gone, else explained (dflash_eval/workflow_guard.py).
MAIN_PROCESS = workflow.exec_mode == ExecMode.DEFAULT
STARTED = time.time()  # outputs newer than this were made by this run (onsuccess: the trackers' warnings)
if MAIN_PROCESS:
    _lock_note, _released = release_stale_lock(sys.argv)
    _again = rerun_incomplete_argv(sys.argv) if _released else None
    if _again:
        # the dead run's unfinished jobs are the outputs Snakemake marks incomplete: the same command
        # goes on as with --rerun-incomplete (set in every profile and make demo); the lock is gone already
        logger.warning(f"dflash-eval: {_lock_note}; going on with --rerun-incomplete to rerun the jobs it left unfinished")
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(_again[0], _again)
    elif _released:
        _lock_note += ("; this run reruns the jobs it left unfinished (--rerun-incomplete)"
                       if {"--rerun-incomplete", "--ri"} & set(sys.argv) else
                       "; the jobs it left unfinished are rerun only with --rerun-incomplete")
    if _lock_note:
        logger.warning(f"dflash-eval: {_lock_note}")

try:  # Snakemake's YAML loader keeps the last of two equal keys: refuse them, naming both lines
    check_config_files(map(str, workflow.configfiles), sys.argv, workflow.basedir)
except InputError as err:
    raise WorkflowError(f"config ({err.file}): {err.field}: {err.problem}. Fix: {err.fix}") from None

try:
    validate(config, "../config/schemas/config.schema.yaml")
except WorkflowError as err:
    # the jsonschema error is the context of Snakemake's; name the entry as a config path
    entry, problem = describe_validation_error(err.__context__ or err)
    raise WorkflowError(
        f"config ({CONFIG_FILES}): {entry}: {problem}. Fix: correct that entry; "
        "config/schemas/config.schema.yaml describes every option, its type and its default."
    ) from None
_non_finite = non_finite_entry(config)
if _non_finite:
    raise WorkflowError(
        f"config ({CONFIG_FILES}): {_non_finite}: not a finite number (.nan / .inf). Fix: give a finite value; "
        "config/schemas/config.schema.yaml describes every option, its type and its default."
    )
integral_numbers(config)  # `n: 4.0` is `n: 4` (one options record: nothing reruns)
try:
    PLAN = build_plan(config)
except InputError as err:
    raise WorkflowError(
        f"config ({CONFIG_FILES}): {err.field}: {err.problem}. Fix: {err.fix}"
    )

if MAIN_PROCESS and not touches(sys.argv):  # summary's input: rewritten when the planned evaluations change
    _lost, _replaced = write_planned_evaluations(PLAN, move=not plans_only(sys.argv))  # (rerun without metadata); --touch would mark summary up to date over it
    if _lost:  # renewed: Snakemake would not remake them under an up-to-date tau.csv
        logger.warning(f"dflash-eval: {len(_lost)} output(s) that tau.csv, the report or trackers.json stand on are gone "
                       f"({', '.join(_lost[:3])}{', ...' if len(_lost) > 3 else ''}): they are made again, and "
                       "summary, report and trackers rerun")
    if _replaced:  # final outputs no later job reads: their stage's digest (dflash_eval/output_digests.py)
        logger.warning(f"dflash-eval: {', '.join(_replaced)}: not what its stage wrote (edited, or another run's "
                       "copied in place, or its digest is gone): " + (
                           "this command runs no job (a dry run, --report, ...), so it shows them as they are; the "
                           "same command without that option remakes them" if plans_only(sys.argv) else
                           "summary, report and trackers rerun to make the run's own again (an edited sealed file: "
                           "moved to <file>.rejected and made again)"))
    _target_gone = lost_target_outputs(PLAN)
    if _target_gone:  # left as they are: remaking them is target work (a cache may have been deleted to free disk)
        logger.warning(f"dflash-eval: {', '.join(_target_gone)} gone while tau.csv is there: not remade for its own sake "
                       "(target work); tau.csv and the report stand on the evaluate outputs, which name the cache and "
                       "completions they were made from; a job that needs them (a new checkpoint, a changed input or "
                       "option upstream) remakes them first, or remake them now: snakemake <that file>" + (
                           "; the target's fingerprint record is among them: remaking it hashes the target's weights "
                           "again and, as a new input, reruns the target work after it (completions, hidden_states), "
                           "e.g. after an interrupted --forcerun target_fingerprint" if PLAN.target.fingerprint in _target_gone
                           else ""))
if MAIN_PROCESS:
    # each job group's options record (dflash_eval/job_records.py): a changed option reruns its jobs by
    # mtime, also without .snakemake/metadata; kept as they are under --rerun-triggers without params
    # and by commands that run no job (-n: checking a changed config, then reverting it, reruns nothing)
    _records = write_records(PLAN, rewrite=rewrite_allowed(sys.argv), config_files=[str(f) for f in workflow.configfiles])
    for _why in _records.remade:  # a shared resource made by an earlier version, perhaps with other options
        logger.warning(f"dflash-eval: created {_why}: it is made again, and what uses it reruns")
    if _records.changed and not rewrite_allowed(sys.argv):  # left as they are: say so, dry run or not
        _dry = plans_only(sys.argv) and not params_trigger_off(sys.argv)  # -n with --rerun-triggers: its own text
        logger.warning(f"dflash-eval: {pending_note(_records.changed, dry_run=_dry, touch=touches(sys.argv))}")
    for _side in sidecars(PLAN.caches() + PLAN.shard_caches()):  # what a killed Snakemake left (Snakefile onerror)
        logger.warning(f"dflash-eval: {reused_sidecar_note(_side.with_suffix(''), None)}")
    _gone = metadata_gone(PLAN.run_path(), records_created=_records.fresh)
    if _gone:
        logger.warning(f"dflash-eval: {_gone}")

RUN = PLAN.run
PROMPT_SETS = PLAN.prompt_sets
TARGET = PLAN.target
CHECKPOINTS = PLAN.checkpoints
DEMO_CHECKPOINTS = PLAN.demo_checkpoints
LAYER_IDS_ARG = ",".join(str(i) for i in PLAN.cache_layer_ids)

if config["generation"]["endpoint"].get("api_key"):
    # Handed to the completions jobs through the environment only: never a param, a shell word or a log line.
    os.environ[config["generation"]["endpoint"]["api_key_env"]] = config["generation"]["endpoint"]["api_key"]


# How rules call the package: each shell runs one `python -m dflash_eval ...`. Without
# --sdm, `python` is the interpreter running Snakemake (so `.venv/bin/snakemake` works
# without activating the venv); in a container or conda env it is that env's own. A
# checkout's package source goes first on PYTHONPATH, so rules and CLI come from one
# commit. The prefix is not part of a rule's code hash: it never triggers reruns. That is
# why it carries the stage options that cannot change outputs (schema `x-rerun: false`:
# timeouts, retries); every other option is a rule's params (PLAN.stage_flags(stage)),
# so editing it reruns the jobs that read it. It also names this Snakemake process (pid and
# start time) for the jobs' watchdog (dflash_eval/core/watchdog.py), in the main process only.
def _shell_prefix():
    parts = ["set -euo pipefail;", f"export {RUNTIME_ENV}={shlex.quote(PLAN.runtime_env())};"]
    parts.append(f"export {SEALED_ENV}=1;")  # its prompts/completions files are sealed: unsealed ones are refused
    parts.append(owner_export(MAIN_PROCESS))  # the jobs' watchdog: stop when this Snakemake is gone
    if config["gpu_pool"]:  # local multi-GPU hosts: each GPU job takes its own GPU(s) (dflash_eval/core/gpu_pool.py)
        parts.append(f"export {GPU_POOL_ENV}={shlex.quote(config['gpu_pool'])};")
    methods = workflow.deployment_settings.deployment_method
    if not (DeploymentMethod.CONDA in methods or DeploymentMethod.APPTAINER in methods):
        parts.append(f"export PATH={shlex.quote(os.path.dirname(sys.executable))}:$PATH;")
    if (Path(workflow.basedir) / "dflash_eval" / "cli.py").is_file():
        src = shlex.quote(str(workflow.basedir))
        parts.append(f"export PYTHONPATH={src}${{PYTHONPATH:+:$PYTHONPATH}};")
    return " ".join(parts).replace("{", "{{").replace("}", "}}") + " "  # shell.prefix formats


shell.prefix(_shell_prefix())


# Threads of the torch rules (completions, hidden_states, evaluate, kernel_parity, engine_parity, target_costs): config
# torch_threads. Snakemake exports it as OMP_NUM_THREADS (torch's intra-op threads), SLURM
# jobs ask for that many CPUs (--cpus-per-task), and --cores caps it (local runs: at most the
# cores you allow). Not workflow.cores: that fails at parse time when --cores is unset
# (cluster runs) and would size cluster jobs by the login node.
TORCH_THREADS = config["torch_threads"]


# Container image (only with --sdm apptainer): a local .sif must exist before any job
# starts; apptainer would otherwise fail in every job.
def _check_container_image():
    image = config["containers"]["cuda"]
    methods = workflow.deployment_settings.deployment_method
    if DeploymentMethod.APPTAINER not in methods or "://" in image:
        return
    if image.endswith(".sif") and not os.path.isfile(image):
        raise WorkflowError(
            f"config ({CONFIG_FILES}): containers.cuda: image file {image!r} does not exist (relative paths are "
            "resolved against the working directory). Fix: build it (containers/README.md: "
            "podman save --format docker-archive -o <image>.tar <tag>, then apptainer build <image>.sif containers/dflash-eval.def), set "
            "containers.cuda to the .sif you have or to docker://<your-registry>/<image>:<tag>, "
            "or run without --sdm apptainer."
        )


_check_container_image()


def target_model_files(wildcards):
    """Target config + weights (what the GPU stages and strip/evaluate read)."""
    return PLAN.target_files()


def target_all_files(wildcards):
    """Target config + weights + tokenizer (completions decode text too)."""
    return PLAN.target_files(tokenizer=True)


def target_dir(wildcards):
    """The target HF folder passed as --target (its files are the declared inputs)."""
    return TARGET.dir


def options_record(stage, by=None):
    """Input function: the options record of ``stage`` (dflash_eval/job_records.py) for the job's
    ``by`` wildcard (prompt_set, ckpt), or the run's."""
    return lambda wildcards: record_path(wildcards.run, stage, getattr(wildcards, by) if by else "run")


def output_dir(wildcards, output):
    return os.path.dirname(output[0])


def _alternatives(values):
    return "|".join(re.escape(v) for v in values)


wildcard_constraints:
    run=re.escape(RUN),
    prompt_set=_alternatives(PROMPT_SETS),
    ckpt=_alternatives(CHECKPOINTS),
    name=_alternatives(DEMO_CHECKPOINTS) if DEMO_CHECKPOINTS else "(?!x)x",
