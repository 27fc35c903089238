"""What a drafter checkpoint is, from its file names and headers alone (torch-free).

Its format (:func:`detect_format`, the table in :mod:`dflash_eval.drafter.checkpoints`), its training step
(:func:`parse_step` from the name, :func:`trainer_state_step` from a trainer's JSON) and whether its safetensors
files are whole (:func:`check_safetensors_size`). :mod:`dflash_eval.drafter.checkpoints` reads the weights
(torch); :mod:`dflash_eval.drafter.trainer_output` watches a trainer's output folder with these checks alone, so
``watch`` imports no torch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from dflash_eval.core.errors import InputError

FORMATS = {
    "hf-folder": "z-lab/HF folder: config.json + model.safetensors",
    "hf-folder-sharded": "z-lab/HF folder: config.json + model.safetensors.index.json + shards",
    "specforge-legacy": "SpecForge legacy epoch_E_step_S/: model.safetensors + config.json + training_state.pt",
    "specforge": "SpecForge <run>-stepN/ with training_state.pt holding draft_state_dict",
    "torch-dict": "torch .pt/.pth/.bin file holding a (nested, prefixed) state dict",
    "dcp": "torch.distributed.checkpoint (FSDP/DCP) folder: .metadata + *.distcp",
    "speculators": "vLLM speculators folder: config.json with speculators_model_type + model.safetensors",
}
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
STATE_FILE = "training_state.pt"
INDEX_FILE = "model.safetensors.index.json"
#: a step is a whole digit run: not followed by a letter or a decimal part (``step20k``, ``step1e5``, ``step_1.5k``
#: are no step; reading their leading digits would give steps 20, 1 and 1)
STEP_END = r"(?![A-Za-z0-9]|\.\d)"
STEP_PATTERNS = (r"(?:global_step|step|iter|checkpoint)[_-]?(\d+)" + STEP_END, r"epoch_\d+_step_(\d+)" + STEP_END)
#: a step-like word whose digits run on into a unit or decimal (:func:`unread_step`)
UNREAD_STEP = r"(?:global_step|step|iter|checkpoint)[_-]?\d[\w.]*"
RESAVE = "re-copy or re-save the checkpoint (the file is incomplete or corrupt)"
LFS_POINTER = "version https://git-lfs.github.com/spec/"  #: first bytes of a Git LFS pointer file
#: trainer-state JSON files whose ``global_step`` names an HF-style folder's step (speculators, HF Trainer)
TRAINER_STATE_FILES = ("training_state.json", "trainer_state.json")


def parse_step(name: str) -> int | None:
    """Training step from a checkpoint name (``step1500``, ``global_step_400``, ``epoch_0_step_100``, ``-step900``,
    ``step100.pt``); ``None`` when none, or when the digits run on into a unit or decimal (``step20k``,
    ``step_1.5k``, ``step1e5``: :func:`unread_step` names it)."""
    for pat in STEP_PATTERNS[::-1]:
        m = re.search(pat, name)
        if m:
            return int(m.group(1))
    return None


def unread_step(name: str) -> str | None:
    """The note for a name whose step-like word :func:`parse_step` does not read (``step20k``): strip records it,
    so the report and ``strip_info.json`` say why the checkpoint has no step. ``None`` when the name has a step or
    no step-like word."""
    m = None if parse_step(name) is not None else re.search(UNREAD_STEP, name)
    return (f"no training step: '{m.group(0)}' in the name {name!r} is not a whole number of steps (a unit or "
            "decimal after the digits); name it with the number (e.g. step20000) or give the step in "
            "trainer_state.json (global_step)") if m else None


# --------------------------------------------------------------------------- detection
def _unsupported(path: Path, what: str) -> InputError:
    supported = "; ".join(f"{name} = {desc}" for name, desc in FORMATS.items())
    return InputError(path, "format", f"{what} is not a supported drafter checkpoint (supported: {supported})",
                      "point the checkpoint entry at one of these (a folder holding a .pt/.bin state dict: "
                      "pass the file itself)")


def detect_format(path) -> tuple[str, Path]:
    """Name the format of ``path`` from file names alone (see the module table).

    A ``training_state.pt`` path stands for its folder. Returns ``(format, path)`` with that
    normalisation applied.

    Raises:
        InputError: the path does not exist, or matches no supported format (the message lists them).
    """
    path = Path(path)
    if not path.exists():
        raise InputError(path, None, "checkpoint not found", "fix the path in the checkpoints section of the config")
    if path.is_file() and path.name == STATE_FILE:
        path = path.parent
    if path.is_file():
        if path.suffix in TORCH_SUFFIXES:
            return "torch-dict", path
        raise _unsupported(path, f"a '{path.suffix}' file")
    has = {p.name for p in path.iterdir()}
    if ".metadata" in has and any(n.endswith(".distcp") for n in has):
        return "dcp", path
    weights = "model.safetensors" in has or INDEX_FILE in has
    if weights and STATE_FILE in has:
        return "specforge-legacy", path
    if INDEX_FILE in has:
        return "hf-folder-sharded", path
    if weights:
        return "hf-folder", path
    if STATE_FILE in has:
        return "specforge", path
    raise _unsupported(path, f"a folder holding {sorted(has)[:12]}")


# --------------------------------------------------------------------------- headers and trainer state
def check_safetensors_size(path: Path, exact: bool = False) -> None:
    """Check a safetensors header against the file size (reads the header only).

    ``exact``: also refuse a file longer than its header says (a writer still going, or
    a file being overwritten in place).

    Raises:
        InputError: truncated header (field ``header``), a tensor whose bytes extend past the end
            of the file (field = that tensor's key), a Git LFS pointer, or an unreadable header.
    """
    size = path.stat().st_size
    with open(path, "rb") as fh:
        if fh.read(len(LFS_POINTER)) == LFS_POINTER.encode():
            raise InputError(path, None, "a Git LFS pointer, not the weights (run 'git lfs pull' in its repository)", RESAVE)
        fh.seek(0)
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise InputError(path, "header", f"truncated: {size} bytes, the header alone needs {8 + max(n, 0)}", RESAVE)
        try:
            header = json.loads(fh.read(n))
            ends = {k: 8 + n + int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"}
        except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError):
            raise InputError(path, "header", "not a safetensors header", RESAVE) from None
    for key, end in sorted(ends.items(), key=lambda kv: kv[1]):
        if end > size:
            raise InputError(path, key, f"truncated: the tensor's data ends at byte {end}, the file has {size}", RESAVE)
    if exact and size != max(ends.values(), default=8 + n):
        raise InputError(path, None, f"{size} bytes, its header describes {max(ends.values(), default=8 + n)}", RESAVE)


def trainer_state_step(folder: Path) -> tuple[int | None, str | None]:
    """``(global_step, file)`` from the trainer-state JSON a checkpoint folder may hold:
    speculators' ``training_state.json`` (``{epoch, local_step, global_step}``,
    vllm-project/speculators ``src/speculators/train/trainer.py``) or the HF Trainer's
    ``trainer_state.json`` (``global_step``); ``(None, None)`` when neither gives an int."""
    for name in TRAINER_STATE_FILES:
        f = folder / name
        if f.is_file():
            try:
                step = json.loads(f.read_text()).get("global_step")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(step, int) and not isinstance(step, bool):
                return step, name
    return None, None
