"""Pinned chain and DDTree tau of a drafter that accepts drafts, through the workflow, hand-checked; the same for
its DFlash 2 sibling (chain tau, the oracle and unary chains and the selector diagnostics), checked against the
reference's online loop.

The random-init drafters of the tiny workflow never have a draft accepted (tau = 1 exactly), so a replay
that always rejects passes every other end-to-end test. The tiny *trained* drafter
(``tests/fixtures/trained_drafter/step300``, built by ``tests/fixtures/make_trained_drafter.py``; the
``trained`` entry of the tiny run's ``checkpoints.list``) accepts 0 to 3 drafts per verify step on the tiny
target's completions. Its acceptance is checked three ways, which must all agree:

1. the pins below (per-sample acceptance lists, tau as exact fractions);
2. an independent recomputation from the cached states (``tests/hand_tau.py``: the drafter run one block
   at a time, the greedy walk and the DDTree written out plainly, the reference benchmark's tau);
3. what the workflow wrote: the per-sample eval JSON (``acceptance_lengths``,
   ``acceptance_lengths_ddtree``) and ``tau.csv`` (``tau``, ``tau_ddtree_2``, ``tau_ddtree_8``).

Two ways to get 3: ``test_trained_drafter_through_the_workflow`` reads the shared tiny Snakemake run
(``tiny_run``, marked slow); ``test_trained_drafter_without_snakemake`` runs the same stage commands (taken
from a Snakemake dry-run of the tiny workflow) in one process, for ``make test-fast``.

Mutations these tests were checked against (each made by hand in the package, both tests failed,
reverted):

(a) the acceptance walk always rejects: ``dflash_eval.replay.chain.chain_walk`` commits 1 token per step
    (``produced = 1``), and ``dflash_eval.replay.ddtree.walk_budgets`` takes depth 0 (``produced = 1``);
(b) it accepts one more draft than it should: ``chain_walk`` commits ``min(a + 2, tokens left)``,
    ``walk_budgets`` ``min(min(d + 1, depth limit) + 1, tokens left)``, and the all-anchor pass
    (``dflash_eval.replay.chain._group_drafts``) counts the accepted prefix one slot past the first mismatch
    (``acc = min(acc + 1, limit)``).

The DFlash 2 sibling (``tests/fixtures/trained_drafter2/step35``, ``make_trained_drafter.py --dflash2``: trained by
``dflash-eval train --variant dflash2``) is evaluated by the same stage commands (``trained2``). Its checks:
the stripped folder loads strictly into the reference ``dflash==0.1.0`` ``DFlash2DraftModel``, whose own online loop
(``dflash_generate``, float32, the tiny target verifying) commits the cached completions with the same tokens per
verify step as the offline replay; and the pins below (selector chain, oracle and unary chains, selector
diagnostics). The selector changes accepted drafts on these responses (its tau differs from the unary chain's),
so a replay that drops it fails. Mutations these tests were checked against (by hand, each failed, reverted):
the all-anchor pass drafts the per-slot argmax instead of the selector's path
(``dflash_eval.replay.anchors._selector_head``: ``path[r] = lg.argmax(-1)``); the selector scores every slot after
the anchor (``CandidateSelector.forward``: ``prev`` never advances); the oracle counts the candidate hits
instead of their leading run (``_group_drafts``: ``hit.long().sum(-1)``); the selector's verify steps read the
in-candidate flags one slot late (``dflash_eval.replay.selector.walks``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import hand_tau
from test_workflow import CI_PROFILE, REPO, TRAINED_DRAFTER, dflash_eval_argv, make_tiny_workdir, shell_commands, smk

BUDGETS = [2, 8]
#: per prompt set and sample id: (chain, DDTree budget 2, DDTree budget 8) tokens committed per verify step
PINNED = {
    "set_a": {
        "a2": ([2, 1, 2, 2, 2, 2, 2, 1, 2, 2, 2, 2, 1], [2, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2], [3, 3, 3, 3, 3, 3, 3, 2]),
        "a0": ([2, 1, 2, 2, 2, 2, 2, 2, 2, 2, 1, 2, 1], [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1], [3, 3, 3, 3, 3, 3, 2, 3]),
        "a1": ([2, 1, 2, 2, 2, 2, 1, 2, 2, 1, 2, 2, 2], [2, 2, 2, 2, 2, 2, 2, 2, 1, 2, 2, 2], [3, 4, 4, 3, 3, 3, 3]),
        "a3": ([1, 4, 3, 1, 2, 2, 2, 2, 1, 1, 1, 1, 2], [1, 3, 3, 2, 2, 2, 2, 2, 2, 1, 2, 1],
               [3, 3, 3, 3, 3, 3, 2, 2, 1]),
    },
    "set_b": {
        "b0": ([2, 2, 2, 2, 2, 1, 1, 2, 2, 2, 1, 1, 2, 1], [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1], [3, 3, 3, 3, 3, 3, 2, 3]),
        "b2": ([1, 1, 1, 2, 2, 2, 2, 1, 2, 2, 2, 2, 2, 1], [2, 2, 2, 2, 2, 1, 2, 2, 2, 2, 2, 2], [3, 3, 3, 3, 3, 3, 3, 2]),
    },
}
#: tau (reference definition: mean over responses of the per-response mean) of the lists above, by hand; each
#: response commits 23 tokens: set_a chain 13 steps each -> 23/13, budget 2 12 steps each -> 23/12, budget 8
#: 8, 8, 7 and 9 steps -> 23 (1/8 + 1/8 + 1/7 + 1/9) / 4 = 2921/1008; set_b 14, 12 and 8 steps each
PINNED_TAU = {
    "set_a": {"chain": Fraction(23, 13), "2": Fraction(23, 12), "8": Fraction(2921, 1008)},
    "set_b": {"chain": Fraction(23, 14), "2": Fraction(23, 12), "8": Fraction(23, 8)},
}


def test_pins_are_consistent():
    """The pinned tau values are the reference definition applied to the pinned lists; every response
    commits its whole completion (23 tokens after the prefill token: 24 new tokens, cut by length)."""
    for ps, samples in PINNED.items():
        for k, key in enumerate(("chain", "2", "8")):
            lists = [v[k] for v in samples.values()]
            assert sum(Fraction(sum(x), len(x)) for x in lists) / len(lists) == PINNED_TAU[ps][key]
            assert all(sum(x) == 23 for x in lists)
    assert {n for s in PINNED.values() for v in s.values() for n in v[0]} == {1, 2, 3, 4}  # several lengths
    assert PINNED_TAU["set_a"]["chain"] > Fraction(13, 10) and PINNED_TAU["set_b"]["chain"] > Fraction(13, 10)


def check_trained(wd: Path, run: str = "tiny", with_table: bool = True) -> None:
    """The ``trained`` checkpoint's eval JSON (and ``tau.csv`` row) of the run in ``wd`` equal the pins and
    the hand recomputation from that run's caches."""
    res = wd / "results" / run
    # strip kept the committed weights bit for bit: the hand check reads the fixture itself
    assert (res / "drafters" / "trained" / "model.safetensors").read_bytes() == \
        (TRAINED_DRAFTER / "model.safetensors").read_bytes()
    rows = {}
    if with_table:
        import pandas as pd

        table = pd.read_csv(res / "tau.csv")
        rows = {r.prompt_set: r for r in table[table.checkpoint == "trained"].itertuples()}
        assert set(rows) == set(PINNED)
    for ps, pins in PINNED.items():
        hand = hand_tau.recompute(TRAINED_DRAFTER, wd / "tiny_target", res / "cache" / f"{ps}.h5", BUDGETS)
        # no argmax draft the chain compared is a near-tie the replay's batching could round the other way
        assert min(h["min_gap"] for h in hand) > 1e-4, [(h["id"], h["min_gap"]) for h in hand]
        assert {h["id"]: (h["chain"], h["ddtree"]["2"], h["ddtree"]["8"]) for h in hand} == pins
        ev = json.loads((res / "eval" / "trained" / f"{ps}.json").read_text())
        assert ev["random_init"] is False and ev["step"] == 300 and ev["block_size"] == 4
        assert ev["trained_max_len"] == 640  # the fixture config's dflash_config.training.max_len
        assert {s["id"]: (s["acceptance_lengths"], s["acceptance_lengths_ddtree"]["2"],
                          s["acceptance_lengths_ddtree"]["8"]) for s in ev["samples"]} == pins
        chains = [h["chain"] for h in hand]
        for key, got in (("chain", ev["tau"]), ("2", ev["ddtree"]["2"]["tau"]), ("8", ev["ddtree"]["8"]["tau"])):
            lists = chains if key == "chain" else [h["ddtree"][key] for h in hand]
            assert hand_tau.reference_tau(lists) == pytest.approx(float(PINNED_TAU[ps][key]), rel=1e-12, abs=0)
            assert got == pytest.approx(float(PINNED_TAU[ps][key]), rel=1e-12, abs=0), (ps, key)
        # the reference benchmark's own summary prints the same tau for these acceptance lists
        assert hand_tau.reference_printed_tau(chains, 4) == f"{float(PINNED_TAU[ps]['chain']):.2f}"
        if with_table:
            row = rows[ps]
            assert (row.step, row.n_samples, row.block_size, row.random_init) == (300, len(pins), 4, False)
            assert row.verify_steps == sum(len(c) for c in chains) and row.committed_tokens == 23 * len(pins)
            # every response of a set has the same tau (23 tokens in as many steps): SE 0; tiny prompts < 640 tokens
            assert (row.tau_se, row.trained_max_len, row.n_beyond_trained) == (0.0, 640, 0)
            for col, key in (("tau", "chain"), ("tau_ddtree_2", "2"), ("tau_ddtree_8", "8")):
                assert getattr(row, col) == round(float(PINNED_TAU[ps][key]), 4), (ps, col)  # 4 decimals in tau.csv


@pytest.mark.slow
def test_trained_drafter_through_the_workflow(tiny_run):
    check_trained(tiny_run)


#: runs stage commands (one argv list each, JSON in argv[1]) in one process, stopping at the first failure
_DRIVER = """
import json, sys
from dflash_eval.cli import main
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    if code:
        sys.exit(f"dflash_eval {' '.join(argv)}: exit status {code}")
"""


TRAINED_DRAFTER2 = REPO / "tests" / "fixtures" / "trained_drafter2" / "step35"


def run_stages(wd: Path, name: str, path: str) -> Path:
    """The stage commands the workflow would run for one ``checkpoints.list`` entry alone (target fingerprint,
    prompts, completions, hidden states, strip, evaluate: the shell commands of ``snakemake -n -p``), run in one
    Python process with the workflow's 2 torch threads, in a tiny workflow folder made in ``wd``; that folder."""
    wd = make_tiny_workdir(wd, random_checkpoints=False, checkpoints={"list": [{"name": name, "path": path}]})
    if name == "trained2":
        shutil.copytree(TRAINED_DRAFTER2, wd / path)
    targets = [f"results/tiny/eval/{name}/{ps}.json" for ps in PINNED]
    out = smk(wd, "-n", "-p", "--workflow-profile", str(CI_PROFILE), *targets).stdout
    for line in out.splitlines():  # Snakemake creates the output and log folders of a job
        key, _, paths = line.strip().partition(": ")
        if key in ("output", "log"):
            for p in paths.split(", "):
                (wd / p).parent.mkdir(parents=True, exist_ok=True)
    argvs = [dflash_eval_argv(c) for c in shell_commands(out)]
    # fingerprint, prompts x2, completions x2, hidden states x2, strip, evaluate x2 (in the dry-run's job order)
    assert len(argvs) == 10 and [a[0] for a in argvs].count("evaluate") == 2, argvs
    env = dict(os.environ, OMP_NUM_THREADS="2")  # what the CI profile's 2 cores give every torch job
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(argvs)], cwd=wd, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return wd


@pytest.mark.slow  # 10-20 s on 2 cores
def test_trained_drafter_without_snakemake(tmp_path):
    """:func:`check_trained` on the stage commands of :func:`run_stages` for the ``trained`` checkpoint."""
    check_trained(run_stages(tmp_path / "wf", "trained", "trained/step300"), with_table=False)


# --------------------------------------------------------------------------- the DFlash 2 sibling
#: DFlash 2 sibling, per prompt set and sample id: (selector chain, oracle chain, unary chain), tokens per verify step
PINNED2 = {
    "set_a": {
        "a2": ([1, 1, 2, 2, 1, 2, 1, 1, 2, 2, 2, 2, 3, 1],
               [1, 1, 2, 2, 1, 2, 1, 1, 2, 2, 2, 2, 3, 1],
               [1, 1, 2, 2, 1, 2, 1, 1, 2, 2, 2, 2, 3, 1]),
        "a0": ([1, 2, 2, 2, 1, 2, 3, 1, 1, 2, 1, 2, 1, 2],
               [1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2],
               [1, 2, 2, 2, 1, 2, 2, 1, 1, 1, 2, 1, 2, 1, 2]),
        "a1": ([1, 1, 2, 2, 1, 3, 1, 2, 2, 2, 2, 1, 2, 1],
               [1, 1, 2, 2, 1, 3, 1, 2, 2, 2, 2, 1, 2, 1],
               [1, 1, 2, 2, 1, 3, 1, 2, 2, 2, 1, 2, 2, 1]),
        "a3": ([1, 2, 4, 1, 2, 1, 1, 2, 1, 2, 1, 1, 1, 1, 1, 1],
               [1, 2, 4, 1, 3, 1, 2, 1, 2, 1, 1, 1, 1, 1, 1],
               [1, 2, 4, 1, 2, 1, 1, 2, 1, 2, 1, 1, 1, 1, 1, 1]),
    },
    "set_b": {
        "b0": ([1, 2, 2, 1, 1, 2, 1, 2, 1, 4, 2, 2, 1, 1],
               [1, 2, 2, 1, 1, 2, 1, 2, 1, 4, 2, 2, 1, 1],
               [1, 2, 2, 1, 1, 2, 1, 2, 1, 3, 2, 1, 2, 1, 1]),
        "b2": ([2, 2, 3, 2, 2, 3, 2, 2, 2, 2, 1],
               [2, 2, 3, 2, 2, 3, 2, 2, 2, 2, 1],
               [2, 2, 3, 2, 2, 3, 2, 2, 2, 2, 1]),
    },
}
#: its selector diagnostics per prompt set (``dflash_eval.replay.metrics.selector_stats`` of the selector chain's
#: verify steps): counts, and the rates as exact fractions of them
PINNED2_SELECTOR = {
    "set_a": {"steps": 58, "accepted": Fraction(37, 58), "oracle_accepted": Fraction(41, 58), "pick_rate_all": Fraction(37, 41), "oracle_path_rate": Fraction(27, 29),
              "topk_recall": {"1": Fraction(35, 58), "2": Fraction(7, 55), "3": Fraction(8, 53)}, "recall_compared": {"1": 58, "2": 55, "3": 53},
              "pick_rate": {"1": Fraction(32, 35), "2": Fraction(4, 5), "3": Fraction(1, 1)}, "pick_compared": {"1": 35, "2": 5, "3": 1}},
    "set_b": {"steps": 25, "accepted": Fraction(22, 25), "oracle_accepted": Fraction(22, 25), "pick_rate_all": Fraction(1, 1), "oracle_path_rate": Fraction(1, 1),
              "topk_recall": {"1": Fraction(18, 25), "2": Fraction(4, 23), "3": Fraction(3, 22)}, "recall_compared": {"1": 25, "2": 23, "3": 22},
              "pick_rate": {"1": Fraction(1, 1), "2": Fraction(1, 1), "3": Fraction(1, 1)}, "pick_compared": {"1": 18, "2": 3, "3": 1}},
}


def _floats(pins: dict) -> dict:
    """``pins`` with every Fraction as the float the replay computes (a ratio of two ints, correctly rounded)."""
    return {k: _floats(v) if isinstance(v, dict) else float(v) if isinstance(v, Fraction) else v for k, v in pins.items()}


def _tau2(ps: str, k: int) -> Fraction:
    """Reference tau (mean over responses of the per-response mean) of chain ``k`` (0 selector, 1 oracle, 2 unary)."""
    lists = [v[k] for v in PINNED2[ps].values()]
    return sum(Fraction(sum(x), len(x)) for x in lists) / len(lists)


def test_dflash2_pins_are_consistent():
    """Every chain commits the whole response (23 tokens); the oracle chain is at least the selector's; the selector
    changes accepted drafts (its chain differs from the unary one in some response of each set, and its tau too);
    the diagnostics count the selector chain's verify steps."""
    for ps, samples in PINNED2.items():
        assert all(sum(x) == 23 for v in samples.values() for x in v)
        assert _tau2(ps, 1) >= _tau2(ps, 0) and _tau2(ps, 0) != _tau2(ps, 2) and _tau2(ps, 0) > Fraction(3, 2)
        assert any(v[0] != v[2] for v in samples.values())
        sel = PINNED2_SELECTOR[ps]
        assert sel["steps"] == sel["recall_compared"]["1"] == sum(len(v[0]) for v in samples.values())
        assert sel["accepted"] <= sel["oracle_accepted"] and sel["pick_compared"]["1"] <= sel["steps"]
    assert _tau2("set_a", 1) > _tau2("set_a", 0)  # the oracle chain goes further than the selector's somewhere
    assert PINNED2_SELECTOR["set_a"]["pick_rate"]["1"] < 1 and PINNED2_SELECTOR["set_a"]["topk_recall"]["2"] < 1


@pytest.mark.slow
def test_trained_dflash2_drafter_without_snakemake(tmp_path, monkeypatch):
    """The DFlash 2 sibling through the stage commands (:func:`run_stages`): strict load of the stripped folder into
    the reference, its online loop == the offline replay per step, and the pins (about 30 s: slow)."""
    import dflash.model as dflash_model
    from transformers import AutoModelForCausalLM

    stage_run = run_stages(tmp_path / "wf", "trained2", "trained2/step35")
    res = stage_run / "results" / "tiny"
    folder = res / "drafters" / "trained2"
    assert (folder / "model.safetensors").read_bytes() == (TRAINED_DRAFTER2 / "model.safetensors").read_bytes()
    ref, info = dflash_model.DFlash2DraftModel.from_pretrained(folder, output_loading_info=True)
    assert {k: list(v) for k, v in info.items() if v} == {}  # no missing / unexpected / mismatched keys
    ref = ref.float().eval()
    target = AutoModelForCausalLM.from_pretrained(stage_run / "tiny_target", dtype=torch.float32).eval()
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # CPU run
    for ps in PINNED:
        ev = json.loads((res / "eval" / "trained2" / f"{ps}.json").read_text())
        chains = {s["id"]: (s["acceptance_lengths"], s["acceptance_lengths_oracle"], s["acceptance_lengths_unary"])
                  for s in ev["samples"]}
        assert chains == PINNED2[ps], (ps, chains)
        assert ev["selector"] == _floats(PINNED2_SELECTOR[ps]), (ps, ev["selector"])
        for k, key in enumerate(("tau", "tau_oracle", "tau_unary")):
            assert ev[key] == pytest.approx(float(_tau2(ps, k)), rel=1e-12, abs=0), (ps, key)
        rows = [json.loads(line) for line in (res / "completions" / f"{ps}.jsonl").read_text().splitlines()]
        assert [r["id"] for r in rows] == list(chains)
        for r in rows:
            prompt = torch.tensor([r["prompt_ids"]])
            with torch.no_grad():
                online = dflash_model.dflash_generate(ref, target, prompt, len(r["completion_ids"]), None,
                                                      return_stats=True)
            assert online.output_ids[0].tolist() == r["prompt_ids"] + r["completion_ids"], r["id"]  # outputs agree
            assert online.acceptance_lengths == chains[r["id"]][0], r["id"]
