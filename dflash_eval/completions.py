"""Greedy target completions for a prompt set (token ids, never re-tokenized text).

Output JSONL, one row per prompt, in the prompts file's order::

    {"id": str,
     "prompt_ids": [int, ...],       # copied from the prompts file
     "completion_ids": [int, ...],   # generated ids up to and including the first eos; no padding
     "text": str,                    # tokenizer.decode(completion_ids), special tokens kept
     "stop_reason": "eos" | "length",
     "max_new_tokens": int}

``completion_ids`` are what the target produced (greedy argmax), not a
re-tokenization of ``text``: the hidden-state cache and the replay condition on
exactly these ids. Provenance (target weights sha256, dtype, device, library
versions, tokens/s) goes to the log.

Completion sources are pluggable (:data:`SOURCES`); a serving-endpoint source
can be added by implementing :class:`CompletionSource`.
"""

from __future__ import annotations

import abc
import json
import logging
import time
from pathlib import Path
from typing import Sequence

import torch

from .errors import InputError, atomic_path
from .progress import Progress

log = logging.getLogger(__name__)

STOP_EOS, STOP_LENGTH = "eos", "length"


class CompletionSource(abc.ABC):
    """Produces greedy completions for batches of prompt token ids.

    Implementations must stop a sequence at the first of :attr:`eos_ids`
    (included in the returned ids) or after ``max_new_tokens`` tokens.
    """

    #: token ids that end a completion
    eos_ids: list[int]
    max_new_tokens: int

    @abc.abstractmethod
    def generate(self, prompt_ids_batch: Sequence[Sequence[int]]) -> list[tuple[list[int], str]]:
        """Complete a batch of prompts.

        Args:
            prompt_ids_batch: B prompts, each a list of token ids (lengths may differ).

        Returns:
            B pairs ``(completion_ids, stop_reason)`` in input order: the generated
            ids up to and including the first eos (``stop_reason == "eos"``), or
            exactly ``max_new_tokens`` ids without an eos (``"length"``).
        """

    def describe(self) -> dict:
        """Provenance of this source (logged)."""
        return {"source": type(self).__name__}


def eos_ids_of(model, tokenizer, target_dir: str | Path | None = None) -> list[int]:
    """The stop ids: ``generation_config.eos_token_id`` (int or list), else the tokenizer's eos.

    ``dflash==0.1.0`` stops on ``generation_config.eos_token_id`` (a list for
    Qwen3/Llama-3); z-lab HEAD on ``tokenizer.eos_token_id`` (dflash.md §3.2).

    Raises:
        InputError: no eos id anywhere.
    """
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise InputError(Path(target_dir or ".") / "generation_config.json", "eos_token_id", "the target declares no eos token",
                         "set eos_token_id in generation_config.json")
    ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
    return list(dict.fromkeys(ids))


def cut_at_eos(new_ids: Sequence[int], eos_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], str]:
    """Trim generated ids after the first eos (kept) and classify the stop.

    Args:
        new_ids: generated ids of one sequence (may carry padding after the eos).
        eos_ids: stop ids.
        max_new_tokens: the generation limit.

    Returns:
        ``(completion_ids, "eos")`` or ``(first max_new_tokens ids, "length")``.

    Raises:
        RuntimeError: fewer than ``max_new_tokens`` ids and no eos (the generator stopped for another reason).
    """
    stops = set(int(e) for e in eos_ids)
    out: list[int] = []
    for t in new_ids[:max_new_tokens]:
        out.append(int(t))
        if out[-1] in stops:
            return out, STOP_EOS
    if len(out) < max_new_tokens:
        raise RuntimeError(f"generation stopped after {len(out)} < {max_new_tokens} tokens without an eos")
    return out, STOP_LENGTH


class TransformersSource(CompletionSource):
    """Greedy ``model.generate`` of a local HF target, batched with left padding.

    Pure argmax decoding: ``do_sample=False``, one beam, and a *fresh*
    :class:`~transformers.GenerationConfig` holding only bos/eos/pad, so that
    logits processors a target's ``generation_config.json`` may carry
    (``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``, ...)
    cannot change the tokens: the cache and the replay assume the completion is
    the target's argmax at every position. Padding uses the tokenizer's pad token,
    else the first eos id; pad positions are masked (``attention_mask``) and the
    model derives position ids from the mask, so left-padded rows match unpadded
    ones up to floating-point reduction order.

    Args:
        model: loaded causal LM (eval mode, on its device).
        tokenizer: its tokenizer (pad token).
        max_new_tokens: generation limit per prompt.
        target_dir: for error messages.
    """

    def __init__(self, model, tokenizer, max_new_tokens: int, target_dir: str | Path | None = None):
        from transformers import GenerationConfig

        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = int(max_new_tokens)
        self.eos_ids = eos_ids_of(model, tokenizer, target_dir)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        self.device = next(model.parameters()).device
        old = model.generation_config
        self.gen_config = GenerationConfig(
            do_sample=False, num_beams=1, max_new_tokens=self.max_new_tokens,
            eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
            bos_token_id=getattr(old, "bos_token_id", None))
        # generate() fills unset fields of the passed config from model.generation_config: make that one neutral too.
        model.generation_config = GenerationConfig(eos_token_id=self.eos_ids, pad_token_id=self.pad_id,
                                                   bos_token_id=getattr(old, "bos_token_id", None))

    @torch.inference_mode()
    def generate(self, prompt_ids_batch: Sequence[Sequence[int]]) -> list[tuple[list[int], str]]:
        B = len(prompt_ids_batch)
        if B == 0:
            return []
        P = max(len(p) for p in prompt_ids_batch)
        input_ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        attn = torch.zeros((B, P), dtype=torch.long)
        for b, p in enumerate(prompt_ids_batch):
            if len(p) == 0:
                raise ValueError("empty prompt")
            input_ids[b, P - len(p):] = torch.tensor(list(p), dtype=torch.long)
            attn[b, P - len(p):] = 1
        out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attn.to(self.device),
                                  generation_config=self.gen_config)
        new = out[:, P:].cpu().tolist()
        return [cut_at_eos(row, self.eos_ids, self.max_new_tokens) for row in new]

    def describe(self) -> dict:
        import transformers

        p = next(self.model.parameters())
        return {"source": "transformers", "transformers": transformers.__version__, "torch": torch.__version__,
                "device": str(p.device), "dtype": str(p.dtype).replace("torch.", ""),
                "torch_threads": torch.get_num_threads(),
                "eos_ids": self.eos_ids, "pad_id": self.pad_id, "max_new_tokens": self.max_new_tokens,
                "attn_implementation": getattr(self.model.config, "_attn_implementation", None)}


#: completion source name (``generation.source``) -> class
SOURCES: dict[str, type[CompletionSource]] = {"transformers": TransformersSource}


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length (sorted by length, stable; longest first).

    Longest first makes the first batch the most memory-hungry, so an
    out-of-memory error shows up at once rather than at the end.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def generate_completions(target_dir: str | Path, prompts_path: str | Path, out: str | Path, source: str = "transformers",
                         max_new_tokens: int = 256, batch_size: int = 16, device: str = "auto",
                         dtype: str = "auto", linear_attn_backend: str = "auto") -> Path:
    """Greedy completions of every prompt in a prompts JSONL (format: module docstring).

    Prompts are sorted by length and generated ``batch_size`` at a time; rows are
    written in the prompts file's order, atomically (nothing is written on failure).

    Args:
        target_dir: HF target folder.
        prompts_path: JSONL from the prompts stage (:func:`dflash_eval.prompts.read_prompts`).
        out: output JSONL.
        source: key of :data:`SOURCES`.
        max_new_tokens: generated tokens per prompt at most (eos included).
        batch_size: prompts per ``generate`` call.
        linear_attn_backend: GDN kernel of hybrid targets ('auto'|'fla'|'torch', :mod:`dflash_eval.hybrid`);
            use the one the cache stage uses.
        device, dtype: see :func:`dflash_eval.target.resolve_device` / :func:`~dflash_eval.target.resolve_dtype`
            (``auto``: bf16 on CUDA, float32 on CPU).

    Returns:
        ``Path(out)``.

    Raises:
        InputError: unknown source, bad limits, bad prompts file or target folder, prompt ids outside the vocabulary.
    """
    from .prompts import read_prompts
    from .hybrid import load_target_bound
    from .target import resolve_device, resolve_dtype, target_info, weights_sha256

    if source not in SOURCES:
        raise InputError(None, "generation.source", f"unknown completion source {source!r}", f"use one of {sorted(SOURCES)}")
    if max_new_tokens < 1 or batch_size < 1:
        raise InputError(None, "generation.max_new_tokens" if max_new_tokens < 1 else "generation.batch_size",
                         "must be >= 1", "set a positive value")
    prompts_path, out = Path(prompts_path), Path(out)
    rows = read_prompts(prompts_path)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    model, tok, kernel = load_target_bound(target_dir, device=dev, dtype=dt, backend=linear_attn_backend)
    if kernel.backend != "none":
        log.info("linear-attention kernel: %s", kernel.backend)
    info = target_info(model)
    for k, r in enumerate(rows):
        bad = [t for t in r["prompt_ids"] if not 0 <= t < info["vocab_size"]]
        if bad:
            raise InputError(prompts_path, f"line {k + 1}: prompt_ids", f"ids {bad[:5]} outside the target vocabulary "
                             f"({info['vocab_size']})", "rebuild the prompts with this target's tokenizer")
    max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    longest = max(len(r["prompt_ids"]) for r in rows) + max_new_tokens
    if max_pos and longest > max_pos:
        log.warning("longest prompt + max_new_tokens = %d exceeds the target's max_position_embeddings %d",
                    longest, max_pos)

    src = SOURCES[source](model, tok, max_new_tokens, target_dir=target_dir)
    sha = weights_sha256(target_dir)
    log.info("completions: target %s (sha256 %s, %s), %d prompts, %s", target_dir, sha[:16], info["model_type"],
             len(rows), json.dumps(src.describe()))

    results: dict[int, tuple[list[int], str]] = {}
    n_new = 0
    t0 = time.perf_counter()
    bar = Progress(len(rows) * max_new_tokens, "completions", logger=log)  # total: at most
    for batch in length_sorted_batches([len(r["prompt_ids"]) for r in rows], batch_size):
        tb = time.perf_counter()
        outs = src.generate([rows[i]["prompt_ids"] for i in batch])
        for i, o in zip(batch, outs):
            results[i] = o
        toks = sum(len(o[0]) for o in outs)
        n_new += toks
        bar.update(toks)
        log.debug("generated %d/%d prompts: batch of %d, %d new tokens, %.1f tokens/s", len(results), len(rows),
                  len(batch), toks, toks / max(time.perf_counter() - tb, 1e-9))
    bar.close()
    elapsed = time.perf_counter() - t0
    n_eos = sum(1 for c, s in results.values() if s == STOP_EOS)
    log.info("completions done: %d new tokens in %.1f s = %.1f tokens/s; %d stopped at eos, %d at max_new_tokens=%d",
             n_new, elapsed, n_new / max(elapsed, 1e-9), n_eos, len(rows) - n_eos, max_new_tokens)

    with atomic_path(out) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            for i, r in enumerate(rows):
                ids, stop = results[i]
                fh.write(json.dumps({
                    "id": r["id"], "prompt_ids": r["prompt_ids"], "completion_ids": ids,
                    "text": tok.decode(ids, skip_special_tokens=False), "stop_reason": stop,
                    "max_new_tokens": max_new_tokens,
                }, ensure_ascii=False) + "\n")
    log.info("wrote %d completions -> %s", len(rows), out)
    return out
