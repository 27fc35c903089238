"""The vLLM speculators checkpoint layout (DFlash and DFlash 2) read as the z-lab layout.

speculators (``vllm-project/speculators``; DFlash 2 from its PR #1006) saves an HF folder
(``config.json`` + ``model.safetensors``) whose tensors follow the z-lab names (``fc``,
``hidden_norm``, ``norm``, ``layers.*``, DFlash 2's ``layers.*.{attention,mlp}_conv.*`` and
``candidate_selector.*`` with the codebooks saved without ``.weight``; its
``models/dflash2/model_definitions.py``), but whose ``config.json`` is flat
(``models/dflash/config.py`` ``DFlashSpeculatorConfig``, ``models/dflash2/config.py``):

=================================  ===============================================================
speculators field                  z-lab ``config.json`` (what the reference and vLLM read)
=================================  ===============================================================
``transformer_layer_config``       the top-level Qwen3 fields (saved with ``to_diff_dict``: fields
                                   equal to the ``Qwen3Config`` defaults are absent and are filled
                                   from transformers' ``Qwen3Config``, the class speculators
                                   builds the drafter from)
``aux_hidden_state_layer_ids``     ``dflash_config.target_layer_ids`` = each id - 1 (speculators
                                   ids index HF ``hidden_states``; z-lab reads
                                   ``hidden_states[id + 1]``: speculators
                                   ``convert/dflash/converter.py``)
``mask_token_id``, ``block_size``  ``dflash_config.mask_token_id`` / ``block_size``
``conv_kernel_size``,              ``dflash_config.<same name>`` (DFlash 2, ``speculators_model_type``
``conv_group_size``,               ``dflash2``)
``selector_rank``,
``selector_top_k``
``sliding_window_non_causal``      ``is_causal: false`` when true and a layer is ``sliding_attention``
                                   (DFlash 2's default); omitted otherwise (the reference's sliding
                                   layers are then causal)
=================================  ===============================================================

Refused, because the maths differs from what the replay models: ``projector_type`` other than
``dflash`` (Domino), ``shift_label: true``, ``sample_from_anchor: true`` (slot 0 drafted), a
reduced draft vocabulary (``draft_vocab_size`` != ``vocab_size``, or non-identity ``t2d`` /
``d2t`` tensors), ``target_hidden_size`` != ``hidden_size``. Dropped with a note: identity
``t2d`` / ``d2t`` and ``verifier_norm.weight`` (the target's final norm, frozen in training).
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_eval.core.errors import InputError
from dflash_eval.drafter.config import qwen3_config
from dflash_eval.drafter.families import FAMILIES, family_of_speculators

#: speculators model types read here and the z-lab architecture each becomes (each family's
#: ``speculators_model_type`` and ``architecture``)
MODEL_TYPES = {f.speculators_model_type: f.architecture for f in FAMILIES.values() if f.speculators_model_type}
#: Qwen3 fields the drafter reads; filled from ``Qwen3Config`` when ``to_diff_dict`` left them out
FILLED_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "num_hidden_layers", "vocab_size", "rms_norm_eps", "attention_bias", "hidden_act",
                 "max_position_embeddings", "layer_types", "use_sliding_window", "sliding_window",
                 "max_window_layers")
#: speculators-only tensors that are not part of the drafter
VERIFIER_KEYS = ("verifier_norm.weight",)
VOCAB_MAPS = ("t2d", "d2t")


def is_speculators_config(cfg: Any) -> bool:
    """True for a speculators ``config.json`` (it names ``speculators_model_type``)."""
    return isinstance(cfg, dict) and "speculators_model_type" in cfg


def to_zlab_config(cfg: dict, source) -> tuple[dict, list[str]]:
    """A speculators DFlash / DFlash 2 ``config.json`` dict -> ``(z-lab config dict, notes)`` (module table).

    Raises:
        InputError: an unknown ``speculators_model_type``, a missing ``transformer_layer_config``, an
            ``aux_hidden_state_layer_ids`` entry < 1 (the embedding output, no target layer), or a
            refused variant (module docstring), naming ``source`` and the field.
    """
    kind = cfg.get("speculators_model_type")
    family = family_of_speculators(kind)
    if family is None:
        raise InputError(source, "speculators_model_type", f"{kind!r} is not a DFlash speculator "
                         f"(read: {sorted(MODEL_TYPES)})", "evaluate a speculators dflash or dflash2 checkpoint")
    tl = cfg.get("transformer_layer_config")
    if not isinstance(tl, dict):
        raise InputError(source, "transformer_layer_config", "missing or not an object",
                         "re-save the checkpoint with speculators (save_pretrained)")
    refused = [("projector_type", cfg.get("projector_type", "dflash") != "dflash", "the Domino projector"),
               ("shift_label", bool(cfg.get("shift_label")), "shifted labels (Domino)"),
               ("sample_from_anchor", bool(cfg.get("sample_from_anchor")), "a drafted slot 0"),
               ("draft_vocab_size", cfg.get("draft_vocab_size") not in (None, tl.get("vocab_size")),
                "a reduced draft vocabulary"),
               ("target_hidden_size", cfg.get("target_hidden_size") not in (None, tl.get("hidden_size")),
                "a target hidden size other than the drafter's")]
    for key, bad, what in refused:
        if bad:
            raise InputError(source, key, f"{cfg.get(key)!r}: {what}, which dflash-eval does not model",
                             "evaluate it with speculators / vLLM, or file an issue with the checkpoint layout")
    notes: list[str] = []
    out = _filled_transformer_fields(tl, notes)
    aux = cfg.get("aux_hidden_state_layer_ids")
    dcfg: dict = {}
    if aux is not None:
        if not isinstance(aux, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux) \
                or min(aux, default=1) < 1:
            raise InputError(source, "aux_hidden_state_layer_ids", f"{aux!r}: expected hidden-state indices >= 1",
                             "fix the list (speculators ids: HF hidden_states indices, the z-lab id + 1)")
        dcfg["target_layer_ids"] = [i - 1 for i in aux]
        notes.append(f"speculators aux_hidden_state_layer_ids {aux} read as dflash_config.target_layer_ids "
                     f"{dcfg['target_layer_ids']} (id - 1)")
    for key in ("mask_token_id", "block_size"):
        if cfg.get(key) is not None:
            dcfg[key] = cfg[key]
    dcfg.update(family.speculators_fields(cfg))  # DFlash 2: its four fields, flat in speculators
    layer_types = out.get("layer_types") or []
    if cfg.get("sliding_window_non_causal") and "sliding_attention" in layer_types:
        out["is_causal"] = False
        notes.append("speculators sliding_window_non_causal: true read as is_causal: false")
    out.update(architectures=[family.architecture], model_type=tl.get("model_type", "qwen3"), dflash_config=dcfg)
    return out, notes


def _filled_transformer_fields(tl: dict, notes: list[str]) -> dict:
    """``transformer_layer_config`` with the :data:`FILLED_FIELDS` (and RoPE) it omits taken from ``Qwen3Config``."""
    out = {k: v for k, v in tl.items() if k not in ("architectures", "auto_map")}
    ref = qwen3_config(**{k: v for k, v in tl.items() if k not in ("model_type", "architectures", "auto_map")})
    filled = []
    for key in FILLED_FIELDS:
        if key not in out and getattr(ref, key, None) is not None:
            value = getattr(ref, key)
            out[key] = list(value) if isinstance(value, (list, tuple)) else value
            filled.append(key)
    if not any(k in out for k in ("rope_theta", "rope_parameters", "rope_scaling")):
        out["rope_parameters"] = dict(ref.rope_parameters)
        filled.append("rope_parameters")
    if filled:
        notes.append(f"speculators transformer_layer_config omits {filled} (equal to the Qwen3Config defaults); "
                     "filled from transformers' Qwen3Config")
    return out


def drop_extra_tensors(state: dict[str, torch.Tensor], source) -> list[str]:
    """Remove speculators-only tensors from ``state`` (in place); returns notes.

    Raises:
        InputError: a ``t2d`` / ``d2t`` vocabulary map that is not the identity (a reduced vocabulary).
    """
    notes = []
    for key in VOCAB_MAPS:
        if key not in state:
            continue
        v = state.pop(key)
        identity = bool((v == 0).all()) if key == "d2t" else bool(v.bool().all())
        if not identity:
            raise InputError(source, key, "a reduced draft vocabulary mapping, which dflash-eval does not model",
                             "evaluate a full-vocabulary drafter (DFlash 2 requires one)")
        notes.append(f"dropped the identity vocabulary map {key}")
    for key in VERIFIER_KEYS:
        if key in state:
            state.pop(key)
            notes.append(f"dropped {key} (the target's final norm, not a drafter tensor)")
    return notes
