"""Writing a hidden-state cache (format: :mod:`dflash_eval.cache.format`): streaming and resumable.

:class:`PartialCache` is the resumable sidecar ``<name>.h5.partial`` (verified per sample on
reopen, renamed into place when complete); :class:`StreamingWriter` writes finished batches on a
thread while the target computes the next; :func:`write_cache` writes a whole cache at once (tests).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import queue
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from dflash_eval.cache.format import (FILE_DATASETS, FORMAT, FORMAT_VERSION, HEADER_VERSION, IDENTITY_ATTRS,
                                      META_VERSION, SCALE_DATASET, STORAGE_FP8, argmax_agreement, attr_value,
                                      h5_writable, h5py_module, header_problem, py_value, sample_meta_json,
                                      sample_sha256, stored_form, write_header)
from dflash_eval.cache.disk_room import require_room
from dflash_eval.cache.reader import verify_group
from dflash_eval.core.errors import InputError, partial_path

log = logging.getLogger(__name__)

#: partial files detached after a failed write in this process (:meth:`PartialCache._detach`); HDF5's
#: own shutdown at interpreter exit can crash on their leftover handles, so the CLI exits without it
DETACHED: list[Path] = []


@dataclass
class SampleMeta:
    """What the writer needs of a sample besides its computed arrays."""

    sample_id: str
    input_ids: np.ndarray  # [T] int32
    prompt_len: int
    stop_reason: str
    max_new_tokens: int


class PartialCache:
    """One cache file under construction in its sidecar ``<out>.partial`` (see the module docstring).

    Use from one thread at a time: :meth:`resume` (what an earlier run left), :meth:`create` when
    there was nothing to resume, :meth:`write_sample` for each new sample, :meth:`commit` after
    each batch, then :meth:`finish` (renames into ``out``) or :meth:`close` (keeps the sidecar).

    Args:
        out: final ``.h5`` path.
        identity: the run's values of :data:`IDENTITY_ATTRS` (a partial file must match them).
        meta: per sample, in completions order (``sample_ids`` come from it).
        keep_link: after :meth:`finish`, keep the sidecar as a hard link of ``out``.
    """

    def __init__(self, out: str | os.PathLike, identity: dict, meta: Sequence[SampleMeta], keep_link: bool = False):
        self.out = Path(out)
        self.path = partial_path(self.out)
        self.identity = dict(identity)
        self.meta = meta
        self.keep_link = keep_link
        #: the file's format version (its identity value): from 5 on each sample's ``meta`` is written and hashed
        self.format_version = int(py_value(self.identity.get("format_version", FORMAT_VERSION)))
        self._f = None
        self.broken = False  # a write failed: the HDF5 state in memory must not reach the file
        self.done: set[int] = set()
        self._unsealed: dict = {}  # sample index -> its group, written but without its checksum yet
        self._run: dict = {}
        self._runs: list = []

    @property
    def is_open(self) -> bool:
        return self._f is not None

    # ---------------------------------------------------------------- open / resume
    def resume(self) -> set[int] | None:
        """Open the sidecar an earlier run left, if any, and verify it.

        Returns:
            indices of the samples already written and verified (kept as they are), or None
            when there is no sidecar (or it could not be opened at all and was removed).

        Raises:
            InputError: the sidecar was written with other settings (every differing
                :data:`IDENTITY_ATTRS` key is named), or another process has it open.
        """
        if not self.path.exists():
            return None
        try:
            try:
                f = h5_writable(self.path, create=False)
            except OSError as err:
                m = re.search(r"truncated file: eof = (\d+), .*stored_eof = (\d+)", str(err))
                if not m or int(m.group(2)) <= int(m.group(1)):
                    raise
                # the end of the file was lost (node loss): restore its length, then verify what is there
                log.warning("%s: partial file shorter than its header says (%s): extended to %s bytes, every "
                            "sample is verified", self.path, m.group(1), m.group(2))
                os.truncate(self.path, int(m.group(2)))
                f = h5_writable(self.path, create=False)
        except OSError as err:
            text = str(err)
            if err.errno in (errno.EAGAIN, errno.EWOULDBLOCK) or "unable to lock file, errno = 11" in text:
                raise InputError(self.path, None, "in use: another process is writing this cache (an orphaned "
                                 "hidden_states job of a killed Snakemake, or a second run)",
                                 "wait for that process to finish (or stop it), then rerun") from None
            if "lock" in text.lower() or isinstance(err, PermissionError):
                raise InputError(self.path, None, f"cannot open the partial file of an earlier run ({text})",
                                 "if the file system has no file locks, set HDF5_USE_FILE_LOCKING=FALSE") from None
            log.warning("%s: the partial file of an earlier run is damaged (%s; killed inside a flush?): "
                        "starting over", self.path, text)
            self.path.unlink()
            return None
        try:
            diff = self._identity_diff(f)
            problem = None if diff or self.format_version < HEADER_VERSION else header_problem(f.attrs)
            if (diff and "n_samples" in f.attrs) or problem:
                # a finished cache of other settings (a kept link whose output Snakemake deleted for a rerun), or
                # covered attributes edited/damaged in the sidecar: nothing unfinished is lost by starting over
                f.close()
                why = (f"finished cache of other settings ({', '.join(diff)}): removed" if diff else
                       "the partial file of an earlier run fails its header check ({}: {})".format(*problem))
                (log.info if diff else log.warning)("%s: %s, starting over", self.path, why)
                self.path.unlink()
                return None
            if diff:
                named = "; ".join(f"{k}: partial {old!r} vs now {new!r}" for k, (old, new) in diff.items())
                raise InputError(self.path, ", ".join(diff),
                                 f"an unfinished cache written with other settings ({named}); its samples cannot be "
                                 "mixed with this run's",
                                 f"delete {self.path} to start over, or rerun with the settings it was written with")
            f, reused = self._verify_partial(f)
        except BaseException:
            if f.id.valid:
                f.close()
            raise
        self._f = f
        self._start_run(reused)
        return set(reused)

    def create(self, attrs: dict) -> None:
        """Start a new sidecar with the file attributes ``attrs`` (identity values included) and, format 6, their
        ``header`` / ``header_sha256`` (:func:`~dflash_eval.cache.format.write_header`; later runs rewrite only
        attributes outside it: ``extraction_runs``, ``n_samples``)."""
        h5py = h5py_module()

        self.out.parent.mkdir(parents=True, exist_ok=True)
        f = h5_writable(self.path, create=True)
        try:
            for key, val in {**attrs, **self.identity}.items():
                f.attrs[key] = attr_value(val)
            f.attrs["extraction_runs"] = "[]"
            if self.format_version >= HEADER_VERSION:
                write_header(f.attrs)
            f.create_dataset("sample_ids", data=np.array([m.sample_id for m in self.meta], dtype=object),
                             dtype=h5py.string_dtype())
            f.create_dataset("prompt_len", data=np.array([m.prompt_len for m in self.meta], dtype=np.int32))
            f.create_dataset("completion_len", data=np.array([len(m.input_ids) - m.prompt_len for m in self.meta],
                                                             dtype=np.int32))
            f.create_dataset("stop_reason", data=np.array([m.stop_reason for m in self.meta], dtype=object),
                             dtype=h5py.string_dtype())
            f.create_dataset("max_new_tokens", data=np.array([m.max_new_tokens for m in self.meta], dtype=np.int32))
            f.create_dataset("argmax_agreement", data=np.full(len(self.meta), np.nan))
            f.create_group("samples")
            f.flush()
        except BaseException:
            f.close()
            raise
        self._f = f
        self._runs = []
        self._start_run(set())

    def _start_run(self, reused: set[int]) -> None:
        self.done = set(reused)
        self._run = {"started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname(),
                     "pid": os.getpid(), "computed": 0, "reused": len(reused)}

    def _identity_diff(self, f) -> dict:
        """``{key: (partial's value, this run's)}`` for every identity attribute that differs."""
        a = {k: py_value(v) for k, v in f.attrs.items()}
        want = {k: py_value(attr_value(self.identity.get(k))) for k in IDENTITY_ATTRS}
        diff = {k: (a.get(k), want[k]) for k in IDENTITY_ATTRS if a.get(k) != want[k]}
        if a.get("format") != FORMAT:
            diff["format"] = (a.get("format"), FORMAT)
        ids = [py_value(s) for s in f["sample_ids"][()]] if "sample_ids" in f else None
        if ids != [m.sample_id for m in self.meta]:
            diff["sample_ids"] = (f"{len(ids or [])} ids", f"{len(self.meta)} ids")
        return diff

    def _verify_partial(self, f):
        """Keep the verified samples, unlink the rest; ``(open file, verified indices)``."""
        a = {k: py_value(v) for k, v in f.attrs.items()}
        self._runs = json.loads(a.get("extraction_runs") or "[]")
        grp = f.require_group("samples")
        reused: set[int] = set()
        bad: list[str] = []
        for name in list(grp):
            i = int(name) if name.isdigit() else -1
            try:
                ok = 0 <= i < len(self.meta) and verify_group(grp[name]) is not None and self._meta_ok(f, i, grp[name])
            except (OSError, KeyError, ValueError, RuntimeError):  # a link to an object that never reached the disk
                ok = False
            if ok:
                reused.add(i)
            else:
                bad.append(name)
        if bad:
            log.warning("%s: %d sample group(s) failed verification (a write cut short): recomputed", self.path, len(bad))
            try:
                for name in bad:
                    del grp[name]
                f.flush()
            except (OSError, KeyError, ValueError, RuntimeError) as err:
                log.warning("%s: cannot unlink them (%s): copying the %d verified samples to a fresh file",
                            self.path, err, len(reused))
                return self._salvage(f, reused), reused
        return f, reused

    def _meta_ok(self, f, i: int, g) -> bool:
        """Whether a verified group's ``meta`` (format 5) holds this run's values and the file's agreement."""
        return (self.format_version < META_VERSION
                or py_value(g.attrs.get("meta")) == self.sample_meta(i, float(f["argmax_agreement"][i])))

    def _salvage(self, f, reused: set[int]):
        """Rebuild the sidecar from its verified samples when its group index is damaged; the reopened file."""
        h5py = h5py_module()

        tmp = self.path.with_name(self.path.name + ".salvage")
        with h5py.File(tmp, "w", locking="best-effort") as g:
            for key, val in f.attrs.items():
                g.attrs[key] = val
            for name in ("sample_ids", "stop_reason"):
                g.create_dataset(name, data=f[name][()], dtype=h5py.string_dtype())
            for name in FILE_DATASETS:
                if name != "stop_reason":
                    g.create_dataset(name, data=f[name][()])
            dst = g.create_group("samples")
            for i in sorted(reused):
                f.copy(f[f"samples/{i:06d}"], dst, name=f"{i:06d}")
        f.close()
        os.replace(tmp, self.path)
        return h5_writable(self.path, create=False)

    # ---------------------------------------------------------------- writing
    def check_room(self, nbytes: int) -> None:
        """:func:`~dflash_eval.cache.disk_room.require_room` before writing ``nbytes`` (HDF5 cannot recover: :meth:`close`)."""
        require_room(self.path.parent, nbytes)

    def sample_meta(self, i: int, argmax_agreement: float) -> str | None:
        """Sample ``i``'s ``meta`` (:func:`~dflash_eval.cache.format.sample_meta_json`); None before format 5."""
        m = self.meta[i]
        return None if self.format_version < META_VERSION else sample_meta_json(
            m.sample_id, m.prompt_len, len(m.input_ids) - m.prompt_len, m.stop_reason, m.max_new_tokens, argmax_agreement)

    def write_sample(self, i: int, hidden: np.ndarray, logical_dtype: str, target_argmax: np.ndarray, sha256: str | None,
                     argmax_agreement: float | None, meta: str | None = None, scale: np.ndarray | None = None) -> None:
        """Write sample ``i`` (arrays as stored: ``hidden [T, K, H]``, ``target_argmax [T]`` int32; FP8: ``scale``).

        ``logical_dtype`` must be the file's ``dtype`` (kept for callers; format 3 stores it once).
        ``argmax_agreement=None``: already written by :meth:`write_agreement`. ``meta`` (format 5: the string
        ``sha256`` covers, :meth:`sample_meta`; None = made from ``argmax_agreement``, ValueError if that is None too).

        With ``sha256=None`` the group is written without its checksum, so it does not count as
        written (a resumed run discards it) until :meth:`seal` adds it: the writer hashes in other
        threads while HDF5 writes.
        """
        if meta is None and self.format_version >= META_VERSION:
            if argmax_agreement is None:
                raise ValueError(f"sample {i}: format {self.format_version} needs its meta (or its argmax_agreement)")
            meta = self.sample_meta(i, argmax_agreement)
        try:
            self._write_sample(i, hidden, logical_dtype, target_argmax, argmax_agreement, meta, scale)
            if sha256 is not None:
                self._seal(i, sha256)
        except BaseException:
            self._detach()
            raise

    def seal(self, i: int, sha256: str) -> None:
        """Add sample ``i``'s checksum (written last: a group with a checksum has all its parts)."""
        try:
            self._seal(i, sha256)
        except BaseException:
            self._detach()
            raise

    def _write_sample(self, i, hidden, logical_dtype, target_argmax, argmax_agreement, meta, scale=None) -> None:
        m = self.meta[i]
        grp = self._f["samples"]
        name = f"{i:06d}"
        if name in grp:  # a group of a failed earlier attempt of this run
            del grp[name]
        if argmax_agreement is not None:
            self._f["argmax_agreement"][i] = argmax_agreement
        g = grp.create_group(name)
        for name, arr in (("input_ids", m.input_ids), ("hidden", hidden), (SCALE_DATASET, scale),
                          ("target_argmax", target_argmax)):
            if arr is not None:  # hidden_scale: FP8 caches only
                g.create_dataset(name, data=arr)
        if meta is not None:
            g.attrs["meta"] = meta
        self._unsealed[i] = g

    def write_agreement(self, indices: Sequence[int], values: Sequence[float]) -> None:
        """Write the ``argmax_agreement`` of several samples in one HDF5 call (before their groups)."""
        if not len(indices):
            return
        try:
            order = np.argsort(np.asarray(indices))
            self._f["argmax_agreement"][np.asarray(indices)[order]] = np.asarray(values, dtype=np.float64)[order]
        except BaseException:
            self._detach()
            raise

    def _seal(self, i: int, sha256: str) -> None:
        g = self._unsealed.pop(i, None)
        if g is None:
            g = self._f["samples"][f"{i:06d}"]
        g.attrs["sha256"] = sha256
        self.done.add(i)
        self._run["computed"] += 1

    def commit(self) -> None:
        """Flush to the OS: everything written so far survives a kill of this process."""
        try:
            self._f.attrs["extraction_runs"] = json.dumps(self._runs + [self._run])
            self._f.flush()
        except BaseException:
            self._detach()
            raise

    def finish(self) -> Path:
        """Mark the file finished (``n_samples``), fsync, and rename it to ``out`` atomically.

        Raises:
            RuntimeError: samples missing (a bug: the caller computes them all first).
        """
        missing = len(self.meta) - len(self.done)
        if missing:
            raise RuntimeError(f"{missing} samples missing from {self.path}")
        self._f.attrs["n_samples"] = len(self.meta)
        self.commit()
        self._f.close()
        self._f = None
        with open(self.path, "rb+") as fh:
            os.fsync(fh.fileno())
        if self.keep_link:
            tmp = self.out.with_name(f".{self.out.name}.{os.getpid()}.link")
            try:
                if tmp.exists():
                    tmp.unlink()
                os.link(self.path, tmp)
                os.replace(tmp, self.out)
                return self.out
            except OSError as err:  # file systems without hard links: plain rename
                log.info("no hard link for %s (%s): renamed instead", self.out, err)
        os.replace(self.path, self.out)
        return self.out

    def _detach(self) -> None:
        """After a failed write: point HDF5's file descriptor at ``/dev/null`` at once.

        HDF5 cannot recover from a failed write (disk full): every later flush, object release
        or close would write the half-done state and can leave a file that no longer opens (its
        header then claims more bytes than the disk took) or crash the interpreter at exit.
        Detached, the file stays as the last commit left it, exactly as after a SIGKILL.
        """
        if self.broken or self._f is None:
            return
        self.broken = True
        DETACHED.append(self.path)
        try:
            fd = self._f.id.get_vfd_handle()
            nul = os.open(os.devnull, os.O_RDWR)
            os.dup2(nul, fd)
            os.close(nul)
        except Exception as err:  # noqa: BLE001 - nothing more can be done for the file
            log.debug("could not detach %s: %s", self.path, err)

    def close(self) -> None:
        """Close without finishing: the sidecar keeps every committed sample for the next run
        (after a failed write, the detached handle is released; see :meth:`_detach`)."""
        f, self._f = self._f, None
        if f is None:
            return
        if self.broken:
            try:
                f.close()
            except Exception:  # noqa: BLE001 - writes to /dev/null of a broken state
                pass
            return
        f.close()


# --------------------------------------------------------------------------- streaming writer thread
@dataclass
class Batch:
    """Computed states of one forward, handed to the writer.

    ``samples``: ``(index, hidden [T, K, H], target_argmax [T] int)`` numpy views (into a reusable
    host buffer); ``ready``: blocks until the views hold their data (a CUDA event's synchronize);
    ``release``: called after the batch is written (returns the buffer).
    """

    samples: list[tuple[int, np.ndarray, np.ndarray]]
    logical_dtype: str
    ready: Callable[[], None] | None = None
    release: Callable[[], None] | None = None
    held: tuple[int, int] | None = None  #: (samples, tokens) of states this batch keeps in host memory
    scales: list[np.ndarray | None] | None = None  #: FP8 caches: each sample's ``hidden_scale [T, K]`` float32

    def held_counts(self) -> tuple[int, int]:
        return self.held or (len(self.samples), sum(len(a) for _, _, a in self.samples))


class StreamingWriter:
    """Writes batches to a :class:`PartialCache` in a background thread, overlapping the next forward.

    At most ``max_batches`` batches are held in host memory at once (counting the one being
    produced): :meth:`reserve` blocks until a slot is free, :meth:`submit` hands the filled
    batch over; the thread verifies nothing, it hashes (``hash_threads`` threads: hashlib
    releases the GIL), writes the groups, commits (flush) and releases the slot.
    ``max_held_samples`` / ``max_held_tokens`` record the peak number of samples whose
    states were in host memory at once.

    Errors of the thread (disk full) are raised in the caller at its next :meth:`reserve`,
    :meth:`submit` or :meth:`close`.
    """

    def __init__(self, cache: PartialCache, max_batches: int = 2, hash_threads: int | None = None,
                 progress: Callable[[int, int], None] | None = None):
        self.cache = cache
        self.max_batches = max_batches
        self._slots = threading.Semaphore(max_batches)
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._failed = False  # sticky: after an error the thread writes nothing more
        self._lock = threading.Lock()
        self.held_samples = self.held_tokens = 0
        self.max_held_samples = self.max_held_tokens = 0
        self.written = 0
        #: seconds the writer thread spent per phase (the stage logs them): ``wait`` (for the batch's
        #: device-to-host copy), ``write`` (HDF5 objects and data), ``hash`` (waiting for checksums still
        #: being computed once the writes are done, plus adding them), ``commit`` (flush)
        self.timings = {"wait": 0.0, "hash": 0.0, "write": 0.0, "commit": 0.0}
        self._progress = progress
        self._pool = ThreadPoolExecutor(max_workers=hash_threads or max(1, min(8, (os.cpu_count() or 2) - 1)),
                                        thread_name_prefix="dflash-hash")
        self._thread = threading.Thread(target=self._run, name="dflash-cache-writer", daemon=True)
        self._thread.start()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None  # raised once; the thread stays stopped
            raise err

    def reserve(self) -> None:
        """Wait for a free host buffer slot (call before producing a batch's host data)."""
        while not self._slots.acquire(timeout=0.5):
            self._raise_if_failed()
            if not self._thread.is_alive():
                raise RuntimeError("cache writer thread stopped")
        self._raise_if_failed()

    def hold(self, n_samples: int, n_tokens: int) -> None:
        """Count samples whose states now sit in host memory (peak tracking; the batch's ``held`` undoes it)."""
        with self._lock:
            self.held_samples += n_samples
            self.held_tokens += n_tokens
            self.max_held_samples = max(self.max_held_samples, self.held_samples)
            self.max_held_tokens = max(self.max_held_tokens, self.held_tokens)

    def submit(self, batch: Batch) -> None:
        """Queue a filled batch (its slot was :meth:`reserve`-d and its samples :meth:`hold`-en)."""
        self._raise_if_failed()
        self._queue.put(batch)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            try:
                if not self._failed:
                    self._write(batch)
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                self._failed = True
                self._error = err
            finally:
                if batch.release is not None:
                    batch.release()
                n, t = batch.held_counts()
                with self._lock:
                    self.held_samples -= n
                    self.held_tokens -= t
                self._slots.release()

    def _write(self, batch: Batch) -> None:
        tm, t0 = self.timings, time.perf_counter()
        if batch.ready is not None:
            batch.ready()
        t1 = time.perf_counter()
        tm["wait"] += t1 - t0
        meta = self.cache.meta
        scales = batch.scales or [None] * len(batch.samples)  # FP8's hidden_scale: 4 bytes a token and layer, counted
        self.cache.check_room(sum(h.nbytes + 8 * len(a) + 4 * h[..., 0].size for _, h, a in batch.samples) + (1 << 20))
        ids32 = [meta[i].input_ids for i, _, _ in batch.samples]
        argmax32 = [np.ascontiguousarray(a, dtype=np.int32) for _, _, a in batch.samples]
        agree = [argmax_agreement(meta[i].input_ids, meta[i].prompt_len, a) for (i, _, _), a in zip(batch.samples, argmax32)]
        metas = [self.cache.sample_meta(i, a) for (i, _, _), a in zip(batch.samples, agree)]  # hashed with the arrays
        # hashes run in the pool (hashlib and HDF5's dataset writes release the GIL) while this thread
        # writes the groups; each checksum is added once its group is written
        shas = [self._pool.submit(sample_sha256, ids32[k], argmax32[k], h, metas[k], scales[k])
                for k, (_, h, _) in enumerate(batch.samples)]
        t2 = time.perf_counter()
        try:
            self.cache.write_agreement([i for i, _, _ in batch.samples], agree)
            for k, (i, hidden, _) in enumerate(batch.samples):
                self.cache.write_sample(i, hidden, batch.logical_dtype, argmax32[k], None, None, metas[k], scales[k])
            t3 = time.perf_counter()
            tm["write"] += t3 - t2
            for k, (i, _, _) in enumerate(batch.samples):
                self.cache.seal(i, shas[k].result())
        except BaseException:
            wait(shas)  # no hash may still read the batch's buffer once it is released
            raise
        t4 = time.perf_counter()
        tm["hash"] += t4 - t3  # hashing left once the writes are done
        self.cache.commit()
        tm["commit"] += time.perf_counter() - t4
        self.written += len(batch.samples)
        if self._progress is not None:
            self._progress(len(batch.samples), sum(len(a) for a in argmax32))

    def close(self) -> None:
        """Write every queued batch, stop the thread, and raise its error if it had one.

        Waits for the thread even when interrupted (SIGTERM while waiting): the file must not be
        closed under a write in progress; the interruption is raised once the thread is done.
        """
        self._queue.put(None)
        interrupted = None
        while self._thread.is_alive():
            try:
                self._thread.join()
            except BaseException as err:  # noqa: BLE001 - re-raised below
                interrupted = interrupted or err
        self._pool.shutdown(wait=True)
        if interrupted is not None:
            raise interrupted
        self._raise_if_failed()


def write_cache(out: str | os.PathLike, attrs: dict, samples) -> int:
    """Write a whole cache from an iterable of samples (tests and small tools; the stage streams instead).

    Args:
        out: destination ``.h5`` path.
        attrs: file attributes (see ``FILE_ATTRS``); lists/dicts are stored as JSON where h5py cannot.
        samples: iterable of dicts with ``sample_id``, ``input_ids`` ([T] ints), ``prompt_len``,
            ``hidden`` (torch ``[T, K, H]`` bf16 or float32), ``target_argmax`` ([T]), ``stop_reason``,
            ``max_new_tokens``. Materialised first (sample ids are written before the groups). FP8 with
            ``attrs["storage"]`` = :data:`~dflash_eval.cache.format.STORAGE_FP8` (``attrs["dtype"]``: read back as).

    Returns:
        number of samples written. On an exception nothing is left behind (the sidecar is removed).
    """
    samples = list(samples)
    meta = [SampleMeta(str(s["sample_id"]), np.asarray(s["input_ids"], dtype=np.int32), int(s["prompt_len"]),
                       str(s.get("stop_reason", "unknown")), int(s.get("max_new_tokens", 0))) for s in samples]
    cache = PartialCache(out, {k: attrs[k] for k in IDENTITY_ATTRS if k in attrs}, meta)
    if cache.path.exists():
        cache.path.unlink()
    cache.create(attrs)
    try:
        writer = StreamingWriter(cache, hash_threads=1)
        try:
            for i, s in enumerate(samples):
                arr, logical, scale = stored_form(s["hidden"], attrs.get("storage") == STORAGE_FP8)
                writer.reserve()
                writer.hold(1, len(arr))
                writer.submit(Batch([(i, arr, np.asarray(s["target_argmax"]))], logical, scales=[scale]))
        finally:
            writer.close()
        cache.finish()
    except BaseException:
        cache.close()
        cache.path.unlink(missing_ok=True)
        raise
    return len(samples)
