"""Prompt sets of every source (:mod:`dflash_eval.data.prompts`, :mod:`dflash_eval.data.long_context`) with the
selection per context-length bin, and the templating of chat messages with tools.

Selection. Without ``context_bins`` the sources keep the seeded walk of :mod:`dflash_eval.data.prompts`
(``random.Random(seed)`` shuffle of the source order, take ``n`` whose templated length is
``<= max_prompt_tokens``). With ``context_bins`` (ascending lower edges in templated tokens; bin k =
``[edge_k, edge_k+1)``, the last ``[edge_last, max_prompt_tokens]``) the candidates are ordered by the
sha256 of their content -- the canonical JSON (``sort_keys``, ``separators=(",", ":")``, UTF-8) of the raw
prompt or message list (followed by the tools' when given; for ``repository`` the folder and its files'
paths and sha256, so that no text is built before it is needed) -- and each bin takes the first ``per_bin``
candidates whose templated length falls in it (as vllm-project/speculators PR #1107 ``scripts/evaluate/``
picks per length bin). So a rerun picks the same prompts, and a larger ``per_bin`` or an added bin (below
the first edge, or above the last with ``max_prompt_tokens`` raised) gives a superset. Identical contents
are taken once. Templating and tokenizing are lazy, in hash order, stopping when every bin is full; a
candidate is skipped untokenized when its raw text exceeds :data:`MAX_CHARS_PER_TOKEN` characters per
token of the top bound (no tokenizer averages more on text or code), or when its templated UTF-8 bytes
(an upper bound on its tokens, plus :func:`_slack`) cannot reach the first edge or only reach full bins.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from pathlib import Path

from jinja2 import TemplateError  # the chat templates' engine (transformers renders them with it)

from dflash_eval.core.errors import InputError
from dflash_eval.data import prompts as P
from dflash_eval.data.long_context import (LONG_SOURCES, Candidate, conversation_candidates, plain_candidates,
                                           repository_candidates, trajectory_candidates)

log = logging.getLogger(__name__)

#: every ``--source`` of the prompts stage
ALL_SOURCES = P.SOURCES + LONG_SOURCES
#: bound on a tokenizer's average characters per token over a long text (real ones: 3-5 on code and prose)
MAX_CHARS_PER_TOKEN = 10

SKIP_REASONS = P.SKIP_REASONS  #: the codes of every source (the report names them)


# --------------------------------------------------------------------------- templating

_TEMPLATE_FIX = ("use a target whose chat template renders tool calls and tool results (e.g. Qwen3, Llama-3.1), "
                 "or leave tool calls and tool messages out of the trajectories")


def render(tok, c: Candidate, enable_thinking: bool, tokenizer_dir: str | Path = "tokenizer") -> str:
    """The chat-templated text of a candidate (``apply_chat_template(messages, tools=...,
    add_generation_prompt=True, enable_thinking=...)``, as :func:`dflash_eval.data.prompts.template_prompt`).

    Raises:
        InputError: the template fails on the messages, or (a trajectory) leaves out a tool call's name, a
            tool result or the tools: names the file, line and field.
    """
    msgs = c.messages()
    kw = {"tools": c.tools} if c.tools else {}
    file, line = c.where if c.where else (tokenizer_dir, None)
    at = f"line {line}: " if line else ""
    try:
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                       enable_thinking=enable_thinking, **kw)
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as err:
        j = next((j for j, m in enumerate(msgs) if m.get("tool_calls") or m["role"] == "tool"), None)
        field = f"{at}messages[{j}]" + (".tool_calls" if msgs[j].get("tool_calls") else "") if j is not None \
            else f"{at}messages"
        raise InputError(file, field, f"the chat template of {tokenizer_dir} cannot render {c.id} "
                         f"({type(err).__name__}: {err})", _TEMPLATE_FIX if j is not None else
                         "use messages the target's chat template accepts") from None
    if c.where:
        for j, m in enumerate(msgs):
            for call in m.get("tool_calls") or ():
                if call["function"]["name"] not in text:
                    raise InputError(file, f"{at}messages[{j}].tool_calls", f"the chat template of {tokenizer_dir} "
                                     f"drops the tool call {call['function']['name']!r}", _TEMPLATE_FIX)
            forms = (m["content"].strip(), json.dumps(m["content"], ensure_ascii=False),
                     json.dumps(m["content"])) if m["role"] == "tool" else ()
            if forms and not any(f in text for f in forms):  # verbatim, or as JSON (Llama 3.1's tojson)
                raise InputError(file, f"{at}messages[{j}].content", f"the chat template of {tokenizer_dir} drops the "
                                 "tool result", _TEMPLATE_FIX)
        for t in c.tools or ():
            name = (t.get("function") or t).get("name")
            if isinstance(name, str) and name not in text:
                raise InputError(file, f"{at}tools", f"the chat template of {tokenizer_dir} ignores the tools "
                                 f"({name!r} is not in the text)", _TEMPLATE_FIX)
    return text


def _slack(c: Candidate) -> int:
    """Tokens a text may hold beyond its UTF-8 byte count (SentencePiece's added word-start marks)."""
    return 16 + 4 * len(c.messages())


def _raw_prompt(msgs: list[dict]) -> str:
    """The row's ``prompt``: the last user turn's text ('' when there is none)."""
    return next((m["content"] for m in reversed(msgs) if m["role"] == "user"), "")


def _row(c: Candidate, source: str, text: str, ids: list[int]) -> dict:
    return {"id": c.id, "source": source, "prompt": _raw_prompt(c.messages()), "text": text, "prompt_ids": ids}


def _tokens(tok, text: str) -> list[int]:
    return [int(t) for t in tok(text, add_special_tokens=False).input_ids]


# --------------------------------------------------------------------------- selection

def bin_bounds(context_bins: list[int], upper: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]`` inclusive token bounds of the bins: ``[edge_k, edge_k+1 - 1]``, the last ``[edge, upper]``.

    Raises:
        InputError: edges not strictly ascending or not positive, or ``upper`` not above the last edge.
    """
    if any(e < 1 for e in context_bins) or any(b <= a for a, b in zip(context_bins, context_bins[1:])):
        raise InputError(None, "prompt_sets.<name>.context_bins", f"{context_bins} is not strictly ascending and positive",
                         "list the bins' lower edges in templated tokens, ascending, e.g. [2048, 4096, 8192]")
    if upper <= context_bins[-1]:
        raise InputError(None, "prompt_sets.<name>.max_prompt_tokens", f"{upper} does not exceed the last bin edge "
                         f"{context_bins[-1]}", "raise max_prompt_tokens above the last edge, or 0 (up to the target's "
                         "positions less generation.max_new_tokens)")
    return [(lo, hi - 1) for lo, hi in zip(context_bins, context_bins[1:])] + [(context_bins[-1], upper)]


def _longer_than(tok, text: str, limit: int, ratio: float) -> bool:
    """Whether a head of ``text`` -- cut after the newline nearest before ``1.25 x limit x ratio`` characters (``ratio``:
    characters per token seen so far) -- already holds more than ``limit + 2`` tokens, so that the whole text does
    too: the pieces before a line start tokenize alike in the head and the whole text (the tokenizers' pre-tokenizers
    split there), and the cut line's first piece may take 2 tokens more. ``ratio`` only sets how much is tokenized,
    never the answer. False when the head would be the whole text."""
    x = int(1.25 * limit * ratio)
    cut = text.rfind("\n", 0, x) + 1 if x < len(text) else 0
    if cut <= 0:
        return False
    return len(tok(text[:cut], add_special_tokens=False).input_ids) > limit + 2


def select_binned(cands: list[Candidate], tok, bounds: list[tuple[int, int]], per_bin: int, source: str,
                  enable_thinking: bool, skipped: Counter, tokenizer_dir: str | Path = "tokenizer",
                  batch: int = 8) -> tuple[list[dict], list[dict]]:
    """The rows of each bin (module docstring: hash order, first ``per_bin`` per bin), bin by bin.

    The candidates that pass the untokenized checks are tokenized ``batch`` at a time (one ``tokenizer(list)``
    call: the Rust tokenizer's threads), then taken in hash order: the same rows as one at a time.

    Returns:
        ``(rows, bins)``: rows in bin order, then hash order; per bin ``{"lo", "hi", "candidates", "taken"}``
        (``candidates``: those tokenized on the walk whose length fell in the bin -- all of them when it is short).
    """
    order = sorted(cands, key=lambda c: (c.key, c.id))
    taken: list[list[dict]] = [[] for _ in bounds]
    met = [0] * len(bounds)
    keys: set = set()
    groups: set = set()
    top = bounds[-1][1]

    def full(k: int) -> bool:
        return len(taken[k]) >= per_bin

    def flush(pending: list[tuple[Candidate, str]]) -> None:
        if not pending:
            return
        nonlocal ratio
        for (c, text), ids in zip(pending, tok([t for _, t in pending], add_special_tokens=False).input_ids):
            k = next((k for k, (lo, hi) in enumerate(bounds) if lo <= len(ids) <= hi), None)
            if k is None:
                skipped["too_short" if len(ids) < bounds[0][0] else "too_long"] += 1
                continue
            seen[0] += len(text)
            seen[1] += len(ids)
            met[k] += 1
            if full(k):
                skipped["bin_full"] += 1
                continue
            taken[k].append(_row(c, source, text, [int(t) for t in ids]))
        pending.clear()
        ratio = seen[0] / max(seen[1], 1) if seen[1] else ratio

    pending: list[tuple[Candidate, str]] = []
    seen, ratio = [0, 0], 4.0  # characters and tokens of the texts tokenized so far (:func:`_longer_than`'s cut)
    for c in order:
        if all(full(k) for k in range(len(bounds))):
            break
        if c.key in keys or (c.group is not None and c.group in groups):
            skipped["duplicate_content"] += 1
            continue
        keys.add(c.key)
        if c.group is not None:
            groups.add(c.group)
        if c.chars > MAX_CHARS_PER_TOKEN * top:
            skipped["too_long"] += 1
            continue
        text = render(tok, c, enable_thinking, tokenizer_dir)
        most = len(text.encode("utf-8")) + _slack(c)  # tokens <= bytes (+ slack)
        if most < bounds[0][0]:
            skipped["too_short"] += 1
            continue
        if all(full(k) for k, (lo, _) in enumerate(bounds) if lo <= most):
            skipped["bin_full"] += 1
            continue
        if _longer_than(tok, text, top, ratio):
            skipped["too_long"] += 1
            continue
        pending.append((c, text))
        if len(pending) >= batch:
            flush(pending)
    flush(pending)
    bins = [{"lo": lo, "hi": hi, "candidates": met[k], "taken": len(taken[k])} for k, (lo, hi) in enumerate(bounds)]
    return [r for t in taken for r in t], bins


def select_walk(cands: list[Candidate], tok, n: int, seed: int, max_prompt_tokens: int, source: str,
                enable_thinking: bool, skipped: Counter, tokenizer_dir: str | Path = "tokenizer") -> list[dict]:
    """The seeded walk of :mod:`dflash_eval.data.prompts` over candidates in source order (``random.Random(seed)``
    shuffle, take ``n`` (0 = all) of ``<= max_prompt_tokens`` templated tokens (0 = no limit))."""
    order = list(range(len(cands)))
    random.Random(seed).shuffle(order)
    rows: list[dict] = []
    for i in order:
        if n and len(rows) >= n:
            break
        c = cands[i]
        if max_prompt_tokens and c.chars > MAX_CHARS_PER_TOKEN * max_prompt_tokens:
            skipped["too_long"] += 1
            continue
        text = render(tok, c, enable_thinking, tokenizer_dir)
        ids = _tokens(tok, text)
        if max_prompt_tokens and len(ids) > max_prompt_tokens:
            skipped["too_long"] += 1
            continue
        rows.append(_row(c, source, text, ids))
    return rows


# --------------------------------------------------------------------------- a set

def build_set_with_meta(source: str, tokenizer_dir: str | Path, n: int, seed: int, path: str | Path | None = None,
                        enable_thinking: bool = False, max_prompt_tokens: int = 0,
                        turn1_completions: str | Path | None = None, context_bins: list[int] | tuple = (),
                        per_bin: int = 0, set_name: str = "<name>") -> tuple[list[dict], dict]:
    """Build one prompt set of any source (:data:`ALL_SOURCES`), with or without context bins.

    The other sources without ``context_bins`` go to
    :func:`dflash_eval.data.prompts.build_prompt_set_with_meta` unchanged (same rows, same meta).

    Args:
        n, seed: the seeded walk's (used only without ``context_bins``).
        max_prompt_tokens: without bins, the walk's length filter (0 = none); with bins, the last bin's
            upper bound (inclusive; resolved by the caller, > the last edge).
        context_bins: ascending lower edges in templated tokens (empty = the seeded walk).
        per_bin: prompts per bin (with ``context_bins``).
        set_name: the prompt set's name, for the config entries named in errors.
        the others: as :func:`dflash_eval.data.prompts.build_prompt_set_with_meta`.

    Returns:
        ``(rows, meta)``: rows ``{id, source, prompt, text, prompt_ids}`` (bin by bin, hash order within a
        bin; or walk order) and the meta of :func:`dflash_eval.data.prompts.build_prompt_set_with_meta`
        plus, with bins, ``context_bins``, ``per_bin`` and ``bins`` (per bin ``lo``, ``hi`` inclusive tokens,
        ``candidates`` met in it, ``taken``), and for ``repository`` ``directory``, ``python``, ``files``.

    Raises:
        InputError: the loaders' errors; bad bins or per_bin (naming ``prompt_sets.<set_name>.context_bins``);
            a bin that no candidate falls in; no prompt at all.
    """
    context_bins = list(context_bins or ())
    if not context_bins and source not in LONG_SOURCES:
        return P.build_prompt_set_with_meta(source, tokenizer_dir, n, seed, path, enable_thinking, max_prompt_tokens,
                                            turn1_completions)
    field = f"prompt_sets.{set_name}.context_bins"
    if context_bins and per_bin < 1:
        raise InputError(None, f"prompt_sets.{set_name}.per_bin", "context_bins needs per_bin >= 1",
                         "set per_bin: the prompts each bin takes")
    if context_bins:
        try:
            bounds = bin_bounds(context_bins, max_prompt_tokens)
        except InputError as err:
            raise InputError(err.file, err.field.replace("<name>", set_name), err.problem, err.fix) from None
    tok = P._load_tokenizer(tokenizer_dir)
    P.check_thinking(tok, enable_thinking)
    skipped: Counter = Counter()
    extra: dict = {}
    if source == "conversation":
        cands = conversation_candidates(path, skipped)
    elif source == "repository":
        cands, extra = repository_candidates(path)
    elif source == "trajectory":
        cands = trajectory_candidates(path, skipped)
    elif source == "mt-bench-turn2":
        if not turn1_completions:
            raise InputError(None, f"prompt_sets.{set_name}.turn1", "source 'mt-bench-turn2' needs the first turn's "
                             "completions", "name the mt-bench prompt set whose answers open the second turn")
        cands = plain_candidates(P.mt_bench_turn2_items(P.read_completions(turn1_completions), tok, path,
                                                        turn1_completions))
    else:
        cands = plain_candidates(P.load_source(source, path, skipped))
    where = f"{source} ({path})" if path else source
    meta = {"source": source, "path": str(path) if path else None, "n": n, "seed": seed,
            "max_prompt_tokens": max_prompt_tokens, "available": len(cands)}
    if context_bins:
        rows, bins = select_binned(cands, tok, bounds, per_bin, source, enable_thinking, skipped, tokenizer_dir)
        for b in bins:
            log.info("%s: bin [%d, %d] tokens: %d candidates met, %d taken", where, b["lo"], b["hi"],
                     b["candidates"], b["taken"])
        empty = [b for b in bins if not b["taken"]]
        if empty:
            raise InputError(path or source, field, "no candidate of " + str(len(cands)) + " falls in the bin(s) "
                             + ", ".join(f"[{b['lo']}, {b['hi']}]" for b in empty) + " after templating",
                             "drop that bin or move it to where the source's prompts lie: lower it for short data; for "
                             "data longer than the bin, an edge above it or a higher max_prompt_tokens; or use a source "
                             "with longer prompts (repository, trajectory, or a path with longer data)")
        for b in bins:
            if b["taken"] < per_bin:
                log.warning("%s: bin [%d, %d] holds %d of per_bin %d prompts (%d candidates fall in it)", where,
                            b["lo"], b["hi"], b["taken"], per_bin, b["candidates"])
        meta.update(context_bins=context_bins, per_bin=per_bin, bins=bins)
    else:
        rows = select_walk(cands, tok, n, seed, max_prompt_tokens, source, enable_thinking, skipped, tokenizer_dir)
        if not rows:
            raise InputError(path or source, f"prompt_sets.{set_name}.max_prompt_tokens",
                             f"no prompt of {len(cands)} is <= {max_prompt_tokens} tokens after templating",
                             "raise max_prompt_tokens (0 = no limit)")
        if n and len(rows) < n:
            log.warning("%s: asked for %d prompts, only %d available", where, n, len(rows))
    lens = [len(r["prompt_ids"]) for r in rows]
    log.info("%s: %d prompts of %d candidates, prompt tokens min/mean/max %d/%.1f/%d", where, len(rows), len(cands),
             min(lens), sum(lens) / len(lens), max(lens))
    meta.update(written=len(rows), skipped=dict(sorted(skipped.items())),
                skip_reasons={k: SKIP_REASONS[k] for k in sorted(skipped) if k in SKIP_REASONS}, **extra)
    return rows, meta
