"""Greedy target completions for a prompt set (token ids, never re-tokenized text): the stage.

Output JSONL, one row per prompt, in the prompts file's order::

    {"id": str,
     "prompt_ids": [int, ...],       # copied from the prompts file
     "completion_ids": [int, ...],   # generated ids up to and including the first stop id; no padding
     "text": str,                    # tokenizer.decode(completion_ids), special tokens kept
     "stop_reason": "eos" | "length",
     "max_new_tokens": int,
     "generation": {...}}            # provenance, the same in every row (below)

``completion_ids`` are what the target produced (greedy argmax), not a
re-tokenization of ``text``: the hidden-state cache and the replay condition on
exactly these ids. ``generation`` records ``source`` (``transformers`` | ``openai``
| ``sglang``), ``stop_ids`` (the end-of-generation ids used, see
:func:`stop_token_ids`) and the source's identity: library versions, dtype and
device for ``transformers``; ``engine``, ``model`` (the served model id) and
``server_version`` for servers, plus the launch settings when the workflow
started the server (``generation.serve: vllm``). Timings go to the log only, so a
rerun with the same inputs writes the same bytes. Rows re-tokenized from a
server's text (``generation.allow_retokenize``) carry ``"retokenized": true`` and
``"retokenize_mismatch"`` (the re-tokenized length differs from the number of
tokens the server generated).

Sources (:data:`SOURCES`): :class:`TransformersSource` (HF ``generate`` of the
local target) and :class:`ServerSource` (a vLLM / SGLang server through
:mod:`dflash_eval.serving`, at ``generation.endpoint.url`` or started by the job).

Resume (append-only): completions are appended as they finish to a sidecar file
``.<out name>.partial`` next to the output (first line: a key of everything that
shapes the output; then one row per line, flushed and fsynced). The sidecar is not
a declared Snakemake output, so Snakemake's clean-up of failed jobs leaves it
alone. A rerun of a killed job (SIGKILL, SIGTERM, node loss, server crash) keeps
the rows already there, generates only the missing prompts, writes the output in
the prompts' order (temp file + rename) and deletes the sidecar: every prompt
exactly once, and the same bytes as an uninterrupted run (the transformers source
regenerates whole batches, so batch composition and thus numerics are the same).
A sidecar whose key differs from this run's (other prompts, target, stop ids,
limits, server, dtype...) is refused with the differences named.
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from .errors import InputError, atomic_path
from .io import iter_jsonl, sha256_file
from .progress import Progress
from .runtime import dtype_name, length_batches

log = logging.getLogger(__name__)

STOP_EOS, STOP_LENGTH = "eos", "length"
PARTIAL_FORMAT = "dflash-eval/completions-partial"
PARTIAL_VERSION = 1

#: special tokens that end a chat turn in common chat formats (ChatML, Llama 3, Phi-3, Gemma, DeepSeek)
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>",
                      "<｜end▁of▁sentence｜>")

#: fixed text whose ids the server must tokenize exactly as the target's tokenizer (plus the eos token's text)
TOKENIZER_PROBE = "dflash-eval tokenizer probe: def f(x):\n\treturn x ** 2  # 12345 ünïcödé 你好 🙂  spaces"

#: emit(list of (prompt index, completion ids, stop reason, extra row fields)) -> None
Emit = Callable[[list[tuple[int, list[int], str, dict]]], None]


# --------------------------------------------------------------------------- stop ids

def _eos_list(value) -> list[int]:
    if value is None:
        return []
    vals = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in vals if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(path, None, f"not valid JSON ({err})", "re-save the target folder") from None
    return data if isinstance(data, dict) else {}


def stop_token_ids(target_dir: str | Path, tokenizer=None) -> tuple[list[int], dict[str, list[int]]]:
    """Every end-of-generation id the target declares anywhere, in this order (duplicates dropped).

    1. ``generation_config.json`` ``eos_token_id`` (int or list) — what HF ``generate`` and
       ``dflash==0.1.0`` stop on; for GGUF targets :func:`dflash_eval.target.convert_gguf` writes
       every end-of-generation id of the GGUF metadata here (eos, eot, eom);
    2. ``dflash_eval_target.json`` ``end_of_generation_ids`` (GGUF targets: the metadata's ids);
    3. ``config.json`` ``eos_token_id`` (top level, else ``text_config``);
    4. the tokenizer's ``eos_token_id`` (what z-lab/dflash HEAD stops on; vLLM adds it too).

    A target whose config says ``eos_token_id: 0`` while its chat turns end with the tokenizer's
    eos ``<|im_end|>`` thus stops at both.

    Args:
        target_dir: HF target folder.
        tokenizer: its tokenizer (loaded from ``target_dir`` when ``None``).

    Returns:
        ``(ids, by_source)``: the stop ids, and for the log/provenance which file declared which.

    Raises:
        InputError: no stop id anywhere.
    """
    target_dir = Path(target_dir)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    cfg = _read_json(target_dir / "config.json")
    by_source = {
        "generation_config.json": _eos_list(_read_json(target_dir / "generation_config.json").get("eos_token_id")),
        "gguf metadata": _eos_list(_read_json(target_dir / "dflash_eval_target.json").get("end_of_generation_ids")),
        "config.json": _eos_list(cfg.get("eos_token_id", (cfg.get("text_config") or {}).get("eos_token_id"))),
        "tokenizer eos": _eos_list(getattr(tokenizer, "eos_token_id", None)),
    }
    by_source = {k: v for k, v in by_source.items() if v}
    ids = list(dict.fromkeys(i for v in by_source.values() for i in v))
    if not ids:
        raise InputError(target_dir / "generation_config.json", "eos_token_id", "the target declares no end-of-generation "
                         "token (generation_config.json, config.json and the tokenizer have no eos)",
                         "set eos_token_id in generation_config.json (an int or a list)")
    return ids, by_source


def end_of_turn_ids(tokenizer) -> dict[int, str]:
    """Special tokens that end an assistant turn: the one the chat template puts right after an
    assistant message, plus :data:`END_OF_TURN_TOKENS` present in the vocabulary.

    Returns:
        ``{id: token text}`` (empty when there is no chat template and none of the known tokens).
    """
    out: dict[int, str] = {}
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    with contextlib.suppress(AttributeError):
        special |= {i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)}
    marker = "dflashevalmarker"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
                                             tokenize=False)
        after = text[text.rindex(marker) + len(marker):]
        first = tokenizer(after, add_special_tokens=False).input_ids[:1]
        if first and first[0] in special:
            out[int(first[0])] = tokenizer.convert_ids_to_tokens(first[0])
    except Exception:  # no template, or one that refuses this conversation
        pass
    vocab = tokenizer.get_vocab()
    for name in END_OF_TURN_TOKENS:
        if name in vocab and vocab[name] in special:
            out.setdefault(int(vocab[name]), name)
    return out


def cut_at_eos(new_ids: Sequence[int], eos_ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], str]:
    """Trim generated ids after the first stop id (kept) and classify the stop.

    Args:
        new_ids: generated ids of one sequence (may carry padding after the stop id).
        eos_ids: stop ids.
        max_new_tokens: the generation limit.

    Returns:
        ``(completion_ids, "eos")`` or ``(first max_new_tokens ids, "length")``.

    Raises:
        RuntimeError: fewer than ``max_new_tokens`` ids and no stop id (the generator stopped for another reason).
    """
    stops = set(int(e) for e in eos_ids)
    out: list[int] = []
    for t in new_ids[:max_new_tokens]:
        out.append(int(t))
        if out[-1] in stops:
            return out, STOP_EOS
    if len(out) < max_new_tokens:
        raise RuntimeError(f"generation stopped after {len(out)} < {max_new_tokens} tokens without a stop id")
    return out, STOP_LENGTH


# --------------------------------------------------------------------------- sources

class CompletionSource(abc.ABC):
    """Produces greedy completions of prompt token ids.

    A sequence ends at the first of :attr:`stop_ids` (included in the returned ids) or
    after :attr:`max_new_tokens` tokens.
    """

    stop_ids: list[int]
    max_new_tokens: int

    @abc.abstractmethod
    def run(self, prompts: Sequence[Sequence[int]], todo: set[int], emit: Emit) -> None:
        """Complete the prompts whose indices are in ``todo``.

        Args:
            prompts: every prompt of the set (token-id lists), so that batching does not depend
                on which ones are already done.
            todo: indices still to generate.
            emit: called as soon as a unit of work (a batch, a request) is done, with
                ``(index, completion_ids, stop_reason, extra_row_fields)`` tuples.
        """

    @abc.abstractmethod
    def provenance(self) -> dict:
        """The ``generation`` field of every row (deterministic: no timings, no URLs)."""

    def resume_key(self) -> dict:
        """What else must match for a partial file to be continued (beyond the provenance)."""
        return {}

    def close(self) -> None:
        """Release resources (servers, connections)."""


class DecodeSteps:
    """``generate(streamer=...)`` hook that logs a long batch's decode step every ``log_every`` seconds.

    A batch of ``rows`` prompts is one ``generate`` call: without this, a job's log shows nothing
    between two batches (minutes for 16 x 256 tokens on a loaded CPU). transformers calls
    :meth:`put` with the prompt ids ``[rows, P]`` first, then with each step's new tokens ``[rows]``
    (``StopCheck`` in ``transformers/generation/utils.py``); the tokens are not used, so the
    output is unchanged.
    """

    def __init__(self, rows: int, max_new_tokens: int, log_every: float = 60.0):
        self.rows, self.max_new_tokens, self.log_every = rows, max_new_tokens, log_every
        self.steps = -1  # the first put() is the prompt
        self.t0 = self.t_last = time.perf_counter()

    def put(self, value) -> None:
        self.steps += 1
        now = time.perf_counter()
        if self.steps > 0 and now - self.t_last >= self.log_every:
            self.t_last = now
            log.info("batch of %d prompts: decode step %d/%d, %.2f s per step", self.rows, self.steps,
                     self.max_new_tokens, (now - self.t0) / self.steps)

    def end(self) -> None:
        pass


class TransformersSource(CompletionSource):
    """Greedy ``model.generate`` of a local HF target, batched with left padding.

    Pure argmax decoding: ``do_sample=False``, one beam, and a *fresh*
    :class:`~transformers.GenerationConfig` holding only bos/eos/pad, so that
    logits processors a target's ``generation_config.json`` may carry
    (``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``, ...)
    cannot change the tokens: the cache and the replay assume the completion is
    the target's argmax at every position. Padding uses the tokenizer's pad token,
    else the first stop id; pad positions are masked with an explicit
    ``attention_mask`` (without one, HF infers the mask from ``pad_token_id`` and
    would mask a prompt's own ``<|im_end|>`` when pad == eos) and the model derives
    position ids from the mask, so left-padded rows match unpadded ones up to
    floating-point reduction order. On CPU the prefill runs each prompt
    alone, without padding (:func:`dflash_eval.target.prefill_unpadded`), and
    grouped KV heads are read in place rather than copied every step
    (:func:`dflash_eval.target.gqa_sdpa`): 3x less CPU time for the demo's
    SmolLM2 completions, same tokens (``tests/test_generate_fast_paths.py``).

    Args:
        model: loaded causal LM (eval mode, on its device).
        tokenizer: its tokenizer (pad token).
        max_new_tokens: generation limit per prompt.
        target_dir: the target folder (stop ids, error messages); default ``model.name_or_path``.
        stop_ids: stop ids; default :func:`stop_token_ids` of ``target_dir``.
        batch_size: prompts per ``generate`` call (:meth:`run`).
    """

    def __init__(self, model, tokenizer, max_new_tokens: int, target_dir: str | Path | None = None,
                 stop_ids: Sequence[int] | None = None, batch_size: int = 16):
        from transformers import GenerationConfig

        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = int(max_new_tokens)
        self.batch_size = int(batch_size)
        target_dir = target_dir or getattr(model, "name_or_path", ".")
        self.stop_ids = list(stop_ids) if stop_ids else stop_token_ids(target_dir, tokenizer)[0]
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else self.stop_ids[0]
        self.device = next(model.parameters()).device
        old = model.generation_config
        self.gen_config = GenerationConfig(
            do_sample=False, num_beams=1, max_new_tokens=self.max_new_tokens,
            eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
            bos_token_id=getattr(old, "bos_token_id", None))
        # generate() fills unset fields of the passed config from model.generation_config: make that one neutral too.
        model.generation_config = GenerationConfig(eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                                                   bos_token_id=getattr(old, "bos_token_id", None))
        self._key: dict = {}
        self.log_every = 60.0  # seconds between decode-step log lines of one batch (DecodeSteps)

    @torch.inference_mode()
    def generate(self, prompt_ids_batch: Sequence[Sequence[int]]) -> list[tuple[list[int], str]]:
        """Complete a batch: B prompts (token-id lists, lengths may differ) -> B ``(completion_ids, stop_reason)``."""
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
        from .target import gqa_sdpa, prefill_unpadded

        with gqa_sdpa(self.model):  # grouped KV heads read in place, not copied per step (bit-identical)
            cache = prefill_unpadded(self.model, prompt_ids_batch, P, P + self.max_new_tokens)  # CPU: no prefill on pads
            out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attn.to(self.device),
                                      past_key_values=cache, generation_config=self.gen_config,
                                      streamer=DecodeSteps(B, self.max_new_tokens, self.log_every))
        new = out[:, P:].cpu().tolist()
        return [cut_at_eos(row, self.stop_ids, self.max_new_tokens) for row in new]

    def run(self, prompts, todo, emit) -> None:
        """Length-sorted batches over *all* prompts; batches with nothing to do are skipped and a
        batch with some rows done is regenerated whole (same composition = same numerics)."""
        for batch in length_batches([len(p) for p in prompts], max_items=self.batch_size):
            if not any(i in todo for i in batch):
                continue
            outs = self.generate([prompts[i] for i in batch])
            emit([(i, ids, stop, {}) for i, (ids, stop) in zip(batch, outs) if i in todo])

    def provenance(self) -> dict:
        import transformers

        p = next(self.model.parameters())
        return {"source": "transformers", "transformers": transformers.__version__, "torch": torch.__version__,
                "device": str(p.device), "dtype": dtype_name(p.dtype), "stop_ids": self.stop_ids}

    def resume_key(self) -> dict:
        return {"batch_size": self.batch_size, "pad_id": self.pad_id, **self._key}

    def describe(self) -> dict:
        """Provenance plus settings that only go to the log."""
        return {**self.provenance(), "pad_id": self.pad_id, "max_new_tokens": self.max_new_tokens,
                "torch_threads": torch.get_num_threads(),
                "attn_implementation": getattr(self.model.config, "_attn_implementation", None)}


class ServerSource(CompletionSource):
    """Completions from a serving engine (:mod:`dflash_eval.serving`), ``concurrency`` requests in flight.

    Each request is one prompt's token ids; the returned ids are kept exactly
    (checked: they end at the first of the target's stop ids, or have exactly
    ``max_new_tokens`` ids). SGLang may drop the matched stop id from
    ``output_ids``; it is restored from ``finish_reason.matched``.

    Args:
        client: an :class:`~dflash_eval.serving.ServerClient` (probed with ``info()`` already).
        info: its :class:`~dflash_eval.serving.ServerInfo`.
        tokenizer: the target's tokenizer (text column; re-tokenization when allowed).
        max_new_tokens, stop_ids: limits; the stop ids are sent as ``stop_token_ids``.
        concurrency: requests in flight.
        allow_retokenize: accept a server that returns text only, re-tokenizing it (inexact).
        launch: settings of a server this job started (recorded in the provenance).
    """

    def __init__(self, client, info, tokenizer, max_new_tokens: int, stop_ids: Sequence[int], concurrency: int = 8,
                 allow_retokenize: bool = False, launch: dict | None = None, protocol: str = "openai"):
        self.client, self.info, self.tokenizer = client, info, tokenizer
        self.max_new_tokens = int(max_new_tokens)
        self.stop_ids = [int(i) for i in stop_ids]
        self.concurrency = max(1, int(concurrency))
        self.allow_retokenize = bool(allow_retokenize)
        self.launch = launch
        self.protocol = protocol
        self.n_retokenized = self.n_mismatch = 0
        self._lock = threading.Lock()
        eos = getattr(tokenizer, "eos_token_id", None)
        self._default_stop = eos if eos in self.stop_ids else self.stop_ids[0]

    def provenance(self) -> dict:
        prov = {"source": self.protocol, "engine": self.info.engine, "model": self.info.model,
                "server_version": self.info.version, "stop_ids": self.stop_ids}
        if self.launch:
            prov["served_by"] = {"serve": "vllm", **self.launch}
        return prov

    def resume_key(self) -> dict:
        return {"allow_retokenize": self.allow_retokenize}

    def to_completion(self, c) -> tuple[list[int], str, dict]:
        """Server answer -> ``(completion_ids, stop_reason, extra row fields)``, checked against the stop set.

        Raises:
            InputError: the server returned no ids and re-tokenization is not allowed.
            ServerError: ids that do not end at a stop id of the target while shorter than
                ``max_new_tokens``, or that run past a stop id (the server ignored the stop ids sent).
        """
        from .serving import ServerError

        stops = set(self.stop_ids)
        extra: dict = {}
        ids = c.ids
        if ids is None:
            if not self.allow_retokenize:
                raise InputError(None, "generation.source", f"the server at {self.client.url} returned no token ids "
                                 "(choices[].token_ids / output_ids), only text",
                                 "use a server that returns ids (vLLM >= 0.10: return_token_ids; SGLang /generate), "
                                 "or set generation.allow_retokenize: true to re-tokenize its text (inexact: the "
                                 "cache's argmax agreement will show the damage)")
            ids = list(self.tokenizer(c.text or "", add_special_tokens=False).input_ids)
            if c.finish == "stop" and (not ids or ids[-1] not in stops):
                ids.append(c.matched if c.matched in stops else self._default_stop)
            try:
                cut, stop = cut_at_eos(ids, self.stop_ids, self.max_new_tokens)
            except RuntimeError:  # short, without a stop id: the re-tokenization lost it
                cut, stop = ids, STOP_LENGTH
            mismatch = ((c.n_tokens is not None and len(ids) != int(c.n_tokens)) or len(cut) != len(ids)
                        or (stop == STOP_LENGTH and len(cut) != self.max_new_tokens))
            with self._lock:
                self.n_retokenized += 1
                self.n_mismatch += int(mismatch)
            return cut, stop, {"retokenized": True, "retokenize_mismatch": bool(mismatch)}
        if c.finish == "stop" and c.matched in stops and (not ids or ids[-1] != c.matched):
            ids = ids + [c.matched]
        try:
            cut, stop = cut_at_eos(ids, self.stop_ids, self.max_new_tokens)
        except RuntimeError:
            raise ServerError(
                f"the server stopped after {len(ids)} < {self.max_new_tokens} tokens (finish_reason {c.finish!r}, "
                f"last id {ids[-1] if ids else None}) without one of the target's stop ids {self.stop_ids}: it stops "
                "on ids or strings the target does not declare (check the server's --generation-config / "
                "default stop settings)") from None
        if len(cut) != len(ids):
            raise ServerError(f"the server returned {len(ids)} ids running past the stop id at position {len(cut) - 1} "
                              f"(stop ids sent: {self.stop_ids}); it ignores stop_token_ids")
        if stop == STOP_LENGTH and c.finish == "stop":
            raise ServerError(f"the server reports finish_reason 'stop' for {len(ids)} = max_new_tokens ids that end "
                              f"with id {ids[-1]}, not a stop id of the target {self.stop_ids}")
        return cut, stop, extra

    def _one(self, i: int, prompt: Sequence[int]):
        c = self.client.complete(prompt, self.max_new_tokens, self.stop_ids)
        ids, stop, extra = self.to_completion(c)
        return i, ids, stop, extra

    def run(self, prompts, todo, emit) -> None:
        ex = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="completions")
        futures = [ex.submit(self._one, i, prompts[i]) for i in sorted(todo, key=lambda i: (-len(prompts[i]), i))]
        try:
            for fut in as_completed(futures):
                emit([fut.result()])
        except BaseException:
            for f in futures:
                f.cancel()
            self.client.close()  # in-flight requests fail fast instead of holding the exit
            ex.shutdown(wait=False, cancel_futures=True)
            raise
        ex.shutdown(wait=True)

    def close(self) -> None:
        self.client.close()


#: completion source name (``generation.source``) -> class
SOURCES: dict[str, type[CompletionSource]] = {"transformers": TransformersSource, "openai": ServerSource,
                                              "sglang": ServerSource}


# --------------------------------------------------------------------------- resumable writer

class PartialCompletions:
    """Append-only sidecar ``<out dir>/.<out name>.partial`` (format: module docstring).

    Args:
        out: the final completions path.
        key: JSON-able dict; a sidecar written under another key is refused.
    """

    def __init__(self, out: str | Path, key: dict):
        self.out = Path(out)
        self.path = self.out.with_name(f".{self.out.name}.partial")
        self.key = json.loads(json.dumps(key))  # normalized (tuples -> lists)
        self._fh = None
        self._lock = threading.Lock()

    def load(self) -> dict[str, str]:
        """Open the sidecar for appending; return the rows already there (``{id: JSON line}``).

        A torn last line (the process died mid-write) is cut off; a sidecar without a
        complete header is started afresh.

        Raises:
            InputError: the sidecar was written under another key (differences named), or a
                complete line in it is not a row.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        done: dict[str, str] = {}
        if self.path.exists():
            data = self.path.read_bytes()
            end = data.rfind(b"\n") + 1
            if end < len(data):
                log.warning("%s: dropped a torn last line (%d bytes) left by an interrupted write", self.path,
                            len(data) - end)
                with open(self.path, "r+b") as fh:
                    fh.truncate(end)
                data = data[:end]
            lines = data.decode("utf-8").splitlines()
            header = None
            if lines:
                with contextlib.suppress(json.JSONDecodeError):
                    header = json.loads(lines[0])
            if not isinstance(header, dict) or header.get("format") != PARTIAL_FORMAT:
                log.warning("%s has no valid header; starting it afresh", self.path)
                self.path.unlink()
            else:
                if header.get("key") != self.key:
                    raise InputError(self.path, "key", "partial completions from an interrupted run with other settings: "
                                     + _key_diff(header.get("key") or {}, self.key),
                                     f"delete {self.path} to start over, or rerun with the settings it was made with")
                for n, line in enumerate(lines[1:], 2):
                    try:
                        row = json.loads(line)
                        rid = str(row["id"])
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise InputError(self.path, f"line {n}", "not a completions row",
                                         f"delete {self.path} to start over") from None
                    done.setdefault(rid, line)
        if not self.path.exists():
            with atomic_path(self.path) as tmp:
                tmp.write_text(json.dumps({"format": PARTIAL_FORMAT, "version": PARTIAL_VERSION, "key": self.key})
                               + "\n", encoding="utf-8")
        self._fh = open(self.path, "a", encoding="utf-8")
        return done

    def append(self, lines: Sequence[str]) -> None:
        """Append rows (JSON lines without newline) in one write, then flush and fsync."""
        if not lines:
            return
        with self._lock:
            self._fh.write("".join(line + "\n" for line in lines))
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def finish(self, ordered_lines: Sequence[str]) -> None:
        """Write the output (the given lines, in order) atomically, then delete the sidecar."""
        self.close()
        with atomic_path(self.out) as tmp:
            with open(tmp, "w", encoding="utf-8") as fh:
                for line in ordered_lines:
                    fh.write(line + "\n")
        self.path.unlink(missing_ok=True)


def _key_diff(old: dict, new: dict, prefix: str = "") -> str:
    diffs = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            if a != b:
                diffs.append(_key_diff(a, b, f"{prefix}{k}."))
        elif a != b:
            diffs.append(f"{prefix}{k} was {json.dumps(a)}, this run {json.dumps(b)}")
    return "; ".join(diffs)


# --------------------------------------------------------------------------- the stage

@dataclass
class ServerOptions:
    """Settings of the server sources (``generation.endpoint``, ``generation.serve``, ``generation.vllm``, ...).

    Attributes:
        url: base URL of the user's server (``generation.endpoint.url``); ``""`` with ``serve="vllm"``.
        model: served model name (``""`` = the server's only model).
        api_key_env: environment variable holding the API key (never logged or recorded).
        concurrency: requests in flight. timeout_s: per request, seconds. retries: per request.
        allow_retokenize: accept servers that return text only (re-tokenized; mismatch rate logged).
        serve: ``"none"`` or ``"vllm"`` (start vLLM on 127.0.0.1 for this job, stop it after).
        vllm_python, vllm_args, vllm_env, vllm_max_model_len, vllm_start_timeout_s: see
            :class:`dflash_eval.serving.VLLMServer` (max_model_len 0 = longest prompt + max_new_tokens,
            rounded up to 256).
        server_log: the served vLLM's log file (default ``<out>.vllm.log``); when no server is started,
            a given file gets one line saying so.
    """

    url: str = ""
    model: str = ""
    api_key_env: str = "DFLASH_EVAL_API_KEY"
    concurrency: int = 8
    timeout_s: float = 600.0
    retries: int = 8
    allow_retokenize: bool = False
    serve: str = "none"
    vllm_python: str = ".venv-vllm/bin/python"
    vllm_args: list[str] = field(default_factory=list)
    vllm_env: dict = field(default_factory=dict)
    vllm_max_model_len: int = 0
    vllm_start_timeout_s: float = 900.0
    server_log: str | None = None


def check_served_tokenizer(client, tokenizer, target_dir, prompt_rows: Sequence[dict] = ()) -> None:
    """Compare the server's tokenization with the target's on :data:`TOKENIZER_PROBE` (+ the eos
    token's text) and on the first prompt's templated text (whose ids must equal its ``prompt_ids``).

    Raises:
        InputError: the ids differ (first difference named).
    """
    probes = [(TOKENIZER_PROBE + (tokenizer.eos_token or ""),
               list(tokenizer(TOKENIZER_PROBE + (tokenizer.eos_token or ""), add_special_tokens=False).input_ids))]
    if prompt_rows and prompt_rows[0].get("text"):
        probes.append((prompt_rows[0]["text"], list(prompt_rows[0]["prompt_ids"])))
    for text, want in probes:
        got = client.tokenize(text)
        if got is None:
            log.warning("%s offers no /tokenize: the served tokenizer cannot be compared with the target's", client.url)
            return
        if got != want:
            k = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            g = got[k] if k < len(got) else None
            w = want[k] if k < len(want) else None
            raise InputError(Path(target_dir) / "tokenizer.json", "tokenizer",
                             f"the server's tokenizer differs from the target's: {text[:60]!r}... is {len(got)} ids on "
                             f"the server and {len(want)} with the target's tokenizer; first difference at token {k}: "
                             f"server {g} ({tokenizer.convert_ids_to_tokens(g) if g is not None else 'end'}) vs target "
                             f"{w} ({tokenizer.convert_ids_to_tokens(w) if w is not None else 'end'})",
                             "serve the configured target with its own tokenizer (vLLM: --tokenizer <target folder>), or "
                             "point target.path at the model the server serves")
    log.info("served tokenizer == target tokenizer on %d probe text(s)", len(probes))


@contextlib.contextmanager
def _open_source(source: str, target_dir: Path, rows: list[dict], max_new_tokens: int, batch_size: int, device: str,
                 dtype: str, linear_attn_backend: str, server: ServerOptions | None,
                 target_fingerprint: str | Path | None = None) -> Iterator[tuple]:
    """Yield ``(source, tokenizer, vocab_size)``; stops a served vLLM and closes clients on exit."""
    from .runtime import resolve_device, resolve_dtype

    if server is not None and server.server_log and (source == "transformers" or server.serve != "vllm"):
        # the rule declares this log for every source: say why it holds no server output
        Path(server.server_log).parent.mkdir(parents=True, exist_ok=True)
        Path(server.server_log).write_text(f"no server started by this job (generation.source: {source}, "
                                           f"generation.serve: {server.serve or 'none'})\n")
    if source == "transformers":
        from .target import TargetSpec, load_target, target_info

        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        spec = TargetSpec.read(target_dir, fingerprint_file=target_fingerprint)
        model, tok, kernel = load_target(spec, device=dev, dtype=dt, backend=linear_attn_backend)
        if kernel.backend != "none":
            log.info("linear-attention kernel: %s", kernel.backend)
        src = TransformersSource(model, tok, max_new_tokens, target_dir=target_dir, batch_size=batch_size)
        max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        longest = max(len(r["prompt_ids"]) for r in rows) + max_new_tokens
        if max_pos and longest > max_pos:
            log.warning("longest prompt + max_new_tokens = %d exceeds the target's max_position_embeddings %d",
                        longest, max_pos)
        src._key = {"weights_sha256": spec.weights_sha256(), "linear_attn_kernel": kernel.backend}
        log.info("completions source: %s", json.dumps(src.describe()))
        yield src, tok, target_info(model)["vocab_size"]
        return

    from transformers import AutoTokenizer

    from .serving import CLIENTS, VLLMServer, api_key_from_env

    server = server or ServerOptions()
    if not (target_dir / "config.json").is_file():
        raise InputError(target_dir, "config.json", "not an HF model folder (no config.json)",
                         "point target.path at the served model's HF folder (config + tokenizer)")
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    cfg = _read_json(target_dir / "config.json")
    vocab = int(cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size") or len(tok))
    stop_ids = stop_token_ids(target_dir, tok)[0]
    longest_row = max(rows, key=lambda r: len(r["prompt_ids"]))
    need = len(longest_row["prompt_ids"]) + max_new_tokens
    with contextlib.ExitStack() as stack:
        launch = None
        url = server.url
        if server.serve == "vllm":
            if source != "openai":
                raise InputError(None, "generation.serve", f"vllm serves the 'openai' protocol, not {source!r}",
                                 "set generation.source: openai")
            dev = resolve_device(device)
            dt = dtype_name(resolve_dtype(dtype, dev))
            mml = server.vllm_max_model_len or -(-need // 256) * 256
            vllm = VLLMServer(server.vllm_python, target_dir, dtype=dt, max_model_len=mml,
                              enforce_eager=dev.type == "cpu", extra_args=server.vllm_args, env=server.vllm_env,
                              log_path=server.server_log, start_timeout_s=server.vllm_start_timeout_s)
            stack.enter_context(vllm)
            url = vllm.url
            launch = {**vllm.describe(), "max_model_len": mml}
        elif server.serve not in ("none", "", None):
            raise InputError(None, "generation.serve", f"unknown value {server.serve!r}", "use none or vllm")
        if not url:
            raise InputError(None, "generation.endpoint.url", f"source {source!r} needs a server",
                             "set generation.endpoint.url to your server's base URL, or generation.serve: vllm")
        client = CLIENTS[source](url, model=server.model, api_key=api_key_from_env(server.api_key_env),
                                 timeout_s=server.timeout_s, retries=server.retries, concurrency=server.concurrency)
        stack.callback(client.close)
        info = client.info()
        log.info("server: %s %s, model %r, max model length %s", info.engine, info.version or "(version unknown)",
                 info.model, info.max_model_len)
        if info.max_model_len is not None and need > info.max_model_len:
            raise InputError(None, "generation.max_new_tokens",
                             f"the served model's max length is {info.max_model_len} tokens, below the longest prompt "
                             f"({longest_row['id']}: {len(longest_row['prompt_ids'])} tokens) + max_new_tokens "
                             f"{max_new_tokens} = {need}",
                             f"serve it with a max length >= {need} (vLLM --max-model-len, SGLang --context-length), "
                             "or lower generation.max_new_tokens / prompt_set.max_prompt_tokens")
        if info.max_model_len is None:
            log.warning("the server does not report its max model length; prompts + %d new tokens may be cut",
                        max_new_tokens)
        check_served_tokenizer(client, tok, target_dir, rows)
        src = ServerSource(client, info, tok, max_new_tokens, stop_ids, concurrency=server.concurrency,
                           allow_retokenize=server.allow_retokenize, launch=launch, protocol=source)
        log.info("completions source: %s (concurrency %d, timeout %.0f s, %d retries)",
                 json.dumps(src.provenance()), server.concurrency, server.timeout_s, server.retries)
        yield src, tok, vocab


def generate_completions(target_dir: str | Path, prompts_path: str | Path, out: str | Path, source: str = "transformers",
                         max_new_tokens: int = 256, batch_size: int = 16, device: str = "auto",
                         dtype: str = "auto", linear_attn_backend: str = "auto",
                         server: ServerOptions | None = None, target_fingerprint: str | Path | None = None) -> Path:
    """Greedy completions of every prompt in a prompts JSONL (format, sources and resume: module docstring).

    Completions are appended to the sidecar ``.<out name>.partial`` as they finish; the output
    is written in the prompts file's order (temp file + rename) once every prompt is done.
    A rerun after an interruption continues the sidecar (log: ``N already done``).

    Args:
        target_dir: HF target folder (server sources read only its config, tokenizer and stop ids).
        prompts_path: JSONL from the prompts stage (:func:`dflash_eval.prompts.read_prompts`).
        out: output JSONL.
        source: ``transformers`` | ``openai`` | ``sglang`` (:data:`SOURCES`).
        max_new_tokens: generated tokens per prompt at most (stop id included).
        batch_size: prompts per ``generate`` call (transformers source).
        linear_attn_backend: GDN kernel of hybrid targets ('auto'|'fla'|'torch', :mod:`dflash_eval.hybrid`);
            use the one the cache stage uses.
        device, dtype: see :func:`dflash_eval.runtime.resolve_device` / :func:`~dflash_eval.runtime.resolve_dtype`
            (``auto``: bf16 on CUDA, float32 on CPU); for ``serve: vllm`` they choose vLLM's ``--dtype``.
        server: server settings (:class:`ServerOptions`) for ``openai`` / ``sglang``.
        target_fingerprint: a ``target-fingerprint`` record (:func:`dflash_eval.target.write_fingerprint`), so the
            weights are not hashed again.

    Returns:
        ``Path(out)``.

    Raises:
        InputError: unknown source, bad limits, bad prompts file or target folder, prompt ids outside the
            vocabulary, a partial file from other settings, a server with another tokenizer or a too short
            max length, a server without token ids (unless allowed).
        ServerUnavailable / ServerError: the server failed (after retries); the partial file keeps
            what was done, a rerun resumes.
    """
    from .prompts import read_prompts

    if source not in SOURCES:
        raise InputError(None, "generation.source", f"unknown completion source {source!r}", f"use one of {sorted(SOURCES)}")
    if max_new_tokens < 1 or batch_size < 1:
        raise InputError(None, "generation.max_new_tokens" if max_new_tokens < 1 else "generation.batch_size",
                         "must be >= 1", "set a positive value")
    prompts_path, out, target_dir = Path(prompts_path), Path(out), Path(target_dir)
    rows = read_prompts(prompts_path)
    ids_seen: set[str] = set()
    for k, r in enumerate(rows):
        if str(r["id"]) in ids_seen:
            raise InputError(prompts_path, f"line {k + 1}: id", f"duplicate prompt id {r['id']!r}", "give every prompt a unique id")
        ids_seen.add(str(r["id"]))

    if server is not None and server.serve == "vllm" and not server.server_log:
        server = replace(server, server_log=f"{out}.vllm.log")  # the served vLLM's log beside the output
    with _open_source(source, target_dir, rows, max_new_tokens, batch_size, device, dtype, linear_attn_backend, server,
                      target_fingerprint) as (src, tok, vocab):
        for k, r in enumerate(rows):
            bad = [t for t in r["prompt_ids"] if not 0 <= t < vocab]
            if bad:
                raise InputError(prompts_path, f"line {k + 1}: prompt_ids", f"ids {bad[:5]} outside the target "
                                 f"vocabulary ({vocab})", "rebuild the prompts with this target's tokenizer")
        stop_ids, by_source = stop_token_ids(target_dir, tok)
        log.info("stop ids %s (%s); declared by %s", stop_ids, ", ".join(repr(tok.convert_ids_to_tokens(i))
                                                                         for i in stop_ids), json.dumps(by_source))
        eot = end_of_turn_ids(tok)
        missing = {i: t for i, t in eot.items() if i not in stop_ids}
        if missing:
            log.warning("the tokenizer ends chat turns with %s, which the target does not declare as end of "
                        "generation: completions may run past the end of the turn (add the id to "
                        "generation_config.json eos_token_id)", ", ".join(f"{t} (id {i})" for i, t in missing.items()))

        provenance = src.provenance()
        key = {"prompts_sha256": sha256_file(prompts_path).hexdigest(), "n_prompts": len(rows), "max_new_tokens": max_new_tokens,
               "generation": provenance, **src.resume_key()}
        partial = PartialCompletions(out, key)
        done: dict[str, str] = {}
        try:
            done.update(partial.load())
            unknown = set(done) - ids_seen
            if unknown:
                raise InputError(partial.path, "id", f"rows for prompts not in {prompts_path}: {sorted(unknown)[:5]}",
                                 f"delete {partial.path} to start over")
            todo = {i for i, r in enumerate(rows) if str(r["id"]) not in done}
            log.info("completions: %d prompts, %d already done (%s), %d to generate", len(rows), len(rows) - len(todo),
                     f"resumed from {partial.path}" if len(todo) < len(rows) else "fresh start", len(todo))
            n_new = n_gen = 0
            t0 = time.perf_counter()
            # tqdm bar on a terminal (total: at most max_new_tokens per prompt); off a terminal the
            # throttled INFO lines below are the progress, so the bar logs none of its own.
            bar = Progress(len(todo) * max_new_tokens, "completions", logger=log, log_every=float("inf"))

            def emit(results) -> None:
                nonlocal n_new, n_gen
                lines, toks = [], 0
                for i, ids, stop, extra in results:
                    r = rows[i]
                    row = {"id": r["id"], "prompt_ids": r["prompt_ids"], "completion_ids": ids,
                           "text": tok.decode(ids, skip_special_tokens=False), "stop_reason": stop,
                           "max_new_tokens": max_new_tokens, "generation": provenance, **extra}
                    line = json.dumps(row, ensure_ascii=False)
                    done[str(r["id"])] = line
                    lines.append(line)
                    toks += len(ids)
                partial.append(lines)
                n_gen += len(lines)
                n_new += toks
                bar.update(toks)
                el = max(time.perf_counter() - t0, 1e-9)
                if n_gen == len(todo) or len(lines) > 1 or n_gen % max(1, len(todo) // 20) == 0:
                    log.info("generated %d/%d prompts (%d done in all), %d new tokens, %.1f tokens/s", n_gen, len(todo),
                             len(done), n_new, n_new / el)

            try:
                src.run([r["prompt_ids"] for r in rows], todo, emit)
            finally:
                bar.close()
            elapsed = time.perf_counter() - t0
            partial.finish([done[str(r["id"])] for r in rows])
        except BaseException:
            partial.close()
            if partial.path.exists():
                log.error("interrupted: %d of %d prompts are done and kept in %s; rerun to resume", len(done),
                          len(rows), partial.path)
            raise
        finally:
            src.close()

    final = [json.loads(done[str(r["id"])]) for r in rows]
    n_eos = sum(1 for f in final if f["stop_reason"] == STOP_EOS)
    log.info("completions done: generated %d prompts (%d new tokens) in %.1f s = %.1f tokens/s; "
             "%d of %d stopped at a stop id, %d at max_new_tokens=%d", n_gen, n_new, elapsed,
             n_new / max(elapsed, 1e-9), n_eos, len(rows), len(rows) - n_eos, max_new_tokens)
    if isinstance(src, ServerSource) and src.n_retokenized:
        log.warning("re-tokenized %d completions from the server's text (generation.allow_retokenize): round-trip "
                    "mismatch rate %.3f (%d of them differ in length from what the server generated)",
                    src.n_retokenized, src.n_mismatch / src.n_retokenized, src.n_mismatch)
    if isinstance(src, ServerSource) and src.client.retry_counts:
        log.info("server requests retried: %s", json.dumps(src.client.retry_counts))
    early = {}
    for f in final:
        for t in f["completion_ids"][:-1]:
            if t in eot:
                early[f["id"]] = eot[t]
                break
    if early:
        log.warning("%d of %d completions contain an end-of-turn token before their end (%s): generation ran past "
                    "the end of the turn; the target's stop ids %s miss it (first: %s)", len(early), len(rows),
                    ", ".join(sorted(set(early.values()))), stop_ids, list(early)[:5])
    log.info("wrote %d completions -> %s", len(rows), out)
    return out


def read_completions(path: str | Path) -> list[dict]:
    """Parse the completions JSONL (InputError with the line number on malformed lines)."""
    path = Path(path)
    if not path.exists():
        raise InputError(path, None, "completions file not found", "run the completions rule first")
    rows = []
    with open(path, encoding="utf-8") as fh:
        for n, r in iter_jsonl(fh, path, fix="regenerate the completions"):
            for k in ("id", "prompt_ids", "completion_ids", "max_new_tokens"):
                if k not in r:
                    raise InputError(path, f"line {n}: {k}", "missing", "regenerate the completions")
            if not r["prompt_ids"]:
                raise InputError(path, f"line {n}: prompt_ids", "empty prompt", "drop the sample")
            rows.append(r)
    if not rows:
        raise InputError(path, None, "no samples", "check the prompt set and completions stage")
    return rows
