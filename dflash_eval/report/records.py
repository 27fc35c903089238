"""The per-request record table: one row per (job, request, method), the evidence every tau number is computed from.

``evaluate`` (source ``offline``), ``validate_online`` (``online``) and ``validate_engine`` (``engine``) each write
``*.records.parquet`` beside their JSON; ``summary`` builds ``tau.csv`` from the evaluate records, the paired
bootstrap (:func:`dflash_eval.report.compare.sample_values`) reads the same rows, and ``reslice``
(:mod:`dflash_eval.report.reslice`) re-bins them by position, prompt length or a sample subset without running
anything. As vllm-project/speculators PR #1107 does (``scripts/evaluate/request_runner.py`` records one Parquet row
per request; ``acceptance_report.py`` and ``rebin.py`` compute every report as a function of that table).

Columns (:data:`SCHEMA`; every one with its dtype, unit and meaning: docs/outputs.md, "Per-request records"):
the job (``run``, ``source``, ``checkpoint``, ``step``, ``variant``, ``prompt_set``, ``block_size``), the request
(``sample_index``, ``sample_id``, ``seed``, ``runs``), what was measured (``method``: ``chain``, ``ddtree_<budget>``,
and for DFlash 2 ``oracle`` / ``unary`` beside the selector's ``chain``; ``sampling``, ``temperature``, ``top_p``,
``top_k``, ``draft``, ``trajectory``), lengths (``prompt_len``, ``response_len``, ``max_new_tokens``), the
acceptance (``accepted_lengths``: per verify step the tokens it committed, accepted drafts + the bonus token, the
convention of :mod:`dflash_eval.replay.metrics`; ``tau``; at temperature > 0 the ``expected_*`` fields of
:class:`dflash_eval.replay.expected.ResponseExpectation`) and flags (``argmax_agreement``,
``repeated_8gram_fraction``, ``truncated``, ``same_output``, ``divergence``, ``latency_s``).

What is not per request (the configured sampling settings and their engines, DFlash 2's selector aggregate, the
provenance block, device, dtype, ``random_init``, ``trained_max_len``, ``ddtree_budgets``) is one JSON object per
job in the file's schema metadata under :data:`JOBS_KEY`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from types import SimpleNamespace
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_eval.core.errors import InputError, atomic_path
from dflash_eval.core.io import read_json_object
from dflash_eval.core.schema import sampling_label
from dflash_eval.replay.metrics import aggregate, aggregate_expected, sample_tau

#: the record table's columns, in order (docs/outputs.md, "Per-request records")
SCHEMA = pa.schema([
    ("run", pa.string()), ("source", pa.string()), ("checkpoint", pa.string()), ("step", pa.int64()),
    ("variant", pa.string()), ("prompt_set", pa.string()), ("block_size", pa.int32()),
    ("sample_index", pa.int32()), ("sample_id", pa.string()), ("seed", pa.int64()), ("runs", pa.int32()),
    ("method", pa.string()), ("sampling", pa.string()), ("temperature", pa.float64()), ("top_p", pa.float64()),
    ("top_k", pa.int32()), ("draft", pa.string()), ("trajectory", pa.string()),
    ("prompt_len", pa.int32()), ("response_len", pa.int32()), ("max_new_tokens", pa.int32()),
    ("accepted_lengths", pa.list_(pa.int32())), ("tau", pa.float64()),
    ("expected_tau_sglang", pa.float64()), ("expected_steps", pa.float64()), ("expected_committed", pa.int64()),
    ("expected_histogram", pa.list_(pa.float64())), ("expected_slot_accepted", pa.list_(pa.float64())),
    ("expected_slot_compared", pa.list_(pa.float64())), ("expected_bin_tokens", pa.list_(pa.float64())),
    ("expected_bin_steps", pa.list_(pa.float64())),
    ("argmax_agreement", pa.float64()), ("repeated_8gram_fraction", pa.float64()), ("truncated", pa.bool_()),
    ("same_output", pa.bool_()), ("divergence", pa.string()), ("latency_s", pa.float64()),
])
COLUMNS = SCHEMA.names
SOURCES = ("offline", "online", "engine")
#: the schema-metadata key of the per-job JSON objects (module docstring)
JOBS_KEY = b"dflash_eval.records.jobs"
#: the file name suffix of a records file (``<job>.records.parquet`` beside ``<job>.json``)
SUFFIX = ".records.parquet"
#: the ``expected_*`` columns and the :class:`~dflash_eval.replay.expected.ResponseExpectation` field of each
EXPECTED_FIELDS = {"expected_tau_sglang": "tau_sglang", "expected_steps": "steps", "expected_committed": "committed",
                   "expected_histogram": "histogram", "expected_slot_accepted": "slot_accepted",
                   "expected_slot_compared": "slot_compared", "expected_bin_tokens": "bin_tokens",
                   "expected_bin_steps": "bin_steps"}
GREEDY = {"label": "T0", "temperature": 0.0, "top_p": 1.0, "top_k": 0}
REFERENCE = "reference"


EVAL_KEYS = ("checkpoint", "prompt_set", "block_size", "samples")  #: what the table needs of an evaluate output


def read_eval(path) -> dict:
    """One evaluate output (per-sample JSON).

    Raises:
        InputError: missing file, not JSON, or lacking ``EVAL_KEYS`` / per-sample ``acceptance_lengths``.
    """
    if not Path(path).is_file():
        raise InputError(path, None, "evaluate output not found",
                         "run its evaluate job first (python -m dflash_eval evaluate ... --out <it>), or fix the path")
    r = read_json_object(path, "evaluate output", "re-run its evaluate job (snakemake -R evaluate)")
    missing = [k for k in EVAL_KEYS if k not in r]
    if not missing and (not isinstance(r["samples"], list)
                        or not all(isinstance(x, dict) and "acceptance_lengths" in x for x in r["samples"])):
        missing = ["samples[].acceptance_lengths"]
    if missing:
        raise InputError(path, missing[0], "missing: not an evaluate output of this version",
                         "re-run its evaluate job (snakemake -R evaluate)")
    return r


def records_path(json_path) -> Path:
    """``<job>.records.parquet`` beside the job's JSON ``<job>.json``."""
    p = Path(json_path)
    return p.with_name((p.name[: -len(".json")] if p.name.endswith(".json") else p.name) + SUFFIX)


def frame(rows: list[dict]) -> pd.DataFrame:
    """``rows`` (dicts keyed by column; a missing key is null) as a record frame with :data:`COLUMNS`, validated
    (:func:`validate`)."""
    table = pa.Table.from_pylist([{c: r.get(c) for c in COLUMNS} for r in rows], schema=SCHEMA)
    return validate(table.to_pandas(types_mapper=_types), "records")


def _types(t: pa.DataType):
    """pandas dtypes of the record columns: nullable integers, booleans and strings (pyarrow's ``to_pandas``)."""
    return {pa.int64(): pd.Int64Dtype(), pa.int32(): pd.Int32Dtype(), pa.bool_(): pd.BooleanDtype(),
            pa.string(): pd.StringDtype()}.get(t)


def validate(df: pd.DataFrame, path) -> pd.DataFrame:
    """``df`` if it is a record table: the columns of :data:`SCHEMA` in order, ``source`` one of :data:`SOURCES`,
    ``accepted_lengths`` entries in ``1..block_size``.

    Raises:
        InputError: a missing or extra column, an unknown source or an entry out of range (naming ``path``).
    """
    fix = "rewrite it with the stage of this version (snakemake --forcerun <its rule>)"
    if list(df.columns) != COLUMNS:
        raise InputError(path, "columns", f"{sorted(set(df.columns) ^ set(COLUMNS))} differ from the record schema",
                         fix)
    bad = set(df["source"].dropna()) - set(SOURCES)
    if bad or df["source"].isna().any():
        raise InputError(path, "source", f"{sorted(bad) or 'null'} is not one of {list(SOURCES)}", fix)
    for b, lens in zip(df["block_size"], df["accepted_lengths"]):
        if lens is not None and len(lens) and (min(lens) < 1 or (pd.notna(b) and max(lens) > int(b))):
            raise InputError(path, "accepted_lengths", f"an entry of {[int(x) for x in lens][:8]} is outside 1..{b}", fix)
    return df


def write_records(path, df: pd.DataFrame, jobs: list[dict]) -> None:
    """Write the record table ``df`` (:func:`frame`) and its per-job objects ``jobs`` (JSON, under
    :data:`JOBS_KEY`) to ``path`` (Parquet, pyarrow; atomically)."""
    table = pa.Table.from_pandas(validate(df, path), schema=SCHEMA, preserve_index=False)
    table = table.replace_schema_metadata({JOBS_KEY: json.dumps(jobs, sort_keys=True, default=_json).encode()})
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def _json(x):
    return None if isinstance(x, float) and math.isnan(x) else str(x)


def read_records(paths) -> tuple[pd.DataFrame, list[dict]]:
    """The record tables of ``paths`` (records files, or folders searched for ``*.records.parquet``) concatenated,
    and every file's job objects (each with ``file``: the path it came from).

    Raises:
        InputError: a missing or unreadable file, or one that is not a record table (another Arrow schema than
            :data:`SCHEMA`, :func:`validate`).
    """
    files = []
    for p in [Path(x) for x in ([paths] if isinstance(paths, (str, Path)) else paths)]:
        files += sorted(p.rglob("*" + SUFFIX)) if p.is_dir() else [p]
    parts, jobs = [], []
    for f in files:
        try:
            table = pq.read_table(f)
        except (OSError, ValueError) as err:
            raise InputError(f, None, f"not a readable records file ({err})",
                             "rerun the stage that wrote it (snakemake --forcerun <its rule>)") from None
        got = table.schema.remove_metadata()
        if not got.equals(SCHEMA):
            diff = [f"{x.name}: {x.type}" for x in got if x.name not in SCHEMA.names or SCHEMA.field(x.name).type != x.type]
            raise InputError(f, "schema", f"not the record schema ({diff[:4] or 'other columns'})",
                             "rewrite it with the stage of this version (snakemake --forcerun <its rule>)")
        parts.append(validate(table.to_pandas(types_mapper=_types), f))
        meta = (table.schema.metadata or {}).get(JOBS_KEY)
        jobs += [{**j, "file": str(f)} for j in (json.loads(meta) if meta else [])]
    if not parts:
        return frame([]), jobs
    return pd.concat(parts, ignore_index=True), jobs


def _job(r: dict, run: str | None) -> dict:
    """The job object of an evaluate output ``r`` (module docstring: what is not per request)."""
    keep = ("checkpoint", "prompt_set", "block_size", "step", "random_init", "device", "dtype", "trained_max_len",
            "variant", "ddtree_applicable", "ddtree_budgets", "sampling_settings", "completion_sampling", "selector",
            "provenance", "drafter_notes", "cross_temperature")
    return {"run": run, "source": "offline", **{k: r[k] for k in keep if k in r}}


def evaluate_records(r: dict, run: str | None = None, repetition: dict | None = None) -> tuple[pd.DataFrame, dict]:
    """The records of one evaluate output ``r`` (its JSON, :func:`dflash_eval.stages.evaluate.evaluate`) and its job.

    Rows per sample, in sample order: ``chain`` at ``T0`` / ``reference`` (the greedy walk on the cached
    completion: every job has it), each DDTree budget's ``ddtree_<B>`` and DFlash 2's ``oracle`` / ``unary`` (at
    ``T0``), then per sampling setting above temperature 0 and draft policy the ``chain`` with the expectation given
    the cached trajectory (``expected_*``; ``accepted_lengths`` null).

    Args:
        r: the evaluate JSON as a dict (per sample ``id``, ``prompt_len``, ``n_tokens``, ``max_new_tokens``,
            ``acceptance_lengths`` and the optional per-method lists; an output of an earlier version may lack
            ``id`` / ``prompt_len``: null).
        run: the run's name (``results/<run>/``), or None.
        repetition: ``{sample index: repeated 8-gram fraction of its completion}``
            (:func:`dflash_eval.data.repetition.repeated_ngram_fraction`), or None (null).

    Returns:
        ``(records, job)``: :func:`frame` rows and the job object (:func:`_job`).
    """
    B = int(r["block_size"])
    drawn = r.get("completion_sampling") or {"temperature": 0.0}
    base = {"run": run, "source": "offline", "checkpoint": r["checkpoint"], "step": r.get("step"),
            "variant": r.get("variant", "dflash"), "prompt_set": r["prompt_set"], "block_size": B, "runs": 1,
            "trajectory": sampling_label(drawn)}
    rows, reqs = [], []
    for i, s in enumerate(r["samples"]):
        n, cap = s.get("n_tokens"), s.get("max_new_tokens")
        req = {**base, "sample_index": i, "sample_id": None if s.get("id") is None else str(s["id"]),
               "prompt_len": s.get("prompt_len"), "response_len": n, "max_new_tokens": cap,
               "truncated": None if n is None or cap is None else int(n) >= int(cap),
               "argmax_agreement": s.get("argmax_agreement"),
               "repeated_8gram_fraction": (repetition or {}).get(i)}
        reqs.append(req)
        greedy = {**req, "sampling": "T0", "temperature": 0.0, "top_p": 1.0, "top_k": 0, "draft": REFERENCE}
        methods = [("chain", s["acceptance_lengths"])]
        methods += [(f"ddtree_{b}", v) for b, v in (s.get("acceptance_lengths_ddtree") or {}).items()]
        methods += [(m, s[f"acceptance_lengths_{m}"]) for m in ("oracle", "unary") if f"acceptance_lengths_{m}" in s]
        rows += [{**greedy, "method": m, "accepted_lengths": v, "tau": sample_tau(v)} for m, v in methods]
    for st in r.get("sampling_settings") or []:
        if float(st["temperature"]) == 0:
            continue
        for pol in st.get("draft") or [REFERENCE]:
            key = st["label"] if pol == REFERENCE else f"{st['label']}:{pol}"
            exp = ((r.get("expected") or {}).get(key) or {}).get("samples")
            if exp is None or len(exp) != len(r["samples"]):
                continue  # read_eval's callers refuse it where they need it (tau_table.summary_frame)
            for i, e in enumerate(exp):
                row = {**reqs[i], "method": "chain", "sampling": st["label"],
                       "temperature": float(st["temperature"]), "top_p": float(st.get("top_p", 1.0)),
                       "top_k": int(st.get("top_k", 0)), "draft": pol, "accepted_lengths": None,
                       "tau": math.nan if e is None else float(e["tau"])}
                row.update({c: None if e is None else e[f] for c, f in EXPECTED_FIELDS.items()})
                rows.append(row)
    return frame(rows), _job(r, run)


def job_view(df: pd.DataFrame, job: dict) -> dict:
    """The evaluate-output view (the keys :func:`dflash_eval.report.tau_table.summary_frame` reads) of one offline
    job's records ``df`` and job object: per sample ``id``, ``prompt_len``, ``n_tokens``, ``max_new_tokens``,
    ``acceptance_lengths`` (+ ``_ddtree`` / ``_oracle`` / ``_unary``), ``argmax_agreement``, and ``expected[<key>]
    ["samples"]`` per sampled setting and policy, all taken from the records."""
    df = df.sort_values("sample_index", kind="stable")
    greedy = df[df["sampling"] == "T0"]
    samples = []
    for i, g in greedy.groupby("sample_index", sort=True):
        by = {m: [int(x) for x in v] for m, v in zip(g["method"], g["accepted_lengths"])}
        first = g.iloc[0]
        s = {"prompt_len": _int(first["prompt_len"]), "n_tokens": _int(first["response_len"]),
             "max_new_tokens": _int(first["max_new_tokens"]), "acceptance_lengths": by["chain"],
             "argmax_agreement": _float(first["argmax_agreement"]),
             "repeated_8gram_fraction": _float(first["repeated_8gram_fraction"])}
        if pd.notna(first["sample_id"]):
            s["id"] = str(first["sample_id"])
        trees = {m[len("ddtree_"):]: v for m, v in by.items() if m.startswith("ddtree_")}
        if trees:
            s["acceptance_lengths_ddtree"] = trees
        s.update({f"acceptance_lengths_{m}": by[m] for m in ("oracle", "unary") if m in by})
        samples.append(s)
    out = {**{k: v for k, v in job.items() if k not in ("source", "file")}, "samples": samples, "expected": {}}
    for (label, pol), g in df[df["sampling"] != "T0"].groupby(["sampling", "draft"], sort=False):
        key = label if pol == REFERENCE else f"{label}:{pol}"
        out["expected"][key] = {"samples": [None if pd.isna(x.tau) and pd.isna(x.expected_steps) else {
            "tau": float(x.tau), **{f: _plain(getattr(x, c)) for c, f in EXPECTED_FIELDS.items()}}
            for x in g.itertuples(index=False)]}
    return out


def job_histogram(r: dict) -> dict:
    """``{k: verify steps that committed k tokens}`` of one job at its first sampling setting (the row
    :func:`dflash_eval.report.tau_table.primary_rows` keeps), from its per-request values: the greedy chain's
    ``accepted_lengths`` counted, or at temperature > 0 the per-response expected counts summed
    (:func:`dflash_eval.replay.metrics.aggregate_expected`: the ``expected[<label>].histogram`` evaluate writes).

    Args:
        r: an evaluate output, or one job's records as one (:func:`dflash_eval.report.records.job_view`).
    """
    first = (r.get("sampling_settings") or [{"label": "T0", "temperature": 0.0}])[0]
    exp = (r.get("expected") or {}).get(first["label"]) if float(first["temperature"]) > 0 else None
    if exp and exp.get("samples"):
        resp = [SimpleNamespace(**x) if x is not None else None for x in exp["samples"]]
        return aggregate_expected(resp, int(r["block_size"])).histogram
    return aggregate([s["acceptance_lengths"] for s in r["samples"]], int(r["block_size"])).histogram


def _int(x):
    return None if pd.isna(x) else int(x)


def _float(x):
    return None if x is None or pd.isna(x) else float(x)


def _plain(x):
    """A record cell as a plain Python value (lists of numbers as lists)."""
    if hasattr(x, "tolist"):
        return x.tolist()
    return None if x is None or (not isinstance(x, (list, str)) and pd.isna(x)) else x


@dataclass(frozen=True)
class Offline:
    """The offline (evaluate) records of a run, read once (:func:`load_offline`)."""

    records: pd.DataFrame  #: every offline row of every job (:data:`COLUMNS`)
    jobs: list  #: ``(file, evaluate-output view)`` per job, in the given order (:func:`job_view`)


def load_offline(paths) -> Offline:
    """The offline jobs of ``paths``, in the given order: records files (:func:`read_records`; one view per job,
    :func:`job_view`) or evaluate JSONs of any version (made into records by :func:`evaluate_records` first, so both
    go through the same rows). An :class:`Offline` is returned as it is.

    Raises:
        InputError: an unreadable file (:func:`read_records`, :func:`read_eval`).
    """
    if isinstance(paths, Offline):
        return paths
    parts, views = [], []
    for p in paths:
        if str(p).endswith(".json"):
            df, job = evaluate_records(read_eval(p))
            parts.append(df)
            views.append((str(p), job_view(df, job)))
            continue
        df, jobs = read_records([p])
        for job in [j for j in jobs if j.get("source") == "offline"]:
            sub = df[(df["source"] == "offline") & (df["checkpoint"] == job["checkpoint"])
                     & (df["prompt_set"] == job["prompt_set"])]
            parts.append(sub)
            views.append((str(p), job_view(sub, job)))
    return Offline(pd.concat(parts, ignore_index=True) if parts else frame([]), views)


def _setting(ev: dict, label: str) -> dict:
    """The sampling setting ``label`` of an evaluate output (``sampling_settings``), as record columns."""
    st = next((x for x in ev.get("sampling_settings") or [GREEDY] if x["label"] == label), GREEDY)
    return {"sampling": label, "temperature": float(st["temperature"]), "top_p": float(st.get("top_p", 1.0)),
            "top_k": int(st.get("top_k", 0))}


def _base(source: str, run, ev: dict, checkpoint: str, prompt_set) -> dict:
    """The job columns of a validation's rows of one checkpoint (its evaluate output ``ev``)."""
    return {"run": run, "source": source, "checkpoint": checkpoint, "step": ev.get("step"),
            "variant": ev.get("variant", "dflash"), "prompt_set": ev.get("prompt_set") or prompt_set,
            "block_size": int(ev["block_size"]), "runs": 1,
            "trajectory": sampling_label(ev.get("completion_sampling") or {"temperature": 0.0})}


def _request(base: dict, i: int, row: dict, lens, **kw) -> dict:
    """One record of the completions row ``row`` (``id``, ``prompt_ids``, ``max_new_tokens``), the ``i``-th sent;
    ``lens``: its accepted lengths or None (response length then unknown)."""
    n = None if lens is None else 1 + sum(lens)  # the prefill token + every token a verify step committed
    cap = row.get("max_new_tokens")
    return {**base, "sample_index": i, "sample_id": str(row["id"]), "prompt_len": len(row.get("prompt_ids") or []),
            "response_len": n, "max_new_tokens": cap, "truncated": None if n is None or cap is None else n >= int(cap),
            "accepted_lengths": lens, "tau": math.nan if lens is None else sample_tau(lens), **kw}


def online_records(result: dict, evals: list[dict], rows: list[dict], run: str | None = None) -> pd.DataFrame:
    """The records of a ``validate_online`` output ``result`` (:func:`dflash_eval.stages.validate_online.validate_online`):
    source ``online``; per checkpoint (``evals``: its evaluate outputs, in ``result["checkpoints"]`` order) and mode
    (``chain``, ``ddtree_<budget>``) one greedy row per prompt of ``rows`` (the completions rows decoded) with the
    online ``accepted_lengths`` and ``same_output``; per sampled setting one row per prompt and run (``seed``: the
    run's generator seed, ``tau``: the run's tau; its steps are not kept, ``accepted_lengths`` null)."""
    out = []
    for entry, ev in zip(result["checkpoints"], evals):
        base = _base("online", run, ev, entry["checkpoint"], entry.get("prompt_set"))
        greedy = {**_setting(ev, "T0"), "draft": REFERENCE}
        for mode, m in entry.get("modes", {}).items():
            by = {str(s["id"]): s for s in m["samples"]}
            out += [_request(base, i, r, by[str(r["id"])]["online"], method=mode, **greedy,
                             same_output=by[str(r["id"])]["same_output"])
                    for i, r in enumerate(rows) if str(r["id"]) in by]
        for label, m in (entry.get("sampling") or {}).items():
            by = {str(s["id"]): s for s in m["samples"]}
            for i, r in enumerate(rows):
                for k, t in enumerate((by.get(str(r["id"])) or {}).get("taus", [])):
                    out.append({**_request(base, i, r, None, method="chain", **_setting(ev, label), draft=REFERENCE),
                                "seed": int(result["seed"]) + i * int(result["seeds"]) + k,
                                "tau": math.nan if t is None else float(t)})
    return frame(out)


def engine_records(result: dict, evals: list[dict], rows: list[dict], run: str | None = None) -> pd.DataFrame:
    """The records of a ``validate_engine`` output ``result`` (:func:`dflash_eval.stages.validate_engine.validate_engine`):
    source ``engine``; per greedy checkpoint entry (``evals``: the evaluate outputs of ``result``'s checkpoints, in
    the order of the stage's ``--evals``, matched by checkpoint) one row per request: the engine's per-step counts
    converted to the replay's convention (``accepted_lengths``; null where they could not be converted),
    ``same_output`` (tokens equal to the cached completion), ``divergence`` (the kind,
    :data:`dflash_eval.serving.vllm.engine.DIVERGENCES`), ``latency_s``; per sampled run (setting, policy) one row
    per prompt: ``tau`` the mean over its ``runs`` requests (the seeds; per-request steps are not kept)."""
    by_ckpt = {str(ev.get("checkpoint")): ev for ev in evals}
    index = {str(r["id"]): i for i, r in enumerate(rows)}
    out = []
    for entry in result.get("checkpoints", []):
        ev = by_ckpt[str(entry["checkpoint"])]
        base = _base("engine", run, ev, entry["checkpoint"], entry.get("prompt_set"))
        for q in entry.get("requests", []):
            i = index[str(q["id"])]
            out.append(_request(base, i, rows[i], q.get("engine"), method="chain", **_setting(ev, "T0"),
                                draft=REFERENCE, same_output=q.get("tokens_equal"), divergence=q.get("kind"),
                                latency_s=q.get("latency_s")))
    for s in result.get("sampled", []):
        ev = by_ckpt[str(s["checkpoint"])]
        base = _base("engine", run, ev, s["checkpoint"], s.get("prompt_set"))
        for p in s.get("per_prompt") or []:
            i = index[str(p["id"])]
            out.append({**_request(base, i, rows[i], None, method="chain", **_setting(ev, s["sampling"]),
                                   draft=s["draft"]), "runs": int(p["n"]), "tau": float(p["engine"])})
    return frame(out)


def validation_jobs(df: pd.DataFrame, result: dict) -> list[dict]:
    """The job objects of a validation's records ``df``: per (source, checkpoint, prompt set) its ``run``, and the
    result's ``device`` / ``dtype`` / ``provenance`` where it has them."""
    keys = df[["run", "source", "checkpoint", "prompt_set"]].drop_duplicates()
    extra = {k: result[k] for k in ("device", "dtype", "provenance") if k in result}
    return [{**{k: (None if pd.isna(v) else str(v)) for k, v in zip(keys.columns, t)}, **extra}
            for t in keys.itertuples(index=False)]
