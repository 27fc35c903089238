"""The target forward that fills the hidden-state cache: layers captured by hooks, batching, packing.

The stage (rule ``hidden_states``) is :mod:`dflash_eval.stages.hidden_states`; the cache format, what
is held in memory while it is written, and how a killed run is resumed are documented in
:mod:`dflash_eval.cache.format` (one place).

Forward. Layers are captured with forward hooks on the decoder layers and copied into one
``[N, K, H]`` buffer (only the K requested layers are kept, never all N+1 that
``output_hidden_states`` materialises); ``hidden[:, k]`` equals HF
``hidden_states[target_layer_ids[k] + 1]``. The target's greedy token after every position
is the LM head's argmax, computed on the device in chunks of at most ~1 GiB of logits.

Batching. Samples are sorted by length (longest first) and cut into batches of at most
``batch_tokens`` tokens (:func:`dflash_eval.core.runtime.length_batches`); the batch plan
depends only on the lengths and ``batch_tokens``, so a resumed run recomputes a batch
with exactly the samples it had.

- ``packed`` (``cache.packing: auto`` on targets whose layers are all full attention): the
  batch's samples are concatenated into one sequence of N tokens with position ids
  restarting at 0 for every sample, and attention is computed per sample from the
  ``cu_seqlens`` offsets (PyTorch's ``torch.nn.attention.varlen.varlen_attn`` flash kernel on
  CUDA, as transformers' flash-attention path does for packed ``position_ids``; a causal
  ``scaled_dot_product_attention`` per sample elsewhere). No padding is computed. Not used for
  hybrid targets (Gated DeltaNet: the torch kernel has no ``cu_seqlens`` path, and the
  recurrent state would flow from one sample into the next), sliding-window targets, or
  architectures outside :data:`PACKABLE_MODEL_TYPES`. Before the first batch a packed forward
  of a few samples is compared with the right-padded one (:func:`check_packing`); a
  disagreement beyond rounding stops the stage.
- ``right-padded`` (``packing: off`` and every other target): ``[b, L]`` batches with an attention mask.

Numerics: packed and padded forwards give the same states up to rounding, not bit-for-bit: the
matrix multiplications run with M = N instead of M = b x L rows (BLAS / cuBLAS may pick other
kernels and blockings) and attention runs in another kernel (varlen flash instead of SDPA with
a mask). Measured on CPU in float32 (``tests/cache/test_cache.py::test_packed_matches_padded``): max abs
difference ~1e-6 relative to the states' scale, identical argmax. A cache records its mode
(attribute ``batching``) and a partial cache is only continued in the same mode, so a resumed
cache is bit-identical to an uninterrupted one.

Overlap (CUDA): each batch's ``[N, K, H]`` states and ``[N]`` argmax are copied to one of two
pinned host buffers on a side stream; a writer thread waits for that copy, hashes and writes the
samples and flushes, while the main thread already runs the next forward
(:class:`dflash_eval.cache.writer.StreamingWriter`). No per-sample device-to-host synchronisation.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from importlib import metadata

import numpy as np
import torch
import torch.nn.functional as F

from dflash_eval import __version__
from dflash_eval.core.errors import InputError
from dflash_eval.target.hybrid import causal_conv1d_status
from dflash_eval.target.model import register_attention

log = logging.getLogger(__name__)

#: model types whose attention goes through transformers' attention interface with RoPE from
#: ``position_ids`` and nothing else per layer (no sliding window, sinks, soft-capping, linear attention)
PACKABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
VARLEN_ATTENTION = "dflash_eval_varlen"
#: the LM head's logits are computed at most this many bytes at a time (:func:`forward_batch`): a 32k-token sample's
#: full-vocabulary logits (32k x 152k x 2 bytes = 10 GB) never exist at once
LOGITS_CHUNK_BYTES = 1 << 30


def versions() -> dict:
    def v(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    return {
        "torch_version": torch.__version__,
        "transformers_version": v("transformers"),
        "fla_version": v("fla-core") if v("fla-core") != "absent" else v("flash-linear-attention"),
        "causal_conv1d_version": v("causal-conv1d"),
        "causal_conv1d_kernel": causal_conv1d_status(),
        "dflash_eval_version": __version__,
    }


def check_layers(layer_ids: list[int], n_layers: int, target_dir) -> None:
    """Every 0-based decoder layer id in ``0..n_layers-1``.

    Raises:
        InputError: an id out of range (names ``cache.target_layer_ids`` and the valid range).
    """
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if bad:
        raise InputError("config", "cache.target_layer_ids",
                         f"layer ids {bad} out of range for a target with {n_layers} decoder layers ({target_dir})",
                         f"use ids in 0..{n_layers - 1}")


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


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (a no-op on the one-device path; index tensors of a target split over GPUs)."""
    return t if t.device == device else t.to(device)


def _base(model):
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


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
        last = _base(model)(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    finally:
        for h in handles:
            h.remove()
    if n_layers - 1 in captured:  # HF's last hidden_states entry is final-normed
        captured[n_layers - 1] = final_norm(model)(captured[n_layers - 1])
    return torch.stack([captured[i].to(ids.device) for i in layer_ids], dim=2), last


def pad_right(batch_ids: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists to ``[b, L]`` int64 ids + attention mask (real positions keep their causal context)."""
    L = max(len(x) for x in batch_ids)
    ids = torch.full((len(batch_ids), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch_ids), L), dtype=torch.long)
    for r, x in enumerate(batch_ids):
        ids[r, : len(x)] = torch.as_tensor(x)
        mask[r, : len(x)] = 1
    return ids.to(device), mask.to(device)


# --------------------------------------------------------------------------- packed (varlen) attention
_PACK: dict = {}  # offsets of the packed forward in progress: cu (device int32), cu_host (list), max_len


def _segment_sdpa(q, k, v, cu_host: list[int], scale):
    """Causal SDPA per packed sample. ``q [N, Hq, D]``, ``k, v [N, Hkv, D]`` -> ``[N, Hq, D]``."""
    gqa = q.shape[1] != k.shape[1]
    outs = []
    for s, e in zip(cu_host[:-1], cu_host[1:]):
        # 4-D [1, H, T, D] as transformers' SDPA path passes them: PyTorch's CPU flash kernel takes only 4-D inputs
        # (a 3-D call falls back to the math kernel, 7-10x slower at 3.5k tokens on one CPU thread)
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None],
                                           v[s:e].transpose(0, 1)[None], is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


def _flash_varlen(q, k, v, cu, max_len: int, scale):
    """PyTorch's varlen flash attention (CUDA), causal, across the signatures of torch 2.9-2.13."""
    from torch.nn.attention.varlen import varlen_attn  # deferred: 2.5 s (torch._dynamo), absent before torch 2.9; --help stays free of it

    params = inspect.signature(varlen_attn).parameters
    kw = {}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)  # causal
    else:
        kw["is_causal"] = True
    if scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        if "scale" not in params:
            raise NotImplementedError("varlen_attn without a scale argument")
        kw["scale"] = scale
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers attention function for a packed batch (registered as :data:`VARLEN_ATTENTION`).

    ``query [1, Hq, N, D]``, ``key/value [1, Hkv, N, D]`` of the N packed tokens; the per-sample
    offsets come from :data:`_PACK`. Returns ``([1, N, Hq, D], None)`` like transformers' SDPA path.
    """
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [N, H, D]
    if q.is_cuda and _PACK.get("flash", True):
        try:
            out = _flash_varlen(q, k, v, _on(_PACK["cu"], q.device), _PACK["max_len"], scaling)
        except (ImportError, NotImplementedError, RuntimeError, TypeError, ValueError) as err:
            log.warning("varlen flash attention unavailable (%s): causal SDPA per sample instead", err)
            _PACK["flash"] = False
            out = _segment_sdpa(q, k, v, _PACK["cu_host"], scaling)
    else:
        out = _segment_sdpa(q, k, v, _PACK["cu_host"], scaling)
    return out.unsqueeze(0), None


@contextlib.contextmanager
def _packed_attention(model, cu_host: list[int], device):
    """Route the model's attention through :func:`varlen_attention_forward` for one forward."""
    register_attention(VARLEN_ATTENTION, varlen_attention_forward)
    cfg = model.config
    old = cfg._attn_implementation
    _PACK.update(cu=torch.tensor(cu_host, dtype=torch.int32).to(device, non_blocking=True), cu_host=cu_host,
                 max_len=max(b - a for a, b in zip(cu_host[:-1], cu_host[1:])))
    cfg._attn_implementation = VARLEN_ATTENTION
    try:
        yield
    finally:
        cfg._attn_implementation = old
        for key in ("cu", "cu_host", "max_len"):
            _PACK.pop(key, None)


def packing_support(spec) -> tuple[bool, str]:
    """Whether samples of a target may be packed into one sequence (and why not).

    Packable: every layer is full attention (no ``linear_attention`` / Gated DeltaNet, no active
    sliding window) and the architecture is in :data:`PACKABLE_MODEL_TYPES`.
    """
    text = spec.config.get("text_config") or spec.config
    if spec.has_linear_attention:
        return False, "hybrid target (Gated DeltaNet layers carry state across packed samples; no cu_seqlens path)"
    types = set(spec.layer_types)
    sliding = ("sliding_attention" in types) or (text.get("sliding_window") and text.get("use_sliding_window", True)
                                                 and spec.model_type not in ("qwen2", "qwen3", "qwen3_moe"))
    if sliding or (text.get("use_sliding_window") and text.get("sliding_window")):
        return False, "sliding-window attention"
    if types - {"full_attention"}:
        return False, f"layer types {sorted(types)}"
    if spec.model_type not in PACKABLE_MODEL_TYPES:
        return False, f"model type {spec.model_type!r} not in {PACKABLE_MODEL_TYPES}"
    return True, "full attention only"


# --------------------------------------------------------------------------- one forward
def forward_batch(model, seqs: list[list[int]], layer_ids: list[int], device, pad_id: int = 0, packed: bool = False,
                  out_dtype: torch.dtype | None = None):
    """Run the target over ``seqs`` and return their states in packed layout, on ``device``.

    Args:
        seqs: token-id lists (any lengths).
        layer_ids: 0-based decoder layers, in the order wanted.
        packed: one concatenated sequence with per-sample attention (see the module docstring);
            else right-padded ``[b, L]`` with an attention mask.
        out_dtype: dtype of the returned states (default: the model's).

    Returns:
        ``(hidden [N, K, H], argmax [N] int32)`` with ``N = sum(len(s))``, sample ``r`` at rows
        ``offsets[r]:offsets[r+1]`` in input order; ``hidden[:, k]`` = HF ``hidden_states[layer_ids[k] + 1]``,
        ``argmax[t]`` = the target's greedy token after token ``t``. No host synchronisation.
    """
    lens = [len(s) for s in seqs]
    N = sum(lens)
    layers = decoder_layers(model)
    n_layers = len(layers)
    H = model.config.get_text_config().hidden_size
    dt = out_dtype or next(model.parameters()).dtype
    slot = {i: k for k, i in enumerate(layer_ids)}
    dev = torch.device(device)
    if packed:
        flat = [t for s in seqs for t in s]
        ids = torch.tensor(flat, dtype=torch.long).unsqueeze(0)
        pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
        if dev.type == "cuda":
            ids, pos = ids.pin_memory(), pos.pin_memory()
        ids, pos = ids.to(dev, non_blocking=True), pos.to(dev, non_blocking=True)
        gather = None
    else:
        ids, mask = pad_right(seqs, pad_id, dev)
        L = ids.shape[1]
        gather = torch.tensor([r * L + t for r, n in enumerate(lens) for t in range(n)], dtype=torch.long)
        gather = gather.to(dev, non_blocking=True)
    out = torch.empty((N, len(layer_ids), H), dtype=dt, device=dev)
    norm = final_norm(model)

    def hook(idx):
        def fn(_mod, _inp, o):
            h = o[0] if isinstance(o, tuple) else o
            if idx == n_layers - 1:  # HF's last hidden_states entry is final-normed
                h = norm(h)
            h = h.reshape(-1, H)  # on the layer's GPU when the target is split (copied to `dev` here)
            out[:, slot[idx]] = h if gather is None else h.index_select(0, _on(gather, h.device))
        return fn

    handles = [layers[i].register_forward_hook(hook(i)) for i in sorted(set(layer_ids))]
    try:
        if packed:
            cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
            with _packed_attention(model, cu, dev):
                last = _base(model)(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state
        else:
            last = _base(model)(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    finally:
        for h in handles:
            h.remove()
    last = last.reshape(-1, H)
    if gather is not None:
        last = last.index_select(0, _on(gather, last.device))
    head = model.get_output_embeddings()
    V = head.weight.shape[0]
    chunk = max(1, LOGITS_CHUNK_BYTES // (V * head.weight.element_size()))  # <= ~1 GiB of logits at once
    argmax = torch.empty(N, dtype=torch.int32, device=dev)
    for t0 in range(0, N, chunk):
        argmax[t0 : t0 + chunk] = head(last[t0 : t0 + chunk]).argmax(-1)
    return out, argmax


@torch.inference_mode()
def run_target(model, batch_ids: list[list[int]], layer_ids: list[int], device, pad_id: int = 0,
               packed: bool = False):
    """One forward (:func:`forward_batch`); returns per sample ``(hidden [T, K, H], argmax [T] int64)`` on CPU."""
    hidden, argmax = forward_batch(model, batch_ids, layer_ids, device, pad_id, packed)
    hidden, argmax = hidden.cpu(), argmax.cpu().long()
    outs, o = [], 0
    for s in batch_ids:
        outs.append((hidden[o : o + len(s)], argmax[o : o + len(s)]))
        o += len(s)
    return outs


@torch.inference_mode()
def check_packing(model, seqs: list[list[int]], layer_ids: list[int], device, pad_id: int = 0) -> float:
    """Compare a packed forward of a few short samples with the right-padded one.

    Rounding differs between the two (other GEMM shapes, another attention kernel): ~1e-6 in
    float32, up to a few 1e-2 in bf16 after many layers. A packing bug (attention or positions
    leaking from one sample into the next) gives differences of order 1.

    Returns:
        the largest relative L2 difference of any stored layer of any sample.

    Raises:
        RuntimeError: above 1e-3 (float32) / 1e-1 (bf16, fp16): packed attention does not separate
            the samples on this target; set ``cache.packing: off``.
    """
    sample = [s[:64] for s in seqs[:3]]
    a, _ = forward_batch(model, sample, layer_ids, device, pad_id, packed=True)
    b, _ = forward_batch(model, sample, layer_ids, device, pad_id, packed=False)
    a, b = a.float(), b.float()
    worst, o = 0.0, 0
    for s in sample:
        for k in range(len(layer_ids)):
            x, y = a[o : o + len(s), k], b[o : o + len(s), k]
            worst = max(worst, float((x - y).norm() / y.norm().clamp_min(1e-30)))
        o += len(s)
    limit = 1e-3 if next(model.parameters()).dtype == torch.float32 else 1e-1
    if worst > limit:
        raise RuntimeError(f"packed forward differs from the padded one by rel-L2 {worst:.2e} on this target: "
                           "set cache.packing: off (and report the target's architecture)")
    log.info("packed vs padded forward on %d samples: max rel-L2 %.2e", len(sample), worst)
    return worst


# --------------------------------------------------------------------------- device memory of one forward
def device_free_bytes(device) -> int | None:
    """Bytes a forward on ``device`` can still allocate: CUDA's free memory (``torch.cuda.mem_get_info``) plus what
    torch's caching allocator holds unused; None on other devices (host memory is not checked: swap, overcommit)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(dev)
    return int(free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev))


def forward_bytes(config, lens: list[int], n_layers_kept: int, element_size: int, packed: bool) -> int:
    """Estimated device bytes one :func:`forward_batch` of samples of ``lens`` tokens allocates beyond the weights.

    The kept states ``[N, K, H]`` (N real tokens), one layer's activations over the forward's tokens (N packed,
    ``b x max(lens)`` padded): the MLP's gate, up and product (3 x intermediate) and ~6 hidden-wide tensors (residual,
    normed input, attention or linear-attention projections and output), and one chunk of logits
    (:data:`LOGITS_CHUNK_BYTES` at most). A lower bound of the real peak (the kernels' workspaces are not counted):
    a batch above it cannot fit; one below may still run out (:func:`too_large_error` names it then).

    Args:
        config: the target's text config (``hidden_size``, ``intermediate_size``, ``vocab_size``).
        lens: tokens per sample of the batch.
        n_layers_kept: K, the stored layers.
        element_size: bytes per element of the forward's dtype (2 for bf16).
        packed: one concatenated sequence (else right-padded).
    """
    H, V = int(config.hidden_size), int(config.vocab_size)
    inter = int(getattr(config, "intermediate_size", None) or 4 * H)
    N = sum(lens)
    rows = N if packed else len(lens) * max(lens)
    logits = min(LOGITS_CHUNK_BYTES, N * V * element_size)
    return int(element_size * (N * n_layers_kept * H + rows * (3 * inter + 6 * H)) + logits)


def too_large_error(completions, sample_id: str, n_tokens: int, batch_samples: int, batch_tokens: int, device,
                    done: int, total: int, partial, need: int | None = None, free: int | None = None) -> InputError:
    """The error of a batch whose target forward does not fit ``device`` (found beforehand or as an out-of-memory).

    Names the batch's longest sample (id and tokens), the batch, what was committed (``done`` of ``total`` samples,
    kept in ``partial`` for the rerun to resume) and the fixes. ``need``/``free``: the estimate and the free bytes
    when the pre-check found it (None: the device ran out of memory during the forward).
    """
    gib = 1 << 30
    why = (f"needs ~{need / gib:.1f} GiB on {device} for the target forward (estimated), {free / gib:.1f} GiB free"
           if need is not None else f"ran out of memory on {device} in the target forward")
    batch = f" (in a batch of {batch_samples} samples, {batch_tokens:,} tokens)" if batch_samples > 1 else ""
    return InputError(completions, f"id {sample_id}", f"the sample {sample_id!r} of {n_tokens:,} tokens{batch} {why}; "
                      f"{done} of {total} samples are committed in {partial} and a rerun resumes them",
                      "leave such samples out (a lower prompt_set.max_prompt_tokens or prompt_sets.<set>."
                      "max_prompt_tokens, the top of the last context bin), spread the "
                      "target over more GPUs (target.devices), or lower cache.batch_tokens when the batch holds "
                      "several samples (cache.storage: fp8 halves the cache's host and disk bytes, not the forward's)")
