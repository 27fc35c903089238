"""The checkpoint table of a workflow plan: one row per ``{ckpt}`` wildcard value (torch-free, parse time).

:func:`checkpoint_table` turns the config's ``checkpoints`` section (a glob, a list, demo
checkpoints) into rows; :func:`checkpoint_files` names the files a strip job reads (never the
folder: its mtime misses in-place edits); :func:`cache_layer_ids` decides the layers the cache
stores; :func:`check_checkpoint_configs` makes strip's and evaluate's config checks before any
job runs. Used by :mod:`dflash_eval.workflow.plan`.
"""

from __future__ import annotations

import errno
import fnmatch
import glob
import json
import logging
import os
import re
from pathlib import Path

from dflash_eval.core.errors import InputError
from dflash_eval.core.io import read_json_object
from dflash_eval.drafter.compat import check_compat
from dflash_eval.drafter.config import DrafterConfig
from dflash_eval.drafter.families import DEFAULT

#: files of a checkpoint folder that are inputs of its strip job (never the folder: its mtime misses in-place edits)
CHECKPOINT_FILE_PATTERNS = ("*.safetensors", "*.json", "*.pt", "*.pth", "*.bin", "*.distcp", ".metadata")
#: the subset that holds weights: a checkpoint folder without any is refused at parse time
#: what a checkpoint given as one file may be (:data:`dflash_eval.drafter.checkpoints.TORCH_SUFFIXES`)
CHECKPOINT_FILES = (".pt", ".pth", ".bin")
CHECKPOINT_WEIGHT_PATTERNS = ("*.safetensors", "*.pt", "*.pth", "*.bin", "*.distcp")
#: names that become path components (run, target, checkpoint, prompt set): no separators, never ``.`` / ``..``
#: or another name starting with a dot (a hidden folder, or one outside ``results/``) or a dash (it would read as a
#: command-line option in a shell word); at most 100 characters
#: (a file system's 255 bytes per path component, less the longest suffix a stage adds)
NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,99}$")
#: a name ending in a unit repeated 20 or more times: Snakemake takes such a wildcard value for a runaway
#: recursion (``snakemake.io.PeriodicityDetector``, min_repeat 20) and silently plans no job for it
PERIODIC_RE = re.compile(r"(.+?)\1{19,}$")


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a run, target, prompt set or checkpoint (None: it can)."""
    if not NAME_RE.match(name):
        return ("may only contain letters, digits, '.', '_' and '-', may not start with '.' or '-' (a command-line "
                "option) and is at most 100 characters long")
    m = PERIODIC_RE.search(name)
    if m:
        return (f"ends in {m.group(1)!r} repeated {len(m.group(0)) // len(m.group(1))} times, which Snakemake takes "
                "for a runaway recursion (it would plan no job for it)")
    return None


def check_names(config: dict) -> None:
    """Refuse run, target and prompt-set names that cannot name a folder (``..`` would leave ``results/``)
    or a wildcard value (:func:`name_problem`).

    Raises:
        InputError: naming the entry.
    """
    for where, name in [("run", config["run"]), ("target.name", config["target"]["name"])] + [
            (f"prompt_sets.{n}", n) for n in config["prompt_sets"]]:
        problem = name_problem(str(name))
        if problem:
            raise InputError("config", where, f"{name!r}: a name becomes a folder or file name, so it {problem}",
                             "rename it (e.g. 'my-run')")


def checkpoint_table(ckpt_cfg: dict, run: str | None = None) -> dict[str, dict]:
    """One row per checkpoint name, sorted by name: ``{name: {path, kind, ...entry}}``.

    ``kind`` is ``glob`` (name = file stem / folder name), ``list`` (explicit name, path,
    overrides, drafter_config) or ``demo`` (written by rule demo_checkpoint to
    ``resources/demo/checkpoints/<name>.pt``).

    Raises:
        InputError: a bad name, a duplicate name, a glob matching nothing (or only broken links),
            a list path or drafter_config that does not exist, a path inside ``results/<run>/`` (with ``run``),
            or no checkpoint at all.
    """
    table: dict[str, dict] = {}
    origin: dict[str, str] = {}

    def add(name, row, where):
        problem = name_problem(name)
        if problem:
            raise InputError("config", where, f"checkpoint name {name!r} {problem} (it names the folders "
                             "results/<run>/drafters/<name> and eval/<name>)",
                             "rename the file/folder or list it under checkpoints.list with an explicit name")
        if name in table:
            raise InputError("config", where, f"duplicate checkpoint name {name!r} (also from {origin[name]})",
                             "give each checkpoint a unique name (checkpoints.list entries take an explicit name)")
        table[name] = row
        origin[name] = where

    pattern = ckpt_cfg.get("glob")
    if pattern:
        matches = sorted(glob.glob(pattern))
        live = [m for m in matches if os.path.exists(m)]
        if not live:
            what = f"only broken links {matches}" if matches else "nothing"
            raise InputError("config", "checkpoints.glob", f"{pattern!r} matches {what} (relative paths are resolved "
                             "against the working directory)", "correct the pattern or remove it")
        for path in live:
            p = Path(path)
            if _path_problem(path, folder_ok=True):
                raise InputError("config", "checkpoints.glob", f"{pattern!r} matches {path!r}, which "
                                 f"{_path_problem(path, folder_ok=True)}", "narrow the pattern or move that entry")
            add(p.name if p.is_dir() else p.stem, {"path": path, "kind": "glob"}, f"checkpoints.glob ({path})")
    for i, entry in enumerate(ckpt_cfg.get("list", [])):
        where = f"checkpoints.list[{i}] ({entry['name']})"
        for key in ("path", "drafter_config"):
            problem = entry.get(key) and _path_problem(entry[key], folder_ok=key == "path")
            if problem:
                raise InputError("config", f"{where}.{key}", f"{entry[key]!r} {problem}",
                                 "correct the path or remove the entry")
        add(entry["name"], {**entry, "path": spelled(entry["path"]), "kind": "list"}, where)
    for i, entry in enumerate(ckpt_cfg.get("demo", [])):
        where = f"checkpoints.demo[{i}] ({entry['name']})"
        if entry.get("drafter") and not os.path.isdir(entry["drafter"]):
            raise InputError("config", f"{where}.drafter", f"{entry['drafter']!r} is not a folder",
                             "point at a stripped drafter folder (config.json + model.safetensors)")
        path = os.path.join("resources", "demo", "checkpoints", f"{entry['name']}.pt")
        add(entry["name"], {**entry, "path": path, "kind": "demo"}, where)
    if not table:
        raise InputError("config", "checkpoints", "no checkpoint configured",
                         "set checkpoints.glob, checkpoints.list or checkpoints.demo")
    outputs = os.path.realpath(os.path.join("results", run)) + os.sep if run else None
    for name, row in table.items():
        if outputs and row.get("kind") != "demo" and os.path.realpath(row["path"]).startswith(outputs):
            raise InputError("config", f"{origin[name]}.path" if row["kind"] == "list" else origin[name],
                             f"{row['path']!r} is inside results/{run}/, which this run writes (a stripped drafter "
                             "of this run as a checkpoint would be its own strip job's input and output)",
                             "point at the original checkpoint, or copy the folder out of results/<run>/ first")
        if row.get("kind") != "demo" and os.path.isfile(row["path"]) and not row["path"].endswith(CHECKPOINT_FILES):
            where = f"{origin[name]}.path" if row["kind"] == "list" else origin[name]
            raise InputError("config", where, f"{row['path']!r} is a file strip cannot read alone (a checkpoint file "
                             f"is a torch state dict, {', '.join(CHECKPOINT_FILES)}; safetensors weights are read "
                             "with their folder's config.json)", "point at the folder that holds it" if row[
                                 "path"].endswith(".safetensors") else "point at the checkpoint file or folder")
    for name, row in table.items():  # an input function must never raise: Snakemake would hide the error
        row["files"] = checkpoint_files(name, row, origin[name])
    same_files_note(table)
    return dict(sorted(table.items()))


def spelled(path: str) -> str:
    """One spelling of a path: repeated and trailing ``/`` and ``./`` segments dropped (``..`` kept: through a
    symbolic link it is not the parent), so ``ck/`` and ``ck`` are one checkpoint."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    out = ("/" if path.startswith("/") else "") + "/".join(parts)
    return out or ("/" if path.startswith("/") else ".")


def _path_problem(path: str, folder_ok: bool) -> str | None:
    """Why a configured checkpoint path cannot be read (``None``: it can): missing, a broken or looping symbolic
    link, or neither a regular file nor (with ``folder_ok``) a folder: a FIFO, socket or device would pass the
    parse and fail in a job with a raw traceback."""
    try:
        os.stat(path)
    except OSError as e:
        if os.path.islink(path):
            return ("is a symbolic link that loops" if e.errno == errno.ELOOP else
                    "is a symbolic link to nothing") + " (relative paths are resolved against the working directory)"
        return "does not exist (relative paths are resolved against the working directory)"
    if os.path.isfile(path) or (folder_ok and os.path.isdir(path)):
        return None
    return ("is neither a regular file nor a folder (a FIFO, socket or device)" if folder_ok else
            "is not a regular file")


def same_files_note(table: dict[str, dict]) -> str | None:
    """Warn (and return the note) when checkpoints of several names are the same files (a path through ``..``, a
    symbolic link, a hard link, a second entry: compared by device and inode): each name is stripped and evaluated on its own, a duplicate row in tau.csv.
    Not an error: comparing a checkpoint with itself under two names can be meant."""
    by_files: dict[tuple, list[str]] = {}
    shown: dict[tuple, str] = {}
    for name, row in sorted(table.items()):
        if row.get("kind") != "demo" and row.get("files"):
            stats = [os.stat(f) for f in row["files"]]  # (device, inode): hard links too
            key = tuple(sorted((st.st_dev, st.st_ino) for st in stats))
            by_files.setdefault(key, []).append(name)
            shown.setdefault(key, os.path.realpath(row["files"][0]) + (", ..." if len(stats) > 1 else ""))
    if all(len(names) == 1 for names in by_files.values()):
        return None
    note = ("; ".join(f"checkpoints {', '.join(names)} are the same files ({shown[key]})"
                      for key, names in by_files.items() if len(names) > 1)
            + ": each name is stripped and evaluated on its own (a row per name in tau.csv); list each checkpoint "
            "once unless that is meant")
    logging.getLogger(__name__).warning(note)
    return note


def demo_layer_ids(name: str, row: dict) -> list[int] | None:
    """A demo entry's target layers: its wrapped drafter's ``dflash_config.target_layer_ids``, else ``layer_ids``.

    Raises:
        InputError: the entry's ``layer_ids`` contradict the wrapped drafter's config.
    """
    layers = row.get("layer_ids")
    cfg_path = os.path.join(row["drafter"], "config.json") if row.get("drafter") else None
    if cfg_path and os.path.isfile(cfg_path):
        from_drafter = (read_json_object(cfg_path, "drafter config").get("dflash_config") or {}).get("target_layer_ids")
        if from_drafter is not None:
            if layers and list(layers) != list(from_drafter):
                raise InputError("config", f"checkpoints.demo ({name}).layer_ids",
                                 f"{layers} differ from {cfg_path} dflash_config.target_layer_ids {from_drafter}",
                                 "drop layer_ids from the entry (the drafter's own config decides)")
            layers = from_drafter
    return layers


def cache_layer_ids(cache_cfg: dict, checkpoints: dict[str, dict], target_spec=None) -> list[int]:
    """Layers stored in the cache: ``cache.target_layer_ids``, or the union of the demo entries' layers
    when every checkpoint is a demo entry whose layers are known.

    Raises:
        InputError: not configured and not derivable; a demo entry's layers missing from it; a layer id
            outside the target (checked when ``target_spec`` is known).
    """
    configured = cache_cfg.get("target_layer_ids")
    demo = {n: demo_layer_ids(n, r) for n, r in checkpoints.items() if r["kind"] == "demo"}
    if configured:
        if len(set(configured)) != len(configured):
            raise InputError("config", "cache.target_layer_ids", f"duplicate ids in {configured}", "list each layer once")
        layers = sorted(set(configured))
    elif len(demo) == len(checkpoints) and all(demo.values()):
        layers = sorted({i for ids in demo.values() for i in ids})
    else:
        raise InputError("config", "cache.target_layer_ids", "not set", "list the 0-based target layers to cache: "
                         "the union of every checkpoint's dflash_config.target_layer_ids")
    for name, ids in demo.items():
        missing = sorted(set(ids or []) - set(layers))
        if missing:
            raise InputError("config", f"checkpoints.demo ({name}).layer_ids",
                             f"{missing} are not in cache.target_layer_ids {layers}", "add them to cache.target_layer_ids")
    if target_spec is not None and target_spec.num_layers is not None:
        bad = [i for i in layers if i >= target_spec.num_layers]
        if bad:
            raise InputError("config", "cache.target_layer_ids", f"{bad} out of range for the "
                             f"{target_spec.num_layers}-layer target {target_spec.path}",
                             f"use ids in 0..{target_spec.num_layers - 1}")
    return layers


def checkpoint_files(name: str, row: dict, where: str | None = None) -> list[str]:
    """A checkpoint's concrete files: the inputs of its strip job, so that a change to any file strip
    reads reruns it.

    A file checkpoint is itself; a folder contributes its top-level ``CHECKPOINT_FILE_PATTERNS``
    files (not the folder: its mtime misses in-place edits). When the config strip falls back to
    (:mod:`dflash_eval.drafter.checkpoints`: the ``config.json`` beside a file, or in the parent of a folder
    that has none; for a ``training_state.pt`` also the run folder above) exists, it is an input too.
    A demo checkpoint's path is returned as is (rule demo_checkpoint writes it).

    Raises:
        InputError: a folder holding no weight files (``CHECKPOINT_WEIGHT_PATTERNS``), naming the
            config entry ``where``.
    """
    path = row["path"]
    if row.get("kind") == "demo" or not os.path.isdir(path):
        files = [path]
        parent = os.path.dirname(os.path.normpath(path))
        sidecars = [os.path.join(parent, "config.json")]
        if os.path.basename(path) == "training_state.pt":
            sidecars.append(os.path.join(os.path.dirname(parent), "config.json"))
    else:
        files = sorted({f for pat in CHECKPOINT_FILE_PATTERNS for f in glob.glob(os.path.join(path, pat))})
        if not any(fnmatch.fnmatch(os.path.basename(f), pat) for f in files for pat in CHECKPOINT_WEIGHT_PATTERNS):
            held = sorted(os.listdir(path))
            raise InputError("config", f"{where}.path" if where else f"checkpoint {name}",
                             f"folder {path!r} holds no weight files ({', '.join(CHECKPOINT_WEIGHT_PATTERNS)}); "
                             f"it holds {held[:8] if held else 'nothing'}",
                             "point at the checkpoint folder itself (or the weights file), or fix the glob")
        sidecars = [] if os.path.isfile(os.path.join(path, "config.json")) else [
            os.path.join(os.path.dirname(os.path.normpath(path)), "config.json")]
    side = next((f for f in sidecars if os.path.isfile(f)), None)
    return files + ([side] if side and row.get("kind") != "demo" and side not in files else [])


def strip_args(row: dict) -> list[str]:
    """``--drafter-config`` / ``--override KEY=JSON`` arguments of a checkpoints.list entry (sorted keys)."""
    args = []
    if row.get("drafter_config"):
        args += ["--drafter-config", row["drafter_config"]]
    for key, value in sorted((row.get("overrides") or {}).items()):
        args += ["--override", f"{key}={json.dumps(value, separators=(',', ':'))}"]
    return args


def demo_args(row: dict) -> list[str]:
    """Arguments of ``dflash-eval demo-checkpoint`` for a checkpoints.demo entry. A wrapped drafter brings
    its own config, so the architecture flags are passed only for random-init entries."""
    args = ["--step", str(row["step"])]
    if row.get("drafter"):
        return args + ["--drafter", row["drafter"]]
    args += ["--random-init", "--seed", str(row["seed"])]
    if row.get("layer_ids"):
        args += ["--layer-ids", ",".join(str(i) for i in row["layer_ids"])]
    args += ["--block-size", str(row["block_size"]), "--num-layers", str(row["num_layers"])]
    return args + (["--variant", row["variant"]] if row.get("variant", DEFAULT) != DEFAULT else [])


def checkpoint_config_file(row: dict) -> str | None:
    """The drafter ``config.json`` strip will use for a checkpoint, when it is a plain JSON file known
    without opening the weights: the entry's ``drafter_config``, a demo entry's wrapped drafter, or the
    ``config.json`` of a z-lab/HF-style folder (with ``model.safetensors`` or its index). None otherwise
    (a torch file or SpecForge state may carry its own config: strip reads it)."""
    if row.get("drafter_config"):
        return row["drafter_config"]
    if row.get("kind") == "demo":
        return os.path.join(row["drafter"], "config.json") if row.get("drafter") else None
    path = row["path"]
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")) and (
            os.path.isfile(os.path.join(path, "model.safetensors"))
            or os.path.isfile(os.path.join(path, "model.safetensors.index.json"))):
        return os.path.join(path, "config.json")
    return None


def check_checkpoint_configs(checkpoints: dict[str, dict], layers: list[int], target_spec=None) -> None:
    """Parse every drafter config known at parse time (:func:`checkpoint_config_file`, with the entry's
    ``overrides``) and check it against the cached layers and, when its config.json exists, the target:
    the same checks strip and evaluate make (:class:`~dflash_eval.drafter.config.DrafterConfig`,
    :func:`~dflash_eval.drafter.compat.check_compat`), before any job runs. Torch-free.

    Raises:
        InputError: naming the checkpoint entry, the drafter config file and the problem.
    """
    for name, row in checkpoints.items():
        cfg_file = checkpoint_config_file(row)
        if not cfg_file or not os.path.isfile(cfg_file):
            continue
        try:
            cfg = DrafterConfig.from_dict(read_json_object(cfg_file, "drafter config"), source=cfg_file,
                                          overrides=row.get("overrides"))
            check_compat(cfg, cfg_file, target=target_spec, cache_attrs={
                "hidden_size": target_spec.hidden_size if target_spec else cfg.hidden_size,
                "target_layer_ids": layers, "num_target_layers": target_spec.num_layers if target_spec else 10 ** 9},
                cache_path=cfg_file)
        except InputError as err:
            where = ": ".join(str(x) for x in (err.file, err.field) if x)
            fix = err.fix
            if row.get("overrides"):  # the problem may come from the entry's overrides, not the file
                fix = (f"{fix}; or correct this entry's overrides {json.dumps(row['overrides'])}, which are "
                       f"applied over {cfg_file}")
            raise InputError("config", f"checkpoint {name} ({row['kind']})", f"{where}: {err.problem}", fix) from None
