"""The disk-full error of the hidden_states stage: what is needed and what is free, in one unit.

The writer refuses a batch when free space < the batch + :data:`HEADROOM` (``PartialCache.check_room``
in :mod:`dflash_eval.cache.writer`); a real ``ENOSPC``/``EDQUOT``/``EFBIG`` can also come from HDF5.
:func:`no_room_error` states, in MB (10^6 bytes), what the samples left need, what the file system
reports free now, and so how much to free (or that the limit is a quota / file size limit, when the
file system reports enough).
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from dflash_eval.core.errors import InputError

#: free space the writer keeps beyond a batch (HDF5 cannot recover from a failed write)
HEADROOM = 64 << 20


def require_room(folder: Path, nbytes: int) -> None:
    """Raise ``OSError(ENOSPC)`` when the file system of ``folder`` has less free space than ``nbytes`` plus
    :data:`HEADROOM` (the writer's check before each batch: :meth:`dflash_eval.cache.writer.PartialCache.check_room`)."""
    free = shutil.disk_usage(folder).free
    if free < nbytes + HEADROOM:
        raise OSError(errno.ENOSPC, f"No space left on device: {free / 1e6:.0f} MB free, the next batch needs "
                      f"{nbytes / 1e6:.0f} MB + {HEADROOM / 1e6:.0f} MB of headroom", str(folder))


def bytes_per_token(storage: str, n_layers: int, hidden_size: int) -> int:
    """Bytes one token takes in a cache (torch-free: the workflow plan sizes caches at parse time).

    Args:
        storage: ``"bfloat16"`` (2 bytes a value), ``"float32"`` (4) or ``"fp8"`` (1, plus a float32 scale per
            token and layer: ``cache.storage: fp8``, :func:`dflash_eval.cache.format.quantize_fp8`).
        n_layers, hidden_size: ``K`` stored layers of ``H`` values.

    Returns:
        the hidden states' bytes plus the token's ``input_ids`` and ``target_argmax`` (int32 each); HDF5's own
        overhead (object headers, about 2 KB per sample) is not counted.

    Raises:
        ValueError: another storage name.
    """
    per_value = {"bfloat16": 2, "float32": 4, "fp8": 1}.get(storage)
    if per_value is None:
        raise ValueError(f"unknown cache storage {storage!r} (bfloat16, float32 or fp8)")
    return n_layers * hidden_size * per_value + (4 * n_layers if storage == "fp8" else 0) + 8


def no_room_error(path: Path, err: BaseException, committed: int, total: int, bytes_left: int) -> InputError:
    """The :class:`InputError` for a cache write that ran out of room.

    Args:
        path: the partial cache file (kept; the rerun resumes from it).
        err: the OSError/RuntimeError that said so (quoted).
        committed, total: samples committed in the partial file, samples in all.
        bytes_left: bytes the hidden states of the ``total - committed`` samples left take (as stored).
    """
    try:
        free = shutil.disk_usage(Path(path).parent).free
    except OSError:
        free = None
    need = bytes_left + HEADROOM
    mb = lambda b: f"{b / 1e6:.0f} MB"  # noqa: E731
    needs = f"the {total - committed} samples left need about {mb(bytes_left)} (+ {mb(HEADROOM)} of headroom)"
    if free is None:
        fix = f"{needs}; free that much space in {Path(path).parent} and rerun: the job resumes from the partial file"
    elif free < need:
        fix = (f"{needs} and {mb(free)} are free in {Path(path).parent}: free at least {mb(need - free)} more and "
               "rerun: the job resumes from the partial file")
    else:
        fix = (f"{needs} and the file system reports {mb(free)} free in {Path(path).parent}, so a quota or a file "
               "size limit (ulimit -f) stopped the write: raise it (or write elsewhere) and rerun: the job resumes "
               "from the partial file")
    return InputError(path, None, f"no room left to write the cache (disk, quota or file size limit: {err}); "
                      f"{committed} of {total} samples are committed in this partial file and kept", fix)


#: the options that shrink a cache (named by every "cannot fit" error)
SHRINK_FIX = ("cache.storage: fp8 (about half of bf16, a quarter of float32: docs/cache-format.md), fewer stored "
              "layers (cache.target_layer_ids), fewer prompts (prompt_set.n) or generation.max_new_tokens")


def check_free_space(path: Path, need: int, samples: int, storage: str) -> None:
    """Refuse to start writing a cache that cannot fit: before the ``hidden_states`` job loads its target.

    Args:
        path: the cache file (its folder's file system is measured; it may not exist yet).
        need: bytes the samples left to compute take as stored (:func:`bytes_per_token` x their tokens).
        samples: how many samples that is (named in the error).
        storage: the cache's storage name (:func:`bytes_per_token`), named in the error.

    Raises:
        InputError: ``(path, "cache", ...)`` when free space < ``need`` + :data:`HEADROOM`, naming both and the
            options that shrink the cache (``cache.disk_check: warn`` skips this check).
    """
    folder = Path(path).parent
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free >= need + HEADROOM:
        return
    raise InputError(path, "cache", f"the {samples} samples left need {need / 1e6:.0f} MB as stored ({storage}) + "
                     f"{HEADROOM / 1e6:.0f} MB of headroom, and {free / 1e6:.0f} MB are free in {folder}",
                     f"free {(need + HEADROOM - free) / 1e6:.0f} MB there, or shrink the cache: {SHRINK_FIX} "
                     "(or cache.disk_check: warn when the free space reported is not what you may write)")
