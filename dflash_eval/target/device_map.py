"""Placing a target over several GPUs: which GPU runs which layer (config ``target.devices`` / ``target.max_memory``).

A target larger than one GPU (a 27B target is ~54 GB in bfloat16) is split by layers: the
embedding, the first decoder layers, ... on GPU 0, the next layers on GPU 1, and so on, with the
final norm and LM head after the last layer (pipeline placement as Hugging Face Accelerate's
"big model inference" does it; transformers' ``from_pretrained(device_map=...)`` then loads each
weight on its GPU and moves the activations from one GPU to the next). The layers run one after
the other, so a split target is as fast as the slowest of its GPUs, not faster; it exists so a
target that fits no single GPU can run on GPUs, with its GPU kernels (fla for hybrid targets),
instead of on the CPU.

The plan (:func:`plan_device_map`) uses Accelerate's own planner, ``infer_auto_device_map`` on a
meta-device copy of the target (no weight read; module sizes from the config's shapes in the load
dtype), with a budget per GPU:

- ``target.max_memory`` (``{"0": "40GiB", "1": 42000000000}``: GPU index -> bytes or a size string)
  caps the bytes of weights a GPU may take; GPUs it does not name get the auto budget,
  :data:`AUTO_FRACTION` of their free memory (the rest is left for activations, the cache
  buffers and the logits chunk of the stage).
- ``target.devices``: 0 (``auto``) = the fewest visible GPUs that hold the target, filled in order
  (GPU 0 alone when it fits: no split, exactly the one-GPU path); N = the first N visible GPUs,
  the layers balanced over them (``get_balanced_memory``), for more activation headroom per GPU.

A target that fits nowhere is an :class:`~dflash_eval.core.errors.InputError` naming its size, each
GPU's free memory and budget, and the options; nothing is ever placed on the CPU or disk behind
the user's back (Accelerate's offloading would run a layer-by-layer copy at a fraction of the
speed).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch

from dflash_eval.core.errors import InputError
from dflash_eval.target.spec import TargetSpec

log = logging.getLogger(__name__)

#: share of a GPU's free memory its weights may take when ``target.max_memory`` does not name it
AUTO_FRACTION = 0.85

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: "int | str", field: str = "target.max_memory") -> int:
    """Bytes from an integer or a size string (``"40GiB"``, ``"48GB"``, ``"512 MiB"``; units of 1000 or 1024).

    Raises:
        InputError: a negative number or a string that is not ``<number><unit>``.
    """
    if isinstance(value, bool):
        raise InputError("config", field, f"{value!r} is not a size", 'give bytes or a string such as "40GiB"')
    if isinstance(value, int):
        if value < 0:
            raise InputError("config", field, f"negative size {value}", "give a size >= 0")
        return value
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise InputError("config", field, f"{value!r} is not a size",
                         'give bytes or a number with a unit: "40GiB", "48GB", "512MiB"')
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def gib(n: int) -> str:
    """``n`` bytes as ``"12.3 GiB"`` (``"0.75 MiB"`` below 1 GiB)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


@dataclass(frozen=True)
class DevicePlan:
    """Where a target's modules go.

    ``device_map`` is what ``from_pretrained(device_map=...)`` takes: module name (``model.embed_tokens``,
    ``model.layers.0``, ..., ``model.norm``, ``lm_head``) -> GPU index. ``gpus``: the GPUs used, in
    the order the layers run through them (the first holds the embedding: inputs go there).
    """

    device_map: dict
    gpus: tuple[int, ...]
    target_bytes: int  #: weights in the load dtype
    budgets: dict  #: GPU index -> bytes of weights it was allowed
    free: dict  #: GPU index -> free bytes when planned

    @property
    def split(self) -> bool:
        """True when more than one GPU is used (transformers then moves activations between them)."""
        return len(self.gpus) > 1

    def describe(self) -> str:
        """One line per GPU: which layers and modules it holds."""
        parts = []
        for g in self.gpus:
            names = [k for k, v in self.device_map.items() if v == g]
            layers = sorted(int(m.group(1)) for k in names if (m := re.search(r"layers\.(\d+)$", k)))
            other = [k.rsplit(".", 1)[-1] for k in names if not re.search(r"layers\.\d+$", k)]
            span = f"layers {layers[0]}-{layers[-1]}" if layers else "no layers"
            parts.append(f"cuda:{g}: {span}{' + ' + ', '.join(other) if other else ''}")
        return "; ".join(parts)


def meta_model(spec: TargetSpec, dtype):
    """The target's module tree on the meta device (shapes only, nothing allocated or read), in ``dtype``."""
    from accelerate import init_empty_weights  # deferred: accelerate costs 0.13 s after torch, at every stage's start; only a split target needs it
    from transformers import AutoConfig, AutoModelForCausalLM  # deferred: --help stays transformers-free (tests/core/test_startup.py)

    try:
        cfg = AutoConfig.from_pretrained(str(spec.path))
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    except (OSError, ValueError, KeyError) as err:
        raise InputError(spec.path, "config.json", f"transformers cannot build this config as a causal LM: {err}",
                         "point target.path at an HF causal-LM folder") from err
    model.tie_weights()
    return model


def plan_device_map(spec: TargetSpec, dtype, free: "dict[int, int] | None" = None, devices: int = 0,
                    max_memory: "dict | None" = None, model=None) -> DevicePlan:
    """Place the target's layers over the visible GPUs (see the module docstring).

    Args:
        spec: the target.
        dtype: torch dtype the weights are loaded in (sizes are computed in it).
        free: GPU index -> free bytes; default: ``torch.cuda.mem_get_info`` of every visible GPU
            (tests inject fake GPUs here).
        devices: config ``target.devices``: 0 = the fewest GPUs that hold the target (in order);
            N >= 1 = the first N GPUs, layers balanced over them.
        max_memory: config ``target.max_memory``: GPU index (int or its string) -> bytes or size string.
        model: a meta-device model of the target (default: :func:`meta_model`).

    Returns:
        a :class:`DevicePlan` (``gpus == (0,)``-like single entry when one GPU holds it).

    Raises:
        InputError: no GPU visible, ``devices`` above the visible count, ``max_memory`` naming a GPU
            that is not visible or giving no size, or the target does not fit the budgets.
    """
    from accelerate.utils import compute_module_sizes, get_balanced_memory, infer_auto_device_map  # deferred: accelerate costs 0.13 s after torch, at every stage's start; only a split target needs it

    if free is None:
        free = {i: int(torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count())}
    if not free:
        raise InputError("config", "target.devices", "no GPU visible", "run on a GPU host, or set the device to cpu")
    order = sorted(free)
    if devices > len(order):
        raise InputError("config", "target.devices", f"{devices} GPUs asked, {len(order)} visible "
                         f"({', '.join(f'cuda:{g}' for g in order)})",
                         f"set target.devices to at most {len(order)} (0 = auto), or make more GPUs visible")
    caps = {}
    for key, value in (max_memory or {}).items():
        try:
            g = int(key)
        except (TypeError, ValueError):
            raise InputError("config", "target.max_memory", f"key {key!r} is not a GPU index",
                             'use GPU indices as keys: {"0": "40GiB", "1": "40GiB"}') from None
        if g not in free:
            raise InputError("config", "target.max_memory", f"GPU {g} is not visible (visible: {order})",
                             "name only visible GPUs (indices after CUDA_VISIBLE_DEVICES)")
        caps[g] = parse_size(value, f"target.max_memory.{key}")
    used_gpus = order[:devices] if devices else order
    budgets = {g: caps.get(g, int(free[g] * AUTO_FRACTION)) for g in used_gpus}
    model = model if model is not None else meta_model(spec, dtype)
    total = int(compute_module_sizes(model, dtype=dtype)[""])
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    mem = dict(budgets)
    if devices and devices > 1:
        mem = get_balanced_memory(model, max_memory=mem, no_split_module_classes=no_split, dtype=dtype)
        mem = {g: min(int(v), budgets[g]) for g, v in mem.items() if g in budgets}
    if not devices and len(order) == 1 and budgets[order[0]] < total <= free[order[0]] and not caps:
        # one GPU, weights above the auto budget but within its free memory: loaded there as before the
        # planner existed (activations may still run out of memory; the planner does not refuse it)
        log.warning("target %s: %s of weights on cuda:%d with %s free leaves little room for activations",
                    spec.path.name, gib(total), order[0], gib(free[order[0]]))
        return DevicePlan(device_map={"": order[0]}, gpus=(order[0],), target_bytes=total, budgets=budgets,
                          free=dict(free))
    dmap = infer_auto_device_map(model, max_memory=mem, no_split_module_classes=no_split, dtype=dtype)
    placed = {v for v in dmap.values()}
    if not placed or any(not isinstance(v, int) for v in placed):
        detail = ", ".join(f"cuda:{g} {gib(free[g])} free, {gib(budgets.get(g, 0))} for weights" for g in order)
        raise InputError(
            spec.path, "target.devices",
            f"the target's weights need {gib(total)} in {str(dtype).removeprefix('torch.')}, more than the GPUs "
            f"allowed hold ({detail}; target.devices: {devices or 'auto'})",
            "use more or larger GPUs (target.devices: 0 = every visible GPU; make them visible with "
            "CUDA_VISIBLE_DEVICES), raise target.max_memory (GPU index -> size, default "
            f"{int(AUTO_FRACTION * 100)} % of free memory), or free the GPUs of other processes")
    gpus = tuple(g for g in used_gpus if g in placed)
    plan = DevicePlan(device_map=dict(dmap), gpus=gpus, target_bytes=total, budgets=budgets, free=dict(free))
    log.info("target %s (%s of weights): %s", spec.path.name, gib(total), plan.describe())
    return plan
