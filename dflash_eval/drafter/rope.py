"""The drafter's rotary position embedding, without importing transformers' Qwen3 modeling module.

Importing ``transformers.models.qwen3.modeling_qwen3`` for ``Qwen3RotaryEmbedding`` alone cost
every drafter stage several seconds of start-up (``bench/startup.py``). :class:`RotaryEmbedding`
performs the same operations in the same dtypes as transformers' ``Qwen3RotaryEmbedding.forward``;
:func:`rotary_embedding` builds it from the drafter config (``tests/replay/test_replay.py`` compares the
cos/sin with transformers' module bit for bit, for default, linear, yarn and dynamic RoPE).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_eval.core.errors import InputError
from dflash_eval.drafter.config import ROPE_DICTS, DrafterConfig


class RotaryEmbedding(nn.Module):
    """Qwen3's rotary embedding (transformers ``Qwen3RotaryEmbedding.forward``, same operations and dtypes)
    for a fixed ``inv_freq`` ``[head_dim/2]`` float32 and ``attention_scaling``.

    Built by :func:`rotary_embedding` without importing transformers' Qwen3 modeling module (several
    seconds of every stage's start-up): default RoPE from ``rope_theta`` here, other RoPE types from
    ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` on :meth:`DrafterConfig.rotary_config`.
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
        self.attention_scaling = attention_scaling

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[N, L, head_dim]`` in ``x.dtype`` for int64 ``position_ids`` ``[N, L]`` (computed in float32)."""
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        pos = position_ids[:, None, :].float()
        with torch.autocast(device_type=x.device.type if x.device.type != "mps" else "cpu", enabled=False):
            freqs = (inv.float() @ pos.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos() * self.attention_scaling
            sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotary_embedding(cfg: DrafterConfig) -> nn.Module:
    """The drafter's RoPE module: :class:`RotaryEmbedding`, or transformers' ``Qwen3RotaryEmbedding`` for
    RoPE types that change ``inv_freq`` with the sequence length (``dynamic``, ``longrope``).

    The default RoPE of an explicit ``rope_theta`` (top level or in the RoPE dict) needs no transformers
    import: ``inv_freq = 1 / theta ** (arange(0, head_dim, 2) / head_dim)``, scaling 1 (transformers
    ``Qwen3RotaryEmbedding.compute_default_rope_parameters``); ``tests/replay/test_replay.py`` checks the
    cos/sin against transformers' module bit for bit. ``inv_freq`` is computed on the CPU even under a
    ``torch.device("meta")`` context (strip-drafter's key check): a meta ``arange`` imports ``torch._dynamo``
    (3 s), and the buffer is not part of the state dict.
    """
    raw = cfg.raw
    rope = next((raw[k] for k in ROPE_DICTS if isinstance(raw.get(k), dict)), None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", raw.get("rope_theta"))
    partial = "partial_rotary_factor" in raw or "partial_rotary_factor" in rope
    if kind == "default" and theta is not None and not partial and not isinstance(theta, bool):
        dim = cfg.head_dim
        return RotaryEmbedding(1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)), 1.0)
    conf = cfg.rotary_config()
    kind = conf.rope_parameters["rope_type"]
    if kind in ("dynamic", "longrope") or partial:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding  # deferred: 3 s, for these RoPE kinds only (tests/core/test_startup.py)

        return Qwen3RotaryEmbedding(conf)
    if kind == "default":
        base, dim = conf.rope_parameters["rope_theta"], conf.head_dim
        return RotaryEmbedding(1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)), 1.0)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # deferred: scaled RoPE only; the default builds transformers-free

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](conf, None)
    return RotaryEmbedding(inv_freq, scaling)


#: RoPE types whose frequencies change with the longest position of each call (transformers
#: ``modeling_rope_utils.dynamic_rope_update``): ``dynamic`` grows them once a call reaches past
#: ``max_position_embeddings`` (and keeps them, module state, for later calls), ``longrope`` switches to
#: ``long_factor`` past ``original_max_position_embeddings``
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rope_fixed_length(cfg: DrafterConfig) -> int | None:
    """The longest sequence (tokens) over which the drafter's RoPE frequencies stay fixed; None when they always do.

    ``dynamic``: ``max_position_embeddings``; ``longrope``: ``original_max_position_embeddings`` of the RoPE dict
    (transformers ``dynamic_rope_update``). Beyond it the reference online loop (``dflash==0.1.0``
    ``dflash_generate``) rotates each step's new keys with the frequencies of that step's longest position and
    keeps the older keys as they were rotated, and the module keeps the grown frequencies for the next sample;
    an offline replay computes every key at once and cannot reproduce that history
    (``tests/replay/test_window_parity.py`` shows the difference).
    """
    rope = next((cfg.raw[k] for k in ROPE_DICTS if isinstance(cfg.raw.get(k), dict)), None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in LENGTH_DEPENDENT_ROPE:
        return None
    conf = cfg.rotary_config()
    if conf.rope_parameters["rope_type"] == "longrope":
        return int(conf.rope_parameters.get("original_max_position_embeddings") or conf.max_position_embeddings)
    return int(conf.max_position_embeddings)


def check_rope_length(cfg: DrafterConfig, longest: int, source) -> None:
    """Refuse replaying positions past :func:`rope_fixed_length` (the replay would not be the reference's).

    Args:
        cfg: the drafter's config.
        longest: the longest sequence the replay feeds the RoPE: the longest sample's tokens ``T`` plus ``B - 2``
            (the last anchor ``T - 2`` and its block's ``B - 1`` positions after it), tokens.
        source: the drafter's ``config.json`` (for the error).

    Raises:
        InputError: a ``dynamic`` / ``longrope`` drafter and ``longest`` past its fixed length, naming the RoPE
            dict's ``rope_type``.
    """
    fixed = rope_fixed_length(cfg)
    if fixed is not None and longest > fixed:
        key = next(k for k in ROPE_DICTS if isinstance(cfg.raw.get(k), dict))
        raise InputError(
            source, f"{key}.rope_type",
            f"'{cfg.rotary_config().rope_parameters['rope_type']}' RoPE changes its frequencies past {fixed} tokens "
            f"and the replay needs {longest} (longest sample + block - 2): the reference online loop then rotates "
            "each step's keys with that step's frequencies and keeps older keys as they were, a history an offline "
            "replay does not reproduce (transformers dynamic_rope_update)",
            f"evaluate samples whose prompt + generation.max_new_tokens + block - 2 stays within {fixed} tokens "
            "(shorter prompts or a smaller max_new_tokens)")
