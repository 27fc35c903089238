"""The HDF5 hidden-state cache: its format (documented here, in one place), writer and reader.

One file per (target, prompt set). The target runs once over each sample's
prompt + completion token ids; the outputs of the requested decoder layers are
stored so that any number of drafter checkpoints can be replayed offline.

File layout (``format = "dflash-eval/hidden-state-cache"``, ``format_version = 1``)::

    /                         attributes (provenance, see FILE_ATTRS below)
    /sample_ids               [S] utf-8 strings, sample order
    /samples/<i:06d>/         one group per sample i (0-based, same order)
        input_ids             [T] int32    prompt + completion token ids (never re-tokenized)
        hidden                [T, K, H]    uint16 = raw bfloat16 bits (attrs logical_dtype="bfloat16"),
                                           or float32 (logical_dtype="float32", CPU extraction);
                                           hidden[:, k] = HF hidden_states[target_layer_ids[k] + 1]
        target_argmax         [T] int32    target's greedy token after position t (teacher forced)
        attrs: sample_id, prompt_len (P), completion_len (T - P), stop_reason ("eos"|"length"),
               max_new_tokens, argmax_agreement (fraction of completion tokens equal to the
               teacher-forced argmax: 1.0 unless generation and extraction numerics differ)

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

Files are written to a temporary name in the destination folder and renamed
when complete; a file at the final path is always whole.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import InputError, atomic_path

log = logging.getLogger(__name__)

FORMAT = "dflash-eval/hidden-state-cache"
FORMAT_VERSION = 1
LAYER_CONVENTION = "hidden[:, k] = HF hidden_states[target_layer_ids[k] + 1] (output of 0-based decoder layer)"
FILE_ATTRS = (
    "format", "format_version", "target_name", "target_sha256", "target_model_type", "num_target_layers",
    "hidden_size", "vocab_size", "target_layer_ids", "layer_convention", "last_layer_normed", "dtype",
    "storage", "device", "device_name", "torch_version", "transformers_version", "fla_version",
    "causal_conv1d_version", "causal_conv1d_kernel", "linear_attn_kernel", "linear_attn_backend", "layer_types", "image", "env", "padding_side",
    "batch_tokens", "completions_sha256", "prompt_set", "n_samples", "created_at", "dflash_eval_version",
)


# --------------------------------------------------------------------------- bf16 <-> uint16
def to_storage(x: torch.Tensor) -> tuple[np.ndarray, str]:
    """Tensor -> (numpy array for HDF5, logical dtype name). bf16 becomes its uint16 bits."""
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


class CacheReader:
    """Read-only access to a cache file (open lazily in each process; h5py handles do not survive fork).

    Raises:
        InputError: the file is missing, not a dflash-eval cache, or of another format version.
    """

    def __init__(self, path: str | os.PathLike):
        import h5py

        self.path = Path(path)
        if not self.path.exists():
            raise InputError(self.path, None, "cache file not found", "run the hidden_states rule first")
        try:
            self._f = h5py.File(self.path, "r")
        except OSError as err:
            raise InputError(self.path, None, f"not a readable HDF5 file ({err})", "delete it and re-run the hidden_states rule") from None
        a = self._f.attrs
        if a.get("format") != FORMAT:
            raise InputError(self.path, "format", f"expected {FORMAT!r}, got {a.get('format')!r}", "point at a dflash-eval cache")
        if int(a.get("format_version", -1)) != FORMAT_VERSION:
            raise InputError(self.path, "format_version", f"{a.get('format_version')} != {FORMAT_VERSION}", "re-extract the cache with this version")
        self.attrs = {k: _py(v) for k, v in a.items()}
        self.layer_ids: list[int] = [int(i) for i in self.attrs["target_layer_ids"]]
        self.sample_ids = [s.decode() if isinstance(s, bytes) else str(s) for s in self._f["sample_ids"][()]]

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

    def argmax_agreement(self, i: int) -> float | None:
        """Sample ``i``'s ``argmax_agreement`` attribute (None when not recorded), without reading its states."""
        v = self._f[f"samples/{i:06d}"].attrs.get("argmax_agreement")
        return None if v is None else float(v)

    def sample(self, i: int, layer_ids: list[int] | None = None) -> CacheSample:
        """Sample ``i``; ``layer_ids`` selects and orders layers (must be stored, else InputError)."""
        g = self._f[f"samples/{i:06d}"]
        hidden_ds = g["hidden"]
        logical = hidden_ds.attrs["logical_dtype"]
        logical = logical.decode() if isinstance(logical, bytes) else str(logical)
        if layer_ids is None:
            arr = hidden_ds[()]
        else:
            idx = self.layer_index(layer_ids)
            arr = hidden_ds[()][:, idx] if idx != list(range(len(self.layer_ids))) else hidden_ds[()]
        return CacheSample(
            index=i,
            sample_id=str(_py(g.attrs["sample_id"])),
            input_ids=torch.from_numpy(g["input_ids"][()].astype(np.int64)),
            prompt_len=int(g.attrs["prompt_len"]),
            hidden=from_storage(arr, logical),
            target_argmax=torch.from_numpy(g["target_argmax"][()].astype(np.int64)),
            stop_reason=str(_py(g.attrs["stop_reason"])),
            max_new_tokens=int(g.attrs["max_new_tokens"]),
        )

    def layer_index(self, layer_ids: list[int]) -> list[int]:
        missing = [i for i in layer_ids if i not in self.layer_ids]
        if missing:
            raise InputError(
                self.path, "target_layer_ids",
                f"drafter needs target layers {missing} but the cache stores {self.layer_ids}",
                "add them to cache.target_layer_ids in the workflow config (this re-extracts the cache)",
            )
        return [self.layer_ids.index(i) for i in layer_ids]


def _py(v):
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


# --------------------------------------------------------------------------- writer
def write_cache(out: str | os.PathLike, attrs: dict, samples) -> int:
    """Write a cache file atomically.

    Args:
        out: destination ``.h5`` path.
        attrs: file attributes (see ``FILE_ATTRS``); lists/dicts are stored as JSON where h5py cannot.
        samples: iterable of dicts with ``sample_id``, ``input_ids`` ([T] ints), ``prompt_len``,
            ``hidden`` (torch ``[T, K, H]`` bf16 or float32), ``target_argmax`` ([T]), ``stop_reason``,
            ``max_new_tokens``, ``argmax_agreement``. Consumed lazily (one sample in memory at a time).

    Returns:
        number of samples written.
    """
    import h5py

    ids: list[str] = []
    with atomic_path(out, suffix=".h5.tmp") as tmp:
        with h5py.File(tmp, "w") as f:
            for key, val in attrs.items():
                as_json = isinstance(val, dict) or (isinstance(val, (list, tuple)) and any(isinstance(x, str) for x in val))
                f.attrs[key] = json.dumps(val) if as_json else (str(val) if isinstance(val, str) else val)  # str subclasses (TorchVersion) too
            grp = f.create_group("samples")
            for i, s in enumerate(samples):
                g = grp.create_group(f"{i:06d}")
                g.create_dataset("input_ids", data=np.asarray(s["input_ids"], dtype=np.int32))
                arr, logical = to_storage(s["hidden"])
                d = g.create_dataset("hidden", data=arr)
                d.attrs["logical_dtype"] = logical
                g.create_dataset("target_argmax", data=np.asarray(s["target_argmax"], dtype=np.int32))
                for k in ("sample_id", "prompt_len", "stop_reason", "max_new_tokens", "argmax_agreement"):
                    g.attrs[k] = s[k]
                ids.append(str(s["sample_id"]))
            f.create_dataset("sample_ids", data=np.array(ids, dtype=object), dtype=h5py.string_dtype())
            f.attrs["n_samples"] = len(ids)
    return len(ids)
