"""One provenance block per output: what made it, and the check ``summary`` makes with it.

Every output a user reads or copies records, under ``"provenance"`` (an evaluate output, the run-level JSON
outputs, ``<set>.meta.json`` beside a prompts or completions file, ``tau.provenance.json`` beside
``tau.csv`` / ``tau.parquet`` and in the parquet's schema metadata) or as the HDF5 attribute ``provenance``
of a cache (:func:`block`)::

    {"stage": "evaluate",
     "dflash_eval": {"version": "0.1.0", "commit": "<git sha1>" | null, "dirty": false | null},
     "settings": {"evaluate": {"ddtree_budgets": [2], "max_samples": 0, ...}},   # settings_of(stage, options)
     "inputs_sha256": {"target": "...", "drafter_weights": "...", "completions": "..."},
     "packages": {"python": "3.11.9", "torch": "2.13.0", "transformers": "...", "h5py": "...", ...}}

``settings`` holds the stage's options that can change its output (the schema's ``x-rerun: false`` ones,
timeouts and retries, are left out), keyed by option path (``vllm.max_model_len``). Snakemake reruns a job
whose options changed (its ``params`` trigger) from ``.snakemake/metadata``; results copied without that
folder lose it. ``summary`` therefore compares the settings each evaluate output (and ``target_costs.json``)
records with the current config's (:func:`check_settings`, the rule's ``params.expected``) and refuses to
combine outputs of other settings, naming the file, the option, both values and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from dflash_eval import __version__
from dflash_eval.core.errors import InputError, atomic_path
from dflash_eval.core.io import read_json_object
from dflash_eval.core.options import _get, _leaves
from dflash_eval.data.prompts import SKIP_REASONS

#: the key of the block in a JSON output (and the HDF5 attribute of a cache)
KEY = "provenance"
#: the distributions whose versions a block records (those installed)
PACKAGES = ("torch", "transformers", "safetensors", "h5py", "numpy", "pandas", "pyarrow", "fla-core",
            "flash-linear-attention", "vllm", "snakemake")


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """dflash-eval's ``version``, and the ``commit`` and ``dirty`` flag of the git checkout it runs from (both
    None outside a checkout, or without git)."""
    root = Path(__file__).resolve().parents[2]  # dflash_eval/data/provenance.py -> the checkout
    commit = dirty = None
    if (root / ".git").exists():
        try:
            commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                    timeout=10, check=True).stdout.strip() or None
            status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
                                     "dflash_eval", "rules", "Snakefile"], capture_output=True, text=True, timeout=10,
                                    check=True).stdout
            dirty = bool(status.strip())
        except (OSError, subprocess.SubprocessError):
            commit = dirty = None
    return {"version": __version__, "commit": commit, "dirty": dirty}


@functools.lru_cache(maxsize=1)
def package_versions() -> dict:
    """``{"python": ..., <distribution>: version}`` of :data:`PACKAGES` that are installed (no import)."""
    out = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def settings_of(stage: str, options) -> dict:
    """``{option path: value}`` of ``stage``'s options that can change its output (not ``x-rerun: false``), from its
    typed options (:func:`dflash_eval.core.options.make`) or the nested dict :meth:`dflash_eval.workflow.plan.Plan.stage_options`
    gives, as JSON has them (what a job records and what summary compares)."""
    tree = dataclasses.asdict(options) if dataclasses.is_dataclass(options) else dict(options or {})
    out = {}
    for path, _, node in _leaves(stage):
        if node.get("x-rerun") is False:
            continue
        out[".".join(path)] = _get(tree, path, node.get("default"))
    return json.loads(json.dumps(out, default=str))


def block(stage: str, settings: dict | None = None, inputs: dict | None = None) -> dict:
    """The provenance block of one output (module docstring).

    Args:
        stage: the stage that writes the output.
        settings: ``{stage: settings_of(...)}`` of the options it ran with.
        inputs: ``{name: sha256}`` of the inputs that identify it (None values are kept: not known).
    """
    return {"stage": stage, "dflash_eval": code_version(), "settings": settings or {},
            "inputs_sha256": dict(inputs or {}), "packages": package_versions()}


def stage_block(stage: str, opts, inputs: dict | None = None) -> dict:
    """:func:`block` of ``stage`` run with the typed options ``opts``."""
    return block(stage, {stage: settings_of(stage, opts)} if opts is not None else {}, inputs)


def write_json(out, doc: dict, **dumps) -> dict:
    """Write a JSON output atomically (``dumps``: :func:`json.dumps` keywords, e.g. ``default=float``); returns
    the document as written (JSON's types)."""
    plain = json.loads(json.dumps(doc, default=dumps.pop("default", None)))
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(plain, indent=1, **dumps) + "\n", encoding="utf-8")
    return plain


def check_settings(path, prov: dict | None, expected: dict, key: str, stage: str, fix: str) -> None:
    """Refuse an output whose provenance block (``prov``) records other ``stage`` settings than ``expected``
    (``{stage: {key: settings}}``, :meth:`dflash_eval.workflow.plan.Plan.expected_settings`; ``key``: the prompt set, or
    ``"run"``). Nothing to compare when ``expected`` has no entry for ``stage`` / ``key``.

    Raises:
        InputError: ``(path, "provenance.settings.<stage>.<option>", ...)`` naming both values and ``fix``; or
            ``(path, "provenance", ...)`` when the output records no block (written by an earlier version).
    """
    want = (expected.get(stage) or {}).get(key)
    if want is None:
        return
    got = ((prov or {}).get("settings") or {}).get(stage)
    if got is None:
        raise InputError(path, KEY, f"records no {stage} settings (written by an earlier version or by hand), so it "
                         f"cannot show that it was made with this config's", fix)
    for option in sorted(set(want) | set(got)):
        if option not in got or option not in want or got[option] != want[option]:
            made = json.dumps(got[option]) if option in got else "(not recorded)"
            now = json.dumps(want[option]) if option in want else "(not an option now)"
            raise InputError(path, f"{KEY}.settings.{stage}.{option}", f"made with {stage}.{option} = {made}, but "
                             f"the config now gives {now} (results copied without .snakemake/, whose records let "
                             "Snakemake rerun a job whose options changed)", fix)


def stale_table_note(run_dir: str | os.PathLike, expected: dict) -> str | None:
    """What to tell the user at parse time when ``<run_dir>/tau.provenance.json`` records other settings than
    ``expected`` (:meth:`dflash_eval.workflow.plan.Plan.expected_settings`), else None. The workflow asks only where
    ``.snakemake/metadata`` is gone: Snakemake then reruns nothing for a changed option, not even summary."""
    path = Path(run_dir, "tau.provenance.json")
    try:
        made = (json.loads(path.read_text(encoding="utf-8")).get("settings") or {})
    except (OSError, ValueError, AttributeError):
        return None
    for stage, by_key in sorted(expected.items()):
        for key in sorted(by_key):
            recorded = (made.get(stage) or {}).get(key)
            try:
                check_settings(path, {"settings": {stage: recorded}} if recorded is not None else None, expected,
                               key, stage, "")
            except InputError as err:
                if recorded is None:
                    continue
                return (f"{path}: {err.field}: {err.problem}; Snakemake reruns nothing for it here, so run "
                        f"`snakemake --forcerun {stage}` (with your options; trackers that logged the old values refuse the "
                        "new ones: log to a new run, e.g. trackers.tensorboard.run_name)")
    return None


# ---- <name>.meta.json beside a prompts or completions file
def meta_path(path: str | os.PathLike) -> Path:
    """The metadata file beside a prompts / completions JSONL: ``<name>.meta.json`` (``set.jsonl`` -> ``set.meta.json``)."""
    p = Path(path)
    return p.with_name(p.stem + ".meta.json")


def write_meta(path: str | os.PathLike, meta: dict, prov: dict | None = None) -> Path:
    """Write :func:`meta_path` of a file just written: ``meta`` and its provenance block ``prov``, atomically."""
    out = meta_path(path)
    write_json(out, {**meta, **({KEY: prov} if prov is not None else {})})
    return out


def read_meta(path: str | os.PathLike, stage: str) -> dict:
    """A meta :func:`write_meta` stored (or the ``.meta.json`` path itself).

    Raises:
        InputError: missing or not a JSON object.
    """
    p = Path(path) if str(path).endswith(".meta.json") else meta_path(path)
    return read_json_object(p, f"{stage} metadata", f"regenerate it with the '{stage}' stage (snakemake -R {stage})")


def read_prompt_meta(path: str | os.PathLike) -> dict:
    """The prompts stage's meta (:func:`read_meta`), with its ``skipped`` table (the report's).

    Raises:
        InputError: see :func:`read_meta`; no ``skipped`` table.
    """
    p = Path(path) if str(path).endswith(".meta.json") else meta_path(path)
    meta = read_meta(p, "prompts")
    if not isinstance(meta.get("skipped"), dict):
        raise InputError(p, "skipped", "missing", "regenerate it with the 'prompts' stage (snakemake -R prompts)")
    return meta


def skip_table_rows(metas: dict[str, dict]) -> tuple[list[str], list[list]]:
    """The skip counts of several prompt sets (``{prompt set: meta}``): the header (prompt set, source, available,
    written, then one reason of :data:`~dflash_eval.data.prompts.SKIP_REASONS` per code met) and one row per set
    (by name; counts as ints, a missing one as "")."""
    codes = sorted({k for m in metas.values() for k in m["skipped"]})
    head = ["prompt set", "source", "available", "written"] + [SKIP_REASONS.get(c, c) for c in codes]
    rows = [[name, m.get("source", ""), m.get("available", ""), m.get("written", "")]
            + [m["skipped"].get(c, 0) for c in codes] for name, m in sorted(metas.items())]
    return head, rows


def skip_table_markdown(metas: dict[str, dict]) -> str:
    """Markdown table of the skip counts of several prompt sets (``{prompt set: meta}``), for the report."""
    head, rows = skip_table_rows(metas)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
