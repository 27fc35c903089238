"""Checks on a cache sample while it is read: its checksum, its per-sample values, and finite hidden states.

:meth:`dflash_eval.cache.reader.CacheReader.sample` passes the arrays it has just read (as stored:
``input_ids`` / ``target_argmax`` ``[T]`` int32, ``hidden`` ``[T, K, H]`` uint16 bf16 bits or
float32) and, from format 5 on, the sample's ``meta`` attribute to :func:`check_read_sample` before
building the sample, then the values of the file-level per-sample arrays it will use to
:func:`check_sample_values`. The bytes pass through memory anyway, so verifying costs one pass over
them: :func:`checksum_and_scan` feeds each chunk of the hidden states to sha256 and scans the same
chunk for non-finite values while it is in the CPU's cache (measured by ``bench/verify_cost.py``);
no sample reaches a metric unverified (format 5; before it, the per-sample values are outside the
checksum).
"""

from __future__ import annotations

import hashlib
import json
import threading

import numpy as np

from dflash_eval.cache.format import META_FIELDS, META_VERSION, le_bytes
from dflash_eval.core.errors import InputError

#: elements of hidden state per chunk of :func:`checksum_and_scan` (4 MiB of bf16 bits): small enough
#: to stay in the CPU's cache between the hash and the scan, large enough that the GIL is taken back a
#: few dozen times per sample, not thousands (the reader's checks run in threads beside evaluate's loop)
SCAN_CHUNK = 1 << 21
_scratch = threading.local()


def checksum_and_scan(input_ids: np.ndarray, target_argmax: np.ndarray, hidden: np.ndarray,
                      meta: str | None = None, scale: np.ndarray | None = None) -> tuple[str, bool]:
    """:func:`~dflash_eval.cache.format.sample_sha256` of a sample and whether its hidden states are all
    finite, in one pass over ``hidden``.

    Args:
        input_ids, target_argmax: ``[T]`` int32; hidden: ``[T, K, H]`` uint16 (bf16 bits), float32 or uint8
            (float8_e4m3fn bits), as stored.
        meta: the ``meta`` attribute (format >= 5), else None.
        scale: FP8 caches: ``hidden_scale`` ``[T, K]`` float32 as stored (hashed after ``hidden``, scanned too).

    Returns:
        ``(hex digest, finite)``: the digest equals ``sample_sha256(input_ids, target_argmax, hidden, meta, scale)``
        (``tests/cache/test_reliability.py``); ``finite`` is False when any value is inf or NaN (bf16: exponent bits
        all ones; float8_e4m3fn: the NaN patterns 0x7F / 0xFF, it has no inf; as :func:`first_non_finite`).
    """
    h = hashlib.sha256()
    h.update(memoryview(le_bytes(input_ids)).cast("B"))
    h.update(memoryview(le_bytes(target_argmax)).cast("B"))
    flat = le_bytes(hidden).reshape(-1)
    bits = flat.dtype in (np.uint16, np.uint8)
    key = (flat.dtype.str, SCAN_CHUNK)
    buf = getattr(_scratch, "buf", None)
    if buf is None or getattr(_scratch, "key", None) != key:  # one scratch buffer per thread, reused
        buf = _scratch.buf = np.empty(SCAN_CHUNK, flat.dtype if bits else np.bool_)
        _scratch.key = key
    mask = np.uint16(0x7F80) if flat.dtype == np.uint16 else np.uint8(0x7F)
    finite = True
    for o in range(0, flat.size, SCAN_CHUNK):
        c = flat[o:o + SCAN_CHUNK]
        h.update(memoryview(c).cast("B"))
        if finite:
            b = buf[: c.size]
            if bits:
                np.bitwise_and(c, mask, out=b)
                finite = int(b.max()) != int(mask)  # the masked bits are at most the mask: no temporary array
            else:
                np.isfinite(c, out=b)
                finite = bool(b.all())
    if scale is not None:
        s = le_bytes(scale)
        h.update(memoryview(s).cast("B"))
        finite = finite and bool(np.isfinite(s).all())
    if meta is not None:
        h.update(meta.encode("utf-8"))
    return h.hexdigest(), finite

#: the fix of every damaged-sample error
REEXTRACT_FIX = ("the file changed after it was written (bit rot, a bad copy, an edit): re-extract it "
                 "(snakemake -R hidden_states, or delete the cache and rerun; `python -m dflash_eval hidden-states` "
                 "resumes), or copy an intact file")


def first_non_finite(hidden: np.ndarray, scale: np.ndarray | None = None) -> tuple[int, int] | None:
    """``(token, layer_index)`` of the first non-finite value in ``hidden`` ``[T, K, H]`` (or its FP8 ``scale``
    ``[T, K]``), else None.

    bf16 stored as uint16 bits: non-finite = exponent bits all ones (``0x7F80`` mask; IEEE 754
    binary16-style layout of bfloat16). float8_e4m3fn as uint8 bits: NaN = low seven bits all ones (``0x7F``;
    OCP 8-bit floating point specification, E4M3 has no inf). float32: :func:`numpy.isfinite`.
    """
    if hidden.dtype == np.uint16:
        bad = (hidden & np.uint16(0x7F80)) == np.uint16(0x7F80)
    elif hidden.dtype == np.uint8:
        bad = (hidden & np.uint8(0x7F)) == np.uint8(0x7F)
    else:
        bad = ~np.isfinite(hidden)
    bad = bad.any(axis=-1)
    if scale is not None:
        bad = bad | ~np.isfinite(scale)
    if not bad.any():
        return None
    t, k = np.argwhere(bad)[0]
    return int(t), int(k)


def check_read_sample(path, i: int, sample_id: str, stored_sha: str | None, input_ids: np.ndarray,
                      target_argmax: np.ndarray, hidden: np.ndarray, layer_ids: list[int],
                      format_version: int, meta: str | None = None, scale: np.ndarray | None = None) -> None:
    """Refuse a sample whose bytes do not match its stored ``sha256`` or whose hidden states are not finite.

    Args:
        path: the cache file (named in the error).
        i: the sample's index (group ``samples/<i:06d>``); sample_id: its id.
        stored_sha: the group's ``sha256`` attribute.
        input_ids, target_argmax: ``[T]`` int32 as stored; hidden: ``[T, K, H]`` uint16 or float32 as stored.
        layer_ids: the file's ``target_layer_ids`` (the ``K`` axis), to name the layer.
        format_version: the file's ``format_version``.
        meta: the group's ``meta`` attribute (format >= 5: hashed after the arrays; required).
        scale: FP8 caches: the group's ``hidden_scale`` ``[T, K]`` float32 as stored (under the checksum).

    Raises:
        InputError: ``(path, "samples/<i:06d>", ...)`` for a checksum mismatch, a missing checksum
            or ``meta`` (format >= 5), or a non-finite hidden state (naming token and target layer).
    """
    field = f"samples/{i:06d}"
    if format_version >= META_VERSION and meta is None:
        raise InputError(path, field, f"sample {sample_id!r} has no meta attribute (every sample of format "
                         f"{format_version} has one): the file was edited or damaged", REEXTRACT_FIX)
    if not stored_sha:
        raise InputError(path, field, f"sample {sample_id!r} has no sha256 attribute (every sample of format "
                         f"{format_version} has one): the file was edited or damaged", REEXTRACT_FIX)
    got, finite = checksum_and_scan(input_ids, target_argmax, hidden,
                                    meta if format_version >= META_VERSION else None, scale)
    if got != stored_sha:
        what = "its bytes and per-sample values (meta)" if format_version >= META_VERSION else "its bytes"
        raise InputError(path, field, f"sample {sample_id!r}: {what} do not match their checksum (sha256 "
                         f"{got[:12]}... read, {stored_sha[:12]}... stored)", REEXTRACT_FIX)
    where = None if finite else first_non_finite(hidden, scale)  # locate it only when there is one
    if where is not None:
        t, k = where
        raise InputError(path, f"{field}/hidden", f"sample {sample_id!r}: non-finite hidden state (inf or NaN) at "
                         f"token {t}, target layer {layer_ids[k]}: the target overflowed when it was extracted "
                         "(or the file was damaged)",
                         "check the target's weights for inf/NaN (or extract in float32: cache.dtype), then "
                         "re-extract (snakemake -R hidden_states)")


#: the file-level dataset holding each ``meta`` key (named in the error)
ARRAY_OF = {"sample_id": "sample_ids", **{k: k for k in META_FIELDS if k != "sample_id"}}


def parse_meta(path, i: int, meta: str | None) -> dict:
    """A sample's ``meta`` attribute (format 5) as a dict of :data:`~dflash_eval.cache.format.META_FIELDS`.

    Raises:
        InputError: ``(path, "samples/<i:06d>", ...)`` when it is missing, not JSON, or lacks a key.
    """
    field = f"samples/{i:06d}"
    try:
        got = json.loads(meta) if meta is not None else None
    except ValueError:
        got = None
    if not isinstance(got, dict) or any(k not in got for k in META_FIELDS):
        raise InputError(path, field, f"sample {i}: its meta attribute is missing or not the JSON object of "
                         f"{', '.join(META_FIELDS)} (got {str(meta)[:80]!r}): the file was edited or damaged",
                         REEXTRACT_FIX)
    return got


def check_sample_values(path, i: int, meta: dict, values: dict) -> None:
    """Refuse a sample whose entries in the file-level per-sample arrays differ from its ``meta`` (format 5).

    Args:
        path: the cache file (named in the error).
        i: the sample's index.
        meta: :func:`parse_meta` of its ``meta`` attribute (under the sample's checksum once
            :func:`check_read_sample` passed; the accessors that read no arrays compare it unhashed).
        values: the values the reader took from the file-level arrays, keyed as ``meta``
            (``argmax_agreement`` NaN when the array holds NaN).

    Raises:
        InputError: ``(path, "<array>", ...)`` naming the first differing array (``prompt_len``,
            ``stop_reason``, ...; ``sample_ids`` for the id), the sample and both values.
    """
    for key in META_FIELDS:
        a, m = values[key], meta[key]
        same = (float(a) == float(m)) if key == "argmax_agreement" else (a == m)
        if not same:
            raise InputError(path, ARRAY_OF[key], f"sample {meta['sample_id']!r} (samples/{i:06d}): "
                             f"{ARRAY_OF[key]}[{i}] is {a!r} in the file-level array but {m!r} in the sample's "
                             "checksummed meta: the file was edited or damaged after it was written", REEXTRACT_FIX)
