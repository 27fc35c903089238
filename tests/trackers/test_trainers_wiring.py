"""The trainer-facing features in the workflow: mt-bench's second turn after the first turn's completions,
the trackers rule and stage, the demo's TensorBoard default, the parse-time checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from dflash_eval.workflow import plan
from dflash_eval.core.errors import InputError
from test_workflow import (REPO, _drafter_config, _fake_hf_target, _write_config, copy_workflow, job_counts,
                           planned_jobs, shell_commands, smk)
from tracker_files import tensorboard_scalars


def test_prompt_set_checks_of_mt_bench_turn2():
    ok = {"mt": {"source": "mt-bench"}, "mt2": {"source": "mt-bench-turn2", "turn1": "mt"}}
    plan.check_prompt_sets(ok)
    with pytest.raises(InputError, match="prompt_sets.mt2.turn1: 'nope' is not a configured prompt set"):
        plan.check_prompt_sets({**ok, "mt2": {"source": "mt-bench-turn2", "turn1": "nope"}})
    with pytest.raises(InputError, match="prompt_sets.mt2.turn1: 'h' has source 'humaneval'"):
        plan.check_prompt_sets({"h": {"source": "humaneval"}, "mt2": {"source": "mt-bench-turn2", "turn1": "h"}})
    with pytest.raises(InputError, match="prompt_sets.mt2.path: 'b.jsonl' differs from the first turn's data"):
        plan.check_prompt_sets({"mt": {"source": "mt-bench", "path": "a.jsonl"},
                                "mt2": {"source": "mt-bench-turn2", "turn1": "mt", "path": "b.jsonl"}})


def test_dry_run_mt_bench_turn2_after_turn1_completions_and_trackers(tmp_path):
    wd = copy_workflow(tmp_path / "wf")
    _fake_hf_target(wd / "target")
    (wd / "ckpts" / "step100").mkdir(parents=True)
    (wd / "ckpts" / "step100" / "model.safetensors").write_text("x")
    (wd / "ckpts" / "step100" / "config.json").write_text(_drafter_config([0, 1]))
    (wd / "mt.jsonl").write_text(json.dumps({"prompt": ["a", "b"], "prompt_id": 1}) + "\n")
    _write_config(wd, {
        "run": "r1", "target": {"name": "t", "path": "target"},
        "prompt_sets": {"mt": {"source": "mt-bench", "path": "mt.jsonl"},
                        "mt2": {"source": "mt-bench-turn2", "turn1": "mt"}},
        "cache": {"target_layer_ids": [0, 1]}, "checkpoints": {"glob": "ckpts/*"},
        "trackers": {"tensorboard": {"enabled": True}, "wandb": {"enabled": True, "run_id": "train-7"}},
    })
    out = smk(wd, "-n", "-p").stdout
    assert job_counts(out) == {"target_fingerprint": 1, "prompts": 2, "completions": 2, "hidden_states": 2,
                               "strip_drafter": 1, "evaluate": 2, "target_costs": 1, "summary": 1, "report": 1,
                               "trackers": 1, "all": 1}
    cmds = shell_commands(out)
    t2 = next(c for c in cmds if " prompts " in c and "mt2.jsonl" in c)
    assert "--source mt-bench-turn2 --path mt.jsonl --turn1-completions results/r1/completions/mt.jsonl" in t2
    jobs = [r for r, w in planned_jobs(out)]
    # the second turn's prompts job reads the first turn's completions (so it runs after them)
    block = out[:out.index("output: results/r1/prompts/mt2.jsonl")].rsplit("rule prompts:", 1)[1]
    assert "results/r1/completions/mt.jsonl" in block.split("input:", 1)[1]
    tr = next(c for c in cmds if "dflash_eval trackers" in c)
    assert "--table results/r1/tau.parquet --run=r1" in tr and "--tensorboard-enabled" in tr
    assert "--wandb-enabled" in tr and "--wandb-run-id=train-7" in tr and "--no-mlflow-enabled" in tr
    assert jobs.count("trackers") == 1
    # no tracker enabled: no trackers job
    cfg = yaml.safe_load((wd / "config" / "config.yaml").read_text())
    cfg.pop("trackers")
    _write_config(wd, cfg)
    assert "trackers" not in job_counts(smk(wd, "-n").stdout)


def test_demo_logs_to_tensorboard_by_default(tmp_path):
    wd = copy_workflow(tmp_path / "wf")
    out = smk(wd, "-n", "-p", "--configfile", "config/demo.yaml").stdout
    tr = next(c for c in shell_commands(out) if "dflash_eval trackers" in c)
    assert "--run=demo" in tr and "--tensorboard-enabled" in tr and "--no-wandb-enabled" in tr
    assert "tensorboard --logdir results/demo/tensorboard" in (REPO / "README.md").read_text()


def test_trackers_stage_cli(tmp_path):
    df = pd.DataFrame({"checkpoint": ["a", "b"], "step": [10, 20], "prompt_set": ["s", "s"], "tau": [1.5, 2.5]})
    df.to_parquet(tmp_path / "tau.parquet")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "dflash_eval", "trackers", "--table", "tau.parquet", "--run", "x",
           "--tensorboard-enabled", "--out", "trackers.json"]
    for _ in range(2):
        subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True)
    rec = json.loads((tmp_path / "trackers.json").read_text())
    assert rec["points"] == 2 and rec["tensorboard"]["logged"] == 0 and rec["tensorboard"]["already"] == 2
    assert tensorboard_scalars(tmp_path / "results/x/tensorboard/x") == {"dflash_eval/s/tau": [(10, 1.5), (20, 2.5)]}


def test_report_shows_tau_by_prompt_length(tmp_path):
    from dflash_eval.stages.report import write_report
    from dflash_eval.stages.summary import write_summary

    ev = {"checkpoint": "step1", "prompt_set": "long", "block_size": 4, "step": 1, "random_init": False,
          "device": "cpu", "dtype": "float32",
          "samples": [{"id": "a", "prompt_len": 100, "acceptance_lengths": [3, 1]},
                      {"id": "b", "prompt_len": 9000, "acceptance_lengths": [2, 2]}]}
    p = tmp_path / "e.json"
    p.write_text(json.dumps(ev))
    write_summary([str(p)], tmp_path / "tau.csv", tmp_path / "tau.parquet")
    write_report(tmp_path / "tau.csv", [str(p)], [], tmp_path / "report.md", out_html=tmp_path / "report.html")
    md = (tmp_path / "report.md").read_text()
    section = md.split("## Acceptance by prompt length", 1)[1].split("\n## ", 1)[0]
    assert "| 0-128 tokens | 8192-16384 tokens |" in section and "| step1 | long | 2.000 (1) | 2.000 (1) |" in section
    assert "128-256" not in section  # bins without a response are left out
    assert 'id="prompt-lengths"' in (tmp_path / "report.html").read_text()
