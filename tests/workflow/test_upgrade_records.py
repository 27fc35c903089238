"""Upgrading a results folder made before the per-request records (``python -m dflash_eval records --from-evals``,
dflash_eval/records_cmd.py): the records written from the JSONs are the stages' own, and Snakemake then plans no
evaluate or validation job (docs/outputs.md, "Upgrading a results folder")."""

from __future__ import annotations

import base64
import json
import shlex
import shutil
from pathlib import Path

import pandas as pd
import pytest

from dflash_eval.core.errors import InputError
from dflash_eval.records_cmd import records_from_evals, touch_command
from dflash_eval.report.build import load_report_data
from dflash_eval.report.records import evaluate_records, job_histogram, read_records
from test_workflow import CI_PROFILE, job_counts, smk

#: the shell command tails of the rules before the records (``--out {output:q} > {log:q} 2>&1``) and now
NEW_TAIL = {"evaluate": " --out {output.json:q} --out-records {output.records:q} --run {wildcards.run:q} > {log:q} 2>&1",
            "validate_online": " --out {output.json:q} --out-records {output.records:q} --run {wildcards.run:q}"
                               " > {log:q} 2>&1"}
OLD_TAIL = " --out {output:q} > {log:q} 2>&1"


def _eval_json(tmp_path: Path, ckpt: str, ps: str) -> Path:
    """A hand-built evaluate output of two samples (block size 4) at T0 and T1 (one expectation per sample)."""
    exp = [{"tau": t, "tau_sglang": t, "steps": 2.0, "committed": 3, "histogram": h, "slot_accepted": [0.0] * 4,
            "slot_compared": [0.0] * 4, "bin_tokens": [0.0] * 8, "bin_steps": [0.0] * 8}
           for t, h in ((1.5, [0.0, 1.5, 0.5, 0.0, 0.0]), (2.0, [0.0, 0.25, 1.0, 0.75, 0.0]))]
    r = {"checkpoint": ckpt, "prompt_set": ps, "block_size": 4, "step": 10, "drafter_notes": ["sliding layers derived"],
         "sampling_settings": [{"label": "T1", "temperature": 1.0}, {"label": "T0", "temperature": 0.0}],
         "expected": {"T1": {"samples": exp}},
         "samples": [{"id": "a", "prompt_len": 5, "n_tokens": 4, "max_new_tokens": 8, "acceptance_lengths": [1, 2]},
                     {"id": "b", "prompt_len": 7, "n_tokens": 8, "max_new_tokens": 8, "acceptance_lengths": [4, 3]}]}
    p = tmp_path / "results" / "r" / "eval" / ckpt / f"{ps}.json"
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps(r))
    return p


def test_records_from_evals_writes_what_evaluate_would_and_keeps_what_is_there(tmp_path):
    """The records of each evaluate JSON lacking them (run = the folder's name; the repeated 8-gram fraction from the
    completions file: sample b's 9 equal tokens have 2 8-grams, the second a repeat: 0.5; sample a's 4 tokens none: 0); a second
    call writes nothing; the report's histogram at its first setting (T1) is the sum of the per-sample expected
    counts, its drafter notes come from the file's job metadata."""
    js = _eval_json(tmp_path, "ck", "s")
    comp = tmp_path / "results" / "r" / "completions" / "s.jsonl"
    comp.parent.mkdir(parents=True)
    comp.write_text("".join(json.dumps({"id": i, "prompt": "p", "prompt_ids": [9], "completion_ids": ids,
                                        "completion": "x", "max_new_tokens": 8}) + "\n"
                            for i, ids in (("a", [5] * 3 + [6]), ("b", [7] * 9))))
    assert records_from_evals(tmp_path / "results" / "r") == [js]
    out = js.with_name("s.records.parquet")
    df, jobs = read_records([out])
    want, job = evaluate_records(json.loads(js.read_text()), "r", {0: 0.0, 1: 0.5})
    pd.testing.assert_frame_equal(df, want)
    assert df["run"].unique().tolist() == ["r"] and df["repeated_8gram_fraction"].tolist()[:2] == [0.0, 0.5]
    assert [{k: v for k, v in j.items() if k != "file"} for j in jobs] == [json.loads(json.dumps(job))]
    before = out.stat().st_mtime_ns
    assert records_from_evals(tmp_path / "results" / "r") == [] and out.stat().st_mtime_ns == before
    data = load_report_data([str(out)])
    assert data.hists[("ck", "s")] == (4, {1: 1.75, 2: 1.5, 3: 0.75, 4: 0.0})
    assert job_histogram(json.loads(js.read_text())) == {1: 1.75, 2: 1.5, 3: 0.75, 4: 0.0}
    assert [e[1] for e in data.extra if e[0] == "Drafter notes"] == [
        "What strip noted (strip_info.json).\n\n- `ck`: sliding layers derived"]
    assert touch_command([js, tmp_path / "validate_online.json"]) == (
        f"snakemake {js} {tmp_path / 'validate_online.json'} "
        "--touch --forcerun evaluate validate_online --allowed-rules evaluate validate_online")
    with pytest.raises(InputError, match="no eval/ folder"):
        records_from_evals(tmp_path)


def _as_before_records(wd: Path) -> dict[str, bytes]:
    """Make the finished run ``wd`` look as the version before the records left it: no records files (nor their
    Snakemake metadata), the evaluate / validate_online JSONs' metadata naming the old shell command, summary's and
    report's their old command and inputs (the evaluate JSONs). Returns the removed records files' bytes by path."""
    meta, removed = wd / ".snakemake" / "metadata", {}
    for f in sorted(meta.iterdir()):
        path = base64.urlsafe_b64decode(f.name + "=" * (-len(f.name) % 4)).decode()
        m = json.loads(f.read_text())
        if m.get("rule") in ("summary", "report"):  # they read the evaluate JSONs then
            m["code"] = m["code"].replace("{input.records:q}", "{input.evals:q}")
            m["input"] = [x.replace(".records.parquet", ".json") for x in m["input"]]
            f.write_text(json.dumps(m))
        if m.get("rule") not in NEW_TAIL:
            continue
        if path.endswith(".records.parquet"):
            removed[path] = (wd / path).read_bytes()
            (wd / path).unlink()
            f.unlink()
        else:
            assert m["code"].endswith(NEW_TAIL[m["rule"]]), m["code"]
            m["code"] = m["code"][: -len(NEW_TAIL[m["rule"]])] + OLD_TAIL
            f.write_text(json.dumps(m))
    return removed


@pytest.mark.slow
def test_upgrade_reruns_no_evaluate_job(tiny_run, tmp_path):
    """On a copy of the tiny run made to look as before the records: the dry run plans every evaluate job (8) and
    validate_online (their records are missing, and summary, whose rule changed, needs them); after
    ``records_from_evals`` the 9 records files are byte for byte the ones the stages wrote and the dry run plans only
    summary and report; after the printed ``--touch`` command the same, and an evaluate option changed then reruns
    all 8 (Snakemake's params trigger sees the jobs again)."""
    wd = tmp_path / "wf"
    shutil.copytree(tiny_run, wd, symlinks=True)
    removed = _as_before_records(wd)
    assert len(removed) == 9
    counts = job_counts(smk(wd, "-n", "--workflow-profile", str(CI_PROFILE)).stdout)
    assert (counts.get("evaluate"), counts.get("validate_online")) == (8, 1)
    written = records_from_evals(wd / "results" / "tiny")
    assert len(written) == 9
    assert {p: (wd / p).read_bytes() for p in removed} == removed
    counts = job_counts(smk(wd, "-n", "--workflow-profile", str(CI_PROFILE)).stdout)
    assert counts == {"summary": 1, "report": 1, "all": 1}, counts  # their rules changed: seconds
    cmd = shlex.split(touch_command([p.relative_to(wd) for p in written]))
    assert cmd[0] == "snakemake"
    smk(wd, *cmd[1:], "--workflow-profile", str(CI_PROFILE))
    counts = job_counts(smk(wd, "-n", "--workflow-profile", str(CI_PROFILE)).stdout)
    assert counts == {"summary": 1, "report": 1, "all": 1}, counts
    (wd / "warn.yaml").write_text("evaluate:\n  agreement_warn: 0.98\n")
    counts = job_counts(smk(wd, "-n", "--workflow-profile", str(CI_PROFILE),
                            "--configfile", "config/config.yaml", "warn.yaml").stdout)
    assert counts.get("evaluate") == 8, counts
