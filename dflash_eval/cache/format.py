"""The HDF5 hidden-state cache format: names, checksums and layout constants (writer: :mod:`dflash_eval.cache.writer`, reader: :mod:`dflash_eval.cache.reader`).

One file per (target, prompt set), ``format = "dflash-eval/hidden-state-cache"``, ``format_version = 6``
(readers accept 6 only). The target runs once over each sample's prompt + completion token ids; the
outputs of the requested decoder layers are stored (``/samples/<i:06d>/hidden`` [T, K, H], bf16 as raw
uint16 bits or float32; with ``cache.storage: fp8`` float8_e4m3fn bits as uint8 beside
``/samples/<i:06d>/hidden_scale`` [T, K] float32, :func:`quantize_fp8`) so that any number of drafter
checkpoints can be replayed offline.

Key convention (transformers ``utils/generic.py``; z-lab/dflash ``dflash/model.py``
``extract_context_feature``): ``target_layer_ids`` are 0-based decoder layers and entry ``i`` holds
HF ``hidden_states[i + 1]``. Checksums: per sample :func:`sample_sha256` over the arrays and the
``meta`` JSON (:func:`sample_meta_json`, format 5); per file ``header`` / ``header_sha256``
(:func:`write_header`, format 6) over every attribute but :data:`UNCOVERED_ATTRS`.

Format (every dataset and attribute, checksums, layer convention, kernel provenance, streaming and
resumable writing, sharded caches, lock-free reading): docs/cache-format.md, "The file in full".
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
#: the per-sample dataset of FP8 caches only (``storage`` :data:`STORAGE_FP8`): one scale per token and layer
SCALE_DATASET = "hidden_scale"
#: the ``storage`` attribute of each stored encoding of ``hidden``
STORAGE_BF16 = "uint16 raw bfloat16 bits"
STORAGE_F32 = "float32"
STORAGE_FP8 = "uint8 raw float8_e4m3fn bits x hidden_scale [T, K] float32 (amax / 448 per token and layer)"
STORAGES = (STORAGE_BF16, STORAGE_F32, STORAGE_FP8)
#: largest finite float8_e4m3fn value (OCP 8-bit floating point specification, E4M3: 1.75 x 2^8)
FP8_MAX = 448.0
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


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states -> their FP8 storage (``cache.storage: fp8``), on ``x``'s device.

    One scale per token and layer, ``scale = amax / 448`` (amax over the hidden axis, 448 = :data:`FP8_MAX`),
    and ``q = float8_e4m3fn(x / scale)`` rounded to nearest (torch's cast); an all-zero row keeps scale 0 (and
    q 0). The convention of speculators' ``FP8HiddenStatesConnector`` (vllm-project/speculators PR #1028:
    per-token dynamic scale, e4m3fn).

    Args:
        x: ``[T, K, H]`` bfloat16 or float32 (any device).

    Returns:
        ``(q, scale)``: ``q`` ``[T, K, H]`` uint8 (the float8_e4m3fn bits), ``scale`` ``[T, K]`` float32. A
        non-finite value of ``x`` gives a non-finite scale (the reader's finite scan refuses it).
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / FP8_MAX
    div = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (xf / div[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


def stored_form(x: torch.Tensor, fp8: bool) -> tuple[np.ndarray, str, np.ndarray | None]:
    """States ``[T, K, H]`` as a cache stores them: ``(hidden, logical dtype, hidden_scale)``; with ``fp8``
    (:func:`quantize_fp8`) ``("uint8 bits", "float8_e4m3fn", [T, K] float32)``, else :func:`to_storage`'s and None."""
    if not fp8:
        return (*to_storage(x), None)
    q, scale = quantize_fp8(x)
    return q.cpu().numpy(), "float8_e4m3fn", scale.cpu().numpy()


def dequantize_fp8(q: np.ndarray, scale: np.ndarray, logical_dtype: str,
                   device: torch.device | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8` up to its rounding: ``value(q) * scale`` in ``logical_dtype``.

    On the CPU the E4M3 bits are placed in float16 bits (sign to bit 15, exponent and mantissa to bits 7-13: a
    float16 of the same mantissa whose exponent bias is 15 instead of 7, subnormals included, so the value is
    ``value(q) / 256``) and the scale is multiplied by 256: exact for every finite code. It is a sign-extending
    widening to int16, a shift and a mask in place, then the float16 widening and the scale's product: about
    5x faster on this project's CPU than a 256-entry table look-up (numpy ``take``) and 9x faster than torch's
    float8 cast (``bench/fp8_cache.py``, docs/measurements.md "FP8 caches"). The NaN codes (0x7F / 0xFF) come
    out finite this way; a cache holds them only beside a non-finite scale (:func:`quantize_fp8`), which the
    reader's checks refuse first and which makes the product NaN anyway. Elsewhere the bytes are copied to
    ``device`` and cast there (torch's float8_e4m3fn cast, a device kernel).

    Args:
        q: ``[T, K, H]`` uint8 (float8_e4m3fn bits, as stored); scale: ``[T, K]`` float32.
        logical_dtype: ``"bfloat16"`` or ``"float32"`` (the cache's ``dtype``: what the target computed in).
        device: None or ``cpu``: on the CPU; else a device the bytes are copied to and dequantised on.

    Returns:
        ``[T, K, H]`` tensor of ``logical_dtype`` on the CPU or ``device``.
    """
    dt = torch.bfloat16 if logical_dtype == "bfloat16" else torch.float32
    s = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32))[..., None]
    qt = torch.from_numpy(np.ascontiguousarray(q))
    if device is not None and torch.device(device).type != "cpu":
        qd = qt.to(device, non_blocking=True)
        return (qd.view(torch.float8_e4m3fn).float() * s.to(device, non_blocking=True)).to(dt)
    half = qt.view(torch.int8).to(torch.int16)  # sign-extended: the sign bit lands in bits 8-15
    half.__ilshift__(7).bitwise_and_(-0x4080)  # 0xBF80 as int16: keep bit 15 (sign) and bits 7-13
    out = half.view(torch.float16).float().mul_(s * 256.0)
    return out.to(dt) if dt != torch.float32 else out


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


def sample_sha256(input_ids: np.ndarray, target_argmax: np.ndarray, hidden: np.ndarray, meta: str | None = None,
                  scale: np.ndarray | None = None) -> str:
    """The per-sample checksum (attribute ``sha256``): sha256 over the stored bytes of the three datasets,
    then (FP8 caches) those of ``hidden_scale``, then (format 5) the UTF-8 bytes of the sample's ``meta`` attribute.

    Args:
        input_ids, target_argmax: ``[T]`` int32; hidden: ``[T, K, H]`` uint16, float32 or uint8 (FP8), as stored.
        meta: the ``meta`` string (:func:`sample_meta_json`) as stored; None for formats before 5.
        scale: FP8 caches: ``hidden_scale`` ``[T, K]`` float32 as stored; None otherwise.
    """
    h = hashlib.sha256()
    for a in (input_ids, target_argmax, hidden) + (() if scale is None else (scale,)):
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
