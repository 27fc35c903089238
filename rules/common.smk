# Shared set-up: config validation, the plan (dflash_eval/workflow/plan.py: every parse-time check and
# every rule's inputs and flags), the shell prefix, helpers every rule uses, and wildcard
# constraints. The other rule files hold only rules.
#
# Everything here runs at parse time and only looks at the file system; no model code
# is imported, so dry-runs and --lint work without torch.

import json
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
from dflash_eval.core.errors import (InputError, failed_checks, remove_done_links, reused_sidecar_note, sidecars,
                                snakemake_lock_note)
from dflash_eval.core.gpu_pool import POOL_ENV as GPU_POOL_ENV
from dflash_eval.core.options import RUNTIME_ENV
from dflash_eval.trackers.log import run_warnings as trackers_run_warnings
from dflash_eval.workflow.plan import build_plan
from dflash_eval.workflow.disk_plan import disk_lines, disk_problem, free_bytes, planned_caches
from dflash_eval.data.provenance import stale_table_note
from dflash_eval.core.watchdog import owner_export
from dflash_eval.core.yaml_strict import check_config_files

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

# The main Snakemake process (not a cluster job's): it names itself to the jobs' watchdog and says how
# to clear a lock a killed run left (Snakemake itself only says "Directory cannot be locked").
MAIN_PROCESS = workflow.exec_mode == ExecMode.DEFAULT
STARTED = time.time()  # outputs newer than this were made by this run (onsuccess: the trackers' warnings)
if MAIN_PROCESS:
    _lock_note = snakemake_lock_note()
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
integral_numbers(config)  # `n: 4.0` is `n: 4` (the same params: nothing reruns)
try:
    PLAN = build_plan(config)
except InputError as err:
    raise WorkflowError(
        f"config ({CONFIG_FILES}): {err.field}: {err.problem}. Fix: {err.fix}"
    )

# The disk the caches need beside the free space, before anything runs (dry runs too); a real run whose caches
# cannot fit stops here, before any job (cache.disk_check; dflash_eval/workflow/disk_plan.py).
if MAIN_PROCESS:
    _sizes = planned_caches(PLAN)
    _free = free_bytes(PLAN.run_path())
    for _line in disk_lines(PLAN, _sizes, _free):
        logger.info(f"dflash-eval: {_line}")
    _disk = disk_problem(PLAN, _sizes, _free)
    # workflow.dryrun is not set yet while the Snakefile is parsed; the output settings are
    _dry = bool(getattr(workflow.output_settings, "dryrun", False) or workflow.dryrun)
    if _disk is not None:
        _text = f"config ({CONFIG_FILES}): {_disk.field}: {_disk.problem}. Fix: {_disk.fix}"
        if _dry or config["cache"]["disk_check"] != "refuse":
            logger.warning(f"dflash-eval: {_text}" + (" (a real run stops here)" if _dry else ""))
        else:
            raise WorkflowError(_text)

if MAIN_PROCESS:
    for _side in sidecars(PLAN.caches() + PLAN.shard_caches()):  # what a killed Snakemake left (Snakefile onerror)
        logger.warning(f"dflash-eval: {reused_sidecar_note(_side.with_suffix(''), None)}")
    if not any(Path(".snakemake", "metadata").glob("*")):  # copied results: the params trigger sees no change
        _stale = stale_table_note(PLAN.run_path(), json.loads(PLAN.expected_settings()))
        if _stale:
            logger.warning(f"dflash-eval: {_stale}")

RUN = PLAN.run
PROMPT_SETS = PLAN.prompt_sets
TARGET = PLAN.target
CHECKPOINTS = PLAN.checkpoints
DEMO_CHECKPOINTS = PLAN.demo_checkpoints
LAYER_IDS_ARG = ",".join(str(i) for i in PLAN.cache_layer_ids)
CACHE_SUFFIX = PLAN.cache_suffix  # .fp8.h5 with cache.storage: fp8 (another file), else .h5

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
    parts.append(owner_export(MAIN_PROCESS))  # the jobs' watchdog: stop when this Snakemake is gone
    # One Triton cache per run, shared by its jobs (unless the user set one): the first job that runs fla's
    # kernels compiles and autotunes them (fla caches the autotune results there too), the others read them.
    parts.append(f'export TRITON_CACHE_DIR="${{TRITON_CACHE_DIR:-$PWD/{PLAN.run_path(".triton")}}}";')
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


def records_of(paths):
    """The per-request records file beside each job JSON of ``paths`` (``<job>.json`` -> ``<job>.records.parquet``,
    dflash_eval/report/records.py)."""
    return [p[: -len(".json")] + ".records.parquet" for p in paths]


def target_model_files(wildcards):
    """Target config + weights (what the GPU stages and strip/evaluate read)."""
    return PLAN.target_files()


def target_all_files(wildcards):
    """Target config + weights + tokenizer (completions decode text too)."""
    return PLAN.target_files(tokenizer=True)


def target_dir(wildcards):
    """The target HF folder passed as --target (its files are the declared inputs)."""
    return TARGET.dir


def output_dir(wildcards, output):
    return os.path.dirname(output[0])


def _alternatives(values):
    return "|".join(re.escape(v) for v in values)


wildcard_constraints:
    run=re.escape(RUN),
    prompt_set=_alternatives(PROMPT_SETS),
    ckpt=_alternatives(CHECKPOINTS),
    name=_alternatives(DEMO_CHECKPOINTS) if DEMO_CHECKPOINTS else "(?!x)x",
