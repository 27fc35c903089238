"""Online speculative sampling (temperature > 0, target in the loop) vs the reference and vs the offline expectation.

The tiny target (``tests/tiny.py``, the tiny workflow's) and the tiny trained drafter
(``tests/fixtures/trained_drafter/step300``, which accepts drafts on the tiny workflow's prompts), CPU
float32:

* (a) :func:`dflash_eval.replay.online.spec_generate` with a sampling setting draws the random numbers the reference
  ``dflash==0.1.0`` ``dflash_generate`` draws (same calls, shapes and order), so a ``torch.Generator`` seeded
  with s gives, run for run, the reference's completion and acceptance lengths after ``torch.manual_seed(s)``
  at T = 1, top-p 0.95, top-k 20 (and at a low temperature, where drafts are accepted often).
* (b) Temperature -> 0: at T = 1e-4 the sampler is the greedy chain (same completion and acceptance lengths
  for every seed), and the temperature-0 setting takes the greedy path exactly.
* (c) The stage: sampled completions -> cache with the final hidden state -> evaluate's expected tau ->
  ``validate_online`` with seeds; the JSON holds per sample and macro the online mean, its SE, the offline
  expected tau and the difference, consistent with the runs it lists; the macro difference is printed.
* (d) DFlash 2 (the trained drafter's weights with identity convs and a random selector): (a) with the reference's
  ``DFlash2DraftModel``, and (c) with evaluate's expectation through the candidate selector.
* Refusals: a setting at temperature 0, a setting evaluate did not evaluate, DDTree with sampling.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_workflow import PROMPTS_A, PROMPTS_B, TRAINED_DRAFTER
from tiny import make_tiny_target

from dflash_eval.core.errors import InputError
from dflash_eval.replay.online import spec_generate
from dflash_eval.replay.sampling import SamplingSetting

T1 = {"temperature": 1.0, "top_p": 0.95, "top_k": 20}
#: low temperature: the tiny target is nearly flat over its top 20 at T = 1 (tau about 1.04), here about 1.4
TLOW = {"temperature": 0.05, "top_p": 0.95, "top_k": 20}
MAX_NEW = 24
#: the stage test (c): its setting, runs per prompt, and copies of the 7 prompts (each copy its own sampled
#: completion: 14 prompts, the issue's 8+); docs/measurements.md also quotes a run with COPIES = 4, SEEDS = 16
STAGE_SETTING, SEEDS, COPIES = TLOW, 8, 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    from dflash_eval.drafter.model import load_drafter
    from dflash_eval.serving.generation import stop_token_ids
    from dflash_eval.target.model import load_target
    from dflash_eval.target.spec import load_embed_and_head

    d = tmp_path_factory.mktemp("online_sampling")
    target_dir = make_tiny_target(d / "target", arch="llama", num_layers=4, hidden=64, seed=0)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    target, _, _ = load_target(target_dir, "cpu", "float32")
    embed, head = (w.float() for w in load_embed_and_head(target_dir))
    # the tiny workflow's prompts as its prompts stage templates them (generation.enable_thinking false)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            enable_thinking=False, return_dict=False)) for p in PROMPTS_A + PROMPTS_B]
    return {"dir": d, "target_dir": target_dir, "target": target, "embed": embed, "head": head, "prompts": prompts,
            "stops": stop_token_ids(target_dir, tok)[0],
            "drafter": load_drafter(TRAINED_DRAFTER, device=torch.device("cpu"), dtype=torch.float32)}


def _ours(tiny, ids, setting, seed):
    g = torch.Generator().manual_seed(seed)
    return spec_generate(tiny["target"], tiny["drafter"], tiny["embed"], tiny["head"], ids, MAX_NEW, tiny["stops"],
                         sampling=SamplingSetting(**setting), generator=g)


@pytest.mark.slow  # 20-90 s each on 2 cores: make test / CI, not the developer loop
@pytest.mark.parametrize("setting", [T1, TLOW], ids=["T1_p0.95_k20", "T0.05_p0.95_k20"])
def test_online_sampler_draws_what_the_reference_draws(tiny, setting, monkeypatch):
    import dflash.model as ref

    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # the reference times with cuda.synchronize
    draft = ref.DFlashDraftModel.from_pretrained(str(TRAINED_DRAFTER), dtype=torch.float32).eval()
    steps, outputs = [], set()
    for ids in tiny["prompts"][:4]:
        for seed in range(4):
            torch.manual_seed(seed)
            r = ref.dflash_generate(draft, tiny["target"], torch.tensor([ids]), max_new_tokens=MAX_NEW,
                                    stop_token_ids=tiny["stops"], return_stats=True, **setting)
            o = _ours(tiny, ids, setting, seed)
            assert o.completion_ids == r.output_ids[0, len(ids):].tolist(), (ids, seed)
            assert o.acceptance_lengths == r.acceptance_lengths, (ids, seed)
            steps += o.acceptance_lengths
            outputs.add(tuple(o.completion_ids))
    assert len(outputs) >= 8  # the runs sample: different seeds, different completions
    assert max(steps) >= 2 and min(steps) == 1  # drafts accepted and rejected, so acceptance is compared
    if setting is TLOW:
        assert sum(a >= 2 for a in steps) >= len(steps) // 4


def test_temperature_to_zero_is_the_greedy_chain(tiny):
    greedy_tau = []
    for ids in tiny["prompts"][:4]:
        g = spec_generate(tiny["target"], tiny["drafter"], tiny["embed"], tiny["head"], ids, MAX_NEW, tiny["stops"])
        zero = _ours(tiny, ids, {"temperature": 0.0}, seed=0)  # the greedy path, exactly
        assert (zero.completion_ids, zero.acceptance_lengths) == (g.completion_ids, g.acceptance_lengths)
        for seed in range(3):
            o = _ours(tiny, ids, {"temperature": 1e-4, "top_p": 0.95, "top_k": 20}, seed)
            assert (o.completion_ids, o.acceptance_lengths) == (g.completion_ids, g.acceptance_lengths), seed
        greedy_tau.append(sum(g.acceptance_lengths) / len(g.acceptance_lengths))
    assert min(greedy_tau) > 1.2  # the greedy chain accepts drafts on these prompts


def test_spec_generate_refuses_sampling_with_ddtree(tiny):
    with pytest.raises(InputError, match="built for the chain only"):
        spec_generate(tiny["target"], tiny["drafter"], tiny["embed"], tiny["head"], tiny["prompts"][0], 8,
                      tiny["stops"], budget=4, sampling=SamplingSetting(**T1))


@pytest.fixture(scope="module")
def staged(tiny):
    """Completions sampled at STAGE_SETTING (seed 0), a cache with the final hidden state, evaluate at that
    setting (the greedy replay on sampled completions is refused without cross_temperature)."""
    from dflash_eval.stages.completions import generate_completions
    from dflash_eval.stages.evaluate import evaluate
    from dflash_eval.stages.hidden_states import extract_hidden_states

    d = tiny["dir"]
    rows = [{"id": f"p{i}", "source": "file", "prompt": "", "text": "", "prompt_ids": p}
            for i, p in enumerate(tiny["prompts"] * COPIES)]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    generate_completions(tiny["target_dir"], d / "prompts.jsonl", d / "c.jsonl", max_new_tokens=MAX_NEW,
                         batch_size=len(rows), device="cpu", dtype="float32", sampling={**STAGE_SETTING, "seed": 0})
    extract_hidden_states(tiny["target_dir"], d / "c.jsonl", d / "c.h5", layer_ids=[1, 2, 3], device="cpu",
                          dtype="float32", final_hidden=True)
    evaluate(TRAINED_DRAFTER, d / "c.h5", tiny["target_dir"], d / "ev.json", device="cpu", dtype="float32",
             ddtree_budgets=[], sampling=[STAGE_SETTING], checkpoint_name="trained", prompt_set="set")
    return d


def _validate(tiny, d, out, **kw):
    from dflash_eval.stages.validate_online import validate_online

    return validate_online(tiny["target_dir"], d / "c.jsonl", [TRAINED_DRAFTER], [d / "ev.json"], d / out,
                           device="cpu", dtype="float32", ddtree_budget=0, **kw)


@pytest.mark.slow  # 20-90 s each on 2 cores: make test / CI, not the developer loop
def test_validate_online_sampled_vs_offline_expected(tiny, staged):
    from dflash_eval.data.completions import read_completions

    d, seeds = staged, SEEDS
    r = _validate(tiny, d, "vo.json", n_samples=len(tiny["prompts"]) * COPIES, seeds=seeds, seed=0)
    ev = json.loads((d / "ev.json").read_text())
    label = SamplingSetting(**STAGE_SETTING).label
    assert [s["label"] for s in r["sampling_settings"]] == [label]  # null = every T > 0 setting evaluated
    c = r["checkpoints"][0]
    assert set(c["modes"]) == {"chain"}  # the greedy check still runs
    m = c["sampling"][label]
    expected = {s["id"]: e["tau"] for s, e in zip(ev["samples"], ev["expected"][label]["samples"])}
    rows = read_completions(d / "c.jsonl")
    assert [s["id"] for s in m["samples"]] == [row["id"] for row in rows]
    for s in m["samples"]:
        taus = [t for t in s["taus"] if t is not None]
        assert len(s["taus"]) == seeds and s["runs"] == len(taus) >= 2
        mean = sum(taus) / len(taus)
        se = math.sqrt(sum((t - mean) ** 2 for t in taus) / (len(taus) - 1) / len(taus))
        assert s["tau_online"] == pytest.approx(mean, rel=1e-12) and s["tau_online_se"] == pytest.approx(se, rel=1e-12)
        assert s["tau_offline"] == expected[s["id"]]  # evaluate's expectation given the cached completion
        assert s["diff"] == pytest.approx(s["tau_online"] - s["tau_offline"], rel=1e-12, abs=1e-15)
        ex = s["expected_taus"]
        assert len(ex) == seeds and all((e is None) == (t is None) for e, t in zip(ex, s["taus"]))
        ex = [e for e in ex if e is not None]
        assert s["tau_expected_online"] == pytest.approx(sum(ex) / len(ex), rel=1e-12)
        var_traj = sum((e - s["tau_expected_online"]) ** 2 for e in ex) / (len(ex) - 1)
        assert s["diff_se"] == pytest.approx(math.sqrt(se ** 2 + var_traj), rel=1e-12)
        assert s["diff_over_se"] == pytest.approx(s["diff"] / s["diff_se"], rel=1e-12)
        assert s["paired_diff"] == pytest.approx(mean - s["tau_expected_online"], rel=1e-9, abs=1e-12)
    n = len(m["samples"])
    assert m["n_compared"] == n
    assert m["tau_online"] == pytest.approx(sum(s["tau_online"] for s in m["samples"]) / n, rel=1e-12)
    assert m["tau_offline"] == pytest.approx(sum(s["tau_offline"] for s in m["samples"]) / n, rel=1e-12)
    for key in ("tau_online_se", "diff_se", "paired_se"):
        assert m[key] == pytest.approx(math.sqrt(sum(s[key] ** 2 for s in m["samples"])) / n, rel=1e-12)
    assert m["diff_over_se"] == pytest.approx(m["diff"] / m["diff_se"], rel=1e-12)
    assert m["rel_diff"] == pytest.approx((m["tau_online"] - m["tau_offline"]) / m["tau_online"], rel=1e-12)
    # the seeding convention: run k of the i-th prompt is spec_generate with a generator seeded seed + i * seeds + k
    i, k = 2, 5
    one = _ours(tiny, rows[i]["prompt_ids"], STAGE_SETTING, seed=i * seeds + k)
    assert m["samples"][i]["taus"][k] == sum(one.acceptance_lengths) / len(one.acceptance_lengths)
    saved = json.loads((d / "vo.json").read_text())
    assert saved["checkpoints"][0]["sampling"][label]["tau_online"] == m["tau_online"]
    assert "Speculative sampling (temperature > 0)" in saved["markdown"] and f"| {label} | {label} |" in saved["markdown"]
    print(f"\nvalidate_online at {label}, {n} prompts x {seeds} seeds: online tau {m['tau_online']:.4f} +- "
          f"{m['tau_online_se']:.4f} (SE over seeds); offline expected tau given the cached completions "
          f"{m['tau_offline']:.4f}: difference {m['diff']:+.4f} +- {m['diff_se']:.4f} (SE of the difference), "
          f"{m['diff_over_se']:+.2f} SE, {100 * m['rel_diff']:+.2f} % (goal 3 %: "
          f"{'met' if m['within_goal'] else 'not met'}); given the online runs' own trajectories "
          f"{m['tau_expected_online']:.4f}: paired difference {m['paired_diff']:+.4f} +- {m['paired_se']:.4f}, "
          f"{m['paired_over_se']:+.2f} SE, {100 * m['paired_diff'] / m['tau_online']:+.2f} %")
    assert m["tau_online"] > 1.2 or STAGE_SETTING is not TLOW  # drafts are accepted
    # the cached side is one trajectory per prompt: with 14 prompts its spread (diff_se, about 5 % of tau here)
    # exceeds the 3 % goal, which is asserted on the paired comparison (docs/measurements.md: the unpaired
    # difference shrinks with more prompts, 1.2 % with 168); both within 3 SE
    assert abs(m["diff_over_se"]) <= 3 and abs(m["paired_over_se"]) <= 3
    assert abs(m["paired_diff"]) <= 0.03 * m["tau_online"]


def test_validate_online_refusals(tiny, staged):
    d = staged
    with pytest.raises(InputError, match=r"--sampling: .*schema entry validate_online\.sampling"):
        _validate(tiny, d, "x.json", n_samples=1, sampling=[{"temperature": 0}])
    with pytest.raises(InputError, match=r"no expected tau at T1_p0\.95_k20"):
        _validate(tiny, d, "x.json", n_samples=1, sampling=[T1])
    # sampling: [] = greedy only, even where the evaluation holds T > 0 settings
    r = _validate(tiny, d, "x.json", n_samples=1, sampling=[])
    assert r["checkpoints"][0]["sampling"] == {} and "Speculative sampling" not in r["markdown"]


# --------------------------------------------------------------------------- DFlash 2 at temperature > 0

@pytest.fixture(scope="module")
def drafter2(tiny):
    """A DFlash 2 drafter that accepts drafts on the tiny target: the trained DFlash 1 drafter's weights, identity
    convs and a random selector whose bilinear term changes the path at some slots (asserted in the test)."""
    from test_dflash2_workflow import write_dflash2

    return write_dflash2(tiny["dir"] / "dflash2", codebook_scale=0.5, seed=3)


@pytest.mark.slow  # 20-90 s each on 2 cores: make test / CI, not the developer loop
@pytest.mark.parametrize("setting", [T1, TLOW], ids=["T1_p0.95_k20", "T0.05_p0.95_k20"])
def test_dflash2_online_sampler_draws_what_the_reference_draws(tiny, drafter2, setting, monkeypatch):
    """DFlash 2: the selector's sampled path and the rejection sampler on its candidates, run for run the
    reference ``dflash_generate`` with ``DFlash2DraftModel``."""
    import dflash.model as ref

    from dflash_eval.drafter.model import load_drafter

    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)
    draft = ref.DFlash2DraftModel.from_pretrained(str(drafter2), dtype=torch.float32).eval()
    ours = load_drafter(drafter2, device=torch.device("cpu"), dtype=torch.float32)
    steps = []
    for ids in tiny["prompts"][:4]:
        for seed in range(4):
            torch.manual_seed(seed)
            r = ref.dflash_generate(draft, tiny["target"], torch.tensor([ids]), max_new_tokens=MAX_NEW,
                                    stop_token_ids=tiny["stops"], return_stats=True, **setting)
            o = spec_generate(tiny["target"], ours, tiny["embed"], tiny["head"], ids, MAX_NEW, tiny["stops"],
                              sampling=SamplingSetting(**setting), generator=torch.Generator().manual_seed(seed))
            assert o.completion_ids == r.output_ids[0, len(ids):].tolist(), (ids, seed)
            assert o.acceptance_lengths == r.acceptance_lengths, (ids, seed)
            steps += o.acceptance_lengths
    assert max(steps) >= 2 and min(steps) == 1


@pytest.mark.slow  # 20-90 s each on 2 cores: make test / CI, not the developer loop
def test_dflash2_validate_online_sampled_vs_offline_expected(tiny, staged, drafter2):
    """evaluate's expected tau of a DFlash 2 drafter at T > 0 (the selector teacher-forced on the cached tokens)
    against its online speculative sampler over seeds; and the selector matters (its path is not the unary one)."""
    from dflash_eval.stages.evaluate import evaluate
    from dflash_eval.stages.validate_online import validate_online

    d = staged
    ev = evaluate(drafter2, d / "c.h5", tiny["target_dir"], d / "ev2.json", device="cpu", dtype="float32",
                  ddtree_budgets=[], sampling=[STAGE_SETTING], checkpoint_name="dflash2", prompt_set="set")
    label = SamplingSetting(**STAGE_SETTING).label
    assert ev["variant"] == "dflash2" and ev["tau_unary"] != ev["tau"]  # the selector changes the greedy chain
    assert ev["expected"][label]["tau"] > 1.2
    r = validate_online(tiny["target_dir"], d / "c.jsonl", [drafter2], [d / "ev2.json"], d / "vo2.json",
                        device="cpu", dtype="float32", ddtree_budget=0, n_samples=len(tiny["prompts"]) * COPIES,
                        seeds=SEEDS, seed=0)
    m = r["checkpoints"][0]["sampling"][label]
    assert m["tau_offline"] == pytest.approx(ev["expected"][label]["tau"], rel=1e-12)  # every sample compared
    print(f"\nDFlash 2 validate_online at {label}, {m['n_compared']} prompts x {SEEDS} seeds: online tau "
          f"{m['tau_online']:.4f} +- {m['tau_online_se']:.4f}; offline expected {m['tau_offline']:.4f}: difference "
          f"{m['diff']:+.4f} +- {m['diff_se']:.4f} ({m['diff_over_se']:+.2f} SE); paired {m['paired_diff']:+.4f} +- "
          f"{m['paired_se']:.4f} ({m['paired_over_se']:+.2f} SE, {100 * m['paired_diff'] / m['tau_online']:+.2f} %)")
    assert abs(m["diff_over_se"]) <= 3 and abs(m["paired_over_se"]) <= 3
    assert abs(m["paired_diff"]) <= 0.03 * m["tau_online"]
