"""Drafter configuration: parse and validate a DFlash drafter ``config.json`` (HF Qwen3 layout + ``dflash_config``).

Kept apart from :mod:`dflash_eval.drafter` so that the model file reads top to bottom
against the paper. The fields and where they are read from follow the reference
``z-lab/dflash`` (``dflash/model.py``, ``_draft_value``): ``block_size``,
``mask_token_id`` and ``target_layer_ids`` come from ``dflash_config`` first, then
from the top level (older checkpoints), and are never guessed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from .errors import InputError

# Config keys of DFlash variants this implementation does not model. A checkpoint
# carrying them would load "successfully" with the wrong maths, so refuse it.
UNSUPPORTED_DFLASH_KEYS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "attention_sink_bias",
)
# Variant switches (sglang / MiMo-style drafts) that change the maths only when set to a true value.
UNSUPPORTED_DFLASH_SWITCHES = ("use_swa", "causal")
# Target-only fields that must not leak into the drafter (speculators #613/#738).
IGNORED_TARGET_FIELDS = ("partial_rotary_factor",)


@dataclass
class DrafterConfig:
    """Drafter hyper-parameters, read from an HF ``config.json`` (Qwen3 layout + ``dflash_config``).

    ``block_size``, ``mask_token_id`` and ``target_layer_ids`` are read from
    ``dflash_config`` first, then from the top level (older checkpoints), as
    ``dflash==0.1.0`` ``_draft_value`` does. They are never recomputed.
    ``sliding_window`` is set only for configs with ``sliding_attention`` layers
    (which require ``use_sliding_window: true``); ``is_causal`` is the optional
    top-level override of every layer's causality (reference semantics).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    hidden_act: str = "silu"
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    is_causal: bool | None = None
    raw: dict = field(default_factory=dict, repr=False)
    notes: list[str] = field(default_factory=list, repr=False)

    @classmethod
    def from_dict(
        cls,
        cfg: dict,
        source: str = "config.json",
        overrides: dict | None = None,
    ) -> "DrafterConfig":
        """Parse and validate a drafter ``config.json`` dict.

        Args:
            cfg: the JSON object (HF Qwen3 config with ``dflash_config``).
            source: file name used in error messages.
            overrides: user-supplied values for ``target_layer_ids``,
                ``mask_token_id`` or ``block_size`` (used only where the file
                lacks them, or where the user forces them).

        Raises:
            InputError: a required field is missing or malformed, or the
                config names a DFlash variant this project does not implement.
        """
        cfg = copy.deepcopy(cfg)
        overrides = dict(overrides or {})
        dcfg = cfg.get("dflash_config") or {}
        notes: list[str] = []

        unsupported = [k for k in UNSUPPORTED_DFLASH_KEYS if k in dcfg or k in cfg]
        unsupported += [k for k in UNSUPPORTED_DFLASH_SWITCHES if dcfg.get(k) or cfg.get(k)]
        for key in unsupported:
            raise InputError(
                source, f"dflash_config.{key}",
                "this is a DFlash-2 / attention-sink / SWA-variant drafter, which dflash-eval does not implement",
                "evaluate it with the reference dflash package, or file an issue with the checkpoint layout",
            )
        for key in IGNORED_TARGET_FIELDS:
            rp = cfg.get("rope_parameters") or {}
            if key in cfg or (isinstance(rp, dict) and key in rp):
                cfg.pop(key, None)
                if isinstance(rp, dict):
                    rp.pop(key, None)
                notes.append(
                    f"ignored target-only field '{key}' (the drafter uses full RoPE; speculators #613/#738)"
                )

        def pick(name: str, required: bool = True, default: Any = None):
            if name in overrides and overrides[name] is not None:
                stored = dcfg.get(name, cfg.get(name))
                if stored is not None and stored != overrides[name]:
                    notes.append(f"override {name}={overrides[name]!r} replaces the checkpoint's {stored!r}")
                return overrides[name]
            if name in dcfg:
                return dcfg[name]
            if name in cfg:
                return cfg[name]
            if required:
                raise InputError(
                    source, f"dflash_config.{name}",
                    "missing (dflash-eval never guesses it: the build_target_layer_ids fallback "
                    "loads wrong layers silently, z-lab/dflash #156)",
                    f"add dflash_config.{name} to the checkpoint config, or set it in the checkpoint "
                    f"entry of the workflow config (overrides: {{{name}: ...}}; CLI: strip --override {name}=...)",
                )
            return default

        def need(name: str, default: Any = None) -> int:
            value = cfg.get(name)
            value = default if value is None else value
            if value is None:
                raise InputError(source, name, "missing", f"add '{name}' to the drafter config.json")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InputError(source, name, f"must be a positive integer, got {value!r}", f"fix '{name}'")
            return value

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        n_layers = need("num_hidden_layers")
        layer_types = list(cfg.get("layer_types") or ["full_attention"] * n_layers)
        if len(layer_types) != n_layers or any(t not in ("full_attention", "sliding_attention") for t in layer_types):
            raise InputError(
                source, "layer_types",
                f"expected {n_layers} entries of 'full_attention'/'sliding_attention', got {layer_types}",
                "fix layer_types or num_hidden_layers",
            )
        sliding = None
        if "sliding_attention" in layer_types:
            # transformers' Qwen3Config drops sliding_window unless use_sliding_window is true (so the
            # reference then applies no window), while SpecForge refuses such a config: ambiguous, refuse.
            if cfg.get("use_sliding_window") is not True:
                raise InputError(
                    source, "use_sliding_window",
                    f"layer_types has sliding_attention but use_sliding_window is {cfg.get('use_sliding_window')!r} "
                    "(the reference then applies no window; SpecForge refuses to train such a config)",
                    "set use_sliding_window: true and sliding_window to the trained window, or make every "
                    "layer full_attention (pass the corrected config with --drafter-config)",
                )
            sliding = need("sliding_window")
        is_causal = cfg.get("is_causal")
        if is_causal is not None and not isinstance(is_causal, bool):
            raise InputError(source, "is_causal", f"must be true/false, got {is_causal!r}", "fix is_causal")
        if is_causal is not None:
            notes.append(f"is_causal={is_causal} applies to every layer (reference Qwen3DFlashAttention)")
        tli = pick("target_layer_ids")
        if not isinstance(tli, (list, tuple)) or not tli or not all(isinstance(i, int) and i >= 0 for i in tli):
            raise InputError(source, "dflash_config.target_layer_ids", f"must be a non-empty list of layer indices, got {tli!r}", "fix the list")
        block_size, mask_token_id = pick("block_size"), pick("mask_token_id")
        for name, value, low in (("block_size", block_size, 2), ("mask_token_id", mask_token_id, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InputError(source, f"dflash_config.{name}", f"must be an integer >= {low}, got {value!r}", f"fix {name}")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise InputError(source, "hidden_act", f"'{act}' not supported (DFlash drafters use silu)", "use silu")
        softcap = pick("final_logit_softcapping", required=False)
        return cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=need("num_key_value_heads", heads),
            head_dim=need("head_dim", hidden // heads),
            intermediate_size=need("intermediate_size"),
            vocab_size=need("vocab_size"),
            target_layer_ids=[int(i) for i in tli],
            block_size=block_size,
            mask_token_id=mask_token_id,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            hidden_act=act,
            layer_types=layer_types,
            sliding_window=sliding,
            input_embedding_scale=float(pick("input_embedding_scale", required=False, default=1.0)),
            output_multiplier=float(pick("output_multiplier", required=False, default=1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
            is_causal=is_causal,
            raw=cfg,
            notes=notes,
        )

    def rotary_config(self):
        """A ``transformers.Qwen3Config`` carrying only what RoPE needs (theta, scaling, head_dim)."""
        from transformers import Qwen3Config

        keys = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")
        kw = {k: self.raw[k] for k in keys if k in self.raw and self.raw[k] is not None}
        return Qwen3Config(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            **kw,
        )
