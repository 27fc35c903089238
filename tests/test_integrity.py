"""Inputs edited or damaged between stages are refused (or, where they cannot be verified, named in the log).

* a drafter folder without ``strip_info.json`` is evaluated with a warning naming it, and the result
  says ``drafter_verified: false`` (true for a stripped folder);
* a ``strip_info.json`` without ``info_sha256``, or without its ``sha256`` record, is refused
  (``strip`` always writes both);
* a completions file with a row deleted, duplicated or moved, or with one row's checksums removed,
  is refused naming the line (rows carry ``row_index`` / ``n_rows`` under ``row_sha256``);
* a prompts file written by the prompts stage is sealed the same way: an edited, deleted or moved
  prompt is refused; a hand-written one is read with a warning.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_reliability import _evaluate, pipeline  # noqa: E402,F401  (the module-scoped fixture)

from dflash_eval.core.errors import InputError  # noqa: E402


@pytest.fixture(scope="module")
def stripped(pipeline, tmp_path_factory):  # noqa: F811
    from dflash_eval.stages.strip_drafter import strip_checkpoint

    return strip_checkpoint(pipeline["dir"] / "drafter", tmp_path_factory.mktemp("integrity") / "stripped",
                            target_dir=pipeline["target_dir"])


def test_a_drafter_without_strip_info_is_evaluated_with_a_warning(pipeline, stripped, tmp_path, caplog):  # noqa: F811
    d = pipeline["dir"]
    assert _evaluate(pipeline, d / "c.h5", drafter=stripped, out="verified.json")["drafter_verified"] is True
    bare = tmp_path / "bare"
    shutil.copytree(stripped, bare)
    (bare / "strip_info.json").unlink()
    with caplog.at_level("WARNING", logger="dflash_eval"):
        result = _evaluate(pipeline, d / "c.h5", drafter=bare, out="bare.json")
    assert result["drafter_verified"] is False
    assert json.loads((d / "bare.json").read_text())["drafter_verified"] is False
    assert [m for m in caplog.messages if "unverified" in m] == [
        f"{bare}: weights read unverified: no strip_info.json; strip the checkpoint with the strip_drafter rule "
        "to have them verified"]


@pytest.mark.parametrize("edit, field", [("no info_sha256", "info_sha256"), ("no sha256", "sha256"),
                                         ("sha256 without config.json", "sha256")])
def test_strip_info_without_its_checksums_is_refused(pipeline, stripped, tmp_path, edit, field):  # noqa: F811
    from dflash_eval.drafter.model import load_drafter
    from dflash_eval.drafter.files import info_sha256

    bad = tmp_path / "bad"
    shutil.copytree(stripped, bad)
    info = json.loads((bad / "strip_info.json").read_text())
    info["step"] = 5000  # the edit the checksum would have caught
    if edit == "no info_sha256":
        del info["info_sha256"]
    else:
        if edit == "no sha256":
            del info["sha256"]
        else:
            del info["sha256"]["config.json"]
        info["info_sha256"] = info_sha256(info)  # resealed by hand: still no record of the files
    (bad / "strip_info.json").write_text(json.dumps(info, indent=2))
    with pytest.raises(InputError) as err:
        load_drafter(bad)
    e = err.value
    assert Path(e.file) == bad / "strip_info.json" and e.field == field and "strip it again" in e.fix
    if field == "sha256":
        assert ("model.safetensors, config.json" if edit == "no sha256" else "for config.json") in e.problem
    with pytest.raises(InputError):
        _evaluate(pipeline, pipeline["dir"] / "c.h5", drafter=bad, out="bad.json")
    assert not (pipeline["dir"] / "bad.json").exists()


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines(keepends=True)


@pytest.mark.parametrize("edit, field, words", [
    ("delete the middle row", "line 1: row_index", "written as row 1 of 3, but is row 1 of 2"),
    ("duplicate a row", "line 2: id", "duplicate id 'p0' (first on line 1)"),
    ("swap two rows", "line 1: row_index", "written as row 2 of 3, but is row 1 of 3"),
    ("drop the last row", "line 1: row_index", "written as row 1 of 3, but is row 1 of 2"),
    ("strip one row's checksums", "line 2: ids_sha256", "carries no ids_sha256 while the rows before it do"),
])
def test_completions_rows_deleted_moved_or_unsealed_are_refused(pipeline, tmp_path, edit, field, words):  # noqa: F811
    from dflash_eval.data.completions import read_completions

    src = pipeline["dir"] / "c.jsonl"
    assert [r["row_index"] for r in read_completions(src)] == [0, 1, 2]  # the intact file reads
    lines = _lines(src)
    if edit == "delete the middle row":
        lines = [lines[0], lines[2]]
    elif edit == "duplicate a row":
        lines = [lines[0], lines[0], lines[2]]
    elif edit == "swap two rows":
        lines = [lines[1], lines[0], lines[2]]
    elif edit == "drop the last row":
        lines = lines[:2]
    else:  # an edit hidden by removing the row's checksums
        row = json.loads(lines[1])
        row["completion_ids"] = row["completion_ids"][:-1]
        del row["ids_sha256"], row["row_sha256"]
        lines[1] = json.dumps(row) + "\n"
    bad = tmp_path / "c.jsonl"
    bad.write_text("".join(lines), encoding="utf-8")
    with pytest.raises(InputError) as err:
        read_completions(bad)
    e = err.value
    assert Path(e.file) == bad and e.field == field and "regenerate the completions" in e.fix
    assert words in e.problem


def _unsealed(lines: list[str], edit_row: int) -> str:
    """Every row's checksums and place removed, then one completion id or prompt id changed."""
    out = []
    for k, line in enumerate(lines):
        row = {key: v for key, v in json.loads(line).items()
               if key not in ("ids_sha256", "row_sha256", "row_index", "n_rows")}
        ids = "completion_ids" if "completion_ids" in row else "prompt_ids"
        if k == edit_row:
            row[ids] = row[ids][:-1] + [row[ids][-1] + 1]
        out.append(json.dumps(row) + "\n")
    return "".join(out)


def test_inside_the_workflow_an_unsealed_prompts_or_completions_file_is_refused(
        pipeline, tmp_path, monkeypatch, caplog):  # noqa: F811
    """Every row's checksums stripped (then a token changed): a direct CLI call reads it with a warning (a
    hand-written or old file); a workflow job (the shell prefix sets the variable) refuses it."""
    from dflash_eval.data.completions import read_completions
    from dflash_eval.data.prompts import read_prompts
    from dflash_eval.row_checksum import SEALED_ENV

    comp = tmp_path / "c.jsonl"
    comp.write_text(_unsealed(_lines(pipeline["dir"] / "c.jsonl"), 1), encoding="utf-8")
    prom = tmp_path / "p.jsonl"
    prom.write_text(_unsealed(_lines(_sealed_prompts(tmp_path)), 0), encoding="utf-8")
    monkeypatch.delenv(SEALED_ENV, raising=False)
    with caplog.at_level("WARNING", logger="dflash_eval"):
        assert len(read_completions(comp)) == 3 and read_prompts(prom)[0]["prompt_ids"] == [1, 40, 3]
    assert sum("read unverified" in m for m in caplog.messages) == 2
    monkeypatch.setenv(SEALED_ENV, "1")
    for read, path, field, fix in [(read_completions, comp, "line 1: ids_sha256", "regenerate the completions"),
                                   (read_prompts, prom, "line 1: row_sha256", "'prompts' stage")]:
        with pytest.raises(InputError) as err:
            read(path)
        assert Path(err.value.file) == path and err.value.field == field and fix in err.value.fix
        assert "rewritten after that stage" in err.value.problem
    smk = (Path(__file__).resolve().parents[1] / "rules" / "common.smk").read_text()
    assert 'parts.append(f"export {SEALED_ENV}=1;")' in smk  # every job of the workflow runs with it


def _sealed_prompts(tmp_path: Path) -> Path:
    from dflash_eval.data.prompts import write_prompts

    rows = [{"id": f"p{i}", "source": "file", "prompt": f"q{i}", "text": f"q{i}", "prompt_ids": [1, 40 + i, 2]}
            for i in range(3)]
    return write_prompts(rows, tmp_path / "prompts.jsonl")


def test_prompts_written_by_the_stage_are_sealed_and_verified(tmp_path, caplog):
    from dflash_eval.data.prompts import read_prompts

    path = _sealed_prompts(tmp_path)
    first = json.loads(_lines(path)[0])
    assert first["row_index"] == 0 and first["n_rows"] == 3 and len(first["row_sha256"]) == 64
    got = read_prompts(path)
    assert [r["prompt_ids"] for r in got] == [[1, 40, 2], [1, 41, 2], [1, 42, 2]]
    assert "row_sha256" not in got[0] and "row_index" not in got[0]  # the rows as the stage built them
    lines = _lines(path)
    edited = json.loads(lines[1])
    edited["prompt_ids"] = [1, 99, 2]  # another prompt under the same id
    cases = {"edited": ([lines[0], json.dumps(edited) + "\n", lines[2]], "line 2: row_sha256"),
             "deleted": ([lines[0], lines[2]], "line 1: row_index"),
             "unsealed": ([lines[0], json.dumps({k: edited[k] for k in ("id", "source", "prompt", "text",
                                                                        "prompt_ids")}) + "\n", lines[2]],
                          "line 2: row_sha256")}
    for name, (body, field) in cases.items():
        bad = tmp_path / f"{name}.jsonl"
        bad.write_text("".join(body), encoding="utf-8")
        with pytest.raises(InputError) as err:
            read_prompts(bad)
        assert err.value.field == field and "'prompts' stage" in err.value.fix, name
    hand = tmp_path / "hand.jsonl"  # a prompts file written by hand: read, with one warning
    hand.write_text(json.dumps({"id": "a", "source": "file", "prompt": "", "text": "", "prompt_ids": [1, 2]}) + "\n")
    with caplog.at_level("WARNING", logger="dflash_eval"):
        assert read_prompts(hand)[0]["prompt_ids"] == [1, 2]
    assert sum("read unverified" in m and "row_sha256" in m for m in caplog.messages) == 1


def test_evaluate_outputs_and_target_costs_carry_a_verified_content_checksum(pipeline, tmp_path, caplog):  # noqa: F811
    """An acceptance length, a step or a sample dropped in an eval JSON, or a cost scaled in target_costs.json,
    used to reach tau.csv and the report unchecked: now refused naming the file and content_sha256."""
    from dflash_eval.target.costs import read_costs
    from dflash_eval.row_checksum import seal_document
    from dflash_eval.report.tau_table import read_eval

    d = pipeline["dir"]
    _evaluate(pipeline, d / "c.h5", out="sealed.json")
    path = d / "sealed.json"
    r = read_eval(path)
    assert len(r["content_sha256"]) == 64
    edits = {"acceptance": lambda x: x["samples"][0].update(acceptance_lengths=[8] * 4),
             "step": lambda x: x.update(step=5000), "dropped": lambda x: x["samples"].pop()}
    for name, edit in edits.items():
        x = json.loads(path.read_text())
        edit(x)
        bad = tmp_path / f"{name}.json"
        bad.write_text(json.dumps(x, indent=1))
        with pytest.raises(InputError) as err:
            read_eval(bad)
        assert Path(err.value.file) == bad and err.value.field == "content_sha256", name
        assert "changed after the evaluate stage wrote it" in err.value.problem and "-R evaluate" in err.value.fix
    old = {k: v for k, v in json.loads(path.read_text()).items() if k != "content_sha256"}  # an older version's file
    (tmp_path / "old.json").write_text(json.dumps(old))
    with caplog.at_level("WARNING", logger="dflash_eval"):
        assert read_eval(tmp_path / "old.json")["tau"] == r["tau"]
    assert any("no content_sha256 (written before it): read unverified" in m for m in caplog.messages)

    from dflash_eval.target.costs import FORMAT, FORMAT_VERSION

    costs = seal_document({"format": FORMAT, "format_version": FORMAT_VERSION, "decode_s": 0.01})
    (tmp_path / "costs.json").write_text(json.dumps(costs))
    assert read_costs(tmp_path / "costs.json")["decode_s"] == 0.01
    (tmp_path / "costs.json").write_text(json.dumps({**costs, "decode_s": 0.1}))
    with pytest.raises(InputError) as err:
        read_costs(tmp_path / "costs.json")
    assert err.value.field == "content_sha256" and "target_costs stage" in err.value.problem


def test_a_drafter_folder_stripped_from_another_checkpoint_is_refused(pipeline, stripped, tmp_path):  # noqa: F811
    """Another checkpoint's stripped folder (self-consistent checksums) put in this checkpoint's place used to be
    evaluated under this checkpoint's name and step; evaluate --checkpoint-source (the workflow passes the
    checkpoint's path) compares it with strip_info.json's source."""
    from dflash_eval.stages.evaluate import evaluate

    d = pipeline["dir"]
    source = json.loads((stripped / "strip_info.json").read_text())["source"]
    assert source == str(d / "drafter")
    kw = dict(device="cpu", dtype="float32", ddtree_budgets=[])
    assert evaluate(stripped, d / "c.h5", pipeline["target_dir"], tmp_path / "ok.json", checkpoint_source=source,
                    **kw)["n_samples"] > 0
    with pytest.raises(InputError) as err:
        evaluate(stripped, d / "c.h5", pipeline["target_dir"], tmp_path / "other.json",
                 checkpoint_source="ckpts/step788.pt", **kw)
    e = err.value
    assert Path(e.file) == stripped / "strip_info.json" and e.field == "source"
    assert f"stripped from {source!r}, but the checkpoint evaluated under this name is 'ckpts/step788.pt'" in e.problem
    assert not (tmp_path / "other.json").exists()
    rule = (Path(__file__).resolve().parents[1] / "rules" / "evaluate.smk").read_text()
    assert "--checkpoint-source {params.checkpoint:q}" in rule  # the workflow passes it to every evaluate job


def test_a_cache_or_completions_of_other_inputs_copied_in_place_is_refused(pipeline, tmp_path):  # noqa: F811
    """Valid, self-consistent files of another prompt set / run / config put in this run's place used to be
    taken for it: evaluate --completions compares the cache's completions_sha256 with the run's completions
    file, hidden_states --prompts the completions rows with the run's prompts file (the workflow passes both)."""
    from dflash_eval.data.completions import read_completions, subset_text
    from dflash_eval.stages.hidden_states import check_generated_from
    from dflash_eval.data.prompts import write_prompts
    from dflash_eval.stages.evaluate import evaluate

    d = pipeline["dir"]
    kw = dict(device="cpu", dtype="float32", ddtree_budgets=[])
    assert evaluate(d / "drafter", d / "c.h5", pipeline["target_dir"], tmp_path / "ok.json", completions=d / "c.jsonl",
                    **kw)["n_samples"] > 0
    rows = read_completions(d / "c.jsonl")
    other = tmp_path / "other.jsonl"
    other.write_text(subset_text(rows[:2]), encoding="utf-8")  # valid completions of another (smaller) set
    with pytest.raises(InputError) as err:
        evaluate(d / "drafter", d / "c.h5", pipeline["target_dir"], tmp_path / "no.json", completions=other, **kw)
    assert Path(err.value.file) == d / "c.h5" and err.value.field == "completions_sha256"
    assert "a cache of another prompt set, run or config" in err.value.problem and not (tmp_path / "no.json").exists()

    prompt_rows = [{"id": r["id"], "source": "file", "prompt": "", "text": "", "prompt_ids": r["prompt_ids"]}
                   for r in rows]
    prompts = write_prompts(prompt_rows, tmp_path / "p.jsonl")
    check_generated_from(d / "c.jsonl", prompts)  # the prompts they were generated from
    edited = [dict(p) for p in prompt_rows]
    edited[1]["prompt_ids"] = edited[1]["prompt_ids"][:-1] + [edited[1]["prompt_ids"][-1] + 1]
    for name, body, words in [("seed", edited, f"row 2 is {rows[1]['id']!r}, prompt 2 of"),
                              ("fewer", prompt_rows[:-1], f"{len(rows)} rows for {len(rows) - 1} prompts")]:
        p = write_prompts(body, tmp_path / f"{name}.jsonl")
        with pytest.raises(InputError) as err:
            check_generated_from(d / "c.jsonl", p)
        assert Path(err.value.file) == d / "c.jsonl" and err.value.field.endswith(": prompt_ids")
        assert words in err.value.problem and "completions of another prompt set" in err.value.problem, name
    for rule, flag in [("evaluate.smk", "--completions {input.completions:q}"), ("cache.smk", "--prompts {input.prompts:q}")]:
        assert flag in (Path(__file__).resolve().parents[1] / "rules" / rule).read_text()  # the workflow passes them


def test_a_cache_sample_that_is_not_its_completions_row_is_refused(pipeline, tmp_path):  # noqa: F811
    """The fourth trial's finding 6: each sample's checksum covers its own bytes only, so a sample of another cache
    moved into the file (its checksum intact, the file-level arrays made to match) changed tau without a word.
    evaluate --completions compares the cache's sample ids with the rows' (each once) and each sample it reads
    with its row's token ids and prompt length."""
    import shutil

    import h5py

    from cache_edit import _meta_of, _reseal
    from dflash_eval.stages.evaluate import evaluate

    d = pipeline["dir"]
    kw = dict(device="cpu", dtype="float32", ddtree_budgets=[])

    def forged(edit):
        c = tmp_path / f"{edit.__name__}.h5"
        shutil.copy(d / "c.h5", c)
        with h5py.File(c, "r+") as f:
            edit(f)
        return c

    def other_tokens(f):  # a sample of the same id and length but other tokens (another run's), resealed
        ids = f["samples/000000/input_ids"][()]
        ids[-1] = (int(ids[-1]) + 1) % 100
        f["samples/000000/input_ids"][...] = ids
        _reseal(f, 0, _meta_of(f, 0))

    def duplicated(f):  # sample 1 copied over slot 0, with the file-level arrays to match
        del f["samples/000000"]
        f.copy(f["samples/000001"], "samples/000000")
        for name in ("sample_ids", "prompt_len", "completion_len", "stop_reason", "max_new_tokens", "argmax_agreement"):
            f[name][0] = f[name][1]

    err_of = {}
    for edit in (other_tokens, duplicated):
        with pytest.raises(InputError) as err:
            evaluate(d / "drafter", forged(edit), pipeline["target_dir"], tmp_path / "no.json",
                     completions=d / "c.jsonl", **kw)
        err_of[edit.__name__] = err.value
    assert not (tmp_path / "no.json").exists()
    e = err_of["other_tokens"]
    assert e.field == "samples/000000" and "holds other token ids than its completions row" in e.problem
    assert "snakemake -R hidden_states" in e.fix
    e = err_of["duplicated"]
    assert e.field == "sample_ids" and "not rows, or twice" in e.problem and "rows without a sample" in e.problem
    # without --completions (outside the workflow) the forged sample is read: its own checksum is intact
    assert evaluate(d / "drafter", tmp_path / "other_tokens.h5", pipeline["target_dir"], tmp_path / "x.json",
                    **kw)["n_samples"] > 0


def test_a_damaged_hdf5_structure_is_named_not_a_raw_h5py_error(pipeline, tmp_path):  # noqa: F811
    """The fifth trial's F3: one byte flipped in the cache's object headers gave evaluate h5py's raw
    ``OSError: Can't synchronously read data`` / ``KeyError: Unable to synchronously open object``, naming no
    file. Every offset of the file's metadata region that h5py itself cannot read is now the catalogue's
    ``damaged HDF5 file`` InputError naming the cache (or a sample), with the re-extract fix."""
    import shutil

    import h5py

    from dflash_eval.cache.reader import CacheReader

    src = pipeline["dir"] / "c.h5"
    c = tmp_path / "c.h5"
    raw_errors = 0
    for off in range(512, 6000, 61):
        shutil.copy(src, c)
        with open(c, "r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
        try:  # what h5py does with it on its own
            with h5py.File(c, "r") as f:
                dict(f.attrs), f["sample_ids"][()], [f[f"samples/{i:06d}/input_ids"][()] for i in range(len(f["samples"]))]
        except (OSError, KeyError, RuntimeError, ValueError, TypeError):
            raw_errors += 1
        else:
            continue
        with pytest.raises(InputError) as err:
            with CacheReader(c) as r:
                with r.verified_samples(list(range(len(r))), r.layer_ids):
                    pass
        assert Path(err.value.file) == c, off
        assert "re-extract" in err.value.fix, (off, err.value.problem)  # damaged, or a checked field gone wrong
    assert raw_errors >= 10  # the region holds object headers: many flips are unreadable to h5py


def test_inside_the_workflow_an_unsealed_cache_eval_output_or_drafter_is_refused(
        pipeline, stripped, tmp_path, monkeypatch, caplog):  # noqa: F811
    """The seventh trial's S1/S2: a cache with its header removed and ``format_version`` set to 5 (then its
    target_layer_ids permuted: tau 1.28 -> 1.00), and an eval JSON without ``content_sha256`` (then its
    acceptance lengths raised: tau 1.28 -> 3.28), were read "unverified" with a warning in a job log only, exit 0.
    A direct CLI call still reads files of earlier versions with the warning; a workflow job (the shell prefix
    sets DFLASH_EVAL_REQUIRE_SEALED=1, where every such file is this version's stage's) refuses them."""
    import h5py
    import numpy as np
    from cache_edit import downgrade

    from dflash_eval.cache.reader import CacheReader
    from dflash_eval.target.costs import FORMAT, FORMAT_VERSION, read_costs
    from dflash_eval.drafter.files import check_source
    from dflash_eval.row_checksum import SEALED_ENV
    from dflash_eval.report.tau_table import read_eval

    d = pipeline["dir"]
    old = tmp_path / "old.h5"
    shutil.copy(d / "c.h5", old)
    downgrade(old, 5)
    with h5py.File(old, "r+") as f:
        f.attrs["target_layer_ids"] = np.array(list(f.attrs["target_layer_ids"])[::-1])
    _evaluate(pipeline, d / "c.h5", out="sealed.json")
    unsealed = {k: v for k, v in json.loads((d / "sealed.json").read_text()).items() if k != "content_sha256"}
    unsealed["samples"][0]["acceptance_lengths"] = [x + 2 for x in unsealed["samples"][0]["acceptance_lengths"]]
    (tmp_path / "ev.json").write_text(json.dumps(unsealed))
    (tmp_path / "costs.json").write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION}))
    bare = tmp_path / "bare"
    shutil.copytree(stripped, bare)
    (bare / "strip_info.json").unlink()
    record = tmp_path / "strip.options.json"
    record.write_text("{}")

    monkeypatch.delenv(SEALED_ENV, raising=False)  # a direct call: read, with one warning each
    with caplog.at_level("WARNING", logger="dflash_eval"):
        CacheReader(old).close()
        assert read_eval(tmp_path / "ev.json")["samples"][0]["acceptance_lengths"][0] >= 3
        read_costs(tmp_path / "costs.json")
    assert sum("read unverified" in m and str(tmp_path) in m for m in caplog.messages) == 3
    check_source(bare, "ck.pt")  # off the workflow (no strip record): not checked

    monkeypatch.setenv(SEALED_ENV, "1")
    with pytest.raises(InputError) as err:
        CacheReader(old)
    assert Path(err.value.file) == old and err.value.field == "format_version"
    assert "inside the workflow every cache is written by its hidden_states stage at format 6" in err.value.problem
    assert "snakemake -R hidden_states" in err.value.fix
    with pytest.raises(InputError, match="inside the workflow every cache"):
        _evaluate(pipeline, old, out="old.json")
    assert not (d / "old.json").exists()
    for read, name, stage in [(read_eval, "ev.json", "evaluate"), (read_costs, "costs.json", "target_costs")]:
        with pytest.raises(InputError) as err:
            read(tmp_path / name)
        assert Path(err.value.file) == tmp_path / name and err.value.field == "content_sha256"
        assert f"inside the workflow every {stage} output is written and sealed by its {stage} stage" in str(err.value)
        assert f"-R {stage}" in err.value.fix
    with pytest.raises(InputError) as err:
        check_source(bare, "ck.pt", record)
    assert Path(err.value.file) == bare / "strip_info.json" and "the run's strip job writes it" in err.value.problem
    CacheReader(d / "c.h5").close()  # this version's files pass
    assert read_eval(d / "sealed.json")["content_sha256"]


def test_a_run_level_output_of_another_run_or_edited_is_refused(tmp_path, monkeypatch):
    """The eighth trial's S4 and S5: another run's target_costs.json (context 400 tokens instead of 32) filled the
    run's speedup columns, and another run's (or an edited) validate_online.json went into the report, exit 0.
    Each run-level output names its stage and the sha256 of its options record, sealed; summary and report compare
    them with the run's records (--run-settings)."""
    from dflash_eval.target.costs import FORMAT, FORMAT_VERSION, read_costs
    from dflash_eval.report.build import load_report_data
    from dflash_eval.row_checksum import SEALED_ENV, write_run_output
    from test_summary import _eval

    run_rec, other_rec = tmp_path / "options" / "target_costs" / "run.json", tmp_path / "other.json"
    run_rec.parent.mkdir(parents=True)
    run_rec.write_text('{"options": "--context-tokens=32"}\n')
    other_rec.write_text('{"options": "--context-tokens=400"}\n')
    section_rec = tmp_path / "options" / "validate_online" / "run.json"
    section_rec.parent.mkdir()
    section_rec.write_text('{"options": "--n-samples=2"}\n')
    records = [str(run_rec), str(section_rec)]
    costs = {"format": FORMAT, "format_version": FORMAT_VERSION, "decode_s": 0.01}
    mine = write_run_output(tmp_path / "costs.json", costs, "target_costs", run_rec)
    assert mine["stage"] == "target_costs" and len(mine["settings_sha256"]) == 64
    assert read_costs(tmp_path / "costs.json", records)["decode_s"] == 0.01
    write_run_output(tmp_path / "theirs.json", costs, "target_costs", other_rec)  # another run's, copied in place
    with pytest.raises(InputError) as err:
        read_costs(tmp_path / "theirs.json", records)
    assert err.value.field == "settings_sha256" and "the run's target_costs options record" in err.value.problem
    assert "another run's copied in place" in err.value.problem
    read_costs(tmp_path / "theirs.json")  # off the workflow: its seal only
    write_run_output(tmp_path / "old.json", costs, "target_costs")  # no record given (a direct call)
    with pytest.raises(InputError, match="settings_sha256: missing"):
        read_costs(tmp_path / "old.json", records)
    # the ninth trial: another run's file of the very same settings, copied into this run's folder
    (tmp_path / "t9b").mkdir()
    shutil.copy(tmp_path / "costs.json", tmp_path / "t9b" / "costs.json")
    with pytest.raises(InputError) as err:
        read_costs(tmp_path / "t9b" / "costs.json", records)
    assert err.value.field == "output" and f"as {str(tmp_path / 'costs.json')!r}, not at this path" in err.value.problem
    assert "another run's file" in err.value.problem

    evals = [_eval(tmp_path, "ckA", "humaneval", 788, [[3, 1]])]
    section = {"title": "Online validation", "markdown": "| ckA | 1.2782 |"}
    write_run_output(tmp_path / "vo.json", section, "validate_online", section_rec)
    data = load_report_data(evals, extra=[str(tmp_path / "vo.json")], run_records=records)
    assert data.extra[-1] == ("Online validation", "| ckA | 1.2782 |")
    doc = json.loads((tmp_path / "vo.json").read_text())
    doc["markdown"] = "| ckA | 1.9000 |"  # the trial's edit
    (tmp_path / "edited.json").write_text(json.dumps(doc))
    write_run_output(tmp_path / "stage.json", section, "kernel_parity", section_rec)  # a stage the run does not run
    shutil.copy(tmp_path / "vo.json", tmp_path / "t9b" / "vo.json")
    for name, field in (("edited.json", "content_sha256"), ("stage.json", "stage"), ("t9b/vo.json", "output")):
        with pytest.raises(InputError) as err:
            load_report_data(evals, extra=[str(tmp_path / name)], run_records=records)
        assert Path(err.value.file) == tmp_path / name and err.value.field == field, name
    (tmp_path / "bare.json").write_text(json.dumps(section))  # unsealed: read off the workflow, refused in it
    monkeypatch.delenv(SEALED_ENV, raising=False)
    assert load_report_data(evals, extra=[str(tmp_path / "bare.json")]).extra[-1][1] == "| ckA | 1.2782 |"
    monkeypatch.setenv(SEALED_ENV, "1")
    with pytest.raises(InputError, match="content_sha256: missing, but inside the workflow"):
        load_report_data(evals, extra=[str(tmp_path / "bare.json")])
    for rule in ("costs", "kernel_parity", "engine_parity", "validate_online", "validate_engine"):  # every writer
        text = (Path(__file__).resolve().parents[1] / "rules" / f"{rule}.smk").read_text()
        assert "--settings {input.record:q}" in text, rule


def test_a_validation_of_other_evaluate_outputs_is_refused(tmp_path, monkeypatch):
    """The tenth trial's F2: an evaluate output edited (acceptance lengths raised), validate_online run on it (it read
    the file unverified), then the intact file restored with its old mtime: nothing reran validate_online and the
    report (exit 0) compared online decoding with the edited numbers (offline tau 2.19 where the samples give 1.69).
    A run-level output records the content_sha256 of each evaluate output it compared with (inputs_sha256), the
    report refuses it when one has changed or gone; validate_online / validate_engine read them verified."""
    from dflash_eval.report.build import load_report_data
    from dflash_eval.row_checksum import INPUTS_FIELD, SEALED_ENV, seal_document, write_run_output
    from dflash_eval.report.tau_table import read_eval

    monkeypatch.setenv(SEALED_ENV, "1")
    rec = tmp_path / "options" / "validate_online" / "run.json"
    rec.parent.mkdir(parents=True)
    rec.write_text('{"options": "--n-samples=2"}\n')
    ev = tmp_path / "eval.json"
    intact = seal_document({"checkpoint": "ckB", "prompt_set": "humaneval", "block_size": 8, "step": 3507,
                            "samples": [{"id": "0", "acceptance_lengths": [3, 1]}]})
    ev.write_text(json.dumps(intact))
    edited = seal_document({**intact, "samples": [{"id": "0", "acceptance_lengths": [4, 2]}]})  # a valid seal, too
    section = {"title": "Online validation", "markdown": "| ckB | 2.0 |"}
    doc = write_run_output(tmp_path / "vo.json", section, "validate_online", rec,
                           inputs={str(ev): edited["content_sha256"]})  # validated against the edited one
    assert doc[INPUTS_FIELD] == {str(ev): edited["content_sha256"]}
    with pytest.raises(InputError) as err:
        load_report_data([str(ev)], extra=[str(tmp_path / "vo.json")], run_records=[str(rec)])
    assert Path(err.value.file) == tmp_path / "vo.json" and err.value.field == INPUTS_FIELD
    assert f"compared with {ev} as it was then" in err.value.problem and "restored after this stage ran" in err.value.problem
    assert err.value.fix == f"rerun it: snakemake --forcerun {tmp_path / 'vo.json'}"
    write_run_output(tmp_path / "vo.json", section, "validate_online", rec, inputs={str(ev): intact["content_sha256"]})
    assert load_report_data([str(ev)], extra=[str(tmp_path / "vo.json")],
                            run_records=[str(rec)]).extra[-1][1] == "| ckB | 2.0 |"
    ev.unlink()  # gone since
    with pytest.raises(InputError, match="is gone or unreadable"):
        load_report_data([], extra=[str(tmp_path / "vo.json")], run_records=[str(rec)])
    # the stages read their evaluate outputs through the verified reader (before any target or server starts)
    for stage in ("validate_online", "validate_engine"):
        text = (Path(__file__).resolve().parents[1] / "dflash_eval" / "stages" / f"{stage}.py").read_text()
        assert "loaded = [read_eval(e) for e in evals]" in text and "inputs={e: ev.get(DOC_FIELD)" in text, stage
    bad = {**intact, "samples": [{"id": "0", "acceptance_lengths": [4, 2]}]}  # edited, old seal
    ev.write_text(json.dumps(bad))
    with pytest.raises(InputError, match="content_sha256: its content does not match"):
        read_eval(ev)


def test_a_validation_that_did_not_pass_is_named_at_the_end_of_the_run(tmp_path):
    """The fifteenth trial: a validation that failed was only an "ok: no" row of the report (exit 0): the Snakefile's
    onsuccess prints each failed check of the validations this run wrote (and none of an earlier run's)."""
    import time

    from dflash_eval.output_digests import failed_checks

    vo = tmp_path / "validate_online.json"
    vo.write_text(json.dumps({"checkpoints": [
        {"checkpoint": "ckA", "modes": {"chain": {"ok": True, "samples": [{"ok": False}]}, "ddtree_4": {"ok": False}},
         "sampling": {"T=1": {"within_goal": False}, "T=0.6": {"within_goal": True}}},
        {"checkpoint": "ckB", "modes": {"chain": {"ok": True}}}]}))
    ve = tmp_path / "validate_engine.json"
    ve.write_text(json.dumps({"checkpoints": [{"checkpoint": "ckB", "ok": False, "requests": [{"ok": False}]}]}))
    assert failed_checks([vo, ve, tmp_path / "gone.json"], since=0) == [
        f"{vo}: ckA ddtree_4: did not pass (see the report)",
        f"{vo}: ckA T=1: sampled online tau differs from offline beyond the goal (see the report)",
        f"{ve}: ckB: did not pass (see the report)"]
    assert failed_checks([vo, ve], since=time.time() + 10) == []  # written before this run: not repeated
