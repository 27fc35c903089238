"""A target KV cache of a given context length and batch, built without a prefill over the context.

``target_costs`` times a decode step and verify forwards *after* ``context`` committed tokens, at
several contexts and batch sizes. Prefilling the target over every (context, batch) costs
O(context^2) attention and minutes on a CPU, and the timed forwards depend only on the cache's
shapes, not its values. :func:`random_cache` therefore prefills ``SEED_TOKENS`` random tokens at the
batch size (so transformers itself creates the cache object of that model with every layer kind:
attention key/value layers, the fixed-size conv and recurrent states of the Gated DeltaNet layers
of hybrid Qwen3.5 / Qwen3-Next targets) and then replaces each attention layer's keys and values
with random tensors of ``context`` positions (a sliding-window layer keeps its window and counts
``context`` seen tokens). The recurrent and conv states have no sequence axis, so the short prefill
already gives them their final shapes. tests/target/test_cost_cache.py checks, on the tiny llama and
tiny hybrid targets, that every layer's shapes and lengths equal a real prefill's, and that the
forward after it returns the same shapes; docs/measurements.md compares the two ways' timings.

:class:`CacheRestore` puts the cache back as built after a timed forward: transformers'
``DynamicLayer.update`` concatenates into new tensors (the built ones are only re-referenced), and
the linear-attention states, updated in place (``copy_``), are copied back from a snapshot
(transformers ``cache_utils.py``, ``DynamicLayer`` and ``LinearAttentionLayer``).
"""
from __future__ import annotations

import copy

import torch

#: tokens of the short prefill that creates the cache object (>= the GDN conv kernel of 4 in the Qwen3.5 / Qwen3-Next configs)
SEED_TOKENS = 4


def _kv_layers(cache):
    """The cache's layers that hold attention keys and values (4-D ``keys``: ``[batch, kv_heads, length, head_dim]``)."""
    return [layer for layer in cache.layers if isinstance(getattr(layer, "keys", None), torch.Tensor)
            and layer.keys.dim() == 4]


def random_cache(model, context: int, batch: int, vocab: int, dev, generator: torch.Generator | None = None):
    """The model's own cache object as after a prefill of ``batch`` rows of ``context`` tokens, with random keys/values.

    Args:
        model: a loaded HF causal LM (:func:`dflash_eval.target.model.load_target`).
        context: committed tokens (the attention layers' key/value length), >= 1.
        batch: rows.
        vocab: token ids of the seed prefill are drawn below it.
        dev: device of the input ids.
        generator: CPU generator of the seed ids (None: torch's global one).

    Returns:
        the cache (``transformers`` ``Cache``): every attention layer's keys/values ``[batch, kv_heads, context,
        head_dim]`` (a sliding-window layer: the last ``window - 1`` positions, ``cumulative_length`` = context) in
        the layer's dtype, standard-normal values; linear-attention layers' conv/recurrent states as the seed prefill left them.
    """
    seed = min(SEED_TOKENS, context)
    ids = torch.randint(0, vocab, (batch, seed), generator=generator).to(dev)
    with torch.inference_mode():
        cache = model(ids, use_cache=True, logits_to_keep=1).past_key_values
    if context == seed:
        return cache
    for layer in _kv_layers(cache):
        b, h, _, d = layer.keys.shape
        window = getattr(layer, "sliding_window", None)
        length = min(context, window - 1) if window and getattr(layer, "is_sliding", False) else context
        layer.keys = torch.randn(b, h, length, d, dtype=layer.keys.dtype, device=layer.keys.device)
        layer.values = torch.randn(b, h, length, layer.values.shape[-1], dtype=layer.values.dtype,
                                   device=layer.values.device)
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = context
    return cache


def cache_shapes(cache) -> list[dict]:
    """Per layer: its class name, ``keys``/``values`` shapes, ``cumulative_length``, conv and recurrent state shapes,
    ``has_previous_state`` (what a timed forward's work depends on; the test compares it with a real prefill's)."""
    out = []
    for layer in cache.layers:
        row = {"class": type(layer).__name__}
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            row[name] = tuple(t.shape) if isinstance(t, torch.Tensor) and t.numel() else None
        row["cumulative_length"] = getattr(layer, "cumulative_length", None)
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None) or {}
            row[name] = {i: tuple(t.shape) for i, t in states.items() if isinstance(t, torch.Tensor)}
        row["has_previous_state"] = dict(getattr(layer, "has_previous_state", {}) or {})
        out.append(row)
    return out


class CacheRestore:
    """Snapshot of a cache; :meth:`__call__` puts it back after a forward (cheap: no copy of the keys/values).

    Attribute references of every layer are kept (the key/value tensors a forward replaces by concatenation),
    and clones of the in-place-updated linear-attention conv/recurrent states (fixed size).
    """

    def __init__(self, cache):
        self.cache = cache
        self.attrs = [{k: copy.copy(v) if isinstance(v, dict) else v for k, v in vars(layer).items()}
                      for layer in cache.layers]
        self.states = [{name: {i: t.clone() for i, t in getattr(layer, name).items() if isinstance(t, torch.Tensor)}
                        for name in ("conv_states", "recurrent_states") if hasattr(layer, name)}
                       for layer in cache.layers]

    def __call__(self):
        """Restore and return the cache."""
        for layer, attrs, states in zip(self.cache.layers, self.attrs, self.states):
            vars(layer).update({k: copy.copy(v) if isinstance(v, dict) else v for k, v in attrs.items()})
            for name, saved in states.items():
                live = getattr(layer, name)
                for i, t in saved.items():
                    if live[i].shape == t.shape:
                        live[i].copy_(t)
                    else:  # a recording layer replaced the tensor: put a copy back
                        live[i] = t.clone()
        return self.cache
