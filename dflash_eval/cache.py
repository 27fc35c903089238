"""The HDF5 hidden-state cache: its format (documented here, in one place), writer and reader.

One file per (target, prompt set). The target runs once over each sample's
prompt + completion token ids; the outputs of the requested decoder layers are
stored so that any number of drafter checkpoints can be replayed offline.

File layout (``format = "dflash-eval/hidden-state-cache"``, ``format_version = 3``)::

    /                         file attributes (FILE_ATTRS, listed below)
    /sample_ids               [S] utf-8 strings: the completions file's ids, in its order
    /prompt_len               [S] int32    P: input_ids[:P] is the prompt
    /completion_len           [S] int32    T - P
    /stop_reason              [S] utf-8    "eos" | "length" (from the completions file)
    /max_new_tokens           [S] int32    the generation limit of the completion
    /argmax_agreement         [S] float64  fraction of completion tokens equal to the teacher-forced argmax at
                                           the previous position (1.0 unless generation and extraction numerics
                                           differ); NaN until sample i is written
    /samples/<i:06d>/         one group per sample i (0-based index into sample_ids)
        input_ids             [T] int32    prompt + completion token ids (never re-tokenized)
        hidden                [T, K, H]    uint16 = raw bfloat16 bits (file attribute dtype = "bfloat16"),
                                           or float32 (dtype = "float32", CPU extraction);
                                           hidden[:, k] = HF hidden_states[target_layer_ids[k] + 1]
        target_argmax         [T] int32    target's greedy token after position t (teacher forced)
        attrs (SAMPLE_ATTRS):
            sha256            hex sha256 of the stored bytes of input_ids, target_argmax and hidden, in
                              this order (little-endian, C order): :func:`sample_sha256`; written last,
                              so a group with it has all its parts

The per-sample values known before the target runs are file-level arrays written once when the
file is created, and ``argmax_agreement`` once per batch, so a sample costs HDF5 one group, three
datasets and one attribute (format 2 kept ``sample_id``, ``prompt_len``, ``completion_len``,
``stop_reason``, ``max_new_tokens``, ``argmax_agreement`` as attributes of each group and
``logical_dtype`` on each ``hidden``: about 2x the HDF5 calls per sample; readers accept both).

File attributes (FILE_ATTRS; each item names attributes, then a colon; lists and dicts of
strings are stored as JSON strings):

- ``format``, ``format_version``: see above. Readers accept versions 1 to 3 (2: per-sample values as
  group attributes, see above; 1 also had no per-sample ``sha256`` / ``completion_len`` and no
  ``batching`` / ``extraction_runs``).
- ``target_name``, ``target_sha256``, ``target_model_type``, ``num_target_layers``, ``hidden_size``,
  ``vocab_size``: the target's folder name, weights fingerprint (:func:`dflash_eval.target.weights_sha256`),
  model type, decoder layers, H, embedding rows.
- ``target_layer_ids``, ``layer_convention``, ``last_layer_normed``: the K stored layers (int array), the
  convention below as text, whether the last (final-normed) layer is among them.
- ``dtype``, ``storage``: ``"bfloat16"`` | ``"float32"``, and how ``hidden`` holds it.
- ``device``, ``device_name``: torch device, GPU name or CPU architecture.
- ``torch_version``, ``transformers_version``, ``fla_version``, ``causal_conv1d_version``,
  ``dflash_eval_version``: the writer's packages.
- ``causal_conv1d_kernel``: whether the causal-conv1d kernels imported (below).
- ``linear_attn_kernel``, ``linear_attn_backend``, ``layer_types``, ``image``, ``env``: kernel provenance
  (below); ``env`` is JSON of the ``FLA_*``, ``TRITON_*``, ``CUDA_VISIBLE*``, ``USE_HUB_KERNELS`` and
  ``DFLASH_EVAL_*`` variables.
- ``batching``, ``padding_side``, ``batch_tokens``: ``"packed"`` (the samples of a forward concatenated,
  attention per sample through ``cu_seqlens``, positions restarting at 0) or ``"right-padded"``;
  ``"right"``, or ``"none"`` when packed; tokens per forward (real tokens when packed, padded ones
  otherwise). When each is used and how their numbers differ: :mod:`dflash_eval.extract`.
- ``completions_sha256``, ``prompt_set``: sha256 of the completions file, and its stem.
- ``created_at``, ``extraction_runs``: when the first run started; JSON list with one entry per run that
  worked on the file (``started_at``, ``host``, ``pid``, and ``computed`` / ``reused`` sample counts).
- ``n_samples``: written last, when every sample is in the file; a file without it is unfinished.

Layer convention (transformers ``utils/generic.py`` collects ``hidden_states``; z-lab/dflash
``dflash/model.py`` ``extract_context_feature`` reads ``hidden_states[i + 1]``): ``target_layer_ids`` are
0-based decoder layers; entry ``i`` holds the *output* of layer ``i``, i.e. HF
``hidden_states[i + 1]`` (un-normed residual stream). For ``i = N - 1`` HF's
last entry is the final-normed state, and so is ours (attribute
``last_layer_normed``). bf16 is stored as its raw bits in a uint16 dataset
(h5py has no bf16 type; ``opaque`` dtypes do not read back): the round trip is
bit-exact. Datasets are contiguous and uncompressed (bf16 activations compress
~1.2x and HDF5 runs filters single-threaded, h5py issue #1516).

Kernel provenance (hybrid targets, :mod:`dflash_eval.hybrid`): ``layer_types`` is the
target's per-layer type list as JSON (``linear_attention`` / ``full_attention``, ``[]``
when the config has none); ``linear_attn_kernel`` is JSON with ``backend``
(``none``/``fla``/``torch``; ``evaluate`` compares it with ``target.training_backend``),
the bound GDN/conv functions, gated-norm class, package versions and ``FLA_*`` env;
``image`` is env ``DFLASH_EVAL_IMAGE`` of the container that wrote the file (``""`` outside one);
``causal_conv1d_kernel`` says whether the causal-conv1d kernels imported
(:func:`dflash_eval.hybrid.causal_conv1d_status`: ``imported <version>``, ``absent``, or
``import failed: ...``), beside ``causal_conv1d_version`` (the installed distribution).

Writing: streaming and resumable (:class:`PartialCache`, :class:`StreamingWriter`)
----------------------------------------------------------------------------------
A cache ``<name>.h5`` is built in the sidecar ``<name>.h5.partial`` next to it (the
workflow does not declare it, so Snakemake never deletes it) and renamed into place when
every sample is in it; a file at the final path is always whole. Each batch's samples are
written as soon as their forward is done and the file is flushed after every batch (one
*commit*). In host memory at once: at most two batches' ``hidden`` / ``target_argmax``
(the one being written and the one being computed or copied from the GPU, through two
reusable buffers), the completions' token ids (4 bytes per token) and the model; never the
whole cache, however many samples there are.

A run that is killed (SIGKILL, a SLURM time limit's SIGTERM, node loss) or fails (disk
full) leaves the sidecar: the next run with the same settings opens it, keeps every sample
whose ``sha256`` verifies, and computes the rest with the same batches, so the finished
datasets are bit-identical to those of an uninterrupted run. A sidecar written with
other settings (:data:`IDENTITY_ATTRS`: target weights, layers, completions file, dtype,
batching, device, library versions) is refused with the differences named, never mixed;
one that HDF5 cannot open at all (killed inside a flush) is started over. A sidecar open
in another process (HDF5 file lock) is reported as in use. With ``keep_link`` the finished
sidecar stays as a second name (hard link, no extra space) of the output until the
workflow succeeds (``Snakefile`` ``onsuccess``): a rerun after a lost Snakemake, which
deletes the output of a job it did not see finish, verifies and reuses it instead of
recomputing.

Reading: caches are read-only once written, so :class:`CacheReader` opens them without the
HDF5 file lock (``locking=False``): a cache open in another process (h5py, HDFView) can be
read, and an unreadable file is reported as damaged (with the HDF5 reason), never as locked.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from .errors import InputError, partial_path

log = logging.getLogger(__name__)

FORMAT = "dflash-eval/hidden-state-cache"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
LAYER_CONVENTION = "hidden[:, k] = HF hidden_states[target_layer_ids[k] + 1] (output of 0-based decoder layer)"
FILE_ATTRS = (
    "format", "format_version", "target_name", "target_sha256", "target_model_type", "num_target_layers",
    "hidden_size", "vocab_size", "target_layer_ids", "layer_convention", "last_layer_normed", "dtype",
    "storage", "device", "device_name", "torch_version", "transformers_version", "fla_version",
    "causal_conv1d_version", "causal_conv1d_kernel", "dflash_eval_version", "linear_attn_kernel", "linear_attn_backend", "layer_types",
    "image", "env", "batching", "padding_side", "batch_tokens", "completions_sha256", "prompt_set", "created_at",
    "extraction_runs", "n_samples",
)
#: file-level per-sample arrays ``[S]`` (format 3), besides ``sample_ids``
FILE_DATASETS = ("prompt_len", "completion_len", "stop_reason", "max_new_tokens", "argmax_agreement")
SAMPLE_DATASETS = ("input_ids", "hidden", "target_argmax")
SAMPLE_ATTRS = ("sha256",)
#: file attributes a partial file must share with the run that continues it (else it is refused)
IDENTITY_ATTRS = (
    "format_version", "target_sha256", "target_layer_ids", "completions_sha256", "hidden_size", "dtype", "storage",
    "batching", "batch_tokens", "device_name", "linear_attn_backend", "torch_version", "transformers_version",
    "fla_version", "causal_conv1d_version",
)
#: errno values that mean "no room to write": disk full, quota, file size limit
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
#: partial files detached after a failed write in this process (:meth:`PartialCache._detach`); HDF5's
#: own shutdown at interpreter exit can crash on their leftover handles, so the CLI exits without it
DETACHED: list[Path] = []


# --------------------------------------------------------------------------- bf16 <-> uint16
def to_storage(x: torch.Tensor) -> tuple[np.ndarray, str]:
    """Tensor -> (numpy array for HDF5, logical dtype name). bf16 becomes its uint16 bits.

    CPU tensors are viewed, not copied.
    """
    x = x.detach().cpu().contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16), "bfloat16"
    if x.dtype == torch.float32:
        return x.numpy(), "float32"
    raise ValueError(f"unsupported cache dtype {x.dtype}")


def from_storage(arr: np.ndarray, logical_dtype: str) -> torch.Tensor:
    """Inverse of :func:`to_storage` (bit-exact)."""
    if logical_dtype == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
    if logical_dtype == "float32":
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    raise ValueError(f"unknown logical dtype {logical_dtype!r}")


def sample_sha256(input_ids: np.ndarray, target_argmax: np.ndarray, hidden: np.ndarray) -> str:
    """The per-sample checksum (attribute ``sha256``): sha256 over the stored bytes of the three datasets.

    Args:
        input_ids, target_argmax: ``[T]`` int32; hidden: ``[T, K, H]`` uint16 or float32, as stored.
    """
    h = hashlib.sha256()
    for a in (input_ids, target_argmax, hidden):
        a = np.ascontiguousarray(a)
        h.update(memoryview(a.astype(a.dtype.newbyteorder("<"), copy=False)).cast("B"))
    return h.hexdigest()


def _attr_value(val):
    """A Python value as an HDF5 attribute (dicts and lists holding strings as JSON)."""
    as_json = isinstance(val, dict) or (isinstance(val, (list, tuple)) and any(isinstance(x, str) for x in val))
    if as_json:
        return json.dumps(val)
    return str(val) if isinstance(val, str) else val  # str subclasses (TorchVersion) too


def _py(v):
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def is_no_space(err: BaseException) -> bool:
    """True for an error that means the disk (or quota, or file size limit) is full.

    h5py raises ``OSError`` or ``RuntimeError`` (a failed flush) and names the errno only in its text.
    """
    if not isinstance(err, (OSError, RuntimeError)):
        return False
    if isinstance(err, OSError) and err.errno in NO_SPACE_ERRNOS:
        return True
    text = str(err)
    return any(f"errno = {e}," in text for e in NO_SPACE_ERRNOS) or "No space left" in text


# --------------------------------------------------------------------------- reader
@dataclass
class CacheSample:
    """One cached sample. ``hidden``: ``[T, K, H]`` in the cache's logical dtype."""

    index: int
    sample_id: str
    input_ids: torch.Tensor  # [T] int64
    prompt_len: int
    hidden: torch.Tensor  # [T, K, H]
    target_argmax: torch.Tensor  # [T] int64
    stop_reason: str
    max_new_tokens: int


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

    Opened without the HDF5 file lock (:func:`open_h5_readonly`).

    Raises:
        InputError: the file is missing, damaged, not a dflash-eval cache, of another format version,
            or unfinished (no ``n_samples``, or fewer sample groups than ``sample_ids``).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
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
        if _py(a.get("format")) != FORMAT:
            raise InputError(self.path, "format", f"expected {FORMAT!r}, got {_py(a.get('format'))!r}",
                             "point at a dflash-eval cache")
        version = int(a.get("format_version", -1))
        if version not in READABLE_VERSIONS:
            raise InputError(self.path, "format_version", f"{version} is not one of {READABLE_VERSIONS}",
                             "re-extract the cache with this version")
        self.format_version = version
        self.attrs = {k: _py(v) for k, v in a.items()}
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
            return {**{k: _py(v) for k, v in g.attrs.items()}, "length": length}
        per = self._per_sample  # format 3: the file-level arrays (agreement read afresh)
        return {"sample_id": self.sample_ids[i], "prompt_len": int(per["prompt_len"][i]),
                "completion_len": length - int(per["prompt_len"][i]), "stop_reason": str(_py(per["stop_reason"][i])),
                "max_new_tokens": int(per["max_new_tokens"][i]), "argmax_agreement": self.argmax_agreement(i),
                "sha256": _py(g.attrs.get("sha256")), "length": length}

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
        """Sample ``i``; ``layer_ids`` selects and orders layers (must be stored, else InputError)."""
        g = self._f[f"samples/{i:06d}"]
        hidden_ds = g["hidden"]
        per = self._per_sample
        logical = (_py(hidden_ds.attrs["logical_dtype"]) if per is None
                   else "bfloat16" if hidden_ds.dtype == np.uint16 else "float32")
        if layer_ids is None:
            arr = hidden_ds[()]
        else:
            idx = self.layer_index(layer_ids)
            arr = hidden_ds[()][:, idx] if idx != list(range(len(self.layer_ids))) else hidden_ds[()]
        return CacheSample(
            index=i,
            sample_id=self.sample_ids[i] if per is not None else str(_py(g.attrs["sample_id"])),
            input_ids=torch.from_numpy(g["input_ids"][()].astype(np.int64)),
            prompt_len=int(per["prompt_len"][i] if per is not None else g.attrs["prompt_len"]),
            hidden=from_storage(arr, logical),
            target_argmax=torch.from_numpy(g["target_argmax"][()].astype(np.int64)),
            stop_reason=str(_py(per["stop_reason"][i] if per is not None else g.attrs["stop_reason"])),
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
            if _verify_group(g) is None:
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


def _verify_group(g) -> str | None:
    """The group's checksum when every dataset is there and the bytes match it, else None."""
    try:
        stored = _py(g.attrs.get("sha256"))
        if not stored or any(name not in g for name in SAMPLE_DATASETS):
            return None
        got = sample_sha256(g["input_ids"][()], g["target_argmax"][()], g["hidden"][()])
    except (OSError, KeyError, ValueError, RuntimeError):  # unreadable pieces of a killed run
        return None
    return stored if got == stored else None


# --------------------------------------------------------------------------- writer
def _h5_writable(path: Path, create: bool):
    """Open (or create) an HDF5 file for writing with HDF5's sieve buffer off.

    Raw data then reaches the file inside the call that writes it, so a failed write (disk full)
    raises there, in :meth:`PartialCache.write_sample`, and not later when h5py releases a
    dataset handle (where it can only print the error and HDF5's state is left broken). File
    locking is best-effort (on where the file system has locks).
    """
    import h5py
    from h5py import h5f, h5p

    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5f.LIBVER_EARLIEST, h5f.LIBVER_LATEST)  # h5py's default
    fapl.set_file_locking(True, True)
    fapl.set_sieve_buf_size(0)
    name = os.fsencode(path)
    fid = h5f.create(name, h5f.ACC_TRUNC, fapl=fapl) if create else h5f.open(name, h5f.ACC_RDWR, fapl=fapl)
    return h5py.File(fid)


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
                f = _h5_writable(self.path, create=False)
            except OSError as err:
                m = re.search(r"truncated file: eof = (\d+), .*stored_eof = (\d+)", str(err))
                if not m or int(m.group(2)) <= int(m.group(1)):
                    raise
                # the end of the file was lost (node loss): restore its length, then verify what is there
                log.warning("%s: partial file shorter than its header says (%s): extended to %s bytes, every "
                            "sample is verified", self.path, m.group(1), m.group(2))
                os.truncate(self.path, int(m.group(2)))
                f = _h5_writable(self.path, create=False)
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
            if diff and "n_samples" in f.attrs:
                # a finished cache of other settings (a kept link whose output Snakemake deleted for a rerun):
                # nothing unfinished is lost by starting over
                f.close()
                log.info("%s: finished cache of other settings (%s): removed, starting over", self.path, ", ".join(diff))
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
        """Start a new sidecar with the file attributes ``attrs`` (identity values included)."""
        import h5py

        self.out.parent.mkdir(parents=True, exist_ok=True)
        f = _h5_writable(self.path, create=True)
        try:
            for key, val in {**attrs, **self.identity}.items():
                f.attrs[key] = _attr_value(val)
            f.attrs["extraction_runs"] = "[]"
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
        a = {k: _py(v) for k, v in f.attrs.items()}
        want = {k: _py(_attr_value(self.identity.get(k))) for k in IDENTITY_ATTRS}
        diff = {k: (a.get(k), want[k]) for k in IDENTITY_ATTRS if a.get(k) != want[k]}
        if a.get("format") != FORMAT:
            diff["format"] = (a.get("format"), FORMAT)
        ids = [_py(s) for s in f["sample_ids"][()]] if "sample_ids" in f else None
        if ids != [m.sample_id for m in self.meta]:
            diff["sample_ids"] = (f"{len(ids or [])} ids", f"{len(self.meta)} ids")
        return diff

    def _verify_partial(self, f):
        """Keep the verified samples, unlink the rest; ``(open file, verified indices)``."""
        a = {k: _py(v) for k, v in f.attrs.items()}
        self._runs = json.loads(a.get("extraction_runs") or "[]")
        grp = f.require_group("samples")
        reused: set[int] = set()
        bad: list[str] = []
        for name in list(grp):
            i = int(name) if name.isdigit() else -1
            try:
                ok = 0 <= i < len(self.meta) and _verify_group(grp[name]) is not None
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

    def _salvage(self, f, reused: set[int]):
        """Rebuild the sidecar from its verified samples when its group index is damaged; the reopened file."""
        import h5py

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
        return _h5_writable(self.path, create=False)

    # ---------------------------------------------------------------- writing
    def check_room(self, nbytes: int) -> None:
        """Raise ``OSError(ENOSPC)`` before writing ``nbytes`` when the file system has less free space than
        that plus 64 MiB (HDF5 itself cannot recover from a failed write: see :meth:`close`)."""
        free = shutil.disk_usage(self.path.parent).free
        if free < nbytes + (64 << 20):
            raise OSError(errno.ENOSPC, f"No space left on device: {free / 1e6:.0f} MB free, the next batch needs "
                          f"{nbytes / 1e6:.0f} MB + 64 MB of headroom", str(self.path.parent))

    def write_sample(self, i: int, hidden: np.ndarray, logical_dtype: str, target_argmax: np.ndarray,
                     sha256: str | None, argmax_agreement: float | None) -> None:
        """Write sample ``i`` (arrays as stored: ``hidden [T, K, H]``, ``target_argmax [T]`` int32).

        ``logical_dtype`` must be the file's ``dtype`` (kept for callers; format 3 stores it once).
        ``argmax_agreement=None``: already written by :meth:`write_agreement`.

        With ``sha256=None`` the group is written without its checksum, so it does not count as
        written (a resumed run discards it) until :meth:`seal` adds it: the writer hashes in other
        threads while HDF5 writes.
        """
        try:
            self._write_sample(i, hidden, logical_dtype, target_argmax, argmax_agreement)
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

    def _write_sample(self, i, hidden, logical_dtype, target_argmax, argmax_agreement) -> None:
        m = self.meta[i]
        grp = self._f["samples"]
        name = f"{i:06d}"
        if name in grp:  # a group of a failed earlier attempt of this run
            del grp[name]
        if argmax_agreement is not None:
            self._f["argmax_agreement"][i] = argmax_agreement
        g = grp.create_group(name)
        g.create_dataset("input_ids", data=m.input_ids)
        g.create_dataset("hidden", data=hidden)
        g.create_dataset("target_argmax", data=target_argmax)
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
        self.cache.check_room(sum(h.nbytes + 8 * len(a) for _, h, a in batch.samples) + (1 << 20))
        ids32 = [meta[i].input_ids for i, _, _ in batch.samples]
        argmax32 = [np.ascontiguousarray(a, dtype=np.int32) for _, _, a in batch.samples]
        # hashes run in the pool (hashlib and HDF5's dataset writes release the GIL) while this thread
        # writes the groups; each checksum is added once its group is written
        shas = [self._pool.submit(sample_sha256, ids32[k], argmax32[k], h) for k, (_, h, _) in enumerate(batch.samples)]
        t2 = time.perf_counter()
        try:
            agree = []
            for k, (i, _, _) in enumerate(batch.samples):
                m = meta[i]
                P, T = m.prompt_len, len(m.input_ids)
                agree.append(float((argmax32[k][P - 1 : T - 1] == m.input_ids[P:]).mean()) if T > P else 1.0)
            self.cache.write_agreement([i for i, _, _ in batch.samples], agree)
            for k, (i, hidden, _) in enumerate(batch.samples):
                self.cache.write_sample(i, hidden, batch.logical_dtype, argmax32[k], None, None)
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
            ``max_new_tokens``. Materialised first (sample ids are written before the groups).

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
                arr, logical = to_storage(s["hidden"])
                writer.reserve()
                writer.hold(1, len(arr))
                writer.submit(Batch([(i, arr, np.asarray(s["target_argmax"]))], logical))
        finally:
            writer.close()
        cache.finish()
    except BaseException:
        cache.close()
        cache.path.unlink(missing_ok=True)
        raise
    return len(samples)
