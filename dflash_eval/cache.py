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

Layer convention (shared/reference/dflash.md §4): ``target_layer_ids`` are
0-based decoder layers; entry ``i`` holds the *output* of layer ``i``, i.e. HF
``hidden_states[i + 1]`` (un-normed residual stream). For ``i = N - 1`` HF's
last entry is the final-normed state, and so is ours (attribute
``last_layer_normed``). bf16 is stored as its raw bits in a uint16 dataset
(h5py has no bf16 type; ``opaque`` dtypes do not read back): the round trip is
bit-exact. Datasets are contiguous and uncompressed (bf16 activations compress
~1.2x; HDF5 filters are single-threaded) — hidden-state-cache.md §0.

Kernel provenance (hybrid targets, :mod:`dflash_eval.hybrid`): ``layer_types`` is the
target's per-layer type list as JSON (``linear_attention`` / ``full_attention``, ``[]``
when the config has none); ``linear_attn_kernel`` is JSON with ``backend``
(``none``/``fla``/``torch``; ``evaluate`` compares it with ``target.training_backend``),
the bound GDN/conv functions, gated-norm class, package versions and ``FLA_*`` env;
``image`` is env ``DFLASH_EVAL_IMAGE`` of the container that wrote the file (``""`` outside one).

Files are written to a temporary name in the destination folder and renamed
when complete; a file at the final path is always whole.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import InputError, atomic_path
from .progress import Progress

log = logging.getLogger(__name__)

FORMAT = "dflash-eval/hidden-state-cache"
FORMAT_VERSION = 1
LAYER_CONVENTION = "hidden[:, k] = HF hidden_states[target_layer_ids[k] + 1] (output of 0-based decoder layer)"
FILE_ATTRS = (
    "format", "format_version", "target_name", "target_sha256", "target_model_type", "num_target_layers",
    "hidden_size", "vocab_size", "target_layer_ids", "layer_convention", "last_layer_normed", "dtype",
    "storage", "device", "device_name", "torch_version", "transformers_version", "fla_version",
    "causal_conv1d_version", "linear_attn_kernel", "linear_attn_backend", "layer_types", "image", "env", "padding_side",
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


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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

    def sample_attrs(self, i: int) -> dict:
        """Attributes of sample ``i`` (``sample_id``, ``prompt_len``, ``stop_reason``, ``max_new_tokens``,
        ``argmax_agreement``) plus ``length`` (tokens), without reading its arrays."""
        g = self._f[f"samples/{i:06d}"]
        return {**{k: _py(v) for k, v in g.attrs.items()}, "length": int(g["input_ids"].shape[0])}

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


# --------------------------------------------------------------------------- extraction
def _versions() -> dict:
    from importlib import metadata

    def v(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    import transformers

    from . import __version__

    return {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "fla_version": v("fla-core") if v("fla-core") != "absent" else v("flash-linear-attention"),
        "causal_conv1d_version": v("causal-conv1d"),
        "dflash_eval_version": __version__,
    }


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder-layer ModuleList of an HF causal LM (``model.model.layers`` and VLM variants)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for cand in (base, getattr(base, "language_model", None), getattr(model, "model", None)):
        if cand is not None and isinstance(getattr(cand, "layers", None), torch.nn.ModuleList):
            return cand.layers
    raise InputError(None, "target", f"cannot find decoder layers of {type(model).__name__}", "use a standard HF causal LM")


def final_norm(model):
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for cand in (base, getattr(base, "language_model", None)):
        if cand is not None and hasattr(cand, "norm"):
            return cand.norm
    raise InputError(None, "target", "cannot find the final norm", "use a standard HF causal LM")


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Group sample indices by length (longest first) so each batch has ``len(batch) * max_len <= batch_tokens``.

    A sample longer than ``batch_tokens`` gets a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def capture_layers(model, ids: torch.Tensor, mask: torch.Tensor, layer_ids: list[int]):
    """One forward of the target body with forward hooks on the requested decoder layers.

    Args:
        ids, mask: ``[b, L]`` int64 token ids and attention mask (right padding).
        layer_ids: 0-based decoder layers, in the order wanted.

    Returns:
        ``(hidden [b, L, K, H], last_hidden_state [b, L, H])`` in the model dtype; ``hidden[:, :, k]``
        equals HF ``hidden_states[layer_ids[k] + 1]`` (the last layer's entry final-normed, as in HF).
        Only K layers are kept, not all N+1 as ``output_hidden_states`` would.
    """
    layers = decoder_layers(model)
    n_layers = len(layers)
    captured: dict[int, torch.Tensor] = {}

    def hook(idx):
        def fn(_mod, _inp, out):
            captured[idx] = out[0] if isinstance(out, tuple) else out
        return fn

    handles = [layers[i].register_forward_hook(hook(i)) for i in sorted(set(layer_ids))]
    try:
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        last = base(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    finally:
        for h in handles:
            h.remove()
    if n_layers - 1 in captured:  # HF's last hidden_states entry is final-normed
        captured[n_layers - 1] = final_norm(model)(captured[n_layers - 1])
    return torch.stack([captured[i] for i in layer_ids], dim=2), last


def pad_right(batch_ids: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists to ``[b, L]`` int64 ids + attention mask (real positions keep their causal context)."""
    L = max(len(x) for x in batch_ids)
    ids = torch.full((len(batch_ids), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch_ids), L), dtype=torch.long)
    for r, x in enumerate(batch_ids):
        ids[r, : len(x)] = torch.as_tensor(x)
        mask[r, : len(x)] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def run_target(model, batch_ids: list[list[int]], layer_ids: list[int], device, pad_id: int = 0):
    """One right-padded forward; returns per sample ``(hidden [T, K, H], argmax [T])`` on CPU.

    ``argmax[t]`` is the target's greedy token after position ``t`` (LM head applied in
    chunks, so ``[b, L, V]`` logits never materialise at once).
    """
    lens = [len(x) for x in batch_ids]
    ids, mask = pad_right(batch_ids, pad_id, device)
    stacked, last = capture_layers(model, ids, mask, layer_ids)
    head = model.get_output_embeddings()
    argmax = torch.empty(ids.shape, dtype=torch.long, device=ids.device)
    step = max(1, 8192 // ids.shape[1])
    for r0 in range(0, len(batch_ids), step):
        argmax[r0 : r0 + step] = head(last[r0 : r0 + step]).argmax(-1)
    return [(stacked[r, : lens[r]].cpu(), argmax[r, : lens[r]].cpu()) for r in range(len(batch_ids))]


def extract_hidden_states(
    target_dir,
    completions_path,
    out,
    layer_ids: list[int],
    batch_tokens: int = 8192,
    device: str = "auto",
    dtype: str = "auto",
    linear_attn_backend: str = "auto",
) -> Path:
    """Run the target over every completion and write the cache (format: module docstring).

    Args:
        target_dir: HF target folder.
        completions_path: JSONL from the completions stage (``id``, ``prompt_ids``, ``completion_ids``,
            ``stop_reason``, ``max_new_tokens``).
        out: cache path.
        layer_ids: 0-based decoder layers to store (order kept), HF ``hidden_states[i+1]``.
        batch_tokens: padded tokens per forward.
        device, dtype: see ``target.resolve_device`` / ``resolve_dtype`` (float32 on CPU by default).
        linear_attn_backend: kernel for hybrid targets' linear-attention layers ('auto'|'fla'|'torch').

    Raises:
        InputError: layer id out of range, empty or malformed completions file.
    """
    from . import hybrid
    from .target import resolve_device, resolve_dtype, target_info, weights_sha256

    completions_path = Path(completions_path)
    rows = read_completions(completions_path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    model, tok, kernel = hybrid.load_target_bound(target_dir, device=str(dev), dtype=str(dt).replace("torch.", ""),
                                                  backend=linear_attn_backend)
    info = target_info(model)
    n_layers = info["num_hidden_layers"]
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if bad:
        raise InputError(
            "config", "cache.target_layer_ids",
            f"layer ids {bad} out of range for a target with {n_layers} decoder layers ({target_dir})",
            f"use ids in 0..{n_layers - 1}",
        )
    if len(set(layer_ids)) != len(layer_ids):
        raise InputError("config", "cache.target_layer_ids", f"duplicate ids in {layer_ids}", "list each layer once")
    pad_id = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0

    seqs = [list(r["prompt_ids"]) + list(r["completion_ids"]) for r in rows]
    batches = length_batches([len(s) for s in seqs], batch_tokens)
    t0 = time.perf_counter()
    n_tok = 0

    def generate():
        nonlocal n_tok
        results: dict[int, tuple] = {}
        bar = Progress(sum(len(s) for s in seqs), "hidden states", logger=log)
        for b in batches:
            outs = run_target(model, [seqs[i] for i in b], layer_ids, dev, pad_id)
            for i, o in zip(b, outs):
                results[i] = o
            n_tok += sum(len(seqs[i]) for i in b)
            bar.update(sum(len(seqs[i]) for i in b))
            log.debug("extracted %d/%d samples, %d tokens", len(results), len(seqs), n_tok)
        bar.close()
        for i, r in enumerate(rows):  # write in completions order
            hidden, argmax = results.pop(i)
            P = len(r["prompt_ids"])
            comp = torch.tensor(seqs[i][P:])
            agree = float((argmax[P - 1 : len(seqs[i]) - 1] == comp).float().mean()) if len(comp) else 1.0
            yield {
                "sample_id": str(r["id"]),
                "input_ids": seqs[i],
                "prompt_len": P,
                "hidden": hidden.to(dt),
                "target_argmax": argmax.numpy(),
                "stop_reason": r.get("stop_reason", "unknown"),
                "max_new_tokens": int(r["max_new_tokens"]),
                "argmax_agreement": agree,
            }

    attrs = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "target_name": Path(target_dir).name,
        "target_sha256": weights_sha256(target_dir),
        "target_model_type": info.get("model_type", ""),
        "num_target_layers": n_layers,
        "hidden_size": info["hidden_size"],
        "vocab_size": info["vocab_size"],
        "target_layer_ids": list(layer_ids),
        "layer_convention": LAYER_CONVENTION,
        "last_layer_normed": (n_layers - 1) in layer_ids,
        "dtype": str(dt).replace("torch.", ""),
        "storage": "uint16 raw bfloat16 bits" if dt == torch.bfloat16 else "float32",
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine(),
        **_versions(),
        "linear_attn_kernel": kernel.describe(),
        "linear_attn_backend": kernel.backend,
        "layer_types": json.dumps(info.get("layer_types", [])),
        "image": os.environ.get("DFLASH_EVAL_IMAGE", ""),
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("FLA_", "TRITON_", "CUDA_VISIBLE", "USE_HUB_KERNELS", "DFLASH_EVAL_"))},
        "padding_side": "right",
        "batch_tokens": batch_tokens,
        "completions_sha256": file_sha256(completions_path),
        "prompt_set": completions_path.stem,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    n = write_cache(out, attrs, generate())
    dt_s = time.perf_counter() - t0
    log.info("wrote %s: %d samples, %d tokens in %.1f s (%.0f tok/s on %s, %s)", out, n, n_tok, dt_s,
             n_tok / max(dt_s, 1e-9), dev, attrs["dtype"])
    return Path(out)


def read_completions(path: Path) -> list[dict]:
    """Parse the completions JSONL (InputError with the line number on malformed lines)."""
    if not path.exists():
        raise InputError(path, None, "completions file not found", "run the completions rule first")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(path, f"line {n}", f"malformed JSON ({err.msg})", "regenerate the completions") from None
        for k in ("id", "prompt_ids", "completion_ids", "max_new_tokens"):
            if k not in r:
                raise InputError(path, f"line {n}: {k}", "missing", "regenerate the completions")
        if not r["prompt_ids"]:
            raise InputError(path, f"line {n}: prompt_ids", "empty prompt", "drop the sample")
        rows.append(r)
    if not rows:
        raise InputError(path, None, "no samples", "check the prompt set and completions stage")
    return rows
