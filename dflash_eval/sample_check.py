"""Checks on a cache sample while it is read: its checksum, and finite hidden states.

:meth:`dflash_eval.cache_reader.CacheReader.sample` passes the arrays it has just read (as stored:
``input_ids`` / ``target_argmax`` ``[T]`` int32, ``hidden`` ``[T, K, H]`` uint16 bf16 bits or
float32) to :func:`check_read_sample` before building the sample. The bytes pass through memory
anyway, so verifying costs one sha256 pass and one exponent scan over them (measured by
``bench/verify_cost.py``); no sample reaches a metric unverified.
"""

from __future__ import annotations

import numpy as np

from .cache_format import sample_sha256
from .errors import InputError

#: the fix of every damaged-sample error
REEXTRACT_FIX = ("the file changed after it was written (bit rot, a bad copy, an edit): re-extract it "
                 "(snakemake -R hidden_states, or delete the cache and rerun; `python -m dflash_eval hidden-states` "
                 "resumes), or copy an intact file")


def first_non_finite(hidden: np.ndarray) -> tuple[int, int] | None:
    """``(token, layer_index)`` of the first non-finite value in ``hidden`` ``[T, K, H]``, else None.

    bf16 stored as uint16 bits: non-finite = exponent bits all ones (``0x7F80`` mask; IEEE 754
    binary16-style layout of bfloat16). float32: :func:`numpy.isfinite`.
    """
    if hidden.dtype == np.uint16:
        bad = (hidden & np.uint16(0x7F80)) == np.uint16(0x7F80)
    else:
        bad = ~np.isfinite(hidden)
    if not bad.any():
        return None
    t, k = np.argwhere(bad.any(axis=-1))[0]
    return int(t), int(k)


def check_read_sample(path, i: int, sample_id: str, stored_sha: str | None, input_ids: np.ndarray,
                      target_argmax: np.ndarray, hidden: np.ndarray, layer_ids: list[int],
                      format_version: int) -> None:
    """Refuse a sample whose bytes do not match its stored ``sha256`` or whose hidden states are not finite.

    Args:
        path: the cache file (named in the error).
        i: the sample's index (group ``samples/<i:06d>``); sample_id: its id.
        stored_sha: the group's ``sha256`` attribute (format >= 2; format 1 stores none: not compared).
        input_ids, target_argmax: ``[T]`` int32 as stored; hidden: ``[T, K, H]`` uint16 or float32 as stored.
        layer_ids: the file's ``target_layer_ids`` (the ``K`` axis), to name the layer.
        format_version: the file's ``format_version``.

    Raises:
        InputError: ``(path, "samples/<i:06d>", ...)`` for a checksum mismatch, a missing checksum
            (format >= 2) or a non-finite hidden state (naming token and target layer).
    """
    field = f"samples/{i:06d}"
    if format_version >= 2:
        if not stored_sha:
            raise InputError(path, field, f"sample {sample_id!r} has no sha256 attribute (every sample of format "
                             f"{format_version} has one): the file was edited or damaged", REEXTRACT_FIX)
        got = sample_sha256(input_ids, target_argmax, hidden)
        if got != stored_sha:
            raise InputError(path, field, f"sample {sample_id!r}: its bytes do not match their checksum (sha256 "
                             f"{got[:12]}... read, {stored_sha[:12]}... stored)", REEXTRACT_FIX)
    where = first_non_finite(hidden)
    if where is not None:
        t, k = where
        raise InputError(path, f"{field}/hidden", f"sample {sample_id!r}: non-finite hidden state (inf or NaN) at "
                         f"token {t}, target layer {layer_ids[k]}: the target overflowed when it was extracted "
                         "(or the file was damaged)",
                         "check the target's weights for inf/NaN (or extract in float32: cache.dtype), then "
                         "re-extract (snakemake -R hidden_states)")
