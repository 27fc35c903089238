"""Running the target: the one loader (:func:`load_target`), its attention helpers and shape facts.

The target's config, fingerprint and shared embed/head are read without torch by
:mod:`dflash_eval.target.spec`; this module loads the model itself (HF ``from_pretrained`` with
the linear-attention kernel of hybrid targets bound and verified, :mod:`dflash_eval.target.hybrid`),
and holds the attention fast paths the completions stage uses (:func:`gqa_sdpa`,
:func:`prefill_unpadded`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dflash_eval.core.errors import InputError
from dflash_eval.core.runtime import MEMORY_FRACTION, dtype_name, resolve_device, resolve_dtype
from dflash_eval.target.device_map import plan_device_map
from dflash_eval.target.hybrid import bind_linear_attention, check_bound_kernel
from dflash_eval.target.spec import NOT_A_TARGET_FIX, TargetSpec, as_spec

log = logging.getLogger(__name__)


def load_target(target: "str | Path | TargetSpec", device="auto", dtype="auto", backend: str = "auto",
                devices: int = 0, max_memory: "dict | None" = None, device_map: "dict | None" = None):
    """Load the target causal LM and its tokenizer for inference, with its linear-attention kernel bound.

    ``AutoModelForCausalLM.from_pretrained(folder, dtype=..., attn_implementation="sdpa")`` on
    ``device`` in eval mode, plus ``AutoTokenizer.from_pretrained(folder)``. For hybrid targets the
    Gated-DeltaNet kernel is chosen before loading and applied + verified after
    (:func:`dflash_eval.target.hybrid.bind_linear_attention` / :func:`~dflash_eval.target.hybrid.check_bound_kernel`),
    so no stage hits fla's CPU crash or silently uses another kernel. This is the one loader every
    stage that runs the target uses.

    Args:
        target: HF folder or :class:`TargetSpec`.
        device: see :func:`dflash_eval.core.runtime.resolve_device`.
        dtype: see :func:`dflash_eval.core.runtime.resolve_dtype` (``'auto'``: bf16 on CUDA, float32 on CPU).
        backend: linear-attention kernel, ``'auto'`` | ``'fla'`` | ``'torch'`` (config ``target.linear_attn_backend``).
        devices, max_memory: config ``target.devices`` / ``target.max_memory``: with ``device`` ``'auto'`` or
            ``'cuda'`` (no index), several visible GPUs (or ``devices`` > 1, or ``max_memory`` set) the
            target's layers are placed over them by :func:`dflash_eval.target.device_map.plan_device_map` when one
            GPU does not hold it (or when ``devices`` > 1); inputs then go to ``device`` (GPU 0, which holds
            the embedding) and transformers moves the activations between GPUs. A CPU, a ``cuda:N`` device,
            ``devices: 1`` or one visible GPU with no option set is one device, loaded as before.
        device_map: an explicit ``from_pretrained`` device map (module name -> device), bypassing the planner.

    Returns:
        ``(model, tokenizer, KernelBinding)``.

    Raises:
        InputError: missing folder / config / weights, transformers cannot load it, or an impossible kernel request.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer  # deferred: --help stays transformers-free (tests/core/test_startup.py)

    spec = as_spec(target)
    if not list(spec.path.glob("*.safetensors")) and not list(spec.path.glob("*.bin")):
        raise InputError(spec.path, "model.safetensors", "no weight files in the target folder", NOT_A_TARGET_FIX)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    binding = bind_linear_attention(backend, dev, spec)
    if device_map is None and dev.type == "cuda" and dev.index is None and devices != 1 and (
            devices > 1 or max_memory or _cuda_count() > 1):  # one visible GPU, auto: loaded as it always was
        plan = plan_device_map(spec, dt, devices=devices, max_memory=max_memory)
        device_map = plan.device_map if plan.split else None
    placed = {"device_map": device_map} if device_map else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(spec.path), dtype=dt, attn_implementation="sdpa", **placed)
        tok = AutoTokenizer.from_pretrained(str(spec.path))
    except (OSError, ValueError, KeyError) as err:
        raise InputError(spec.path, "config.json", f"transformers cannot load this folder as a causal LM: {err}",
                         NOT_A_TARGET_FIX) from err
    if not device_map:
        model.to(dev)
    model.eval()
    log.info("loaded target %s (%s) on %s in %s", spec.path, model.config.model_type,
             dev if not device_map else "devices " + ", ".join(sorted({str(v) for v in device_map.values()})),
             dtype_name(dt))
    return model, tok, check_bound_kernel(model, binding)


def _cuda_count() -> int:
    return torch.cuda.device_count()


#: attention implementation of :func:`gqa_sdpa` (registered with transformers on first use)
GQA_SDPA = "dflash_eval_sdpa_gqa"


def sdpa_gqa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       is_causal=None, **kwargs):
    """transformers' SDPA attention with grouped KV heads broadcast by SDPA instead of copied.

    With an attention mask (left-padded batched generation), transformers' ``sdpa`` path copies the
    whole KV cache ``num_key_value_groups`` times per layer and step (``repeat_kv``; its
    ``use_gqa_in_sdpa`` passes ``enable_gqa`` only without a mask): on CPU that copy was half of a
    decode step of SmolLM2 (9 query / 3 KV heads) at batch 16. ``scaled_dot_product_attention(...,
    enable_gqa=True)`` reads the shared heads in place and gives bit-identical outputs (checked in
    ``tests/data/test_completions.py``). Shapes as in transformers: ``query [b, Hq, q, D]``, ``key/value
    [b, Hkv, k, D]`` -> ``([b, q, Hq, D], None)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # deferred: --help stays transformers-free (tests/core/test_startup.py)

    if getattr(module, "num_key_value_groups", 1) == 1 or attention_mask is None or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=False, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def register_attention(name: str, fn) -> None:
    """Register ``fn`` as the transformers attention implementation ``name`` (a model's ``config._attn_implementation``)."""
    from transformers import AttentionInterface  # deferred: --help stays transformers-free (tests/core/test_startup.py)

    AttentionInterface.register(name, fn)


#: device types on which :func:`gqa_sdpa` swaps the attention in (``bench/completions_gpu.py`` prints the stage
#: with and without it: one H100, warm, batch 32, 128 new tokens: 1.30x on an 8B llama, 1.00x on an 8B hybrid;
#: 3x less CPU time on the CPU)
GQA_SDPA_DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def gqa_sdpa(model):
    """Run ``model`` with :func:`sdpa_gqa_attention` (masks built as for ``sdpa``) inside the block.

    Only for models whose attention is ``sdpa`` and whose parameters sit on a device type in
    :data:`GQA_SDPA_DEVICES`; others are left as they are.
    """
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface  # deferred: --help stays transformers-free (tests/core/test_startup.py)

    cfg = model.config
    old = cfg._attn_implementation
    if old != "sdpa" or next(model.parameters()).device.type not in GQA_SDPA_DEVICES:
        yield
        return
    register_attention(GQA_SDPA, sdpa_gqa_attention)
    AttentionMaskInterface.register(GQA_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    cfg._attn_implementation = GQA_SDPA
    try:
        yield
    finally:
        cfg._attn_implementation = old


@functools.lru_cache(maxsize=None)
def _preallocated_layer_class(dynamic_layer: type):
    """A subclass of transformers' ``DynamicLayer`` (``dynamic_layer``) whose keys/values are views of buffers sized once.

    ``DynamicLayer.update`` concatenates the whole cache with each new token (``torch.cat``): for
    the demo's batch-16 CPU decoding that copy was a fifth of a decode step. This layer writes the
    new keys/values into a buffer of ``capacity`` positions (set by :func:`prefill_unpadded`) and
    returns views of its first ``n`` positions; past the capacity it concatenates as before. The
    attention reads the same values in the same order (same tokens: ``tests/serving/test_generate_fast_paths.py``).
    """
    class PreallocatedLayer(dynamic_layer):
        def reserve(self, capacity: int) -> None:
            n = self.keys.shape[-2]
            kbuf = self.keys.new_empty((*self.keys.shape[:-2], capacity, self.keys.shape[-1]))
            vbuf = self.values.new_empty((*self.values.shape[:-2], capacity, self.values.shape[-1]))
            kbuf[..., :n, :] = self.keys
            vbuf[..., :n, :] = self.values
            self._bufs = (kbuf, vbuf)
            self.keys, self.values = kbuf[..., :n, :], vbuf[..., :n, :]

        def update(self, key_states, value_states, *args, **kwargs):
            bufs = getattr(self, "_bufs", None)
            n = self.keys.shape[-2] if self.is_initialized else 0
            m = n + key_states.shape[-2]
            if bufs is None or m > bufs[0].shape[-2] or key_states.shape[0] != bufs[0].shape[0]:
                self._bufs = None
                return super().update(key_states, value_states, *args, **kwargs)
            bufs[0][..., n:m, :] = key_states
            bufs[1][..., n:m, :] = value_states
            self.keys, self.values = bufs[0][..., :m, :], bufs[1][..., :m, :]
            return self.keys, self.values

    return PreallocatedLayer


def prefill_unpadded(model, prompts, width: int, capacity: int = 0):
    """The KV cache of left-padded prompts, each prompt computed alone (CPU: no work on padding).

    ``model.generate`` on a left-padded ``[B, width]`` batch runs the prefill over every pad
    position too (47-73 % of the demo's prompt tokens). Here each prompt but its last token goes
    through the model on its own, unpadded, and the per-layer keys/values are placed at the right
    end of a ``[B, Hkv, width - 1, D]`` cache (zeros under the pads, which the attention mask hides);
    ``generate(input_ids, attention_mask, past_key_values=cache)`` then starts at the last prompt
    token, with the positions it derives from the mask (each prompt's own 0..len-1). Floating-point
    results match the padded prefill up to reduction order (as left-padded rows match unpadded ones).

    Args:
        prompts: B token-id lists, each non-empty; width: the padded length (longest prompt).
        capacity: > 0 sizes each layer's key/value buffers for this many positions (the padded
            prompt plus the new tokens), so decoding writes in place instead of concatenating
            (:func:`_preallocated_layer_class`).

    Returns:
        a ``DynamicCache``, or None where it does not apply (not on CPU, where the batched GPU prefill
        is cheaper than B separate ones; no prompt longer than one token; caches other than plain
        attention layers, e.g. hybrid linear-attention or sliding-window targets).
    """
    from transformers.cache_utils import DynamicCache, DynamicLayer  # deferred: --help stays transformers-free (tests/core/test_startup.py)

    dev = next(model.parameters()).device
    if dev.type != "cpu" or width < 2:
        return None
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types):  # hybrid / sliding-window caches: not spliced (below)
        return None
    parts = []
    for p in prompts:
        c = DynamicCache(config=model.config)
        if len(p) > 1:
            model(input_ids=torch.tensor([list(p[:-1])], device=dev), past_key_values=c, use_cache=True,
                  logits_to_keep=1)
        parts.append(c)
    ref = next((c for c in parts if c.get_seq_length() > 0), None)
    if ref is None or any(type(layer).__name__ != "DynamicLayer" for layer in ref.layers):
        return None
    batch = DynamicCache(config=model.config)
    for li, layer in enumerate(ref.layers):
        shape_k = (len(prompts), layer.keys.shape[1], width - 1, layer.keys.shape[3])
        shape_v = (len(prompts), layer.values.shape[1], width - 1, layer.values.shape[3])
        keys, values = layer.keys.new_zeros(shape_k), layer.values.new_zeros(shape_v)
        for b, c in enumerate(parts):
            n = c.get_seq_length()
            if n:
                keys[b, :, width - 1 - n:] = c.layers[li].keys[0]
                values[b, :, width - 1 - n:] = c.layers[li].values[0]
        batch.update(keys, values, li)
    if capacity > width - 1:
        layer_class = _preallocated_layer_class(DynamicLayer)
        for layer in batch.layers:
            layer.__class__ = layer_class  # same state, in-place update()
            layer.reserve(capacity)
    return batch


def target_info(model) -> dict[str, Any]:
    """Shape facts of a loaded target.

    Reads the *text* config (``config.get_text_config()``), so VLM-style
    configs that nest the decoder under ``text_config`` work too.

    Returns:
        dict with ``num_hidden_layers``, ``hidden_size``, ``vocab_size`` (rows of
        the input embedding, which can exceed the tokenizer's length),
        ``config_vocab_size``, ``model_type`` (of the text config) and
        ``layer_types`` (list of str, only when the config has them, e.g.
        ``full_attention`` / ``sliding_attention`` / ``linear_attention``).
    """
    cfg = model.config.get_text_config()
    emb = model.get_input_embeddings()
    info: dict[str, Any] = {
        "num_hidden_layers": int(cfg.num_hidden_layers),
        "hidden_size": int(cfg.hidden_size),
        "vocab_size": int(emb.weight.shape[0]),
        "config_vocab_size": int(getattr(cfg, "vocab_size", emb.weight.shape[0])),
        "model_type": str(getattr(cfg, "model_type", "") or model.config.model_type),
    }
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        info["layer_types"] = list(layer_types)
    return info


#: most prompts per ``generate`` call when the batch is memory-sized (``generation.batch_size: 0``)
MAX_DECODE_BATCH = 512
#: prompts per ``generate`` call on the CPU when memory-sized: decoding there is compute-bound, and the
#: prefill runs each prompt alone (:func:`prefill_unpadded`), so larger batches gain little
CPU_DECODE_BATCH = 16


def cache_bytes_per_row(cfg, positions: int, elem: int) -> int:
    """Bytes one row's decode cache holds at ``positions`` positions, by ``cfg.layer_types`` (absent: every
    layer full attention).

    - ``full_attention``: keys and values, ``2 x KV heads x head_dim x elem`` per position;
    - ``sliding_attention``: the same for at most ``cfg.sliding_window`` positions;
    - ``linear_attention`` (Qwen3-Next / Qwen3.5 Gated DeltaNet): a state of fixed size, the float32 recurrent
      state ``[linear_num_value_heads, linear_key_head_dim, linear_value_head_dim]`` and the short convolution's
      ``[2 x key dim + value dim, linear_conv_kernel_dim]`` in ``elem`` (transformers' ``Qwen3NextDynamicCache``
      layers; fla's ``chunk_gated_delta_rule`` returns the final state in float32).

    Args:
        cfg: the target's text config. positions: prompt + generated tokens. elem: bytes per element of the
            target's dtype.
    """
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    per_position = 2 * kv_heads * head_dim * elem
    types = list(getattr(cfg, "layer_types", None) or ()) or ["full_attention"] * cfg.num_hidden_layers
    total = 0
    for t in types:
        if t == "linear_attention":
            v_heads, k_dim, v_dim = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
            conv_dim = 2 * cfg.linear_num_key_heads * k_dim + v_heads * v_dim
            total += 4 * v_heads * k_dim * v_dim + elem * conv_dim * cfg.linear_conv_kernel_dim
        elif t == "sliding_attention" and getattr(cfg, "sliding_window", None):
            total += per_position * min(positions, int(cfg.sliding_window))
        else:
            total += per_position * positions
    return total


def decode_batch_size(model, prompt_len: int, max_new_tokens: int, total_memory: int | None = None) -> int:
    """Prompts per ``generate`` call that fit the device: the completions stage's ``batch_size: 0``.

    Bytes per row: the decode cache of ``prompt_len + max_new_tokens`` positions (:func:`cache_bytes_per_row`:
    keys and values of the attention layers, the fixed state of a hybrid's linear-attention layers), the prefill's
    activations (``element size x (6 hidden + 3 intermediate)`` per prompt token, one layer at a time)
    and its ``[prompt_len, prompt_len]`` mask, and the last position's float32 logits and their
    processing (``16 x vocab``). The budget is ``runtime.MEMORY_FRACTION['cuda']`` of the device's
    **total** memory minus the weights: unlike its free memory, that is the same on every run on the
    same GPU model, and the batch size is part of the completions' resume key (a batch's composition
    changes its floating-point results). The count is rounded down to a power of two, within
    ``[1, MAX_DECODE_BATCH]``. CPU devices: :data:`CPU_DECODE_BATCH`.

    Args:
        model: the loaded target (its parameters' device and dtype, its text config).
        prompt_len: the longest prompt, tokens. max_new_tokens: the generation limit.
        total_memory: device bytes to plan for (default: ``torch.cuda.get_device_properties``; CPU: not sized).

    Returns:
        the batch size (>= 1).
    """
    p = next(model.parameters())
    if total_memory is None:
        if p.device.type != "cuda":
            return CPU_DECODE_BATCH
        total_memory = torch.cuda.get_device_properties(p.device).total_memory
    cfg = model.config.get_text_config()
    elem = p.element_size()
    act = elem * (6 * cfg.hidden_size + 3 * getattr(cfg, "intermediate_size", 4 * cfg.hidden_size))
    per_row = (cache_bytes_per_row(cfg, prompt_len + max_new_tokens, elem) + prompt_len * act
               + prompt_len * prompt_len * elem + 16 * cfg.vocab_size)
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    rows = max(1, (int(MEMORY_FRACTION["cuda"] * total_memory) - weights) // per_row)
    batch = min(MAX_DECODE_BATCH, 1 << (int(rows).bit_length() - 1))
    log.info("batch size %d: memory-sized for %d + %d tokens per row (%.1f MB each) in %.1f GiB beside %.2f GiB of "
             "weights", batch, prompt_len, max_new_tokens, per_row / 1e6, MEMORY_FRACTION["cuda"] * total_memory / 2**30,
             weights / 2**30)
    return batch
