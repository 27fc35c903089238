"""Drafters this project makes itself: demo checkpoints and the trainer's checkpoints share one writer.

Training checkpoints are written in the layout real trainers use and that
:mod:`dflash_eval.drafter.checkpoints` reads back (``torch-dict`` format)::

    {"step": int, "random_init": bool, "draft_config": {...drafter config.json...},
     "model": {drafter keys (bf16)..., "embed_tokens.weight", "lm_head.weight"},  # copies of the target's
     "optimizer": AdamW state dict (not in random-init demo checkpoints), "train_loss": float (trainer only)}

The target copies exercise the strip stage's shared-tensor comparison; the optimizer state
makes the files realistic in size and nesting.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflash_eval.core.errors import InputError, atomic_path
from dflash_eval.drafter.families import DFLASH, DFLASH2, family_of
from dflash_eval.drafter.families.dflash2 import DEMO_FIELDS
from dflash_eval.drafter.model import DFlashDrafter
from dflash_eval.target.spec import TargetSpec, as_spec

log = logging.getLogger(__name__)


def pick_mask_token(tokenizer, data: list[list[int]] = ()) -> int:
    """An existing special token that never occurs in ``data`` (the target has no spare embedding row).

    Preference: the highest-id special or added-special token that is not bos/eos/pad/unk and does not
    occur in any sequence of ``data`` (the mask token must never be a real context token; as the
    reference trainers do, DFlash reuses an existing embedding row rather than growing the vocabulary).

    Raises:
        InputError: no special token qualifies.
    """
    seen = set()
    for seq in data:
        seen.update(seq)
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    special = {int(i) for i in tokenizer.all_special_ids}
    special |= {int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    cands = sorted(special - reserved - seen, reverse=True)
    if not cands:
        raise InputError(None, "mask_token_id", "no unused special token in the tokenizer",
                         "pass --mask-token-id explicitly (a row of the target embedding never seen in data)")
    return cands[0]


#: DFlash 2 fields of a random-init demo drafter (:data:`dflash_eval.drafter.families.dflash2.DEMO_FIELDS`)
DFLASH2_DEMO_FIELDS = DEMO_FIELDS
#: the families the demo trainer and the random-init demo checkpoint build (``--variant`` choices)
DEMO_FAMILIES = (DFLASH.name, DFLASH2.name)


def drafter_config_for_target(target: "TargetSpec | str | Path", layer_ids, block_size: int, num_layers: int,
                              mask_token_id: int, variant: str = "dflash") -> dict:
    """A drafter ``config.json`` dict for ``target`` (hidden size and head layout copied from it).

    ``layer_ids`` None = five layers spread over the target (``round(1 + i * (N - 4) / 4)``).
    ``variant``: one of :data:`DEMO_FAMILIES`; the family's fields (``demo_fields``: DFlash 2's
    :data:`DFLASH2_DEMO_FIELDS`, group size 1 when 16 does not divide the hidden size; rank at most the hidden
    size, top-K at most the vocabulary) go to ``dflash_config`` and its architecture to ``architectures``.

    Raises:
        ValueError: an unknown ``variant``.
    """
    if variant not in DEMO_FAMILIES:
        raise ValueError(f"variant {variant!r} not in {DEMO_FAMILIES}")
    family = family_of(variant)
    spec = as_spec(target)
    t = spec.config.get("text_config") or spec.config
    if layer_ids is None:
        layer_ids = [round(1 + i * (spec.num_layers - 4) / 4) for i in range(5)]
    heads = int(t["num_attention_heads"])
    cfg = {
        "architectures": [family.architecture],
        "model_type": "qwen3",
        "hidden_size": spec.hidden_size,
        "intermediate_size": int(t["intermediate_size"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(t.get("num_key_value_heads", heads)),
        "head_dim": int(t.get("head_dim") or spec.hidden_size // heads),
        "num_hidden_layers": num_layers,
        "num_target_layers": spec.num_layers,
        "rms_norm_eps": float(t.get("rms_norm_eps", 1e-5)),
        "rope_theta": float(t.get("rope_theta", (t.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        "max_position_embeddings": int(t.get("max_position_embeddings", 8192)),
        "vocab_size": spec.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": block_size,
        "dflash_config": {"target_layer_ids": list(layer_ids), "mask_token_id": int(mask_token_id), "block_size": block_size},
    }
    cfg["dflash_config"].update(family.demo_fields(spec.hidden_size, spec.vocab_size))
    return cfg


def random_init_(model: DFlashDrafter) -> DFlashDrafter:
    """Normal(0, 0.02) init of every matrix in place (norms stay at 1), from torch's global RNG."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                torch.nn.init.normal_(p, std=0.02)
    return model


def identity_convs_(model: DFlashDrafter) -> DFlashDrafter:
    """Set every DFlash 2 conv to the identity in place (no-op for DFlash 1): ``base_kernel[:, 0] = 1``, the
    other taps and ``kernel_projection`` zero, so a fresh DFlash 2 drafter starts as its DFlash 1 backbone
    (speculators PR #1006, ``src/speculators/models/dflash2/model_definitions.py``
    ``GroupedDynamicCausalConv.reset_parameters``)."""
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                if conv is not None:
                    conv.base_kernel.zero_()
                    conv.base_kernel[:, 0] = 1.0
                    conv.kernel_projection.weight.zero_()
    return model


def save_training_checkpoint(path, model: DFlashDrafter, draft_config: dict, optimizer_state: dict, embed: torch.Tensor,
                             head: torch.Tensor, step: int, random_init: bool = False, **extra) -> Path:
    """Write a training checkpoint (layout: module docstring) atomically; weights as bf16 on CPU.

    Args:
        model: the drafter; ``draft_config``: its config dict; ``optimizer_state``: ``optimizer.state_dict()``
            (``None``: no ``optimizer`` key).
        embed, head: the target's ``[V, H]`` embedding and LM head (stored as copies).
        step: training step; ``random_init``: True for untrained demo drafters; ``extra``: more top-level keys.
    """
    state = {k: v.detach().to(torch.bfloat16).cpu() for k, v in model.state_dict().items()}
    state["embed_tokens.weight"] = embed.detach().cpu().clone()
    state["lm_head.weight"] = head.detach().cpu().clone()
    ckpt = {"step": int(step), "random_init": bool(random_init), "draft_config": draft_config, "model": state,
            **({"optimizer": optimizer_state} if optimizer_state is not None else {}), **extra}
    with atomic_path(path) as tmp:
        torch.save(ckpt, tmp)
    return Path(path)
