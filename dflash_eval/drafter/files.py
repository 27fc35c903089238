"""A stripped drafter folder's files: ``strip_info.json`` and the weights, refused when not finite.

``strip`` records the sha256 of ``model.safetensors`` and ``config.json`` in ``strip_info.json``
(``sha256: {file: hex}``, :func:`file_checksums`): the evaluate output's provenance names the drafter's
weights by it. :func:`read_drafter_weights` refuses any non-finite tensor, naming it; ``load_drafter``
loads the state dict strictly (a missing or unexpected key is an error).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from dflash_eval.core.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    import torch  # imported where weights are read: summary reads strip_info.json without torch

log = logging.getLogger(__name__)

#: files of a stripped folder whose sha256 ``strip_info.json`` records
CHECKED_FILES = ("model.safetensors", "config.json")
RESTRIP_FIX = ("strip it again (snakemake -R strip_drafter, or `python -m dflash_eval strip-drafter`), or copy an "
               "intact folder")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_checksums(folder: Path) -> dict[str, str]:
    """``{name: sha256 hex}`` of :data:`CHECKED_FILES` in ``folder`` (for ``strip_info.json`` ``sha256``)."""
    return {name: sha256_bytes((Path(folder) / name).read_bytes()) for name in CHECKED_FILES}


def read_strip_info(folder: Path) -> dict:
    """``folder/strip_info.json`` (``{}`` when the file is absent).

    Raises:
        InputError: not a JSON object.
    """
    info_file = Path(folder) / "strip_info.json"
    if not info_file.is_file():
        return {}
    try:
        info = json.loads(info_file.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise InputError(info_file, None, f"not valid JSON ({err})", RESTRIP_FIX) from None
    if not isinstance(info, dict):
        raise InputError(info_file, None, "not a JSON object", RESTRIP_FIX)
    return info


def read_drafter_weights(folder: Path) -> dict[str, torch.Tensor]:
    """``folder/model.safetensors`` as a state dict, every floating tensor finite.

    Returns:
        ``{key: tensor}`` on the CPU, dtypes as stored (bf16 after strip).

    Raises:
        InputError: the weights file missing or not safetensors; a tensor holding NaN or Inf (naming it).
    """
    folder = Path(folder)
    weights = folder / "model.safetensors"
    try:
        data = weights.read_bytes()
    except FileNotFoundError:
        raise InputError(weights, None, "not found", "run the strip_drafter rule (dflash-eval strip-drafter) first") from None
    try:
        state = load(data)
    except (SafetensorError, ValueError) as err:
        raise InputError(weights, None, f"not a readable safetensors file ({err})", RESTRIP_FIX) from None
    for key, v in sorted(state.items()):
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            n_bad = int((~torch.isfinite(v)).sum())
            raise InputError(weights, key, f"{n_bad} of {v.numel()} values are NaN or Inf (a diverged or damaged "
                             "checkpoint: every draft would be garbage)",
                             "evaluate an earlier checkpoint of the run, or strip it again from the trainer's output")
    return state
