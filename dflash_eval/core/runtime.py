"""Where and how computations run: device and dtype options, and length batching.

``auto`` device = CUDA when available, else CPU; ``auto`` dtype = bfloat16 on CUDA,
float32 elsewhere (bf16 matmuls are very slow on CPUs without AMX/AVX512-BF16, so CPU
runs compute in float32 and every output records the dtype it used).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch

from dflash_eval.core.errors import InputError

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
           "float": torch.float32, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Turn a device option into a :class:`torch.device`.

    ``'auto'`` = ``cuda`` when available, else ``cpu``; anything else is passed
    to ``torch.device`` (``'cpu'``, ``'cuda'``, ``'cuda:1'``).

    Raises:
        InputError: an unparseable device, or a CUDA device on a machine without (that) GPU.
    """
    if isinstance(device, torch.device):
        dev = device
    elif device in (None, "", "auto"):
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(str(device))
        except (RuntimeError, ValueError):
            raise InputError(None, "device", f"unknown torch device {device!r}", "use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(None, "device", f"{device!r} requested but CUDA is not available", "use 'auto' or 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(None, "device", f"{device!r}: only {torch.cuda.device_count()} GPU(s) visible",
                             "pick an existing GPU index")
    return dev


def resolve_dtype(dtype: str | torch.dtype = "auto", device: str | torch.device = "auto") -> torch.dtype:
    """Turn a dtype option into a :class:`torch.dtype`.

    ``'auto'`` = ``bfloat16`` on CUDA, ``float32`` elsewhere. Also accepts ``'bfloat16'``,
    ``'float32'``, ``'float16'`` (with or without a ``torch.`` prefix) and :class:`torch.dtype` values.

    Raises:
        InputError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype or "auto").removeprefix("torch.")
    if name == "auto":
        return torch.bfloat16 if resolve_device(device).type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise InputError(None, "dtype", f"unknown dtype {dtype!r}", "use 'auto', 'bfloat16' or 'float32'")
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling every output records)."""
    return str(dtype).removeprefix("torch.")


def length_batches(lengths: Sequence[int], max_tokens: int | None = None, max_items: int | None = None,
                   packed: bool = False) -> list[list[int]]:
    """Group indices into batches of similar length, longest first.

    Indices are sorted by length (descending, stable) and cut into consecutive batches so that
    ``len(batch) * longest <= max_tokens`` (padded tokens; with ``packed``: ``sum of lengths <=
    max_tokens``, the batch is one concatenated sequence) and ``len(batch) <= max_items``; a
    single item longer than ``max_tokens`` gets a batch of its own. Longest first makes the
    first batch the most memory-hungry, so an out-of-memory error shows at once. The result
    depends only on the arguments (a resumed run gets the same batches).

    Args:
        lengths: per-item lengths (tokens).
        max_tokens: token budget per batch (None = no limit).
        max_items: items per batch (None = no limit).
        packed: count real tokens instead of padded ones.

    Returns:
        lists of indices into ``lengths``.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i in order:
        cost = used + lengths[i] if packed else (len(cur) + 1) * (lengths[cur[0]] if cur else lengths[i])
        full = cur and ((max_items is not None and len(cur) >= max_items)
                        or (max_tokens is not None and cost > max_tokens))
        if full:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += lengths[i]
    if cur:
        batches.append(cur)
    return batches


MEMORY_FRACTION = {"cuda": 0.6, "cpu": 0.25}  # share of free memory the replay plans its temporaries for


def free_memory_bytes(device: str | torch.device) -> int:
    """Memory the replay may plan its temporaries for on ``device``, in bytes.

    CUDA: ``MEMORY_FRACTION['cuda']`` of the free device memory (``torch.cuda.mem_get_info``)
    plus what torch's caching allocator holds unused. CPU (and other devices):
    ``MEMORY_FRACTION['cpu']`` of ``MemAvailable`` from ``/proc/meminfo`` (Linux), else of
    the free physical pages (``os.sysconf``), else 2 GiB.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        cached = torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        return int(MEMORY_FRACTION["cuda"] * (free + cached))
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 8 << 30
    return int(MEMORY_FRACTION["cpu"] * avail)
