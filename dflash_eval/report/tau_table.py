"""The tau table (``tau.csv`` / ``tau.parquet``), rebuilt from the per-sample results of ``evaluate``.

Written by the ``summary`` stage (:mod:`dflash_eval.stages.summary`), read back by the report. One row
per (checkpoint, prompt set, sampling setting); the speedup and ``estimate_reliable`` columns are added
last by :func:`speedup_columns`, from the same function as the report's speedup table. Tau conventions
and their sources: :mod:`dflash_eval.replay.metrics`.

Columns (every one, with its definition): docs/outputs.md, "Every column of the tau table".
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from dflash_eval.core.errors import InputError
from dflash_eval.core.schema import sampling_label
from dflash_eval.data.provenance import check_settings
from dflash_eval.drafter.families import family_of, label, ordered
from dflash_eval.report.loops import LOOP_COLUMNS, Loops, loop_columns
from dflash_eval.report.records import Offline, load_offline
from dflash_eval.replay.metrics import PROMPT_BINS, aggregate, aggregate_expected, agreement, position_bin_labels
from dflash_eval.target.cost_stats import assess
from dflash_eval.target.costs import ddtree_budgets, speedup

#: the settings of an evaluate output written before sampling settings existed: greedy only
GREEDY_SETTING = {"label": "T0", "temperature": 0.0, "top_p": 1.0, "top_k": 0}
#: the draft policy of every row of an evaluate output written before draft policies existed
#: (:data:`dflash_eval.replay.sampling.REFERENCE`; at temperature 0 every policy drafts the argmax)
REFERENCE_POLICY = "reference"


def policy_label(setting_label: str, policy: str) -> str:
    """The ``expected`` key of a (setting, policy) in an evaluate output
    (:attr:`dflash_eval.replay.policies.DraftSetting.label`, without the torch import)."""
    return setting_label if policy == REFERENCE_POLICY else f"{setting_label}:{policy}"

log = logging.getLogger(__name__)

COLUMNS = ["checkpoint", "step", "prompt_set", "sampling", "draft", "temperature", "top_p", "top_k", "expected",
           "trajectory", "engine",
           "n_samples", "tau", "tau_tokens_per_step", "mean_accepted",
           "block_size", "n_skipped", "verify_steps", "committed_tokens", "random_init", "device", "dtype",
           "agreement_min", "agreement_mean", "tau_sglang"] + [f"tau_pos_{label.replace('-', '_')}" for label in position_bin_labels()] \
    + [f"{kind}_prompt_{label.replace('-', '_')}" for kind in ("tau", "n", "se") for label in position_bin_labels(PROMPT_BINS)] \
    + ["tau_se", "trained_max_len", "n_beyond_trained"] + LOOP_COLUMNS


def slot_columns(max_block_size: int) -> list[str]:
    """``accept_slot_1 .. accept_slot_<B-1>``: the per-slot columns after :data:`COLUMNS`."""
    return [f"accept_slot_{k}" for k in range(1, max_block_size)]



#: after the DDTree and slot columns: every table has them; then each family's own columns (its ``table_columns``:
#: DFlash 2's selector diagnostics), for the families with a row in the table
VARIANT_COLUMNS = ["variant", "ddtree_applicable"]
#: ``tau.parquet``'s schema metadata key holding the provenance block of the table (``tau.provenance.json``)
PARQUET_PROVENANCE = b"dflash_eval.data.provenance"


def write_parquet(df: pd.DataFrame, path, provenance: dict | None = None) -> None:
    """Write ``df`` as parquet (pyarrow), with ``provenance`` (JSON) under :data:`PARQUET_PROVENANCE` in its schema
    metadata."""
    table = pa.Table.from_pandas(df, preserve_index=False)
    if provenance is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                               PARQUET_PROVENANCE: json.dumps(provenance, sort_keys=True).encode()})
    pq.write_table(table, path)


def read_parquet(path) -> pd.DataFrame:
    """A ``tau.parquet`` written by :func:`write_parquet`.

    Raises:
        InputError: unreadable.
    """
    try:
        return pq.read_table(path).to_pandas()
    except (OSError, ValueError) as err:
        raise InputError(path, None, f"not a readable parquet file ({err})",
                         f"rebuild it: snakemake --forcerun {path} (or rerun `python -m dflash_eval summary`)") from None


def read_table_file(path) -> pd.DataFrame:
    """A ``tau.parquet`` (:func:`read_parquet`) or ``tau.csv``."""
    return read_parquet(path) if Path(path).suffix == ".parquet" else pd.read_csv(path)


#: the columns that name a row of the tau table
TABLE_KEY = ("checkpoint", "prompt_set", "sampling", "draft")
#: how ``tau.csv`` writes floats (the summary stage; :func:`check_table` renders the same)
CSV_FLOAT_FORMAT = "%.4f"


def table_csv(df: pd.DataFrame) -> str:
    """The text of ``tau.csv`` for the table ``df`` (what the summary stage writes)."""
    return df.to_csv(index=False, float_format=CSV_FLOAT_FORMAT)


def summary_frame(evals: list[str] | Offline, expected: dict | None = None, loops: Loops | None = None) -> pd.DataFrame:
    """Rows of the tau table from evaluate outputs (see module docstring).

    ``evals``: records files (``<job>.records.parquet``, :mod:`dflash_eval.report.records`) or evaluate JSONs, which
    are made into the same records first, or those already read (:func:`dflash_eval.report.records.load_offline`). Every aggregate is
    recomputed with :func:`dflash_eval.replay.metrics.aggregate` from the per-request ``accepted_lengths`` (at
    temperature > 0 the per-request expectations) of the records, so the table cannot disagree with the per-request
    data it summarises.

    ``expected``: the settings the config gives (:meth:`dflash_eval.workflow.plan.Plan.expected_settings`), compared with
    each output's provenance block (:func:`dflash_eval.data.provenance.check_settings`); None: not compared.
    ``loops``: the run's repetition measures and threshold (:func:`dflash_eval.report.loops.read_loops`), which fill
    the loop columns (:mod:`dflash_eval.report.loops`); None or a set it lacks: left empty.

    Raises:
        InputError: an evaluate output is missing or malformed (:func:`dflash_eval.report.records.read_eval`), made with other settings than
            ``expected`` gives, two outputs are for the same (checkpoint, prompt set), or a sample is missing from
            the completions ``loops`` holds for its set (:meth:`dflash_eval.report.loops.Loops.flags`).
    """
    rows, budgets = [], set()
    families: set[str] = set()  # the families whose own columns the table has
    seen: dict[tuple, str] = {}
    for path, r in load_offline(evals).jobs:  # every output as its records (dflash_eval.report.records)
        if expected:
            check_settings(path, r.get("provenance"), expected, str(r["prompt_set"]), "evaluate",
                           f"rerun the evaluate jobs with this config: snakemake --forcerun evaluate (or delete {path})")
        key = (r["checkpoint"], r["prompt_set"])
        if key in seen:
            raise InputError(path, "checkpoint/prompt_set", f"{key} is also the pair of {seen[key]}",
                             "pass each evaluate output once")
        seen[key] = str(path)
        lens = [s.get("prompt_len") for s in r["samples"]]
        lens = lens if all(isinstance(x, int) for x in lens) else None
        trained = r.get("trained_max_len")  # the drafter's training sequence length (evaluate), None: unknown
        beyond = sum(n >= trained for n, s in zip(lens, r["samples"]) if s["acceptance_lengths"]) \
            if trained and lens else None
        greedy = aggregate([s["acceptance_lengths"] for s in r["samples"]], r["block_size"], lens)
        looping = loops.flags(r, path) if loops is not None else None
        agree = agreement([s.get("argmax_agreement") for s in r["samples"]])
        drawn = r.get("completion_sampling") or {"temperature": 0.0}
        trajectory = sampling_label(drawn)
        applicable = bool(r.get("ddtree_applicable", True))
        family = family_of(r.get("variant"))  # an output without variant: DFlash 1 (the default family)
        ddtree = {"variant": family.name, "ddtree_applicable": applicable}
        for b in r.get("ddtree_budgets", []):
            budgets.add(int(b))
            ddtree[f"tau_ddtree_{b}"] = math.nan if not applicable else aggregate(
                [s["acceptance_lengths_ddtree"][str(b)] for s in r["samples"]], r["block_size"]).tau
        own = family.table_values(r)
        if own:
            families.add(family.name)
            ddtree.update(own)
        for st, policy in [(st, pol) for st in r.get("sampling_settings") or [GREEDY_SETTING]
                           for pol in st.get("draft") or [REFERENCE_POLICY]]:
            key = policy_label(st["label"], policy)
            if float(st["temperature"]) == 0:
                stats, agg, per_sample = greedy, aggregate, [s["acceptance_lengths"] for s in r["samples"]]
            else:
                exp = (r.get("expected") or {}).get(key)
                if exp is None or len(exp.get("samples", [])) != len(r["samples"]):
                    raise InputError(path, f"expected.{key}", "missing or not one entry per sample",
                                     "re-run its evaluate job (snakemake -R evaluate)")
                # the fields of dflash_eval.replay.expected.ResponseExpectation.as_dict (read without torch)
                resp = [SimpleNamespace(**x) if x is not None else None for x in exp["samples"]]
                stats, agg, per_sample = aggregate_expected(resp, r["block_size"], lens), aggregate_expected, resp
            rows.append({
                "checkpoint": r["checkpoint"],
                "step": r.get("step"),
                "prompt_set": r["prompt_set"],
                "sampling": st["label"],
                "draft": policy,
                "temperature": float(st["temperature"]),
                "top_p": float(st.get("top_p", 1.0)),
                "top_k": int(st.get("top_k", 0)),
                # an expectation only given trajectories drawn at the setting (else evaluated on request:
                # evaluate.cross_temperature)
                "expected": float(st["temperature"]) > 0 and trajectory == st["label"],
                "trajectory": trajectory,
                "engine": "; ".join((st.get("engines") or {}).get(policy) or _default_engines(st, policy)),
                "n_samples": stats.n_samples,
                "tau": stats.tau,
                "tau_se": stats.tau_se,
                "tau_tokens_per_step": stats.tau_tokens_per_step,
                "mean_accepted": stats.tau - 1.0,
                "block_size": r["block_size"],
                "n_skipped": stats.n_skipped,
                "verify_steps": stats.verify_steps,
                "committed_tokens": stats.committed_tokens,
                "random_init": r.get("random_init", False),
                "trained_max_len": trained,
                "n_beyond_trained": beyond,
                **loop_columns(agg, per_sample, r["block_size"], lens, looping),
                "device": r.get("device"),
                "dtype": r.get("dtype"),
                "agreement_min": agree.min,
                "agreement_mean": agree.mean,
                "tau_sglang": stats.tau_sglang,
                **{f"tau_pos_{label.replace('-', '_')}": v for label, v in stats.position_tau.items()},
                **{f"tau_prompt_{label.replace('-', '_')}": v for label, v in stats.prompt_tau.items()},
                **{f"n_prompt_{label.replace('-', '_')}": v for label, v in stats.prompt_samples.items()},
                **{f"se_prompt_{label.replace('-', '_')}": v for label, v in stats.prompt_se.items()},
                **{f"accept_slot_{k}": v for k, v in stats.slot_acceptance.items()},
                **ddtree,
            })
    max_block = max((r["block_size"] for r in rows), default=1)
    # each column once: families may share columns (LiLiCorr reports DFlash 2's candidate-walk columns)
    extra = list(dict.fromkeys(VARIANT_COLUMNS + [c for name in ordered(families)
                                                  for c in family_of(name).table_columns(max_block)]))
    df = pd.DataFrame(rows, columns=COLUMNS + [f"tau_ddtree_{b}" for b in sorted(budgets)] + slot_columns(max_block)
                      + extra)
    df = df.astype({"step": "Int64", "trained_max_len": "Int64", "n_beyond_trained": "Int64", "n_loop": "Int64"})
    df["setting_order"] = df.groupby(["checkpoint", "prompt_set"]).cumcount()
    df = df.sort_values(["prompt_set", "step", "checkpoint", "setting_order"], na_position="last", kind="stable")
    return df.drop(columns="setting_order").reset_index(drop=True)


def primary_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (checkpoint, prompt set): each pair's first configured sampling setting (the report's
    per-pair tables; every setting is in the full table)."""
    return frame.drop_duplicates(["checkpoint", "prompt_set"]).reset_index(drop=True)


def sampled_sets_note(frame: pd.DataFrame) -> str | None:
    """The sentence under the per-pair tables naming the prompt sets shown at a setting above temperature 0 (their
    first evaluated setting, :func:`~dflash_eval.report.tau_table.primary_rows`), or None when every set is greedy."""
    rows = frame[frame["temperature"].astype(float) > 0].drop_duplicates("prompt_set")
    if not len(rows):
        return None
    drafts = rows["draft"] if "draft" in rows else ["reference"] * len(rows)
    sets = ", ".join(f"{r.prompt_set} at {r.sampling}" + (f" [{d}]" if d != "reference" else "")
                     + (f" (on {r.trajectory} completions: not an expectation)" if r.trajectory != r.sampling else "")
                     for r, d in zip(rows.itertuples(), drafts))
    return (f"Shown at temperature > 0: {sets}. Their tau, histograms and per-slot rates are the expected values of "
            "the reference's speculative sampler (drafts sampled from the drafter's q) given the cached completions "
            "(docs/design.md, Acceptance at temperature > 0; the other draft policies: Acceptance by sampling "
            "setting); their DDTree columns are DDTree verified against the sampled target as "
            "liranringel/ddtree does, the greedy tree walk on those completions."
            + (" The other prompt sets: the greedy replay." if frame["prompt_set"].nunique() > len(rows) else ""))


def _default_engines(st: dict, policy: str) -> list[str]:
    """The engines of an evaluate output written before it recorded them: the reference's (and at temperature 0,
    every engine's) drafts."""
    if float(st["temperature"]) == 0:
        return ["dflash 0.1.0 dflash_generate", "vLLM (any draft_sample_method)"]
    return ["dflash 0.1.0 dflash_generate"] if policy == REFERENCE_POLICY else []



def method_speedups(r: dict, costs: dict, budgets: list[int]) -> list[dict]:
    """The estimate of every method of one tau-table row (the one place the report and ``tau.csv`` get it).

    Args:
        r: a tau-table row (``checkpoint``, ``block_size``, ``tau``, ``tau_ddtree_<budget>`` per budget).
        costs: :func:`dflash_eval.target.costs.read_costs` output.
        budgets: the DDTree budgets of the table (:func:`dflash_eval.target.costs.ddtree_budgets`).

    Returns:
        one dict per method, chain first: ``method`` (``chain`` or ``ddtree_<budget>``), ``budget`` (nodes;
        None for the chain), ``verify_tokens`` (n: the block size, or budget + 1), ``tau``, ``t_verify_s``,
        ``t_draft_s``, ``t_decode_s`` (seconds; NaN where not measured) and ``speedup`` (:func:`dflash_eval.target.costs.speedup`).
    """
    verify = {(int(v["n"]), v["mask"]): float(v.get("fit_s", v["median_s"])) for v in costs["verify"]}
    t_dec = float(costs["decode_s"])
    d = costs["drafters"].get(r["checkpoint"], {})
    if d.get("block_size") is not None and int(d["block_size"]) != int(r["block_size"]):
        raise InputError(costs.get("output") or "target_costs.json", f"drafters.{r['checkpoint']}.block_size",
                         f"{d['block_size']}, but {r['checkpoint']} was evaluated at block size {r['block_size']}: the "
                         "costs were timed from another drafter config", "rerun target_costs (snakemake --forcerun "
                         "target_costs) after the run's strip_drafter jobs")
    methods = [("chain", None, int(r["block_size"]), "causal", r["tau"], d.get("draft_s"))]
    for b in budgets:
        methods.append((f"ddtree_{b}", b, b + 1, "tree", r.get(f"tau_ddtree_{b}"), d.get("draft_tree_s", {}).get(str(b))))
    out = []
    for method, b, n, mask, tau, t_draft in methods:
        t_ver = verify.get((n, mask), math.nan)
        t_draft = math.nan if t_draft is None else float(t_draft)
        tau = float(tau) if tau is not None and pd.notna(tau) else math.nan
        out.append({"method": method, "budget": b, "verify_tokens": n, "tau": tau, "t_verify_s": t_ver,
                    "t_draft_s": t_draft, "t_decode_s": t_dec, "speedup": speedup(tau, t_dec, t_ver, t_draft)})
    return out


def speedup_frame(frame, costs: dict):
    """Estimated speedup per (checkpoint, prompt set, method).

    Args:
        frame: the tau table (:func:`summary_frame`): ``checkpoint``, ``step``,
            ``prompt_set``, ``block_size``, ``tau`` and any ``tau_ddtree_<budget>`` columns.
        costs: :func:`dflash_eval.target.costs.read_costs` output.

    Returns:
        DataFrame with ``checkpoint, step, prompt_set, method`` (``chain`` or ``ddtree_<budget>``),
        ``budget`` (nodes; NA for the chain), ``verify_tokens`` (n), ``tau``, ``t_verify_s``,
        ``t_draft_s``, ``t_decode_s``, ``speedup`` (NaN where a cost was not measured) and
        ``estimate_reliable`` (:func:`dflash_eval.target.cost_stats.assess`: the same for every row) and ``best``
        (True on the fastest method per checkpoint and prompt set).
    """
    reliable = assess(costs)["reliable"]
    budgets = ddtree_budgets(frame)
    rows = [{"checkpoint": r["checkpoint"], "step": r["step"], "prompt_set": r["prompt_set"], **m,
             "estimate_reliable": reliable}
            for r in frame.to_dict("records") for m in method_speedups(r, costs, budgets)]
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    df["budget"] = df["budget"].astype("Int64")
    key = ["checkpoint", "prompt_set"]
    best = df.dropna(subset=["speedup"]).groupby(key)["speedup"].idxmax()
    df["best"] = df.index.isin(best.values)
    return df


def speedup_columns(frame, costs: dict | None):
    """The tau table's speedup columns (:mod:`dflash_eval.report.tau_table`), aligned with ``frame``'s rows.

    Args:
        frame: the tau table (every row, every sampling setting).
        costs: :func:`dflash_eval.target.costs.read_costs` output, or None (``target_costs`` disabled: the columns are empty).

    Returns:
        DataFrame with ``speedup_chain``, ``speedup_ddtree_<budget>`` per budget of the table (the
        report's estimate, :func:`method_speedups`, on the row's own tau; NaN where a cost was not
        measured or the tau is NaN) and ``estimate_reliable`` (nullable bool: :func:`dflash_eval.target.cost_stats.assess`
        of the costs, the same on every row; NA without costs).
    """
    budgets = ddtree_budgets(frame)
    names = ["speedup_chain"] + [f"speedup_ddtree_{b}" for b in budgets]
    if costs is None:
        out = pd.DataFrame({n: math.nan for n in names}, index=frame.index)
        out["estimate_reliable"] = pd.array([pd.NA] * len(frame), dtype="boolean")
        return out
    reliable = bool(assess(costs)["reliable"])
    rows = [{f"speedup_{m['method']}": m["speedup"] for m in method_speedups(r, costs, budgets)}
            for r in frame.to_dict("records")]
    out = pd.DataFrame(rows, index=frame.index, columns=names, dtype=float)
    out["estimate_reliable"] = pd.array([reliable] * len(frame), dtype="boolean")
    return out


def with_speedups(frame, costs: dict | None):
    """``frame`` (the tau table, :func:`dflash_eval.report.tau_table.summary_frame`) with :func:`speedup_columns`
    appended: the content of ``tau.csv``, for the summary stage and the report's full table."""
    return pd.concat([frame, speedup_columns(frame, costs)], axis=1)


def method_columns(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """``[(column, label)]``: ``("tau", "chain (DFlash)")`` then one per DDTree budget present."""
    return [("tau", "chain (DFlash)")] + [(f"tau_ddtree_{b}", f"DDTree, budget {b}") for b in ddtree_budgets(frame)]


def variant_label(variant: str) -> str:
    """The family's label of a ``variant`` (``"DFlash 1"`` / ``"DFlash 2"`` for ``dflash`` / ``dflash2``,
    :func:`dflash_eval.drafter.families.label`); an unknown variant: its name."""
    return label(variant)


def variant_order(frame: pd.DataFrame) -> list[str]:
    """The ``variant`` values of ``frame`` in the families' report order (DFlash 1, DFlash 2), then any other by name
    (:func:`dflash_eval.drafter.families.ordered`); [] without the column."""
    if "variant" not in frame:
        return []
    return ordered(frame["variant"].dropna().unique())


def checkpoint_order(frame: pd.DataFrame) -> list[str]:
    """The report's training order of the checkpoints of ``frame``: grouped by run (``variant``, in
    :func:`variant_order`: DFlash 1, then DFlash 2; rows without a variant last), each run by training step (unknown
    steps last), then name. ``tau.csv`` keeps its own row order (:func:`summary_frame`)."""
    first = frame.drop_duplicates("checkpoint")
    run = first["variant"].map({v: i for i, v in enumerate(variant_order(first))}) if "variant" in first else 0
    return list(first.assign(run=run).sort_values(["run", "step", "checkpoint"], na_position="last")["checkpoint"])
