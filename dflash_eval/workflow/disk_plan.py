"""The disk the run's hidden-state caches need, said before the run (torch-free: parse time and ``-n``).

``rules/common.smk`` prints :func:`disk_lines` of :func:`planned_caches` in the main Snakemake process (a
dry run included) and, with ``cache.disk_check: refuse`` (the default), stops a real run whose caches cannot
fit in the free space of the results folder before any job starts (:func:`disk_problem`); the
``hidden_states`` job checks its own cache again before it loads the target
(:func:`dflash_eval.cache.disk_room.check_free_space`), when the token counts are exact.

Each prompt set's size is ``tokens x`` :func:`~dflash_eval.cache.disk_room.bytes_per_token` (stored layers ``K``,
the target's ``hidden_size`` ``H``, the storage), with ``tokens`` taken from the best of:

* ``exact``: the completions file exists (prompt + completion tokens of every row);
* ``estimate``: the prompts file exists (each prompt's tokens + the set's ``max_new_tokens``: an upper
  bound, as completions that stop early are shorter);
* ``bound``: nothing yet (``prompt_set.n x (max_prompt_tokens + max_new_tokens)``, the limits the prompts
  stage keeps; unknown with ``n: 0`` or ``max_prompt_tokens: 0``; for a set with ``context_bins``,
  ``per_bin x`` the sum over the bins of (the bin's upper end + ``max_new_tokens``), the last bin ending at
  ``max_prompt_tokens`` or, for 0, the target's ``max_position_embeddings - max_new_tokens``: :func:`binned_bound`).
  A bound is printed but never refused.

A finished cache needs nothing more; a partial sidecar (``<cache>.partial``) is counted as already written.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import h5py

from dflash_eval.cache.disk_room import HEADROOM, bytes_per_token
from dflash_eval.core.errors import InputError
from dflash_eval.workflow.gguf_header import gguf_file, gguf_shape
from dflash_eval.workflow.plan import max_new_tokens
from dflash_eval.workflow.sampling import needs_final_hidden


@dataclass
class CacheSize:
    """The planned cache of one prompt set."""

    prompt_set: str
    path: str  #: ``results/<run>/cache/<set>.h5``
    tokens: int | None  #: prompt + completion tokens (None: unknown yet)
    bytes: int | None  #: as stored (None: unknown)
    basis: str  #: ``done``, ``exact``, ``estimate``, ``bound``, ``bins`` or ``unknown`` (module docstring)
    written: int = 0  #: bytes a partial sidecar already holds
    final_hidden: bool = False  #: the target's final normed state is stored too (a set evaluated at T > 0)


def storage_name(cache_cfg: dict) -> tuple[str, str]:
    """``(storage, why)``: ``"fp8"``, ``"bfloat16"`` or ``"float32"`` for config section ``cache``.

    ``cache.dtype: auto`` is bfloat16 on CUDA and float32 on CPU (the stage's rule); at parse time the jobs'
    device is not known, so ``auto`` is taken as bfloat16 when ``cache.device`` names CUDA or this host has an
    NVIDIA GPU (``/proc/driver/nvidia/gpus``), else float32; ``why`` says so.
    """
    if cache_cfg.get("storage") == "fp8":
        return "fp8", "cache.storage: fp8"
    dtype = cache_cfg.get("dtype", "auto")
    if dtype != "auto":
        return dtype, f"cache.dtype: {dtype}"
    device = str(cache_cfg.get("device", "auto"))
    gpus = Path("/proc/driver/nvidia/gpus")
    cuda = device.startswith("cuda") or (device == "auto" and gpus.is_dir() and any(gpus.iterdir()))
    return ("bfloat16", "cache.dtype auto, a CUDA device") if cuda else ("float32", "cache.dtype auto, no CUDA device here")


def target_shape(plan) -> tuple[int | None, int | None]:
    """``(hidden_size, num_layers)`` of the plan's target: its config.json (an HF folder, or a GGUF already
    converted), else the GGUF's header, else ``(None, None)``."""
    cfg = Path(plan.target.dir, "config.json")
    if cfg.is_file():
        text = json.loads(cfg.read_text())
        text = text.get("text_config", text)
        return text.get("hidden_size"), text.get("num_hidden_layers")
    path = gguf_file(plan.target.gguf)
    return gguf_shape(path) if path else (None, None)


def _jsonl_lengths(path: Path, keys: tuple[str, ...]) -> list[int]:
    """Per row, the summed lengths of the lists ``keys`` of a JSONL file."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                out.append(sum(len(row.get(k) or []) for k in keys))
    return out


def binned_bound(opts: dict, max_new: int, max_positions: int | None) -> int | None:
    """Upper bound on the prompt + completion tokens of a prompt set with ``context_bins`` (``opts``: its merged
    options): ``per_bin x sum_k (upper_k + max_new)``, ``upper_k = edge_k+1 - 1`` and the last ``max_prompt_tokens``
    (0: ``max_positions - max_new``); None when that is unknown. E.g. bins [2048, 4096], per_bin 2,
    max_prompt_tokens 8192, max_new 256: 2 x ((4095 + 256) + (8192 + 256)) = 25,598."""
    bins = list(opts["context_bins"])
    last = int(opts.get("max_prompt_tokens") or 0) or (max_positions - max_new if max_positions else 0)
    if not last:
        return None
    uppers = [b - 1 for b in bins[1:]] + [last]
    return int(opts.get("per_bin") or 0) * sum(u + max_new for u in uppers)


def _max_positions(plan) -> int | None:
    cfg = Path(plan.target.dir, "config.json")
    if not cfg.is_file():
        return None
    text = json.loads(cfg.read_text())
    return text.get("max_position_embeddings") or (text.get("text_config") or {}).get("max_position_embeddings")


def planned_caches(plan) -> list[CacheSize]:
    """The size of each prompt set's cache (:class:`CacheSize`, module docstring), in ``plan.prompt_sets`` order."""
    cfg = plan.config
    storage, _ = storage_name(cfg["cache"])
    H, n_layers = target_shape(plan)
    out = []
    for ps in plan.prompt_sets:
        max_new = max_new_tokens(cfg, ps)
        cache = Path(plan.cache_path(ps))
        K = len(plan.cache_layer_ids)
        if needs_final_hidden(cfg, ps) and (n_layers is None or n_layers - 1 not in plan.cache_layer_ids):
            K += 1  # the final normed hidden state (the last layer) is added
        if cache.is_file() and _stored_fp8(cache) in (None, storage == "fp8"):
            out.append(CacheSize(ps, str(cache), None, 0, "done"))
            continue
        completions = Path(plan.run_path("completions", f"{ps}.jsonl"))
        prompts = Path(plan.run_path("prompts", f"{ps}.jsonl"))
        opts = plan.prompt_set_options(ps)
        if completions.is_file():
            tokens, basis = sum(_jsonl_lengths(completions, ("prompt_ids", "completion_ids"))), "exact"
        elif prompts.is_file():
            tokens, basis = sum(n + max_new for n in _jsonl_lengths(prompts, ("prompt_ids",))), "estimate"
        elif opts.get("context_bins"):
            tokens = binned_bound(opts, max_new, _max_positions(plan))
            basis = "bins" if tokens is not None else "unknown"
        elif int(opts.get("n") or 0) > 0 and int(opts.get("max_prompt_tokens") or 0) > 0:
            tokens, basis = int(opts["n"]) * (int(opts["max_prompt_tokens"]) + max_new), "bound"
        else:
            tokens, basis = None, "unknown"
        size = None if tokens is None or not H else tokens * bytes_per_token(storage, K, int(H))
        partial = cache.with_name(cache.name + ".partial")
        written = partial.stat().st_size if partial.is_file() else 0
        out.append(CacheSize(ps, str(cache), tokens, size, basis if size is not None else "unknown", written,
                             K > len(plan.cache_layer_ids)))
    return out


def _stored_fp8(cache: Path) -> bool | None:
    """Whether an existing cache stores FP8 (its ``storage`` attribute, ``dflash_eval.cache.format``), None when
    its header cannot be read. A cache whose storage is not the planned one is extracted again (its rule's
    ``--storage`` flag changed), so it counts as to write."""
    try:
        with h5py.File(cache, "r") as f:
            value = f.attrs.get("storage")
    except OSError:
        return None
    if value is None:
        return None
    return "float8" in (value.decode() if isinstance(value, bytes) else str(value))


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes of the file system holding ``path`` (its nearest existing ancestor: ``results/`` may not exist yet)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def _size(b: int | None) -> str:
    if b is None:
        return "unknown"
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"


WHY = {"done": "cache exists", "exact": "from the completions", "estimate": "prompts + max_new_tokens, at most",
       "bound": "prompt_set.n x (max_prompt_tokens + max_new_tokens), at most",
       "bins": "per_bin x the context bins' upper ends + max_new_tokens, at most", "unknown": "unknown yet"}


def disk_lines(plan, sizes: list[CacheSize], free: int) -> list[str]:
    """What the run's caches need beside the free space, one line per prompt set and a total (printed at parse time)."""
    storage, why = storage_name(plan.config["cache"])
    H, _ = target_shape(plan)
    head = (f"hidden-state caches ({storage}: {why}; {len(plan.cache_layer_ids)} stored layers of hidden size "
            f"{H or 'unknown'}), free in {plan.run_path()}: {_size(free)}")
    lines = [head]
    for s in sizes:
        need = None if s.bytes is None else max(0, s.bytes - s.written)
        tok = "" if s.tokens is None else f", {s.tokens} tokens"
        part = f", {_size(s.written)} already in its .partial" if s.written else ""
        final = ", and the final normed state (evaluated at T > 0)" if s.final_hidden else ""
        lines.append(f"  {s.prompt_set}: {_size(need)} to write ({WHY[s.basis]}{tok}{final}{part})")
    total = sum(max(0, s.bytes - s.written) for s in sizes if s.bytes is not None)
    lines.append(f"  total: {_size(total)} to write, {_size(free)} free")
    return lines


def disk_problem(plan, sizes: list[CacheSize], free: int) -> InputError | None:
    """The error of a run whose caches cannot fit, else None.

    Counted: the caches whose size is ``exact`` or an ``estimate`` (a ``bound`` is too loose to stop a run), less
    what their partial sidecars hold, plus the writer's headroom (64 MiB,
    :data:`~dflash_eval.cache.disk_room.HEADROOM`), against ``free``.

    Returns:
        ``InputError("config", "cache", ...)`` naming each set's size, the free space, and the options that
        shrink a cache (``cache.storage: fp8``, fewer layers, ``prompt_set.n``), or None.
    """
    counted = [s for s in sizes if s.basis in ("exact", "estimate") and s.bytes is not None]
    need = sum(max(0, s.bytes - s.written) for s in counted)
    if not counted or need + HEADROOM <= free:
        return None
    storage, why = storage_name(plan.config["cache"])
    each = ", ".join(f"{s.prompt_set} {_size(max(0, s.bytes - s.written))} ({s.basis})" for s in counted)
    shrink = ("cache.storage: fp8 (about half of bf16, a quarter of float32: docs/cache-format.md)"
              if storage != "fp8" else "")
    guessed = ("set cache.dtype: bfloat16 if the jobs run on GPUs (this host has none, so float32 was assumed)"
               if why.endswith("no CUDA device here") else "")
    fixes = [f for f in (guessed, shrink, f"fewer stored layers (cache.target_layer_ids: {len(plan.cache_layer_ids)} now)",
                         "fewer prompts (prompt_set.n) or generation.max_new_tokens",
                         f"free {_size(need + HEADROOM - free)} in {plan.run_path()}",
                         "or cache.disk_check: warn (the hidden_states job still checks its own cache)") if f]
    return InputError("config", "cache", f"the hidden-state caches need {_size(need)} ({each}) + "
                      f"{_size(HEADROOM)} of headroom, and {_size(free)} are free in {plan.run_path()}",
                      "; ".join(fixes))
