"""Where completions come from: the sources of the ``completions`` stage, and the target's stop ids.

Sources (:data:`SOURCES`): :class:`TransformersSource` (HF ``generate`` of the local target) and
:class:`ServerSource` (a vLLM / SGLang server through :mod:`dflash_eval.serving.clients`, at
``generation.endpoint.url`` or started by the job, :func:`open_source`). Each returns, per prompt,
the generated ids up to and including the first stop id (:func:`cut_at_eos`), never a
re-tokenization of text (the file format: :mod:`dflash_eval.data.completions`).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from dflash_eval.core.errors import InputError
from dflash_eval.core.runtime import dtype_name, length_batches, resolve_device, resolve_dtype
from dflash_eval.data.completions import STOP_EOS, STOP_LENGTH
from dflash_eval.replay.sampling import generation_sampling
from dflash_eval.serving.clients import CLIENTS, ServerError, VLLMServer, api_key_from_env
from dflash_eval.target import model as target_model  # its functions looked up at call time (tests replace the fast paths)
from dflash_eval.target.spec import TargetSpec

log = logging.getLogger(__name__)

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


def load_tokenizer(target_dir: str | Path):
    """The target folder's tokenizer (``AutoTokenizer.from_pretrained``)."""
    from transformers import AutoTokenizer  # deferred: --help stays transformers-free (tests/core/test_startup.py)

    return AutoTokenizer.from_pretrained(str(target_dir))


def stop_token_ids(target_dir: str | Path, tokenizer=None) -> tuple[list[int], dict[str, list[int]]]:
    """Every end-of-generation id the target declares anywhere, in this order (duplicates dropped).

    1. ``generation_config.json`` ``eos_token_id`` (int or list) — what HF ``generate`` and
       ``dflash==0.1.0`` stop on; for GGUF targets :func:`dflash_eval.target.model.convert_gguf` writes
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
        tokenizer = load_tokenizer(target_dir)
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
    """A ``generate`` logits processor that logs a long batch's decode step every ``log_every`` seconds.

    A batch of ``rows`` prompts is one ``generate`` call: without this, a job's log shows nothing
    between two batches (minutes for 16 x 256 tokens on a loaded CPU). transformers calls every
    logits processor once per decode step with ``(input_ids [rows, t], scores [rows, V])``; this one
    counts the call and returns ``scores`` itself, so the tokens are unchanged. Not a ``streamer``:
    transformers hands a streamer each step's tokens as ``tokens.cpu()`` (``StopCheck`` in
    ``transformers/generation/utils.py``), one more host-device synchronisation per step.
    """

    def __init__(self, rows: int, max_new_tokens: int, log_every: float = 60.0):
        self.rows, self.max_new_tokens, self.log_every = rows, max_new_tokens, log_every
        self.steps = 0
        self.t0 = self.t_last = time.perf_counter()

    def __call__(self, input_ids, scores):
        self.steps += 1
        now = time.perf_counter()
        if now - self.t_last >= self.log_every:
            self.t_last = now
            log.info("batch of %d prompts: decode step %d/%d, %.2f s per step", self.rows, self.steps,
                     self.max_new_tokens, (now - self.t0) / self.steps)
        return scores


class TransformersSource(CompletionSource):
    """Greedy (or, with ``sampling``, seeded sampled) ``model.generate`` of a local HF target, left-padded batches.

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
    alone, without padding (:func:`dflash_eval.target.model.prefill_unpadded`), and
    grouped KV heads are read in place rather than copied every step
    (:func:`dflash_eval.target.model.gqa_sdpa`): 3x less CPU time for the demo's
    SmolLM2 completions, same tokens (``tests/serving/test_generate_fast_paths.py``).

    Args:
        model: loaded causal LM (eval mode, on its device).
        tokenizer: its tokenizer (pad token).
        max_new_tokens: generation limit per prompt.
        target_dir: the target folder (stop ids, error messages); default ``model.name_or_path``.
        stop_ids: stop ids; default :func:`stop_token_ids` of ``target_dir``.
        batch_size: prompts per ``generate`` call (:meth:`run`).
        sampling: ``generation.sampling`` (:func:`dflash_eval.replay.sampling.generation_sampling`); above temperature
            0 ``do_sample`` with the reference's filter as the only warper, seeded per batch (:meth:`run`).
    """

    def __init__(self, model, tokenizer, max_new_tokens: int, target_dir: str | Path | None = None,
                 stop_ids: Sequence[int] | None = None, batch_size: int = 16, sampling: dict | None = None):
        from transformers import GenerationConfig  # deferred: --help stays transformers-free (tests/core/test_startup.py)

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
        self.sampling, self.processors = generation_sampling(sampling)
        sample = bool(self.processors)  # the reference's filter as the only warper (sampling.hf_logits_processor)
        self.gen_config = GenerationConfig(
            do_sample=sample, num_beams=1, max_new_tokens=self.max_new_tokens,
            eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
            bos_token_id=getattr(old, "bos_token_id", None), **({"temperature": 1.0, "top_k": 0, "top_p": 1.0}
                                                                 if sample else {}))
        # generate() fills unset fields of the passed config from model.generation_config: make that one neutral too.
        model.generation_config = GenerationConfig(eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                                                   bos_token_id=getattr(old, "bos_token_id", None))
        self._key: dict = {}
        self.log_every = 60.0  # seconds between decode-step log lines of one batch (DecodeSteps)

    @torch.inference_mode()
    def generate(self, prompt_ids_batch: Sequence[Sequence[int]], seed: int = 0) -> list[tuple[list[int], str]]:
        """Complete a batch: B prompts (token-id lists, lengths may differ) -> B ``(completion_ids, stop_reason)``;
        when sampling, ``torch.manual_seed(seed)`` first (the draws then depend on the batch's composition)."""
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
        with target_model.gqa_sdpa(self.model):  # grouped KV heads read in place, not copied per step (bit-identical)
            cache = target_model.prefill_unpadded(self.model, prompt_ids_batch, P, P + self.max_new_tokens)  # CPU: no prefill on pads
            if self.processors:
                torch.manual_seed(seed)
            steps = DecodeSteps(B, self.max_new_tokens, self.log_every)  # last: it sees the final scores
            out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attn.to(self.device),
                                      past_key_values=cache, generation_config=self.gen_config,
                                      logits_processor=[*self.processors, steps])  # generate() merges a plain list
        new = out[:, P:].cpu().tolist()
        return [cut_at_eos(row, self.stop_ids, self.max_new_tokens) for row in new]

    def run(self, prompts, todo, emit) -> None:
        """Length-sorted batches over *all* prompts; batches with nothing to do are skipped and a
        batch with some rows done is regenerated whole (same composition = same numerics)."""
        for batch in length_batches([len(p) for p in prompts], max_items=self.batch_size):
            if not any(i in todo for i in batch):
                continue
            outs = self.generate([prompts[i] for i in batch], seed=int(self.sampling.get("seed") or 0) + batch[0])
            emit([(i, ids, stop, {}) for i, (ids, stop) in zip(batch, outs) if i in todo])

    def provenance(self) -> dict:
        p = next(self.model.parameters())
        return {"source": "transformers", "transformers": metadata.version("transformers"), "torch": torch.__version__,
                "device": str(p.device), "dtype": dtype_name(p.dtype), "stop_ids": self.stop_ids,
                **({"sampling": self.sampling} if self.processors else {})}

    def resume_key(self) -> dict:
        return {"batch_size": self.batch_size, "pad_id": self.pad_id, **self._key}

    def describe(self) -> dict:
        """Provenance plus settings that only go to the log."""
        return {**self.provenance(), "pad_id": self.pad_id, "max_new_tokens": self.max_new_tokens,
                "torch_threads": torch.get_num_threads(),
                "attn_implementation": getattr(self.model.config, "_attn_implementation", None)}


class ServerSource(CompletionSource):
    """Completions from a serving engine (:mod:`dflash_eval.serving.clients`), ``concurrency`` requests in flight.

    Each request is one prompt's token ids; the returned ids are kept exactly
    (checked: they end at the first of the target's stop ids, or have exactly
    ``max_new_tokens`` ids). SGLang may drop the matched stop id from
    ``output_ids``; it is restored from ``finish_reason.matched``.

    Args:
        client: an :class:`~dflash_eval.serving.clients.ServerClient` (probed with ``info()`` already).
        info: its :class:`~dflash_eval.serving.clients.ServerInfo`.
        tokenizer: the target's tokenizer (text column; re-tokenization when allowed).
        max_new_tokens, stop_ids: limits; the stop ids are sent as ``stop_token_ids``.
        concurrency: requests in flight.
        allow_retokenize: accept a server that returns text only, re-tokenizing it (inexact).
        launch: settings of a server this job started (recorded in the provenance).
    """

    def __init__(self, client, info, tokenizer, max_new_tokens: int, stop_ids: Sequence[int], concurrency: int = 8,
                 allow_retokenize: bool = False, launch: dict | None = None, protocol: str = "openai",
                 sampling: dict | None = None):
        self.client, self.info, self.tokenizer = client, info, tokenizer
        self.sampling, sampled = generation_sampling(sampling)
        self.sampling = self.sampling if sampled else None
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
        if self.sampling:
            prov["sampling"] = self.sampling
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
        c = self.client.complete(prompt, self.max_new_tokens, self.stop_ids, sampling=self.sampling and {
            **self.sampling, "seed": int(self.sampling["seed"]) + i})
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
def open_source(opts, target_dir: Path, rows: list[dict], server_log: str | None = None,
                target_fingerprint: str | Path | None = None) -> Iterator[tuple]:
    """Open the completions source ``opts.source`` and yield ``(source, tokenizer, vocab_size)``.

    Args:
        opts: the ``completions`` stage's options (config section ``generation`` and
            ``target.linear_attn_backend``, :mod:`dflash_eval.core.options`).
        target_dir: the target HF folder (server sources read only its config, tokenizer and stop ids).
        rows: the prompts (their lengths size vLLM's ``--max-model-len`` and are checked against the server's).
        server_log: the served vLLM's log file; when no server is started here, a given file gets one
            line saying so (the workflow declares it for every source).
        target_fingerprint: a ``target-fingerprint`` record (the weights are not hashed again).

    On exit a served vLLM is stopped and clients are closed.

    Raises:
        InputError: no server for a server source, a served model shorter than the longest prompt +
            ``max_new_tokens``, a server with another tokenizer.
    """
    source, max_new_tokens = opts.source, opts.max_new_tokens
    if server_log and (source == "transformers" or opts.serve != "vllm"):
        # the rule declares this log for every source: say why it holds no server output
        Path(server_log).parent.mkdir(parents=True, exist_ok=True)
        Path(server_log).write_text(f"no server started by this job (generation.source: {source}, "
                                    f"generation.serve: {opts.serve or 'none'})\n")
    if source == "transformers":
        dev = resolve_device(opts.device)
        dt = resolve_dtype(opts.dtype, dev)
        spec = TargetSpec.read(target_dir, fingerprint_file=target_fingerprint)
        model, tok, kernel = target_model.load_target(spec, device=dev, dtype=dt, backend=opts.linear_attn_backend,
                                          devices=opts.devices, max_memory=opts.max_memory)
        if kernel.backend != "none":
            log.info("linear-attention kernel: %s", kernel.backend)
        longest = max(len(r["prompt_ids"]) for r in rows) + max_new_tokens
        batch = opts.batch_size or target_model.decode_batch_size(model, longest - max_new_tokens, max_new_tokens)  # logged there
        src = TransformersSource(model, tok, max_new_tokens, target_dir=target_dir, batch_size=batch,
                                 sampling=dataclasses.asdict(opts.sampling))
        max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if max_pos and longest > max_pos:
            log.warning("longest prompt + max_new_tokens = %d exceeds the target's max_position_embeddings %d",
                        longest, max_pos)
        src._key = {"weights_sha256": spec.weights_sha256(), "linear_attn_kernel": kernel.backend}
        log.info("completions source: %s", json.dumps(src.describe()))
        yield src, tok, target_model.target_info(model)["vocab_size"]
        return

    if not (target_dir / "config.json").is_file():
        raise InputError(target_dir, "config.json", "not an HF model folder (no config.json)",
                         "point target.path at the served model's HF folder (config + tokenizer)")
    tok = load_tokenizer(target_dir)
    cfg = _read_json(target_dir / "config.json")
    vocab = int(cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size") or len(tok))
    stop_ids = stop_token_ids(target_dir, tok)[0]
    longest_row = max(rows, key=lambda r: len(r["prompt_ids"]))
    need = len(longest_row["prompt_ids"]) + max_new_tokens
    with contextlib.ExitStack() as stack:
        launch = None
        url = opts.endpoint.url
        if opts.serve == "vllm":
            if source != "openai":
                raise InputError(None, "generation.serve", f"vllm serves the 'openai' protocol, not {source!r}",
                                 "set generation.source: openai")
            dev = resolve_device(opts.device)
            dt = dtype_name(resolve_dtype(opts.dtype, dev))
            mml = opts.vllm.max_model_len or -(-need // 256) * 256
            vllm = VLLMServer(opts.vllm.python, target_dir, dtype=dt, max_model_len=mml,
                              enforce_eager=dev.type == "cpu", extra_args=list(opts.vllm.args),
                              env={k: str(v) for k, v in opts.vllm.env.items()},
                              log_path=server_log, start_timeout_s=opts.vllm.start_timeout_s)
            stack.enter_context(vllm)
            url = vllm.url
            launch = {**vllm.describe(), "max_model_len": mml}
        if not url:
            raise InputError(None, "generation.endpoint.url", f"source {source!r} needs a server",
                             "set generation.endpoint.url to your server's base URL, or generation.serve: vllm")
        client = CLIENTS[source](url, model=opts.endpoint.model, api_key=api_key_from_env(opts.endpoint.api_key_env),
                                 timeout_s=opts.timeout_s, retries=opts.retries, concurrency=opts.concurrency)
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
        src = ServerSource(client, info, tok, max_new_tokens, stop_ids, concurrency=opts.concurrency,
                           allow_retokenize=opts.allow_retokenize, launch=launch, protocol=source,
                           sampling=dataclasses.asdict(opts.sampling))
        log.info("completions source: %s (concurrency %d, timeout %.0f s, %d retries)",
                 json.dumps(src.provenance()), opts.concurrency, opts.timeout_s, opts.retries)
        yield src, tok, vocab
