"""Reading a hidden-state cache (format: :mod:`dflash_eval.cache_format`): :class:`CacheReader`.

Caches are read-only once written, so :class:`CacheReader` opens them without the HDF5 file lock
(``locking=False``): a cache open in another process (h5py, HDFView) can be read, and an
unreadable file is reported as damaged (with the HDF5 reason), never as locked.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .cache_format import FORMAT, READABLE_VERSIONS, SAMPLE_DATASETS, CacheSample, from_storage, py_value, sample_sha256
from .errors import InputError
from .sample_check import check_read_sample

def open_h5_readonly(path: Path):
    """``h5py.File(path, "r", locking=False)`` with errors that say what is wrong.

    Caches are read-only once written, so readers take no HDF5 file lock: another process
    holding the file open (even for writing) does not stop a reader.

    Raises:
        InputError: the file is not HDF5 (no signature), is damaged (truncated, bad header: the
            HDF5 reason is quoted), or cannot be read (permissions).
    """
    import h5py

    try:
        return h5py.File(path, "r", locking=False)
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

    ``verify`` (default True): :meth:`sample` checks each sample it reads (checksum, finite states).

    Opened without the HDF5 file lock (:func:`open_h5_readonly`).

    Raises:
        InputError: the file is missing, damaged, not a dflash-eval cache, of another format version,
            or unfinished (no ``n_samples``, or fewer sample groups than ``sample_ids``).
    """

    def __init__(self, path: str | os.PathLike, verify: bool = True):
        self.path = Path(path)
        self.verify_reads = verify  # False only for measurements (bench/verify_cost.py) and raw-bit tests
        if not self.path.exists():
            raise InputError(self.path, None, "cache file not found", "run the hidden_states rule first")
        self._f = open_h5_readonly(self.path)
        try:
            self._check()
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
        self.format_version = version
        self.attrs = {k: py_value(v) for k, v in a.items()}
        self.layer_ids: list[int] = [int(i) for i in self.attrs["target_layer_ids"]]
        self.sample_ids = [s.decode() if isinstance(s, bytes) else str(s) for s in self._f["sample_ids"][()]]
        # format 3: per-sample values in file-level arrays, read once (format 1/2: group attributes)
        self._per_sample = ({k: self._f[k][()] for k in ("prompt_len", "stop_reason", "max_new_tokens")}
                            if "prompt_len" in self._f else None)
        n_groups = len(self._f["samples"]) if "samples" in self._f else 0
        if "n_samples" not in self.attrs or n_groups < len(self.sample_ids):
            raise InputError(self.path, "n_samples", f"unfinished cache: {n_groups} of {len(self.sample_ids)} samples",
                             "finish it: rerun the hidden_states rule (it resumes from the samples already there)")

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
        ``argmax_agreement``) plus ``length`` (tokens), without reading its arrays."""
        g = self._f[f"samples/{i:06d}"]
        length = int(g["input_ids"].shape[0])
        if self._per_sample is None:  # format 1/2: group attributes
            return {**{k: py_value(v) for k, v in g.attrs.items()}, "length": length}
        per = self._per_sample  # format 3: the file-level arrays (agreement read afresh)
        return {"sample_id": self.sample_ids[i], "prompt_len": int(per["prompt_len"][i]),
                "completion_len": length - int(per["prompt_len"][i]), "stop_reason": str(py_value(per["stop_reason"][i])),
                "max_new_tokens": int(per["max_new_tokens"][i]), "argmax_agreement": self.argmax_agreement(i),
                "sha256": py_value(g.attrs.get("sha256")), "length": length}

    def argmax_agreement(self, i: int) -> float | None:
        """Sample ``i``'s ``argmax_agreement`` (None when not recorded), without reading its states.

        Format 3: the file-level array (read at each call: a file edited in place is seen); 1/2: the
        group attribute.
        """
        if "argmax_agreement" in self._f:
            v = float(self._f["argmax_agreement"][i])
            return None if np.isnan(v) else v
        v = self._f[f"samples/{i:06d}"].attrs.get("argmax_agreement")
        return None if v is None else float(v)

    def sample(self, i: int, layer_ids: list[int] | None = None) -> CacheSample:
        """Sample ``i``; ``layer_ids`` selects and orders layers (must be stored, else InputError).

        Verified while read (:func:`dflash_eval.sample_check.check_read_sample`, unless the reader was
        opened with ``verify=False``): the stored ``sha256`` over the bytes just read, and finite
        hidden states.

        Raises:
            InputError: a layer not stored; a checksum mismatch or non-finite hidden state (naming
                the file, ``samples/<i>`` and the fix).
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
        raws = [self._read_raw(i, layer_ids) for i in indices] if not self.verify_reads or workers < 2 else None
        if raws is None:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cache-verify") as pool:
                raws, checks = [], []
                for i in indices:
                    raws.append(self._read_raw(i, layer_ids))
                    checks.append(pool.submit(self._check_raw, raws[-1]))
                for c in checks:
                    c.result()
        return [self._build(r) for r in raws]

    def _read_raw(self, i: int, layer_ids: list[int] | None) -> tuple:
        g = self._f[f"samples/{i:06d}"]
        idx = None if layer_ids is None else self.layer_index(layer_ids)
        sample_id = self.sample_ids[i] if self._per_sample is not None else str(py_value(g.attrs["sample_id"]))
        return (i, g, idx, sample_id, g["hidden"][()], g["input_ids"][()], g["target_argmax"][()],
                py_value(g.attrs.get("sha256")))

    def _check_raw(self, raw: tuple) -> None:
        i, _, _, sample_id, arr, ids, argmax, stored = raw
        check_read_sample(self.path, i, sample_id, stored, ids, argmax, arr, self.layer_ids, self.format_version)

    def _build(self, raw: tuple) -> CacheSample:
        i, g, idx, sample_id, arr, ids, argmax, _ = raw
        hidden_ds = g["hidden"]
        per = self._per_sample
        logical = (py_value(hidden_ds.attrs["logical_dtype"]) if per is None
                   else "bfloat16" if hidden_ds.dtype == np.uint16 else "float32")
        if idx is not None and idx != list(range(len(self.layer_ids))):
            arr = arr[:, idx]
        return CacheSample(
            index=i,
            sample_id=sample_id,
            input_ids=torch.from_numpy(ids.astype(np.int64)),
            prompt_len=int(per["prompt_len"][i] if per is not None else g.attrs["prompt_len"]),
            hidden=from_storage(arr, logical),
            target_argmax=torch.from_numpy(argmax.astype(np.int64)),
            stop_reason=str(py_value(per["stop_reason"][i] if per is not None else g.attrs["stop_reason"])),
            max_new_tokens=int(per["max_new_tokens"][i] if per is not None else g.attrs["max_new_tokens"]),
        )

    def verify(self, indices: Sequence[int] | None = None) -> list[int]:
        """Recompute the per-sample ``sha256`` (format 2) of ``indices`` (default: all).

        Returns:
            the indices whose stored bytes do not match their checksum (empty = intact).
            Format-1 files carry no checksums: nothing to compare, ``[]``.
        """
        if self.format_version < 2:
            return []
        bad = []
        for i in (range(len(self)) if indices is None else indices):
            g = self._f[f"samples/{i:06d}"]
            if verify_group(g) is None:
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


def verify_group(g) -> str | None:
    """The group's checksum when every dataset is there and the bytes match it, else None."""
    try:
        stored = py_value(g.attrs.get("sha256"))
        if not stored or any(name not in g for name in SAMPLE_DATASETS):
            return None
        got = sample_sha256(g["input_ids"][()], g["target_argmax"][()], g["hidden"][()])
    except (OSError, KeyError, ValueError, RuntimeError):  # unreadable pieces of a killed run
        return None
    return stored if got == stored else None


