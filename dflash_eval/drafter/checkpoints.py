"""Drafter checkpoints: detect the format, read, validate, strip to a z-lab DFlash folder.

:func:`detect_format` picks the format from the path alone (``hf-folder``, ``hf-folder-sharded``,
``specforge-legacy``, ``specforge``, ``torch-dict``, ``speculators``, ``dcp``; ``+shared`` when target
tensors were dropped); the name goes into ``strip_info.json``. Validation and the stripped output:
:mod:`dflash_eval.stages.strip_drafter`.

Formats (layout, config and step of each, DFlash 2 codebook names, overrides): docs/checkpoint-formats.md, "Supported inputs".
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import pickle
import re
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from dflash_eval.core.errors import InputError
from dflash_eval.core.io import read_json_object
from dflash_eval.drafter.detect import (FORMATS, INDEX_FILE, LFS_POINTER, RESAVE, STATE_FILE, TORCH_SUFFIXES,
                                        check_safetensors_size, detect_format, parse_step, trainer_state_step)
from dflash_eval.drafter.detect import unread_step as unread_step  # re-exported: strip-drafter's notes
from dflash_eval.drafter.speculators import is_speculators_config

log = logging.getLogger(__name__)

NEST_KEYS = ("draft_state_dict", "draft_model", "model", "state_dict", "module")
PREFIXES = ("_orig_mod.", "module.", "draft_model.", "model.")
CONFIG_KEYS = ("draft_config", "config", "dflash_config_full")
# target tensors some trainers save beside the drafter (dropped after comparison with the target)
SHARED_KEYS = {
    "embed_tokens.weight": "embed",
    "lm_head.weight": "head",
    "verifier_lm_head.weight": "head",
    "target_embed_tokens.weight": "embed",
    "target_lm_head.weight": "head",
}
# non-trained buffers that may appear in state dicts
IGNORABLE_BUFFERS = re.compile(r"(^|\.)rotary_emb\.(inv_freq|original_inv_freq)$")
PARAM_LEAF = re.compile(r"(^|\.)(weight|bias|base_kernel|predecessor_codebook|successor_codebook)$")
#: DFlash 2 codebooks under their saved names (no ``.weight``; reference ``DFlash2DraftModel.from_pretrained``)
CODEBOOK_KEYS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")
#: torch files a trainer's checkpoint folder holds beside the weights (HF Trainer, SpecForge), not drafter weights
TRAINER_SIDE_FILES = ("optimizer*.pt", "optimizer*.bin", "scheduler*.pt", "scaler*.pt", "training_args.bin",
                      "rng_state*.pth", STATE_FILE)


@dataclass
class LoadedCheckpoint:
    """A checkpoint read into memory.

    ``state`` holds the tensors with nesting and prefixes removed (still including any shared
    target tensors), ``path`` the file or folder they came from (named in errors), ``config``
    the checkpoint's own drafter config (``config_source`` says where it was found) and
    ``sidecars`` the ``config.json`` files to try when it has none.
    """

    path: Path
    format: str
    state: dict[str, torch.Tensor]
    config: dict | None = None
    meta: dict = field(default_factory=dict)
    config_source: str | None = None
    sidecars: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: why the checkpoint's own config cannot be used (several differing copies), raised unless a
    #: ``--drafter-config`` replaces it
    config_error: InputError | None = None


# --------------------------------------------------------------------------- shared readers
def _read_json(path: Path, what: str) -> dict:
    return read_json_object(path, what, RESAVE)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file, after checking the header against the file size
    (:func:`_check_safetensors_size`).

    Raises:
        InputError: truncated header (field ``header``), a tensor whose bytes extend past the end
            of the file (field = that tensor's key), or an otherwise unreadable file.
    """
    check_safetensors_size(path)
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises its own error type
        raise InputError(path, "header", f"unreadable safetensors: {err}", RESAVE) from None


def _read_safetensors_folder(folder: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``model.safetensors``, or every shard named by ``model.safetensors.index.json``; returns (state, notes).

    Raises:
        InputError: a shard listed in the index is missing, or a shard's keys disagree with the index.
    """
    index = folder / INDEX_FILE
    # a torch state dict beside the safetensors weights (e.g. another step's export) is not read:
    # said in the notes (strip_info.json, the report), the trainer's own side files left out
    torch_files = sorted(p.name for p in folder.iterdir() if p.suffix in TORCH_SUFFIXES
                         and not any(fnmatch.fnmatch(p.name, pat) for pat in TRAINER_SIDE_FILES))
    torch_note = [f"ignored {torch_files}: the weights read are the folder's safetensors (point the checkpoint "
                  "entry at a .pt file to read that one)"] if torch_files else []
    if not index.is_file():
        others = sorted(p.name for p in folder.glob("*.safetensors") if p.name != "model.safetensors")
        notes = [f"ignored {others}: not model.safetensors and no {INDEX_FILE}"] if others else []
        return _read_safetensors(folder / "model.safetensors"), notes + torch_note
    weight_map = _read_json(index, "safetensors index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise InputError(index, "weight_map", "missing or empty", RESAVE)
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        listed = {k for k, s in weight_map.items() if s == shard}
        if not (folder / shard).is_file():
            raise InputError(index, f"weight_map.{min(listed)}", f"names shard '{shard}', which is missing", RESAVE)
        part = _read_safetensors(folder / shard)
        absent, extra = sorted(listed - set(part)), sorted(set(part) - listed)
        if absent or extra:
            raise InputError(folder / shard, (absent or extra)[0], f"disagrees with {INDEX_FILE}: listed there but absent "
                             f"{absent[:10]}, present but not listed {extra[:10]}", RESAVE)
        state.update(part)
    unused = sorted(p.name for p in folder.glob("*.safetensors") if p.name not in set(weight_map.values()))
    return state, ([f"ignored {unused}: not in {INDEX_FILE}"] if unused else []) + torch_note


def _torch_load(path: Path, allowed: tuple = ()) -> Any:
    """``torch.load(weights_only=True)`` on CPU (memory-mapped when possible); ``allowed``: extra safe classes.

    Raises:
        InputError: the pickle needs a class outside the weights-only allow-list (field = that
            class), or the file cannot be read at all.
    """
    fix = ("save plain tensors and dicts, e.g. {'model': model.state_dict(), 'step': N}; dflash-eval loads "
           "checkpoints with torch.load(weights_only=True) and never runs pickled code")
    problem = _not_a_torch_file(path)
    if problem:
        raise InputError(path, None, problem, RESAVE)
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as err:
        m = re.search(r"GLOBAL ([\w.]+)", str(err))
        if m:
            raise InputError(path, m.group(1), "the pickle needs this class, which torch.load(weights_only=True) "
                             "refuses to import", fix) from None
        raise InputError(path, None, f"cannot be read with torch.load(weights_only=True): {err}", RESAVE) from None
    except Exception as err:  # truncated zip, not a torch file, ...
        raise InputError(path, None, f"cannot be read with torch.load(weights_only=True): "
                         f"{type(err).__name__}: {str(err).rstrip('. ')}", RESAVE) from None


def _not_a_torch_file(path: Path) -> str | None:
    """Why ``path`` cannot be a torch checkpoint, judged from its first bytes (None when it may be one).

    torch.save writes a zip archive (``PK\\x03\\x04``) since torch 1.6, a pickle (protocol >= 2,
    first byte ``0x80``) before; anything else (an empty file, text, HTML from a failed download)
    gets a message saying what it is instead of the unpickler's bare ``: 101``.
    """
    with open(path, "rb") as fh:
        head = fh.read(64)
    if not head:
        return "empty file (0 bytes): not a torch checkpoint"
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80":
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and text.startswith(LFS_POINTER):
        return "a Git LFS pointer, not the checkpoint itself (run 'git lfs pull' in its repository)"
    if text is not None and all(c.isprintable() or c in "\n\r\t" for c in text):
        return f"a text file, not a torch checkpoint (starts with {text[:40]!r})"
    return f"not a torch checkpoint (neither a zip archive nor a pickle; starts with bytes {head[:16]!r})"


def _strip_prefixes(state: dict, source) -> dict:
    """Remove wrapper prefixes (``PREFIXES``, repeatedly) from every key.

    Raises:
        InputError: two keys become one (field = the second original key).
    """
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for key, val in state.items():
        k = key
        changed = True
        while changed:
            changed = False
            for p in PREFIXES:
                if k.startswith(p):
                    k = k[len(p):]
                    changed = True
        if k in out:
            raise InputError(source, key, f"duplicate key after prefix stripping: '{key}' and '{origin[k]}' both become '{k}'",
                             "save one copy of the drafter weights per checkpoint")
        out[k] = val
        origin[k] = key
    return out


def _find_state_dict(obj: dict, source) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Descend through ``NEST_KEYS`` to the dict of drafter tensors; returns (tensors, nesting path)."""
    path: list[str] = []
    while True:
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        if tensors and len(tensors) >= len(obj) // 2 and any("fc" in k or "layers." in k for k in tensors):
            return tensors, path
        nxt = next((k for k in NEST_KEYS if isinstance(obj.get(k), dict)), None)
        if nxt is None:
            raise InputError(source, "/".join(path) or "top level",
                             f"no drafter state dict found (keys: {sorted(map(str, obj))[:12]})",
                             f"save the drafter weights under one of {list(NEST_KEYS)} or at the top level")
        obj = obj[nxt]
        path.append(nxt)


def _from_torch_dict(obj: Any, path: Path, fmt: str, step_name: str) -> LoadedCheckpoint:
    """A loaded torch dict -> :class:`LoadedCheckpoint` (state dict, embedded config, step)."""
    if not isinstance(obj, dict):
        raise InputError(path, "top level", f"is a {type(obj).__name__}, not a dict",
                         "save a state dict, or a dict holding one under 'model' / 'state_dict'")
    state, nest = _find_state_dict(obj, path)
    cfg_keys = [k for k in CONFIG_KEYS if isinstance(obj.get(k), dict)]
    # several drafter configs (not e.g. a training-arguments dict under 'config') must agree
    drafter_cfgs = [k for k in cfg_keys if {"hidden_size", "dflash_config"} & set(obj[k])]
    conflict = None
    if len(drafter_cfgs) > 1 and len({json.dumps(obj[k], sort_keys=True, default=str) for k in drafter_cfgs}) > 1:
        conflict = InputError(path, " / ".join(drafter_cfgs), "the checkpoint holds several different drafter configs",
                              "pass the right one with --drafter-config (workflow: the checkpoint entry's drafter_config)")
    cfg_keys = drafter_cfgs or cfg_keys
    cfg_key = cfg_keys[0] if cfg_keys and conflict is None else None
    meta = {k: obj[k] for k in ("step", "global_step", "epoch", "random_init") if isinstance(obj.get(k), (int, float, str))}
    step = meta.get("step", meta.get("global_step"))
    notes = []
    if isinstance(meta.get("global_step"), (int, float)) and "step" in meta and meta["global_step"] != meta["step"]:
        notes.append(f"the checkpoint stores step={meta['step']!r} and global_step={meta['global_step']!r}; "
                     "the step column uses 'step'")
    named = parse_step(step_name)
    if isinstance(step, (int, float)) and named is not None and int(step) != named:
        notes.append(f"the checkpoint stores step {int(step)}, its name {step_name!r} says {named}: the step column "
                     "uses the stored one")
    meta["step"] = int(step) if isinstance(step, (int, float)) else named
    return LoadedCheckpoint(path, fmt + (f"[{'/'.join(nest)}]" if nest else ""), _strip_prefixes(state, path),
                            obj[cfg_key] if cfg_key else None, meta, f"{path} [{cfg_key}]" if cfg_key else None,
                            [path.parent / "config.json"], notes=notes, config_error=conflict)


# --------------------------------------------------------------------------- one loader per format
def _load_hf_folder(path: Path, fmt: str = "hf-folder") -> LoadedCheckpoint:
    state, notes = _read_safetensors_folder(path)
    cfg_file = path / "config.json"
    cfg = _read_json(cfg_file, "drafter config") if cfg_file.is_file() else None
    if fmt.startswith("hf-folder") and is_speculators_config(cfg):
        fmt = "speculators"
    source = path if (path / INDEX_FILE).is_file() else path / "model.safetensors"  # named in errors
    step, state_file = trainer_state_step(path)
    if step is not None and parse_step(path.name) not in (None, step):
        notes.append(f"{state_file} global_step {step} differs from the folder name's step {parse_step(path.name)}")
    return LoadedCheckpoint(source, fmt, _strip_prefixes(state, source),
                            cfg, {"step": step if step is not None else parse_step(path.name)},
                            str(cfg_file) if cfg is not None else None, [], notes)


def _load_specforge_legacy(path: Path) -> LoadedCheckpoint:
    ck = _load_hf_folder(path, "specforge-legacy")
    try:  # epoch/global_step/args(argparse.Namespace)/optimizer; only the counters are wanted
        ts = _torch_load(path / STATE_FILE, allowed=(argparse.Namespace,))
        step = ts.get("global_step") if isinstance(ts, dict) else None
    except InputError as err:
        ts, step = None, None
        ck.notes.append(f"step taken from the folder name: {err.problem}")
    if isinstance(step, int):
        if ck.meta["step"] is not None and ck.meta["step"] != step:
            ck.notes.append(f"{STATE_FILE} global_step {step} differs from the folder name's step {ck.meta['step']}")
        ck.meta["step"] = step
    if isinstance(ts, dict) and isinstance(ts.get("epoch"), int):
        ck.meta["epoch"] = ts["epoch"]
    return ck


def _load_specforge(path: Path) -> LoadedCheckpoint:
    file = path / STATE_FILE
    obj = _torch_load(file)
    if not isinstance(obj, dict) or not isinstance(obj.get("draft_state_dict"), dict):
        keys = sorted(map(str, obj))[:12] if isinstance(obj, dict) else type(obj).__name__
        raise InputError(file, "draft_state_dict", f"missing (found {keys}): not a SpecForge training_state.pt",
                         "point at a SpecForge <run>-stepN folder, or export it with specforge's to_hf first")
    ck = _from_torch_dict(obj, file, "specforge", path.name)
    ck.format = "specforge"
    ck.sidecars = [path / "config.json", path.parent / "config.json"]
    return ck


def _load_torch(path: Path) -> LoadedCheckpoint:
    return _from_torch_dict(_torch_load(path), path, "torch-dict", path.stem)


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` allowing only its metadata dataclasses, torch dtypes/sizes and paths."""

    SAFE = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}

    def find_class(self, module: str, name: str):
        ok = "." not in name and (
            (module, name) in self.SAFE
            or (module == "torch.distributed.checkpoint.metadata" and isinstance(super().find_class(module, name), type))
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not ok:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")
        return super().find_class(module, name)


def _load_dcp(path: Path) -> LoadedCheckpoint:
    import torch.distributed.checkpoint as dcp  # deferred: imports torch._dynamo, which --help must not (tests/core/test_startup.py)

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            file = path / ".metadata"
            try:
                with open(file, "rb") as fh:
                    md = _DCPMetadataUnpickler(fh).load()
            except pickle.UnpicklingError as err:
                m = re.search(r"GLOBAL ([\w.]+)", str(err))
                raise InputError(file, m.group(1) if m else None, f"DCP metadata needs a class outside the safe "
                                 f"list ({err}); dflash-eval never runs pickled code", "re-save with torch.distributed.checkpoint") from None
            except Exception as err:
                raise InputError(file, None, f"unreadable DCP metadata: {err}", RESAVE) from None
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = dcp.metadata.StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    reader = SafeReader(str(path))
    md = reader.read_metadata()
    planner = md.planner_data or {}
    keys, skipped = set(), []
    for fqn, item in md.state_dict_metadata.items():
        leaf = planner.get(fqn, (fqn,))[-1]
        if isinstance(item, dcp.metadata.TensorStorageMetadata) and PARAM_LEAF.search(str(leaf)):
            keys.add(fqn)
        else:
            skipped.append(fqn)
    if not keys:
        raise InputError(path / ".metadata", None, f"no parameter tensors (entries: {sorted(md.state_dict_metadata)[:12]})",
                         "save the drafter's model state dict with torch.distributed.checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is unavailable ... single process": intended
        try:
            obj = dcp.state_dict_loader._load_state_dict_from_keys(keys, storage_reader=reader)
        except Exception as err:
            raise InputError(path, None, f"cannot read the DCP shards: {err}", RESAVE) from None
    state, nest = _find_state_dict(obj, path)
    notes = [f"skipped {len(skipped)} non-parameter DCP entries (optimizer state, counters)"] if skipped else []
    return LoadedCheckpoint(path, "dcp" + (f"[{'/'.join(nest)}]" if nest else ""), _strip_prefixes(state, path), None,
                            {"step": parse_step(path.name)}, None, [path / "config.json", path.parent / "config.json"], notes)


LOADERS = {
    "hf-folder": _load_hf_folder,
    "hf-folder-sharded": lambda p: _load_hf_folder(p, "hf-folder-sharded"),
    "specforge-legacy": _load_specforge_legacy,
    "specforge": _load_specforge,
    "torch-dict": _load_torch,
    "dcp": _load_dcp,
}


def load_checkpoint(path) -> LoadedCheckpoint:
    """Detect the format of ``path`` (:func:`detect_format`) and read it with that format's loader.

    Returns:
        a :class:`LoadedCheckpoint`; ``state`` tensors keep their stored dtype (CPU).

    Raises:
        InputError: unsupported or unreadable input (see the module docstring).
    """
    fmt, path = detect_format(path)
    ck = LOADERS[fmt](path)
    ck.notes += saved_codebook_names(ck.state, ck.path)
    log.info("%s: detected format %s (%s)", path, ck.format, FORMATS.get(ck.format, FORMATS[fmt]))
    return ck


def saved_codebook_names(state: dict[str, torch.Tensor], source) -> list[str]:
    """Rename ``candidate_selector.*_codebook.weight`` to the saved ``...codebook`` (in place); returns notes.

    Raises:
        InputError: one codebook stored under both names.
    """
    renamed = []
    for key in CODEBOOK_KEYS:
        alias = key + ".weight"
        if alias not in state:
            continue
        if key in state:
            raise InputError(source, alias, f"stored twice, as '{key}' and '{alias}'",
                             "save one copy of the drafter weights per checkpoint")
        state[key] = state.pop(alias)
        renamed.append(alias)
    return [f"renamed {renamed} to the saved DFlash 2 names (no .weight)"] if renamed else []
