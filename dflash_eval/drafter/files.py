"""A stripped drafter folder's files, verified while read: checksums and finite weights.

``strip`` records the sha256 of ``model.safetensors`` and ``config.json`` in ``strip_info.json``
(``sha256: {file: hex}``, :func:`file_checksums`); :func:`read_drafter_weights` hashes the weight
bytes it reads (one read: the same bytes are hashed and parsed) and compares, then refuses any
non-finite tensor, naming it. A folder without ``strip_info.json`` (written by hand, or the file
deleted) is read unverified, with a warning naming it (``evaluate`` records ``drafter_verified``).

``strip_info.json`` itself ends with ``info_sha256``: sha256 of its other fields as canonical JSON
(:func:`info_sha256`), so the values a stage takes from it (``step``, the tau table's and the
report's x axis; ``random_init``; the ``sha256`` record) are verified too (:func:`read_strip_info`).
``strip`` always writes both: a ``strip_info.json`` without ``info_sha256``, or without the ``sha256``
record of every checked file, is refused (strip again).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_eval.core.errors import InputError

if TYPE_CHECKING:  # pragma: no cover
    import torch  # imported where weights are read: summary reads strip_info.json without torch

log = logging.getLogger(__name__)

#: files of a stripped folder whose sha256 ``strip_info.json`` records
CHECKED_FILES = ("model.safetensors", "config.json")
RESTRIP_FIX = ("the folder changed after strip wrote it (an edit, a bad copy, bit rot): strip it again "
               "(snakemake -R strip_drafter, or `python -m dflash_eval strip-drafter`), or copy an intact folder")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_checksums(folder: Path) -> dict[str, str]:
    """``{name: sha256 hex}`` of :data:`CHECKED_FILES` in ``folder`` (for ``strip_info.json`` ``sha256``)."""
    return {name: sha256_bytes((Path(folder) / name).read_bytes()) for name in CHECKED_FILES}


#: the self-checksum of ``strip_info.json``
INFO_FIELD = "info_sha256"


def info_sha256(info: dict) -> str:
    """sha256 (hex) of ``json.dumps(info without info_sha256, sort_keys=True, separators=(",", ":"))`` (ASCII),
    computed on the JSON round trip of ``info`` so that writer and reader hash the same text."""
    body = {k: v for k, v in json.loads(json.dumps(info)).items() if k != INFO_FIELD}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


#: what :func:`read_drafter_weights` logs for a folder without ``strip_info.json``
UNVERIFIED_WARNING = ("%s: weights read unverified: no strip_info.json; strip the checkpoint with the strip_drafter "
                      "rule to have them verified")


def check_source(folder: Path, checkpoint: str, settings_record: str | Path | None = None) -> None:
    """Refuse a stripped folder whose ``strip_info.json`` names another source than ``checkpoint`` (the path
    its strip job was given: the workflow passes it to ``evaluate``), e.g. another checkpoint's folder
    copied in its place; with ``settings_record`` (the run's strip options record, which holds the stamps of
    the checkpoint's files: :func:`dflash_eval.core.io.file_stamps`), also one whose ``settings_sha256`` is not that
    record's: a folder stripped from other bytes at the same path (an older copy of the folder put back, the
    checkpoint rewritten since) or with other strip options. A folder without ``strip_info.json`` is not
    checked (read with a warning), except with ``settings_record`` (the workflow), where it is refused.

    Raises:
        InputError: ``(<folder>/strip_info.json, "source" | "settings_sha256", ...)`` naming the difference (or
            the field missing: stripped by an earlier version or outside the workflow); as :func:`read_strip_info`.
    """
    info = read_strip_info(Path(folder))
    where = Path(folder) / "strip_info.json"
    if not info and settings_record is not None:
        raise InputError(where, None, "missing, but the run's strip job writes it: the folder cannot show that it "
                         f"holds {checkpoint} stripped with the options of {settings_record}", RESTRIP_FIX)
    if not info:
        return
    if str(info.get("source")) != str(checkpoint):
        raise InputError(where, "source", f"stripped from {info.get('source')!r}, but the "
                         f"checkpoint evaluated under this name is {str(checkpoint)!r}: the folder holds another "
                         "checkpoint's drafter", RESTRIP_FIX)
    if settings_record is None:
        return
    want = hashlib.sha256(Path(settings_record).read_bytes()).hexdigest()
    got = info.get("settings_sha256")
    if got is None:
        raise InputError(where, "settings_sha256", f"missing: stripped by an earlier version or outside the workflow, "
                         f"so it cannot show that it was made from the checkpoint's current files and the strip "
                         f"options of {settings_record}", RESTRIP_FIX)
    if got != want:
        raise InputError(where, "settings_sha256", f"{got[:16]}... is not the sha256 of the run's strip record "
                         f"{settings_record} ({want[:16]}...): the folder was stripped from other bytes of "
                         f"{checkpoint} (an older copy of the folder put back, or the checkpoint's files replaced "
                         "since) or with other strip options", RESTRIP_FIX)


def read_strip_info(folder: Path) -> dict:
    """``folder/strip_info.json``, verified against its ``info_sha256`` (``{}`` when the file is absent).

    Raises:
        InputError: not a JSON object; no ``info_sha256`` or no ``sha256`` record of each of
            :data:`CHECKED_FILES` (``strip`` writes both); its fields do not match ``info_sha256``
            (an edit after strip).
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
    want = info.get(INFO_FIELD)
    if want is None:
        raise InputError(info_file, INFO_FIELD, "missing (strip writes it: the file was edited, or stripped by an "
                         "older version), so its step, random_init and checksum record cannot be verified", RESTRIP_FIX)
    record = info.get("sha256")
    missing = [n for n in CHECKED_FILES if not isinstance(record, dict) or not isinstance(record.get(n), str)]
    if missing:
        raise InputError(info_file, "sha256", f"no checksum recorded for {', '.join(missing)} (strip records "
                         f"{', '.join(CHECKED_FILES)}), so the weights cannot be verified", RESTRIP_FIX)
    if info_sha256(info) != want:
        fields = ", ".join(sorted(k for k in info if k != INFO_FIELD))
        raise InputError(info_file, INFO_FIELD, f"its fields do not match their checksum: one of {fields} (or a "
                         "field added or removed) changed after strip wrote it", RESTRIP_FIX)
    return info


def recorded_checksums(folder: Path) -> dict[str, str]:
    """``strip_info.json``'s ``sha256`` record (empty when the file is absent), verified (:func:`read_strip_info`).

    Raises:
        InputError: as :func:`read_strip_info`.
    """
    return dict(read_strip_info(folder).get("sha256") or {})


def check_file(folder: Path, name: str, data: bytes, recorded: dict[str, str]) -> None:
    """Compare ``data`` (the bytes of ``folder/name`` just read) with its recorded sha256, if any.

    Raises:
        InputError: a mismatch, naming the file and both checksums.
    """
    want = recorded.get(name)
    if want is None:
        return
    got = sha256_bytes(data)
    if got != want:
        raise InputError(Path(folder) / name, None, f"its bytes do not match the sha256 in strip_info.json "
                         f"({got[:12]}... read, {want[:12]}... recorded)", RESTRIP_FIX)


def read_drafter_weights(folder: Path) -> dict[str, torch.Tensor]:
    """``folder/model.safetensors`` as a state dict, verified (checksums, finite tensors).

    Also checks ``config.json`` against its record (the caller has parsed it already; it is small).
    Without ``strip_info.json`` the checksums are not checked, and a warning names the folder.

    Returns:
        ``{key: tensor}`` on the CPU, dtypes as stored (bf16 after strip).

    Raises:
        InputError: the weights file missing or not safetensors; a bad ``strip_info.json``
            (:func:`read_strip_info`); a checksum mismatch (:func:`check_file`); a tensor holding NaN or Inf (naming it).
    """
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load

    folder = Path(folder)
    weights = folder / "model.safetensors"
    recorded = recorded_checksums(folder)
    if not recorded:
        log.warning(UNVERIFIED_WARNING, folder)
    if (folder / "config.json").is_file():
        check_file(folder, "config.json", (folder / "config.json").read_bytes(), recorded)
    try:
        data = weights.read_bytes()
    except FileNotFoundError:
        raise InputError(weights, None, "not found", "run the strip_drafter rule (dflash-eval strip-drafter) first") from None
    check_file(folder, "model.safetensors", data, recorded)
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
