"""DFlash 2 checkpoints through the tiny workflow's stage commands, beside DFlash 1 in one run's tau.csv.

The run holds the tiny trained DFlash 1 drafter (``trained``, which accepts drafts on the tiny target's
completions, pins in tests/replay/test_pinned_tau.py) and three DFlash 2 checkpoints:

* ``lifted``: the same weights as a DFlash 2 drafter whose conv is the identity (tap 0 = 1, no dynamic
  kernel) and whose selector adds nothing (zero codebooks): its selector path is the per-slot argmax, so
  its acceptance equals ``trained``'s exactly, per step, and ``tau_unary == tau``;
* ``picky``: ``lifted`` with large random codebooks, so the selector's path leaves the argmax: its
  batched replay must equal the sequential replay and online decoding with the target in the loop;
* ``demo2``: a random-init DFlash 2 demo entry (``checkpoints.demo`` with ``variant: dflash2``).

The stage commands are those of a Snakemake dry-run of the tiny workflow, run in one process
(as tests/replay/test_pinned_tau.py does), up to ``tau.csv`` and ``report.md``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_pinned_tau import _DRIVER, PINNED
from test_workflow import CI_PROFILE, REPO, TRAINED_DRAFTER, dflash_eval_argv, make_tiny_workdir, shell_commands, smk

TOP_K, RANK = 4, 8


def write_dflash2(dst: Path, codebook_scale: float = 0.0, seed: int = 0) -> Path:
    """The trained DFlash 1 fixture as a z-lab DFlash 2 folder: identity conv, codebooks ``codebook_scale`` * N(0, 1)."""
    cfg = json.loads((TRAINED_DRAFTER / "config.json").read_text())
    cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=RANK, selector_top_k=TOP_K)
    cfg["architectures"] = ["DFlash2DraftModel"]
    state = load_file(str(TRAINED_DRAFTER / "model.safetensors"))
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    for i in range(cfg["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, 2, H)
            base[:, 0] = 1.0  # tap 0 (the slot itself) = 1 on both sides: the identity
            state[f"layers.{i}.{conv}.base_kernel"] = base
            state[f"layers.{i}.{conv}.kernel_projection.weight"] = torch.zeros(2 * 2 * (H // 16), H)
    for name in ("predecessor_codebook", "successor_codebook"):  # saved without .weight, as the reference saves them
        state[f"candidate_selector.{name}"] = codebook_scale * torch.randn(V, RANK, generator=gen)
    state["candidate_selector.hidden_projection.weight"] = torch.randn(RANK, H, generator=gen) / H ** 0.5
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    wd = tmp_path_factory.mktemp("dflash2") / "wf"
    ckpts = {"list": [{"name": "trained", "path": "trained/step300"}, {"name": "lifted", "path": "d2/lifted"},
                      {"name": "picky", "path": "d2/picky"}],
             "demo": [{"name": "demo2", "step": 7, "random_init": True, "variant": "dflash2", "layer_ids": [1, 3],
                       "block_size": 4, "num_layers": 1, "seed": 3}]}
    wd = make_tiny_workdir(wd, random_checkpoints=False, checkpoints=ckpts)
    write_dflash2(wd / "d2" / "lifted")
    write_dflash2(wd / "d2" / "picky", codebook_scale=4.0, seed=1)
    targets = ["results/tiny/tau.csv", "results/tiny/report.md"]
    out = smk(wd, "-n", "-p", "--workflow-profile", str(CI_PROFILE), *targets).stdout
    for line in out.splitlines():
        key, _, paths = line.strip().partition(": ")
        if key in ("output", "log"):
            for p in paths.split(", "):
                (wd / p).parent.mkdir(parents=True, exist_ok=True)
    argvs = [dflash_eval_argv(c) for c in shell_commands(out)]
    assert [a[0] for a in argvs].count("evaluate") == 8, argvs
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(argvs)], cwd=wd, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return wd


def _eval(wd: Path, ckpt: str, ps: str) -> dict:
    return json.loads((wd / "results" / "tiny" / "eval" / ckpt / f"{ps}.json").read_text())


@pytest.mark.slow
def test_dflash2_beside_dflash1_in_one_tau_table(run):
    import pandas as pd

    table = pd.read_csv(run / "results" / "tiny" / "tau.csv")
    assert set(zip(table.checkpoint, table.prompt_set)) == {
        (c, p) for c in ("trained", "lifted", "picky", "demo2") for p in PINNED}
    variant = dict(zip(table.checkpoint, table.variant))
    assert variant == {"trained": "dflash", "lifted": "dflash2", "picky": "dflash2", "demo2": "dflash2"}
    rows = {(r.checkpoint, r.prompt_set): r for r in table.itertuples()}
    for ps, pins in PINNED.items():
        one, lifted = _eval(run, "trained", ps), _eval(run, "lifted", ps)
        # the identity conv and a silent selector draft DFlash 1's argmax: the same per-step acceptance
        assert [s["acceptance_lengths"] for s in lifted["samples"]] == [s["acceptance_lengths"] for s in one["samples"]]
        assert {s["id"]: s["acceptance_lengths"] for s in lifted["samples"]} == {k: v[0] for k, v in pins.items()}
        assert [s["acceptance_lengths_unary"] for s in lifted["samples"]] == [s["acceptance_lengths"]
                                                                                for s in lifted["samples"]]
        r1, r2 = rows["trained", ps], rows["lifted", ps]
        assert r2.tau == r1.tau == r2.tau_unary and r2.tau_oracle >= r2.tau
        assert r1.ddtree_applicable and not r2.ddtree_applicable
        assert r1.tau_ddtree_2 >= 1 and math.isnan(r2.tau_ddtree_2) and math.isnan(r2.tau_ddtree_8)
        assert math.isnan(r1.tau_oracle) and math.isnan(r1.topk_recall_slot_1)  # DFlash 1 rows: no selector columns
        # a silent selector picks the top candidate: its accepted drafts per step are the chain's; a perfect
        # selector over the same candidates accepts at least as many
        sel = lifted["selector"]
        # accepted drafts are counted before the cut at the response's end (only each response's last step is cut)
        extra = round(sel["accepted"] * sel["steps"]) - (r2.committed_tokens - r2.verify_steps)
        assert sel["steps"] == r2.verify_steps and 0 <= extra <= 3 * r2.n_samples
        assert sel["oracle_accepted"] >= sel["accepted"] and 0 < sel["pick_rate_all"] <= 1
        assert r2.sel_accepted == round(sel["accepted"], 4) and r2.sel_pick_rate == round(sel["pick_rate_all"], 4)
        for k in (1, 2, 3):
            assert 0 < getattr(r2, f"topk_recall_slot_{k}") <= 1
        assert lifted["variant"] == "dflash2" and lifted["ddtree"] == {"2": None, "8": None}
        assert "acceptance_lengths_ddtree" not in lifted["samples"][0]
        # the picky selector leaves the argmax somewhere, and never beats the oracle over the same candidates
        picky = _eval(run, "picky", ps)
        assert [s["acceptance_lengths"] for s in picky["samples"]] != [s["acceptance_lengths"] for s in lifted["samples"]]
        assert [s["acceptance_lengths_unary"] for s in picky["samples"]] == [s["acceptance_lengths"]
                                                                              for s in one["samples"]]
        assert rows["picky", ps].tau_oracle >= rows["picky", ps].tau
        # random init: drafts still go through the whole pipeline (tau >= 1 by construction)
        assert rows["demo2", ps].random_init and rows["demo2", ps].tau >= 1.0
    report = (run / "results" / "tiny" / "report.md").read_text()
    assert "## Candidate walks: DFlash 2" in report and "| lifted |  | set_a |" in report
    assert "| checkpoint | step | prompt_set | tau | tau_unary | tau_oracle | recall@K | pick rate | oracle path |" in report
    # lifted equals trained step by step: the best of each variant ties, Δ tau 0
    t = rows["trained", "set_a"].tau
    assert f"| set_a | trained | {t:.3f} | lifted | {t:.3f} | 0.000 |" in report


@pytest.mark.slow
def test_picky_batched_equals_sequential_and_online(run):
    """The selector's chain from the all-anchor pass == the sequential replay == online decoding (target in the loop)."""
    from dflash_eval.stages.evaluate import evaluate
    from dflash_eval.stages.validate_online import validate_online

    res = run / "results" / "tiny"
    for ps in PINNED:
        batched = _eval(run, "picky", ps)
        seq = evaluate(res / "drafters" / "picky", res / "cache" / f"{ps}.h5", run / "tiny_target",
                       run / f"seq-{ps}.json", device="cpu", dtype="float32", replay="sequential")
        assert [s["acceptance_lengths"] for s in seq["samples"]] == [s["acceptance_lengths"] for s in batched["samples"]]
        assert seq["selector"] == batched["selector"]  # the diagnostics come from the all-anchor pass in both modes
        vo = validate_online(run / "tiny_target", res / "completions" / f"{ps}.jsonl", [res / "drafters" / "picky"],
                             [res / "eval" / "picky" / f"{ps}.json"], run / f"vo-{ps}.json", n_samples=2,
                             ddtree_budget=2, device="cpu", dtype="float32")
        assert set(vo["checkpoints"][0]["modes"]) == {"chain"}  # DDTree not applicable to DFlash 2: skipped
        chain = vo["checkpoints"][0]["modes"]["chain"]
        assert chain["n_same_output"] == chain["n_identical_steps"] == 2 and chain["ok"]
        assert all(s["online"] == s["offline"] for s in chain["samples"])
