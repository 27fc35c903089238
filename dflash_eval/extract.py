"""The hidden_states stage: run the target over prompt + completion ids and write the HDF5 cache.

The cache format is documented in :mod:`dflash_eval.cache` (one place); this module
holds the target forward that fills it. Layers are captured with forward hooks on the
decoder layers (only the K requested layers are kept, never all N+1 that
``output_hidden_states`` materialises); ``hidden[:, k]`` equals HF
``hidden_states[target_layer_ids[k] + 1]``.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

from .cache import FORMAT, FORMAT_VERSION, LAYER_CONVENTION, write_cache
from .errors import InputError
from .io import sha256_file
from .runtime import dtype_name, length_batches, resolve_device, resolve_dtype

log = logging.getLogger(__name__)


def _versions() -> dict:
    from importlib import metadata

    def v(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    import transformers

    from . import __version__
    from .hybrid import causal_conv1d_status

    return {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "fla_version": v("fla-core") if v("fla-core") != "absent" else v("flash-linear-attention"),
        "causal_conv1d_version": v("causal-conv1d"),
        "causal_conv1d_kernel": causal_conv1d_status(),
        "dflash_eval_version": __version__,
    }


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder-layer ModuleList of an HF causal LM (``model.model.layers`` and VLM variants)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for cand in (base, getattr(base, "language_model", None), getattr(model, "model", None)):
        if cand is not None and isinstance(getattr(cand, "layers", None), torch.nn.ModuleList):
            return cand.layers
    raise InputError(None, "target", f"cannot find decoder layers of {type(model).__name__}", "use a standard HF causal LM")


def final_norm(model):
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for cand in (base, getattr(base, "language_model", None)):
        if cand is not None and hasattr(cand, "norm"):
            return cand.norm
    raise InputError(None, "target", "cannot find the final norm", "use a standard HF causal LM")


def capture_layers(model, ids: torch.Tensor, mask: torch.Tensor, layer_ids: list[int]):
    """One forward of the target body with forward hooks on the requested decoder layers.

    Args:
        ids, mask: ``[b, L]`` int64 token ids and attention mask (right padding).
        layer_ids: 0-based decoder layers, in the order wanted.

    Returns:
        ``(hidden [b, L, K, H], last_hidden_state [b, L, H])`` in the model dtype; ``hidden[:, :, k]``
        equals HF ``hidden_states[layer_ids[k] + 1]`` (the last layer's entry final-normed, as in HF).
        Only K layers are kept, not all N+1 as ``output_hidden_states`` would.
    """
    layers = decoder_layers(model)
    n_layers = len(layers)
    captured: dict[int, torch.Tensor] = {}

    def hook(idx):
        def fn(_mod, _inp, out):
            captured[idx] = out[0] if isinstance(out, tuple) else out
        return fn

    handles = [layers[i].register_forward_hook(hook(i)) for i in sorted(set(layer_ids))]
    try:
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        last = base(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    finally:
        for h in handles:
            h.remove()
    if n_layers - 1 in captured:  # HF's last hidden_states entry is final-normed
        captured[n_layers - 1] = final_norm(model)(captured[n_layers - 1])
    return torch.stack([captured[i] for i in layer_ids], dim=2), last


def pad_right(batch_ids: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists to ``[b, L]`` int64 ids + attention mask (real positions keep their causal context)."""
    L = max(len(x) for x in batch_ids)
    ids = torch.full((len(batch_ids), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch_ids), L), dtype=torch.long)
    for r, x in enumerate(batch_ids):
        ids[r, : len(x)] = torch.as_tensor(x)
        mask[r, : len(x)] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def run_target(model, batch_ids: list[list[int]], layer_ids: list[int], device, pad_id: int = 0):
    """One right-padded forward; returns per sample ``(hidden [T, K, H], argmax [T])`` on CPU.

    ``argmax[t]`` is the target's greedy token after position ``t`` (LM head applied in
    chunks, so ``[b, L, V]`` logits never materialise at once).
    """
    lens = [len(x) for x in batch_ids]
    ids, mask = pad_right(batch_ids, pad_id, device)
    stacked, last = capture_layers(model, ids, mask, layer_ids)
    head = model.get_output_embeddings()
    argmax = torch.empty(ids.shape, dtype=torch.long, device=ids.device)
    step = max(1, 8192 // ids.shape[1])
    for r0 in range(0, len(batch_ids), step):
        argmax[r0 : r0 + step] = head(last[r0 : r0 + step]).argmax(-1)
    return [(stacked[r, : lens[r]].cpu(), argmax[r, : lens[r]].cpu()) for r in range(len(batch_ids))]


def extract_hidden_states(
    target_dir,
    completions_path,
    out,
    layer_ids: list[int],
    batch_tokens: int = 8192,
    device: str = "auto",
    dtype: str = "auto",
    linear_attn_backend: str = "auto",
) -> Path:
    """Run the target over every completion and write the cache (format: module docstring).

    Args:
        target_dir: HF target folder.
        completions_path: JSONL from the completions stage (``id``, ``prompt_ids``, ``completion_ids``,
            ``stop_reason``, ``max_new_tokens``).
        out: cache path.
        layer_ids: 0-based decoder layers to store (order kept), HF ``hidden_states[i+1]``.
        batch_tokens: padded tokens per forward.
        device, dtype: see :func:`dflash_eval.runtime.resolve_device` / ``resolve_dtype`` (float32 on CPU by default).
        linear_attn_backend: kernel for hybrid targets' linear-attention layers ('auto'|'fla'|'torch').

    Raises:
        InputError: layer id out of range, empty or malformed completions file.
    """
    from .completions import read_completions
    from .target import TargetSpec, load_target, target_info

    completions_path = Path(completions_path)
    if not layer_ids:
        raise InputError(None, "--layer-ids", "no layer given", "pass comma-separated 0-based decoder layers, e.g. 1,8,15")
    rows = read_completions(completions_path)
    spec = TargetSpec.read(target_dir)
    # checked from config.json before the target loads (the workflow checks it at parse time too)
    n_layers = spec.num_layers
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if bad:
        raise InputError(
            "config", "cache.target_layer_ids",
            f"layer ids {bad} out of range for a target with {n_layers} decoder layers ({target_dir})",
            f"use ids in 0..{n_layers - 1}",
        )
    if len(set(layer_ids)) != len(layer_ids):
        raise InputError("config", "cache.target_layer_ids", f"duplicate ids in {layer_ids}", "list each layer once")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    model, tok, kernel = load_target(spec, device=dev, dtype=dt, backend=linear_attn_backend)
    info = target_info(model)
    pad_id = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0

    seqs = [list(r["prompt_ids"]) + list(r["completion_ids"]) for r in rows]
    batches = length_batches([len(s) for s in seqs], max_tokens=batch_tokens)
    t0 = time.perf_counter()
    n_tok = 0

    def generate():
        nonlocal n_tok
        results: dict[int, tuple] = {}
        for b in batches:
            outs = run_target(model, [seqs[i] for i in b], layer_ids, dev, pad_id)
            for i, o in zip(b, outs):
                results[i] = o
            n_tok += sum(len(seqs[i]) for i in b)
            log.info("extracted %d/%d samples, %d tokens", len(results), len(seqs), n_tok)
        for i, r in enumerate(rows):  # write in completions order
            hidden, argmax = results.pop(i)
            P = len(r["prompt_ids"])
            comp = torch.tensor(seqs[i][P:])
            agree = float((argmax[P - 1 : len(seqs[i]) - 1] == comp).float().mean()) if len(comp) else 1.0
            yield {
                "sample_id": str(r["id"]),
                "input_ids": seqs[i],
                "prompt_len": P,
                "hidden": hidden.to(dt),
                "target_argmax": argmax.numpy(),
                "stop_reason": r.get("stop_reason", "unknown"),
                "max_new_tokens": int(r["max_new_tokens"]),
                "argmax_agreement": agree,
            }

    attrs = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "target_name": Path(target_dir).name,
        "target_sha256": spec.weights_sha256(),
        "target_model_type": info.get("model_type", ""),
        "num_target_layers": n_layers,
        "hidden_size": info["hidden_size"],
        "vocab_size": info["vocab_size"],
        "target_layer_ids": list(layer_ids),
        "layer_convention": LAYER_CONVENTION,
        "last_layer_normed": (n_layers - 1) in layer_ids,
        "dtype": dtype_name(dt),
        "storage": "uint16 raw bfloat16 bits" if dt == torch.bfloat16 else "float32",
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine(),
        **_versions(),
        "linear_attn_kernel": kernel.describe(),
        "linear_attn_backend": kernel.backend,
        "layer_types": json.dumps(info.get("layer_types", [])),
        "image": os.environ.get("DFLASH_EVAL_IMAGE", ""),
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("FLA_", "TRITON_", "CUDA_VISIBLE", "USE_HUB_KERNELS", "DFLASH_EVAL_"))},
        "padding_side": "right",
        "batch_tokens": batch_tokens,
        "completions_sha256": sha256_file(completions_path).hexdigest(),
        "prompt_set": completions_path.stem,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    n = write_cache(out, attrs, generate())
    dt_s = time.perf_counter() - t0
    log.info("wrote %s: %d samples, %d tokens in %.1f s (%.0f tok/s on %s, %s)", out, n, n_tok, dt_s,
             n_tok / max(dt_s, 1e-9), dev, attrs["dtype"])
    return Path(out)
