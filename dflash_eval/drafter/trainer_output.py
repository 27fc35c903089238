"""A training run's output folder as ``watch`` sees it: which entries are checkpoints, which are
complete, and at which training step. Reads file names, sizes, headers and small JSON files only;
never writes there.

An entry (a file or folder directly in the folder, or matching ``watch.pattern``) is a candidate
unless it is a symlink (SpecForge's ``<run>-latest`` / ``<run>-best``, speculators'
``checkpoint_best`` and ``epoch<E>_step<S>`` point at checkpoints already listed), hidden, a
temporary name, speculators' ``interrupted`` save, or a trainer's log folder (:data:`NOT_CHECKPOINTS`).

A candidate is **complete** (:func:`inspect`) when all of these hold; otherwise the reason is
reported and the entry is looked at again on the next poll:

1. :func:`dflash_eval.drafter.detect.detect_format` recognises it (a folder without weights yet is not
   a checkpoint yet);
2. no temporary file inside (``*.tmp``: SpecForge saves ``training_state.pt.tmp`` and renames it,
   specforge/training/checkpoint.py ``_atomic_save``; ``*.partial``, ``*.incomplete``);
3. the trainer's own "done" marker, where its layout has one: speculators writes
   ``training_state.json`` after the weights, optimizer and scheduler of an ``<epoch>/`` folder
   (the folders holding ``optimizer_state_dict.pt``; vllm-project/speculators
   ``src/speculators/train/trainer.py``, ``maybe_save_checkpoint``); the HF Trainer writes
   ``trainer_state.json`` last into ``checkpoint-N/``; SpecForge's ``training_state.pt`` is itself
   renamed into place once written (and required by the format). z-lab publishes finished HF
   folders (no marker);
4. every weights file is whole: each safetensors file exactly as long as its header says
   (:func:`dflash_eval.drafter.detect.check_safetensors_size`, the check strip makes, here exact),
   every shard of an index present, each ``.pt`` / ``.pth`` / ``.bin`` a readable zip archive
   (``torch.save``'s format: its central directory is written last);
5. nothing in it changed for ``settle_s`` seconds (newest mtime).

Step: the name's (:func:`dflash_eval.drafter.detect.parse_step`), else the ``global_step`` of the
folder's ``training_state.json`` / ``trainer_state.json``. The checkpoint name (the workflow's
``{ckpt}``) is the entry's name (file stem), with ``-step<N>`` appended when only such a JSON file
gives the step: speculators rewrites its ``<epoch>/`` folder at each mid-epoch save, and each
step is its own checkpoint.
"""

from __future__ import annotations

import fnmatch
import json
import re
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from dflash_eval.core.errors import InputError
from dflash_eval.drafter.detect import (INDEX_FILE, STATE_FILE, check_safetensors_size, detect_format, parse_step,
                                        trainer_state_step)

#: folder names trainers use for logs beside their checkpoints (SpecForge runs/, swanlog/; W&B, MLflow)
NOT_CHECKPOINTS = ("runs", "logs", "wandb", "swanlog", "mlruns", "tensorboard", "interrupted")
TEMP_SUFFIXES = (".tmp", ".partial", ".incomplete", ".lock")
NAME_OK = re.compile(r"[^A-Za-z0-9._-]")


@dataclass
class Candidate:
    """One entry of the training folder and what :func:`inspect` found."""

    path: Path
    name: str  #: the workflow's checkpoint name
    step: int | None
    complete: bool
    reason: str = ""  #: why not complete
    signature: list = field(default_factory=list)  #: [relative path, size, mtime_ns] of every file


def candidates(train_dir: str | Path, pattern: str = "") -> list[Path]:
    """Checkpoint candidates in ``train_dir``: its entries (or those matching the glob ``pattern``,
    relative to it), sorted by name, without symlinks, hidden or temporary names and log folders.

    Raises:
        InputError: ``train_dir`` is not a folder.
    """
    root = Path(train_dir)
    if not root.is_dir():
        raise InputError("config", "watch.dir", f"{str(train_dir)!r} is not a folder",
                         "point watch.dir at the training run's output folder (it may be empty at first)")
    entries = sorted(root.glob(pattern)) if pattern else sorted(root.iterdir())
    out = []
    for p in entries:
        if p.is_symlink() or p.name.startswith(".") or p.name.endswith(TEMP_SUFFIXES) or p.name in NOT_CHECKPOINTS:
            continue
        if p.is_file() and not p.name.endswith((".pt", ".pth", ".bin")):
            continue  # JSON / text files beside the checkpoints (best_meta.json, train_command.txt)
        out.append(p)
    return out


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(f for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def signature(path: Path) -> list:
    """``[[relative path, size, mtime_ns], ...]`` of every file of a checkpoint (missing files skipped)."""
    out = []
    for f in _files(path):
        try:
            st = f.stat()
        except FileNotFoundError:  # deleted while listing (rotation)
            continue
        out.append([str(f.relative_to(path)) if f != path else f.name, st.st_size, st.st_mtime_ns])
    return out


def _json_step(folder: Path) -> int | None:
    return trainer_state_step(folder)[0] if folder.is_dir() else None


def checkpoint_name(path: Path, step: int | None) -> str:
    """The workflow name of a candidate (see the module docstring)."""
    base = path.name if path.is_dir() else path.stem
    base = NAME_OK.sub("_", base)
    if parse_step(base) is None and step is not None:
        base = f"{base}-step{step}"
    return base


def _weights_problem(path: Path, fmt: str) -> str | None:
    """Why a weights file of the checkpoint is not whole yet (None when all are)."""
    folder = path if path.is_dir() else None
    files: list[Path] = []
    if folder is not None:
        index = folder / INDEX_FILE
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                return f"{index.name} is not complete JSON yet"
            missing = [s for s in shards if not (folder / s).is_file()]
            if missing:
                return f"shard {missing[0]} of {index.name} not written yet"
            files += [folder / s for s in shards]
        elif (folder / "model.safetensors").is_file():
            files.append(folder / "model.safetensors")
        files += sorted(f for f in folder.iterdir() if f.suffix in (".pt", ".pth", ".bin") and f.is_file())
        if fmt == "specforge" and not (folder / STATE_FILE).is_file():
            return f"{STATE_FILE} not written yet"
    else:
        files.append(path)
    for f in files:
        if f.suffix == ".safetensors":
            try:
                check_safetensors_size(f, exact=True)
            except InputError as err:
                return f"{f.name}: {err.problem}"
        elif f.suffix in (".pt", ".pth", ".bin"):
            with open(f, "rb") as fh:
                head = fh.read(4)
            if head == b"PK\x03\x04":
                try:
                    with zipfile.ZipFile(f) as z:
                        z.namelist()
                except (zipfile.BadZipFile, OSError, EOFError) as err:
                    return f"{f.name}: not a whole zip archive yet ({err})"
            elif not head:
                return f"{f.name}: empty"
    return None


def _marker_problem(path: Path) -> str | None:
    """The trainer's own "done" marker that is still missing (None when none is expected or it is there)."""
    if not path.is_dir():
        return None
    if (path / "optimizer_state_dict.pt").is_file() and not (path / "training_state.json").is_file():
        return "speculators checkpoint without training_state.json yet (written last)"
    if re.fullmatch(r"checkpoint-\d+", path.name) and not (path / "trainer_state.json").is_file():
        return "HF Trainer checkpoint without trainer_state.json yet (written last)"
    return None


def identify(path: str | Path) -> tuple[str, int | None]:
    """``(workflow name, step)`` of a candidate from its name and trainer-state JSON (cheap: no weights read)."""
    path = Path(path)
    step = parse_step(path.name if path.is_dir() else path.stem)
    if step is None:
        step = _json_step(path)
    return checkpoint_name(path, step), step


def inspect(path: str | Path, settle_s: float = 30.0, now: float | None = None) -> Candidate:
    """Whether ``path`` is a complete checkpoint (module docstring, rules 1-5), its step and name."""
    path = Path(path)
    now = time.time() if now is None else now
    name, step = identify(path)
    cand = Candidate(path, name, step, False)
    try:
        fmt, _ = detect_format(path)
    except InputError as err:
        cand.reason = f"not a checkpoint (yet): {err.problem.split(' (supported')[0]}"
        return cand
    sig = signature(path)
    cand.signature = sig
    temp = [rel for rel, _, _ in sig if rel.endswith(TEMP_SUFFIXES)]
    problem = (f"temporary file {temp[0]} present: still being written" if temp else None) \
        or _marker_problem(path) or _weights_problem(path, fmt)
    if problem is None and sig:
        age = now - max(m for _, _, m in sig) / 1e9
        if age < settle_s:
            problem = f"changed {age:.0f} s ago (settle_s {settle_s:g})"
    if problem is None and not sig:
        problem = "no files"
    cand.complete = problem is None
    cand.reason = problem or ""
    return cand


def matches(name: str, pattern: str) -> bool:
    """``fnmatch`` of a checkpoint name (for ``watch.final_checkpoint``)."""
    return bool(pattern) and fnmatch.fnmatch(name, pattern)


def same_files(a: list, b: list) -> bool:
    """Two signatures describe the same files (paths, sizes, mtimes)."""
    return [list(x) for x in a] == [list(x) for x in b]

