"""Linear-attention (Gated DeltaNet, GDN) kernel binding for hybrid targets (Qwen3.5/3.6, Qwen3-Next).

fla and transformers' pure-torch GDN give states ~1-3 % apart (rel-L2 per layer), so the cache must
say which kernel produced it: :func:`bind_linear_attention` resolves the backend (``auto`` = fla on
CUDA when importable, else torch) before the target loads; :func:`check_bound_kernel` forces it on
every modeling module (transformers ``models/qwen3_5/modeling_qwen3_5.py`` dispatchers), refuses a
mismatch and returns the cache attribute ``linear_attn_kernel``. Batches are right-padded, never packed.

Dispatch details, batching and measured batch invariance: docs/targets.md, "How transformers binds the GDN kernels".
"""
from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_eval.core.errors import InputError
from dflash_eval.target.spec import TargetSpec, as_spec

log = logging.getLogger(__name__)

BACKENDS = ("auto", "fla", "torch")

#: key in the binding description -> module-level dispatcher name in transformers' modeling module
GDN_FUNCTIONS = {
    "chunk_rule": "torch_chunk_gated_delta_rule",
    "recurrent_rule": "torch_recurrent_gated_delta_rule",
    "conv_fn": "causal_conv1d_fn",
    "conv_update": "causal_conv1d_update",
}
#: distributions whose versions are recorded (import name, distribution names to try)
KERNEL_PACKAGES = {
    "torch": ("torch",), "transformers": ("transformers",), "triton": ("triton",),
    "fla": ("fla-core", "flash-linear-attention"), "flash_linear_attention": ("flash-linear-attention",),
    "causal_conv1d": ("causal-conv1d",), "flash_qla": ("flash-qla", "flash_qla", "FlashQLA"),
    "tilelang": ("tilelang",), "kernels": ("kernels",),
}
#: environment variables recorded with the binding (prefixes)
ENV_PREFIXES = ("FLA_", "TRITON_", "USE_HUB_KERNELS", "DFLASH_EVAL_")
#: ... except where caches live: they change no kernel choice, and the workflow sets TRITON_CACHE_DIR per run
#: (rules/common.smk), a machine path
ENV_NOT_RECORDED = ("TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DUMP_DIR", "TRITON_OVERRIDE_DIR")

# modeling-module name -> {key: transformers' original dispatcher}, captured before the first rebinding
_ORIGINAL: dict[str, dict[str, object]] = {}


@dataclass
class KernelBinding:
    """Which linear-attention kernel a target forward uses.

    ``backend``: ``"none"`` (no linear-attention layers), ``"fla"`` or ``"torch"``.
    ``detail``: requested backend, bound functions (``module.qualname``), gated-norm class,
    versions and ``FLA_*`` environment (filled by :func:`check_bound_kernel`).
    """

    backend: str
    detail: dict = field(default_factory=dict)

    def describe(self) -> str:
        """JSON stored in the cache attribute ``linear_attn_kernel`` (``evaluate`` reads ``backend``)."""
        return json.dumps({"backend": self.backend, **self.detail}, sort_keys=True)


# --------------------------------------------------------------------------- facts about the environment
@functools.lru_cache(maxsize=1)
def _packages_distributions() -> dict:
    return importlib.metadata.packages_distributions()  # scans every installed distribution: once


def _dist_version(import_name: str) -> str:
    for dist in KERNEL_PACKAGES.get(import_name, (import_name,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    for dist in _packages_distributions().get(import_name, []):
        return importlib.metadata.version(dist)
    return "present (no distribution metadata)" if importlib.util.find_spec(import_name) else "absent"


def kernel_versions() -> dict[str, str]:
    """Versions of the packages that decide GDN numerics (``"absent"`` when not installed), plus the image.

    ``image`` is env ``DFLASH_EVAL_IMAGE`` (set by containers/cuda/Dockerfile), ``""`` outside it.
    """
    out = {name: _dist_version(name) for name in KERNEL_PACKAGES}
    out["image"] = os.environ.get("DFLASH_EVAL_IMAGE", "")
    return out


def kernel_env() -> dict[str, str]:
    """Environment variables that change kernel choice (``FLA_FLASH_QLA``, ``FLA_DISABLE_BACKEND_DISPATCH`` ...)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES) and k not in ENV_NOT_RECORDED}


def fla_status() -> tuple[bool, str]:
    """``(True, version)`` if ``fla.ops.gated_delta_rule`` imports, else ``(False, reason)``."""
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except Exception as err:  # noqa: BLE001 - any import failure means "not usable"
        return False, f"{type(err).__name__}: {err}"
    return True, _dist_version("fla")


def causal_conv1d_status() -> str:
    """Whether the causal-conv1d kernels can be used, for the cache attribute ``causal_conv1d_kernel``.

    ``"imported <version>"`` when ``causal_conv1d`` and its compiled extension
    ``causal_conv1d_cuda`` import; ``"absent"`` when the package is not installed (transformers
    then runs the GDN short convolution with its torch ``F.conv1d`` fallback); otherwise
    ``"import failed: <error>"`` (installed but unusable, e.g. built for another torch or CUDA;
    the fallback runs too). A version alone cannot tell these apart. transformers also binds
    the package only with a CUDA torch (reference: transformers ``is_causal_conv1d_available``).
    """
    if importlib.util.find_spec("causal_conv1d") is None:
        return "absent"
    try:
        importlib.import_module("causal_conv1d")
        importlib.import_module("causal_conv1d_cuda")
    except Exception as err:  # noqa: BLE001 - any import failure means "not usable"
        return f"import failed: {type(err).__name__}: {err}"
    return f"imported {_dist_version('causal_conv1d')}"


def target_has_linear_attention(target) -> bool:
    """True if the target (folder or :class:`~dflash_eval.target.spec.TargetSpec`) has ``linear_attention`` layers."""
    if not isinstance(target, TargetSpec) and not (Path(target) / "config.json").exists():
        return False
    return as_spec(target).has_linear_attention


# --------------------------------------------------------------------------- reading and setting the binding
def bound_implementation(fn):
    """The callable a modeling-module dispatcher forwards to (its closure variable ``implementation``), else ``fn``."""
    try:
        impl = inspect.getclosurevars(fn).nonlocals.get("implementation")
    except TypeError:  # builtins, functools.partial ...
        impl = None
    return impl if impl is not None else fn


def _qualname(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def classify(path: str, modeling_module: str) -> str:
    """Backend of one bound function from its ``module.qualname``: fla, torch, causal_conv1d, flash_qla or other."""
    if path.startswith("fla."):
        return "fla"
    if path.startswith(modeling_module + "."):
        return "torch"
    return path.split(".", 1)[0] if path.startswith(("causal_conv1d.", "flash_qla.")) else "other"


def modeling_modules(model) -> list:
    """transformers modeling modules of ``model``'s submodules that define the GDN dispatchers (sorted by name)."""
    names = {type(m).__module__ for m in model.modules()}
    mods = [sys.modules[n] for n in sorted(names) if n in sys.modules]
    return [m for m in mods if hasattr(m, GDN_FUNCTIONS["chunk_rule"])]


def describe_module(module) -> dict[str, str]:
    """``{chunk_rule, recurrent_rule, conv_fn, conv_update}`` -> ``module.qualname`` of what is bound now."""
    return {key: _qualname(bound_implementation(getattr(module, name)))
            for key, name in GDN_FUNCTIONS.items() if hasattr(module, name)}


def _torch_guarded(torch_fn):
    """The torch GDN body behind a guard: it ignores ``cu_seqlens``, so packed input must fail loudly."""

    implementation = torch_fn  # same closure name as transformers' dispatcher, so bound_implementation reads it

    @functools.wraps(torch_fn)
    def guarded(*args, cu_seqlens=None, **kwargs):
        if cu_seqlens is not None:
            raise ValueError("torch gated-delta-rule path cannot keep packed sequences apart (cu_seqlens given); "
                             "pad per batch instead, or use the fla backend")
        return implementation(*args, **kwargs)

    return guarded


def force_backend(module, backend: str) -> None:
    """Rebind ``module``'s GDN dispatchers to ``backend`` (process-wide, affects every model of that module).

    ``"torch"``: the ``__wrapped__`` torch bodies (rule functions behind :func:`_torch_guarded`) for
    all four functions. ``"fla"``: transformers' original import-time dispatchers (fla rules, conv as
    bound at import: causal_conv1d when installed, else torch).
    """
    orig = _ORIGINAL.setdefault(module.__name__, {k: getattr(module, n) for k, n in GDN_FUNCTIONS.items()
                                                  if hasattr(module, n)})
    for key, fn in orig.items():
        if backend == "torch":
            fn = getattr(fn, "__wrapped__", fn)
            fn = _torch_guarded(fn) if key in ("chunk_rule", "recurrent_rule") else fn
        setattr(module, GDN_FUNCTIONS[key], fn)


# --------------------------------------------------------------------------- the two calls target.load_target makes
def bind_linear_attention(backend: str, device, target) -> KernelBinding:
    """Resolve the configured backend before the target is loaded; refuse impossible requests.

    Args:
        backend: ``"auto"`` (fla on CUDA when ``fla.ops.gated_delta_rule`` imports, else torch),
            ``"fla"`` or ``"torch"`` (config ``target.linear_attn_backend``).
        device: torch device (or string) the target will run on.
        target: HF target folder or :class:`~dflash_eval.target.spec.TargetSpec` (only ``config.json`` is read).

    Returns:
        ``KernelBinding("none")`` for targets without linear-attention layers, else the resolved
        backend with ``detail["requested"]``; :func:`check_bound_kernel` applies and verifies it.

    Raises:
        InputError: unknown backend; ``fla`` requested on a non-CUDA device (fla has Triton GPU
            kernels only); ``fla`` requested but not importable.
    """
    if backend not in BACKENDS:
        raise InputError("config", "target.linear_attn_backend", f"unknown backend {backend!r}", f"use one of {BACKENDS}")
    if not target_has_linear_attention(target):
        return KernelBinding("none", {"note": "target has no linear-attention layers"})
    dev = torch.device(device)
    ok, why = fla_status()
    if backend == "fla":
        if dev.type != "cuda":
            raise InputError("config", "target.linear_attn_backend",
                             f"'fla' requested but the target runs on {dev} (fla has GPU Triton kernels only; "
                             "transformers binds it anyway and the CPU forward crashes)",
                             "run the hidden_states rule on a CUDA GPU, or set linear_attn_backend: torch "
                             "(states then differ from fla-trained drafters by ~1-3 % per layer)")
        if not ok:
            raise InputError("config", "target.linear_attn_backend",
                             f"'fla' requested but fla is not importable ({why})",
                             "install fla-core==0.6.0 (containers/cuda/Dockerfile pins it), or set linear_attn_backend: torch")
    resolved = backend if backend != "auto" else ("fla" if dev.type == "cuda" and ok else "torch")
    if backend == "auto" and resolved == "torch":
        log.warning("linear_attn_backend auto -> torch (%s); drafters trained on fla states will see ~1-3 %% "
                    "per-layer differences", "CPU" if dev.type != "cuda" else f"fla unavailable: {why}")
    return KernelBinding(resolved, {"requested": backend})


def check_bound_kernel(model, binding: KernelBinding) -> KernelBinding:
    """Apply ``binding`` to the loaded model's modeling modules, read back what is bound, refuse a mismatch.

    Call after loading and before the first forward (the rebinding is process-wide, see
    :func:`force_backend`).

    Returns:
        the binding with ``detail`` = requested backend, ``functions`` (per modeling module: key ->
        ``module.qualname``, e.g. ``fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule``),
        ``gated_norm`` (class of the GDN output norm), ``versions`` (:func:`kernel_versions`),
        ``env`` (:func:`kernel_env`) and ``flash_qla`` (whether fla may route the chunk rule to FlashQLA).

    Raises:
        InputError: the target has linear-attention layers but no modeling module with the GDN
            dispatchers (unsupported transformers version), or the rule functions bound after
            forcing are not the requested backend.
    """
    if binding.backend == "none":
        return binding
    mods = modeling_modules(model)
    if not mods:
        raise InputError(None, "target", f"{type(model).__name__} has linear-attention layers but its modeling code "
                         f"has no module-level {GDN_FUNCTIONS['chunk_rule']} (transformers {_dist_version('transformers')})",
                         "use transformers 5.17 (pinned in envs/requirements.txt and the container)")
    functions = {}
    for m in mods:
        force_backend(m, binding.backend)
        functions[m.__name__] = desc = describe_module(m)
        got = {k: classify(desc[k], m.__name__) for k in ("chunk_rule", "recurrent_rule") if k in desc}
        wrong = {k: desc[k] for k, b in got.items() if b != binding.backend}
        if wrong:
            raise InputError(None, "target.linear_attn_backend",
                             f"requested '{binding.backend}' but {m.__name__} is bound to {wrong}",
                             "check that fla imported before transformers loaded the model (fla-core 0.6.0), "
                             "or set linear_attn_backend: torch")
    norms = sorted({_qualname(type(mod.norm)) for mod in model.modules()
                    if type(mod).__name__.endswith("GatedDeltaNet") and hasattr(mod, "norm")})
    versions = kernel_versions()
    env = kernel_env()
    qla = "absent"
    if versions["flash_qla"] != "absent" and binding.backend == "fla":
        off = env.get("FLA_FLASH_QLA") == "0" or env.get("FLA_DISABLE_BACKEND_DISPATCH") == "1"
        qla = "disabled by env" if off else "possible (SM90+, bf16, K=V=128): set FLA_FLASH_QLA=0 unless training used it"
    detail = {**binding.detail, "functions": functions, "gated_norm": norms, "versions": versions, "env": env,
              "flash_qla": qla}
    log.info("linear-attention kernel: %s; %s", binding.backend, json.dumps(functions))
    return KernelBinding(binding.backend, detail)
