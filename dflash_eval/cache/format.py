"""The HDF5 hidden-state cache format, documented here in one place (writer: :mod:`dflash_eval.cache.writer`, reader: :mod:`dflash_eval.cache.reader`).

One file per (target, prompt set). The target runs once over each sample's
prompt + completion token ids; the outputs of the requested decoder layers are
stored so that any number of drafter checkpoints can be replayed offline.

File layout (``format = "dflash-eval/hidden-state-cache"``, ``format_version = 6``)::

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
            meta              (format 5) the sample's per-sample values as compact JSON, keys in this order:
                              ``{"sample_id", "prompt_len", "completion_len", "stop_reason", "max_new_tokens",
                              "argmax_agreement"}`` (:func:`sample_meta_json`): the checksummed copy of its
                              entries in the file-level arrays above, which must equal it
            sha256            hex sha256 of the stored bytes of input_ids, target_argmax and hidden, in
                              this order (little-endian, C order), then (format 5) the UTF-8 bytes of
                              ``meta``: :func:`sample_sha256`; written last, so a group with it has all its parts

Every per-sample value a stage uses is covered (format 5): the reader checks the checksum over the
arrays and ``meta`` when it reads a sample, and that the file-level arrays hold ``meta``'s values
(:meth:`~dflash_eval.cache.reader.CacheReader.sample`); the accessors that read no arrays
(``sample_attrs``, ``argmax_agreement``) compare the arrays with ``meta`` (no hash). An edited
``prompt_len`` (or any other array entry) is refused naming the file, the field and the sample.

Every file attribute a stage uses is covered too (format 6): ``header`` holds them as canonical JSON and
``header_sha256`` its checksum (:func:`write_header`), written whenever a covered attribute is (the file's
creation, a shard merge). Covered: every file attribute but :data:`UNCOVERED_ATTRS`, i.e. all of FILE_ATTRS
(and the writer's extras: ``shards`` of a merged cache, the ``engine*`` attributes of a vLLM extraction) except
``extraction_runs`` (rewritten at every commit of every run) and ``n_samples`` (written when the last sample is:
a killed run's sidecar must resume with its header intact). The reader checks both when it opens a format-6 file
(:meth:`~dflash_eval.cache.reader.CacheReader._check_header`): an edited, added or deleted attribute is refused
naming it with both values, and so is a missing ``header`` / ``header_sha256``.

The per-sample values known before the target runs are file-level arrays written once when the
file is created, and ``argmax_agreement`` once per batch, so a sample costs HDF5 one group, three
datasets and two attributes.

File attributes (FILE_ATTRS; each item names attributes, then a colon; lists and dicts of
strings are stored as JSON strings):

- ``format``, ``format_version``: see above. Readers accept version 6 only; a file of an earlier version
  is refused (re-extract it).
- ``completion_sampling``: JSON ``{"temperature", "top_p", "top_k", "seed"}`` of how the completions were
  drawn (the completions file's ``generation.sampling`` provenance; ``{"temperature": 0.0, "top_p": 1.0,
  "top_k": 0, "seed": null}`` = greedy, the only kind before format 4). Evaluating a sampling setting at
  another temperature is refused unless ``evaluate.cross_temperature`` (:func:`completion_sampling`).
- ``target_name``, ``target_sha256``, ``target_model_type``, ``num_target_layers``, ``hidden_size``,
  ``vocab_size``: the target's folder name, weights fingerprint (:func:`dflash_eval.target.spec.weights_sha256`),
  model type, decoder layers, H, embedding rows.
- ``target_layer_ids``, ``layer_convention``, ``last_layer_normed``: the K stored layers (int array), the
  convention below as text, whether the last (final-normed) layer is among them. That layer is the cache's
  information on the target's distribution p at temperature > 0: its LM head gives the exact logits at
  every position for any sampling setting (H values per token; ``cache.final_hidden`` adds it to the
  stored layers). Without it a cache evaluates greedy settings only (:func:`final_hidden_index`).
- ``dtype``, ``storage``: ``"bfloat16"`` | ``"float32"``, and how ``hidden`` holds it.
- ``device``, ``device_name``: torch device, GPU name or CPU architecture.
- ``torch_version``, ``transformers_version``, ``fla_version``, ``causal_conv1d_version``,
  ``dflash_eval_version``: the writer's packages.
- ``causal_conv1d_kernel``: whether the causal-conv1d kernels imported (below).
- ``provenance``: JSON, the provenance block of the hidden_states job (:mod:`dflash_eval.data.provenance`; the HF source)
- ``linear_attn_kernel``, ``linear_attn_backend``, ``layer_types``, ``image``, ``env``: kernel provenance
  (below); ``env`` is JSON of the ``FLA_*``, ``TRITON_*``, ``CUDA_VISIBLE*``, ``USE_HUB_KERNELS`` and
  ``DFLASH_EVAL_*`` variables.
- ``batching``, ``padding_side``, ``batch_tokens``: ``"packed"`` (the samples of a forward concatenated,
  attention per sample through ``cu_seqlens``, positions restarting at 0) or ``"right-padded"``;
  ``"right"``, or ``"none"`` when packed; tokens per forward (real tokens when packed, padded ones
  otherwise). When each is used and how their numbers differ: :mod:`dflash_eval.cache.extract`.
- ``completions_sha256``, ``prompt_set``: sha256 of the completions file, and its stem.
- ``created_at``, ``extraction_runs``: when the first run started; JSON list with one entry per run that
  worked on the file (``started_at``, ``host``, ``pid``, and ``computed`` / ``reused`` sample counts).
- ``n_samples``: written last, when every sample is in the file; a file without it is unfinished.
- ``header``, ``header_sha256``: (format 6) canonical JSON (sorted keys, compact separators) of every other
  file attribute but ``extraction_runs`` and ``n_samples``, as read back by h5py (int arrays as lists), and the
  hex sha256 of its UTF-8 text; see above.

Layer convention (transformers ``utils/generic.py`` collects ``hidden_states``; z-lab/dflash
``dflash/model.py`` ``extract_context_feature`` reads ``hidden_states[i + 1]``): ``target_layer_ids`` are
0-based decoder layers; entry ``i`` holds the *output* of layer ``i``, i.e. HF
``hidden_states[i + 1]`` (un-normed residual stream). For ``i = N - 1`` HF's
last entry is the final-normed state, and so is ours (attribute
``last_layer_normed``). bf16 is stored as its raw bits in a uint16 dataset
(h5py has no bf16 type; ``opaque`` dtypes do not read back): the round trip is
bit-exact. Datasets are contiguous and uncompressed (bf16 activations compress
~1.2x and HDF5 runs filters single-threaded, h5py issue #1516).

Kernel provenance (hybrid targets, :mod:`dflash_eval.target.hybrid`): ``layer_types`` is the
target's per-layer type list as JSON (``linear_attention`` / ``full_attention``, ``[]``
when the config has none); ``linear_attn_kernel`` is JSON with ``backend``
(``none``/``fla``/``torch``; ``evaluate`` compares it with ``target.training_backend``),
the bound GDN/conv functions, gated-norm class, package versions and ``FLA_*`` env;
``image`` is env ``DFLASH_EVAL_IMAGE`` of the container that wrote the file (``""`` outside one);
``causal_conv1d_kernel`` says whether the causal-conv1d kernels imported
(:func:`dflash_eval.target.hybrid.causal_conv1d_status`: ``imported <version>``, ``absent``, or
``import failed: ...``), beside ``causal_conv1d_version`` (the installed distribution).

Writing: streaming and resumable (:class:`~dflash_eval.cache.writer.PartialCache`, :class:`~dflash_eval.cache.writer.StreamingWriter`)
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

Sharded caches (:mod:`dflash_eval.cache.shards`): ``hidden-states --shard K/N`` writes an ordinary cache of
the samples of batches ``K, K + N, ...`` of the whole prompt set's batch plan (so every sample is
computed with the neighbours it has in a one-job extraction: bit-identical states), in the
completions file's order, resumable like any cache. ``merge-cache-shards`` then writes the prompt
set's cache: the file attributes of the first shard (the shards must agree on every
:data:`IDENTITY_ATTRS` value), ``extraction_runs`` of all shards, ``n_samples``, the extra file
attribute ``shards`` (JSON list of the shard file names, which must lie in the merged file's
folder), the file-level per-sample arrays of every sample, and per sample ``/samples/<i:06d>`` an
HDF5 external link to ``<shard file>:/samples/<j:06d>`` (resolved relative to the merged file):
readers see one cache; the states are not copied. Move or delete the shards and the merged file
no longer reads (its samples are reported missing).

Reading: caches are read-only once written, so :class:`~dflash_eval.cache.reader.CacheReader` opens them without the
HDF5 file lock (``locking=False``): a cache open in another process (h5py, HDFView) can be
read, and an unreadable file is reported as damaged (with the HDF5 reason), never as locked.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from dataclasses import dataclass

import numpy as np
import torch

FORMAT = "dflash-eval/hidden-state-cache"
FORMAT_VERSION = 6
READABLE_VERSIONS = (6,)
#: the first format whose per-sample checksum covers the sample's per-sample values (its ``meta`` attribute)
META_VERSION = 5
#: the first format whose file attributes are under a checksum (the ``header`` attribute)
HEADER_VERSION = 6
#: file attributes outside ``header``: rewritten as the file grows (each commit, at the end), and the header itself
UNCOVERED_ATTRS = ("extraction_runs", "n_samples", "header", "header_sha256")
LAYER_CONVENTION = "hidden[:, k] = HF hidden_states[target_layer_ids[k] + 1] (output of 0-based decoder layer)"
FILE_ATTRS = (
    "format", "format_version", "target_name", "target_sha256", "target_model_type", "num_target_layers",
    "hidden_size", "vocab_size", "target_layer_ids", "layer_convention", "last_layer_normed", "dtype",
    "storage", "device", "device_name", "torch_version", "transformers_version", "fla_version",
    "causal_conv1d_version", "causal_conv1d_kernel", "dflash_eval_version", "linear_attn_kernel", "linear_attn_backend", "layer_types",
    "image", "env", "batching", "padding_side", "batch_tokens", "completions_sha256", "prompt_set", "created_at",
    "extraction_runs", "n_samples", "completion_sampling", "provenance", "header", "header_sha256",
)
#: ``completion_sampling`` of greedy completions (and of caches before format 4)
GREEDY_COMPLETIONS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None}


def completions_sampling(rows: list[dict]) -> dict:
    """The cache's ``completion_sampling`` (above) from the completions rows'
    ``generation`` provenance: its ``sampling`` entry, else greedy (every source without it decodes greedily)."""
    gen = rows[0].get("generation") if rows else None
    sampling = gen.get("sampling") if isinstance(gen, dict) else None
    return {**GREEDY_COMPLETIONS, **(sampling or {})}


#: file-level per-sample arrays ``[S]`` (format 3), besides ``sample_ids``
FILE_DATASETS = ("prompt_len", "completion_len", "stop_reason", "max_new_tokens", "argmax_agreement")
SAMPLE_DATASETS = ("input_ids", "hidden", "target_argmax")
SAMPLE_ATTRS = ("meta", "sha256")
#: the keys of a sample's ``meta`` (format 5), in their stored order; all but ``sample_id`` are in FILE_DATASETS
META_FIELDS = ("sample_id", "prompt_len", "completion_len", "stop_reason", "max_new_tokens", "argmax_agreement")
#: file attributes a partial file must share with the run that continues it (else it is refused)
IDENTITY_ATTRS = (
    "format_version", "target_sha256", "target_layer_ids", "completions_sha256", "hidden_size", "dtype", "storage",
    "batching", "batch_tokens", "device_name", "linear_attn_backend", "torch_version", "transformers_version",
    "fla_version", "causal_conv1d_version",
)
#: errno values that mean "no room to write": disk full, quota, file size limit
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)



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


def argmax_agreement(input_ids: np.ndarray, prompt_len: int, target_argmax: np.ndarray) -> float:
    """The sample's ``argmax_agreement``: the fraction of completion tokens ``input_ids[t]`` (``t >= P``)
    equal to the teacher-forced argmax at the previous position ``target_argmax[t - 1]``; 1.0 without any."""
    P, T = int(prompt_len), len(input_ids)
    return float((np.asarray(target_argmax)[P - 1 : T - 1] == np.asarray(input_ids)[P:]).mean()) if T > P else 1.0


def sample_meta_json(sample_id: str, prompt_len: int, completion_len: int, stop_reason: str, max_new_tokens: int,
                     argmax_agreement: float) -> str:
    """A sample's ``meta`` attribute (format 5): compact JSON of :data:`META_FIELDS` in that order (ASCII:
    non-ASCII ids are escaped; floats as Python's shortest round-trip repr, so the value reads back exactly)."""
    return json.dumps({"sample_id": str(sample_id), "prompt_len": int(prompt_len), "completion_len": int(completion_len),
                       "stop_reason": str(stop_reason), "max_new_tokens": int(max_new_tokens),
                       "argmax_agreement": float(argmax_agreement)}, separators=(",", ":"))


def le_bytes(a: np.ndarray) -> np.ndarray:
    """``a`` C-contiguous and little-endian: the byte order :func:`sample_sha256` hashes (a view where it already is)."""
    a = np.ascontiguousarray(a)
    return a.astype(a.dtype.newbyteorder("<"), copy=False)


def sample_sha256(input_ids: np.ndarray, target_argmax: np.ndarray, hidden: np.ndarray, meta: str | None = None) -> str:
    """The per-sample checksum (attribute ``sha256``): sha256 over the stored bytes of the three datasets,
    then (format 5) the UTF-8 bytes of the sample's ``meta`` attribute.

    Args:
        input_ids, target_argmax: ``[T]`` int32; hidden: ``[T, K, H]`` uint16 or float32, as stored.
        meta: the ``meta`` string (:func:`sample_meta_json`) as stored; None for formats before 5.
    """
    h = hashlib.sha256()
    for a in (input_ids, target_argmax, hidden):
        h.update(memoryview(le_bytes(a)).cast("B"))
    if meta is not None:
        h.update(meta.encode("utf-8"))
    return h.hexdigest()


def header_json(attrs) -> str:
    """The ``header`` attribute (format 6) of file attributes ``attrs`` (an h5py ``AttributeManager`` or a dict
    of stored values): canonical JSON (sorted keys, compact) of every attribute but :data:`UNCOVERED_ATTRS`."""
    return json.dumps({k: py_value(v) for k, v in attrs.items() if k not in UNCOVERED_ATTRS}, sort_keys=True,
                      separators=(",", ":"), default=str)


def header_sha256(text: str) -> str:
    """The ``header_sha256`` attribute: hex sha256 of the UTF-8 bytes of ``header``."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def header_problem(attrs) -> tuple[str, str] | None:
    """What is wrong with the ``header`` of file attributes ``attrs`` (format 6), or None when it holds.

    Returns:
        ``(attribute, cause)``: ``header`` / ``header_sha256`` missing, their checksum differing, or the first
        covered attribute (sorted by name) whose value differs from the header's (edited, added or deleted).
    """
    for key in ("header", "header_sha256"):
        if key not in attrs:
            return key, (f"missing (every file of format {HEADER_VERSION} has it: the checksum of the file "
                         "attributes): it was deleted, or the file is damaged")
    text = str(py_value(attrs["header"]))
    if header_sha256(text) != py_value(attrs["header_sha256"]):
        return "header", "the file attributes' header does not match its header_sha256: it was edited or damaged"
    stored, now = json.loads(text), json.loads(header_json(attrs))
    for key in sorted(set(stored) | set(now)):
        was, has = (json.dumps(d[key], sort_keys=True) if key in d else "(absent)" for d in (stored, now))
        if was != has:
            short = [t if len(t) <= 60 else t[:57] + "..." for t in (has, was)]
            return key, (f"file attribute {key} is {short[0]} but {short[1]} in the checksummed header: the "
                         "attribute was edited or damaged after the file was written")
    return None


def write_header(attrs) -> None:
    """Store ``header`` and ``header_sha256`` (format 6) of the file attributes as they are now in ``attrs``
    (an h5py ``AttributeManager``); call after every write of a covered attribute."""
    text = header_json(attrs)
    attrs["header"] = text
    attrs["header_sha256"] = header_sha256(text)


def attr_value(val):
    """A Python value as an HDF5 attribute (dicts and lists holding strings as JSON)."""
    as_json = isinstance(val, dict) or (isinstance(val, (list, tuple)) and any(isinstance(x, str) for x in val))
    if as_json:
        return json.dumps(val)
    return str(val) if isinstance(val, str) else val  # str subclasses (TorchVersion) too


def py_value(v):
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def h5py_module():
    """h5py, imported on first use (the one place): every stage's ``--help`` imports the cache modules."""
    import h5py  # deferred: every --help imports the cache modules and stays h5py-free (tests/core/test_startup.py)

    return h5py


def h5_writable(path: "str | os.PathLike", create: bool):
    """Open (or create) an HDF5 file for writing with HDF5's sieve buffer off.

    Raw data then reaches the file inside the call that writes it, so a failed write (disk full)
    raises there, in :meth:`dflash_eval.cache.writer.PartialCache.write_sample`, and not later when h5py
    releases a dataset handle (where it can only print the error and HDF5's state is left broken).
    File locking is best-effort (on where the file system has locks).
    """
    h5py = h5py_module()
    h5f, h5p = h5py.h5f, h5py.h5p
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5f.LIBVER_EARLIEST, h5f.LIBVER_LATEST)  # h5py's default
    fapl.set_file_locking(True, True)
    fapl.set_sieve_buf_size(0)
    name = os.fsencode(path)
    fid = h5f.create(name, h5f.ACC_TRUNC, fapl=fapl) if create else h5f.open(name, h5f.ACC_RDWR, fapl=fapl)
    return h5py.File(fid)


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
    argmax_agreement: float | None = None  #: None when not recorded (older caches)


def completion_sampling(attrs: dict) -> dict:
    """How a cache's completions were drawn: its ``completion_sampling`` attribute (JSON) as a dict, or
    :data:`GREEDY_COMPLETIONS` for a cache without it (before format 4 every completion was greedy)."""
    raw = attrs.get("completion_sampling")
    if not raw:
        return dict(GREEDY_COMPLETIONS)
    return {**GREEDY_COMPLETIONS, **(json.loads(raw) if isinstance(raw, str) else dict(raw))}


def final_hidden_index(attrs: dict) -> int | None:
    """Index k of the final normed hidden state in ``hidden[:, k]`` (the target's last layer, stored with
    the final norm applied: ``last_layer_normed``), or None when the cache does not hold it."""
    layers = [int(i) for i in attrs.get("target_layer_ids", [])]
    n = attrs.get("num_target_layers")
    if not attrs.get("last_layer_normed") or n is None or int(n) - 1 not in layers:
        return None
    return layers.index(int(n) - 1)
