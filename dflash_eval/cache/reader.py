"""Reading a hidden-state cache (format: :mod:`dflash_eval.cache.format`): :class:`CacheReader`.

Caches are read-only once written, so :class:`CacheReader` opens them without the HDF5 file lock
(``locking=False``): a cache open in another process (h5py, HDFView) can be read, and an
unreadable file is reported as damaged (with the HDF5 reason), never as locked.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import numpy as np
import torch

from dflash_eval.cache.format import (FILE_DATASETS, FORMAT, READABLE_VERSIONS, SAMPLE_DATASETS, SCALE_DATASET, STORAGE_FP8,
                                      STORAGES, CacheSample, dequantize_fp8, from_storage, h5py_module, header_problem,
                                      py_value, sample_sha256)
from dflash_eval.cache.sample_check import check_read_sample, check_sample_values, parse_meta
from dflash_eval.core.errors import InputError

log = logging.getLogger(__name__)


def open_h5_readonly(path: Path):
    """``h5py.File(path, "r", locking=False)`` with errors that say what is wrong.

    Caches are read-only once written, so readers take no HDF5 file lock: another process
    holding the file open (even for writing) does not stop a reader.

    Raises:
        InputError: the file is not HDF5 (no signature), is damaged (truncated, bad header: the
            HDF5 reason is quoted), or cannot be read (permissions).
    """
    try:
        return h5py_module().File(path, "r", locking=False)
    except OSError as err:
        text = str(err)
        if isinstance(err, PermissionError) or err.errno == errno.EACCES:
            raise InputError(path, None, f"no permission to read it ({text})", "fix the file's permissions") from None
        if "file signature not found" in text:
            problem = "not an HDF5 file (no HDF5 signature): damaged, or not a cache"
        elif "truncated file" in text:
            problem = f"damaged HDF5 file: truncated ({text})"
        else:
            problem = f"damaged HDF5 file ({text})"
        raise InputError(path, None, problem,
                         "it fails the format checks, so re-extract it: snakemake -R hidden_states (or run "
                         "`python -m dflash_eval hidden-states` again)") from None


class CacheReader:
    """Read-only access to a cache file (open lazily in each process; h5py handles do not survive fork).

    ``verify`` (default True): :meth:`sample` checks each sample it reads (checksum, per-sample values,
    finite states).

    FP8 caches (``storage`` :data:`~dflash_eval.cache.format.STORAGE_FP8`) are dequantised after the checks see
    the stored bytes (:func:`~dflash_eval.cache.format.dequantize_fp8`), to the cache's ``dtype``; on the CPU, or
    on ``dequant_device`` (a CUDA device: the sample's ``hidden`` is then returned on it).

    Opened without the HDF5 file lock (:func:`open_h5_readonly`).

    The file attributes are verified on open (:meth:`_check_header`).

    Raises:
        InputError: the file is missing, damaged, not a dflash-eval cache, of another format version,
            unfinished (no ``n_samples``, or fewer sample groups than ``sample_ids``), ``n_samples`` or the group
            count differing from ``sample_ids``, or (format 6) a file attribute differs from the checksummed
            ``header``, or ``header`` / ``header_sha256`` is missing or does not match.
    """

    def __init__(self, path: str | os.PathLike, verify: bool = True, dequant_device: str | torch.device | None = None):
        self.path = Path(path)
        self.verify_reads = verify  # False only for measurements (bench/verify_cost.py) and raw-bit tests
        #: FP8 caches: where the states are dequantised (None: on the CPU; a CUDA device: the samples' ``hidden``
        #: is returned there, the stored bytes cross to it, half of bf16's)
        self.dequant_device = None if dequant_device is None else torch.device(dequant_device)
        if not self.path.exists():
            raise InputError(self.path, None, "cache file not found", "run the hidden_states rule first")
        self._f = open_h5_readonly(self.path)
        try:
            self._check()
        except InputError:  # the checks' own errors (an InputError is a ValueError)
            self._f.close()
            raise
        except H5_DAMAGE as err:  # h5py's errors for a damaged structure (an attribute's heap, a group)
            self._f.close()
            raise damaged(self.path, None, err) from None
        except BaseException:
            self._f.close()
            raise

    def _check(self) -> None:
        a = self._f.attrs
        if py_value(a.get("format")) != FORMAT:
            raise InputError(self.path, "format", f"expected {FORMAT!r}, got {py_value(a.get('format'))!r}",
                             "point at a dflash-eval cache")
        version = int(a.get("format_version", -1))
        if version not in READABLE_VERSIONS:
            raise InputError(self.path, "format_version", f"{version} is not one of {READABLE_VERSIONS}",
                             "re-extract the cache with this version")
        self._check_header()
        self.format_version = version
        self.attrs = {k: py_value(v) for k, v in a.items()}
        self.layer_ids: list[int] = [int(i) for i in self.attrs["target_layer_ids"]]
        storage = self.attrs.get("storage")
        if isinstance(storage, str) and storage not in STORAGES:
            raise InputError(self.path, "storage", f"{str(storage)[:80]!r} is not a storage this version reads "
                             f"({' / '.join(map(repr, STORAGES))})", "read it with the dflash-eval that wrote it, "
                             "or re-extract it")
        #: float8_e4m3fn states with a per-token scale (``cache.storage: fp8``), dequantised on read
        self.fp8 = storage == STORAGE_FP8
        self.sample_ids = [s.decode() if isinstance(s, bytes) else str(s) for s in self._f["sample_ids"][()]]
        self._per_sample = {k: self._f[k][()] for k in FILE_DATASETS if k in self._f}  # read once
        self._checked: set[int] = set()  # samples whose arrays were compared with their meta
        n_groups = len(self._f["samples"]) if "samples" in self._f else 0
        if "n_samples" not in self.attrs or n_groups < len(self.sample_ids):
            raise InputError(self.path, "n_samples", f"unfinished cache: {n_groups} of {len(self.sample_ids)} samples",
                             "finish it: rerun the hidden_states rule (it resumes from the samples already there)")
        if int(self.attrs["n_samples"]) != len(self.sample_ids) or n_groups > len(self.sample_ids):
            raise InputError(self.path, "n_samples", f"n_samples is {self.attrs['n_samples']} and samples/ holds "
                             f"{n_groups} groups, but the file lists {len(self.sample_ids)} sample_ids (the writer "
                             "makes all three equal): the file was edited or damaged", HEADER_FIX)

    def _check_header(self) -> None:
        """Format 6: ``header_sha256`` matches ``header``, and every covered file attribute equals its value there.

        Raises:
            InputError: ``header`` or ``header_sha256`` missing, their checksum differs, or an attribute
                (named, with both values) was edited, added or deleted.
        """
        problem = header_problem(self._f.attrs)
        if problem:
            raise InputError(self.path, problem[0], problem[1], HEADER_FIX)

    def _array_values(self, i: int, length: int | None = None) -> dict:
        """Sample ``i``'s entries of the file-level arrays, keyed as ``meta``."""
        per = self._per_sample
        return {"sample_id": self.sample_ids[i], "prompt_len": int(per["prompt_len"][i]),
                "completion_len": int(per["completion_len"][i]), "stop_reason": str(py_value(per["stop_reason"][i])),
                "max_new_tokens": int(per["max_new_tokens"][i]), "argmax_agreement": float(per["argmax_agreement"][i])}

    def _compare_meta(self, i: int, meta: str | None, raw: "_Raw | None" = None, hashed: bool = False) -> None:
        """The file-level arrays of sample ``i`` against its ``meta`` (InputError naming the array).

        On a mismatch the sample's checksum decides which copy changed (unless ``hashed``: it passed already):
        a ``meta`` that fails it is reported as a checksum error, else the array is named.
        """
        try:
            check_sample_values(self.path, i, parse_meta(self.path, i, meta), self._array_values(i))
        except InputError:
            if not hashed:
                self._check_raw(raw if raw is not None else self._read_raw(i, None), compare=False)
            raise
        self._checked.add(i)

    def _values_checked(self, i: int) -> None:
        """Before a value of sample ``i`` is handed out without reading its arrays: compare the
        file-level arrays with the group's ``meta`` (no hash: the checksum is verified when the sample is read)."""
        if self.verify_reads and i not in self._checked:
            self._compare_meta(i, py_value(self._f[f"samples/{i:06d}"].attrs.get("meta")))
    def __len__(self) -> int:
        return len(self.sample_ids)

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def length(self, i: int) -> int:
        """Tokens (prompt + completion) of sample ``i``, without reading its hidden states."""
        return int(self._f[f"samples/{i:06d}/input_ids"].shape[0])

    def sample_attrs(self, i: int) -> dict:
        """Attributes of sample ``i`` (``sample_id``, ``prompt_len``, ``stop_reason``, ``max_new_tokens``,
        ``argmax_agreement``) plus ``length`` (tokens), without reading its arrays.

        Format 5: the values are compared with the sample's ``meta`` first (InputError naming the array
        that differs); the checksum itself is verified when the sample is read (:meth:`sample`).
        """
        g = self._f[f"samples/{i:06d}"]
        length = int(g["input_ids"].shape[0])
        self._values_checked(i)
        v = self._array_values(i, length)
        agree = v["argmax_agreement"]
        return {**v, "completion_len": length - v["prompt_len"], "argmax_agreement": None if np.isnan(agree) else agree,
                "sha256": py_value(g.attrs.get("sha256")), "length": length}

    def argmax_agreement(self, i: int) -> float | None:
        """Sample ``i``'s ``argmax_agreement`` (None when not recorded), without reading its states.

        The file-level array (format 5: compared with the sample's ``meta`` first, as in :meth:`sample_attrs`).
        """
        self._values_checked(i)
        v = float(self._per_sample["argmax_agreement"][i])
        return None if np.isnan(v) else v

    def sample(self, i: int, layer_ids: list[int] | None = None) -> CacheSample:
        """Sample ``i``; ``layer_ids`` selects and orders layers (must be stored, else InputError).

        Verified while read (:func:`dflash_eval.cache.sample_check.check_read_sample`, unless the reader was
        opened with ``verify=False``): the stored ``sha256`` over the bytes just read (format 5: and the
        sample's ``meta``), finite hidden states, and (format 5) that the file-level arrays hold the
        values of ``meta`` (:func:`~dflash_eval.cache.sample_check.check_sample_values`): the returned
        ``prompt_len``, ``stop_reason``, ``max_new_tokens``, ``argmax_agreement`` and ``sample_id`` are verified.

        Raises:
            InputError: a layer not stored; a checksum mismatch or non-finite hidden state (naming
                the file, ``samples/<i>`` and the fix); an array entry that differs from ``meta`` (naming
                the file, the array, the sample and the fix).
        """
        raw = self._read_raw(i, layer_ids)
        if self.verify_reads:
            self._check_raw(raw)
        return self._build(raw)

    def samples(self, indices: Sequence[int], layer_ids: list[int] | None = None, workers: int = 4) -> list[CacheSample]:
        """:meth:`sample` of each index, the checks run in ``workers`` threads while the next sample is read.

        hashlib and numpy release the GIL on large buffers, so verifying costs little wall time
        beyond the HDF5 reads (``bench/verify_cost.py``). Raises the error of the first bad index.
        """
        with self.verified_samples(indices, layer_ids, workers) as out:
            pass
        return out

    @contextlib.contextmanager
    def verified_samples(self, indices: Sequence[int], layer_ids: list[int] | None = None,
                         workers: int = 4) -> Iterator[list[CacheSample]]:
        """The samples of ``indices`` at once, verified while the caller uses them (``with ... as samples``).

        Each sample is read (in ``indices``' order) and handed to ``workers`` threads for its checksum and
        finite-state scan (:func:`~dflash_eval.cache.sample_check.check_read_sample`: hashlib and numpy release
        the GIL on large buffers), so the checks overlap with the reads that follow and with the body
        (evaluate's replay on the device). The cheap comparison of the file-level arrays with ``meta``
        (format 5) is done before the samples are handed out. Leaving the block waits for every check
        and raises the first bad sample's InputError in ``indices``' order, also when the body raised
        (replaying damaged values can fail in other ways: the check names the cause; the body's
        error is chained): whatever the body computed from a sample must not be kept unless the block
        exits normally.

        Raises:
            InputError: as :meth:`sample`, on leaving the block (the array comparison: before the body).
        """
        if not self.verify_reads:
            yield [self._build(self._read_raw(i, layer_ids)) for i in indices]
            return

        pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="cache-verify")
        checks = []
        try:
            raws = []
            for i in indices:
                raw = self._read_raw(i, layer_ids)
                raws.append(raw)
                checks.append(pool.submit(self._check_raw, raw, False))  # hash + finite scan, in a thread
                try:
                    self._compare_meta(raw.i, raw.meta, raw)
                except InputError as err:  # an earlier sample's failure comes first
                    raise _first_failure(checks[:-1]) or err from None
            try:
                yield [self._build(r) for r in raws]
            except BaseException as err:
                bad = _first_failure(checks)
                if bad is not None:
                    raise bad from err
                raise
            bad = _first_failure(checks)
            if bad is not None:
                raise bad
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _read_raw(self, i: int, layer_ids: list[int] | None) -> "_Raw":
        idx = None if layer_ids is None else self.layer_index(layer_ids)
        try:
            g = self._f[f"samples/{i:06d}"]
            attrs = g.attrs
            return _Raw(i, g, idx, self.sample_ids[i], whole(g, "hidden"), whole(g, "input_ids"),
                        whole(g, "target_argmax"), py_value(attrs.get("sha256")), py_value(attrs.get("meta")),
                        whole(g, SCALE_DATASET) if self.fp8 else None)
        except H5_DAMAGE as err:  # a damaged group or dataset: h5py's message names neither file nor sample
            raise damaged(self.path, f"samples/{i:06d}", err) from None

    def _check_raw(self, raw: "_Raw", compare: bool = True) -> None:
        """The checks of one sample as read: checksum (and ``meta``), finite states, then (``compare``,
        format 5) the arrays against ``meta``, which is authentic once the checksum passed."""
        check_read_sample(self.path, raw.i, raw.sample_id, raw.sha256, raw.input_ids, raw.target_argmax, raw.hidden,
                          self.layer_ids, self.format_version, raw.meta, raw.scale)
        if compare:
            self._compare_meta(raw.i, raw.meta, raw, hashed=True)

    def _build(self, raw: "_Raw") -> CacheSample:
        i, idx, arr, scale = raw.i, raw.idx, raw.hidden, raw.scale
        if idx is not None and idx != list(range(len(self.layer_ids))):
            arr = arr[:, idx]
            scale = None if scale is None else scale[:, idx]
        if self.fp8:
            hidden = dequantize_fp8(arr, scale, str(self.attrs.get("dtype", "float32")), self.dequant_device)
        else:
            hidden = from_storage(arr, "bfloat16" if arr.dtype == np.uint16 else "float32")
        v = self._array_values(i, len(raw.input_ids))
        agree = None if np.isnan(v["argmax_agreement"]) else v["argmax_agreement"]
        return CacheSample(
            index=i,
            sample_id=raw.sample_id,
            input_ids=torch.from_numpy(raw.input_ids.astype(np.int64)),
            prompt_len=int(v["prompt_len"]),
            hidden=hidden,
            target_argmax=torch.from_numpy(raw.target_argmax.astype(np.int64)),
            stop_reason=str(v["stop_reason"]),
            max_new_tokens=int(v["max_new_tokens"]),
            argmax_agreement=agree,
        )

    def verify(self, indices: Sequence[int] | None = None) -> list[int]:
        """Recompute the per-sample ``sha256`` of ``indices`` (default: all); format 5 also
        compares the file-level arrays with each sample's ``meta``.

        Returns:
            the indices whose stored bytes do not match their checksum, or (format 5) whose array
            entries differ from their ``meta`` (empty = intact).
        """
        bad = []
        for i in (range(len(self)) if indices is None else indices):
            try:
                g = self._f[f"samples/{i:06d}"]
            except H5_DAMAGE:  # the group itself is damaged
                bad.append(i)
                continue
            ok = verify_group(g) is not None
            if ok:
                try:
                    check_sample_values(self.path, i, parse_meta(self.path, i, py_value(g.attrs.get("meta"))),
                                        self._array_values(i))
                except InputError:
                    ok = False
            if not ok:
                bad.append(i)
        return bad

    def layer_index(self, layer_ids: list[int]) -> list[int]:
        missing = [i for i in layer_ids if i not in self.layer_ids]
        if missing:
            raise InputError(
                self.path, "target_layer_ids",
                f"drafter needs target layers {missing} but the cache stores {self.layer_ids}",
                "add them to cache.target_layer_ids in the workflow config (this re-extracts the cache)",
            )
        return [self.layer_ids.index(i) for i in layer_ids]


def whole(group, name: str) -> np.ndarray:
    """Dataset ``name`` of h5py ``group``, whole, as stored (its dtype and shape), through h5py's low-level API:
    ``h5d.open`` and one read into a new array, about half the cost of ``group[name][()]`` for a sample's small
    datasets (h5py builds no high-level Dataset object). Raises what h5py raises (:data:`H5_DAMAGE`)."""
    h5 = h5py_module()
    d = h5.h5d.open(group.id, name.encode())
    out = np.empty(d.shape, d.dtype)
    d.read(h5.h5s.ALL, h5.h5s.ALL, out)
    return out


#: what h5py raises for bytes of a damaged structure (object headers, heaps, datatype messages)
H5_DAMAGE = (OSError, KeyError, RuntimeError, ValueError, TypeError)


def damaged(path, field, err: BaseException) -> InputError:
    """The error for an HDF5 structure h5py cannot read (``OSError`` / ``KeyError`` quoted), naming the file."""
    return InputError(path, field, f"damaged HDF5 file ({type(err).__name__}: {err})", HEADER_FIX)


HEADER_FIX = ("re-extract the cache (snakemake -R hidden_states, or delete it and run `python -m dflash_eval "
              "hidden-states`), or restore an intact copy")


class _Raw(NamedTuple):
    """One sample as read, before it is checked and built: arrays as stored, its attributes."""

    i: int
    g: object  # its h5py group
    idx: list[int] | None  # layer selection
    sample_id: str
    hidden: np.ndarray
    input_ids: np.ndarray
    target_argmax: np.ndarray
    sha256: str | None
    meta: str | None  # format 5
    scale: np.ndarray | None = None  # FP8 caches: hidden_scale [T, K] float32


def _first_failure(futures) -> BaseException | None:
    """Wait for every future; the exception of the first (in order) that failed, else None."""
    first = None
    for f in futures:
        err = f.exception()
        if first is None and err is not None:
            first = err
    return first


def verify_group(g) -> str | None:
    """The group's checksum when every dataset is there and the bytes (and its ``meta``, when it has one:
    format 5) match it, else None."""
    try:
        stored = py_value(g.attrs.get("sha256"))
        if not stored or any(name not in g for name in SAMPLE_DATASETS):
            return None
        meta = py_value(g.attrs["meta"]) if "meta" in g.attrs else None
        scale = g[SCALE_DATASET][()] if g["hidden"].dtype == np.uint8 else None  # FP8: required, under the checksum
        got = sample_sha256(g["input_ids"][()], g["target_argmax"][()], g["hidden"][()], meta, scale)
    except (OSError, KeyError, ValueError, RuntimeError):  # unreadable pieces of a killed run
        return None
    return stored if got == stored else None
