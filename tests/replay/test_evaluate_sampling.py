"""Sampling settings through the evaluate stage, the cache's p information and the tau table, CPU float32.

* A cache extracted with ``final_hidden`` holds the target's last layer (format 5, greedy
  ``completion_sampling``); evaluate at ``[T0, T1 p0.95 k20]`` gives the greedy replay unchanged (chain
  and DDTree equal to an evaluate without settings) and the T = 1 expectation equal to the expectation
  built directly from the HF target's own logits and the drafter's all-anchor pass.
* The tau table has one row per checkpoint x prompt set x setting, recomputed from the per-sample data.
* Refusals: a T > 0 setting on completions drawn at T = 0 without ``cross_temperature``; a T > 0 setting
  on a cache without the final hidden state (both name the fix).
* The plan: per prompt set sampling (``prompt_sets.<name>.sampling``), each setting on the sets drawn at its
  temperature, the final hidden state only where a T > 0 setting is evaluated; a setting or a set without a
  partner, and duplicate settings, are refused.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import make_tiny_pipeline  # noqa: E402

from dflash_eval.core.errors import InputError  # noqa: E402

T1 = {"temperature": 1.0, "top_p": 0.95, "top_k": 20}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from dflash_eval.stages.hidden_states import extract_hidden_states

    p = make_tiny_pipeline(tmp_path_factory.mktemp("sampling_eval"), [1, 2], block_size=4, max_new_tokens=20)
    d, target_dir = p["dir"], p["target_dir"]
    extract_hidden_states(target_dir, d / "c.jsonl", d / "final.h5", layer_ids=[1, 2], device="cpu",
                          dtype="float32", final_hidden=True)
    extract_hidden_states(target_dir, d / "c.jsonl", d / "plain.h5", layer_ids=[1, 2], device="cpu",
                          dtype="float32")
    return p


def _evaluate(run, cache, out, **kw):
    from dflash_eval.stages.evaluate import evaluate

    d = run["dir"]
    return evaluate(d / "drafter", d / cache, run["target_dir"], d / out, device="cpu", dtype="float32",
                    checkpoint_name="ck", prompt_set="set", **kw)


def test_final_hidden_cache_is_format_6_with_the_last_layer(run):
    from dflash_eval.cache.format import FORMAT_VERSION, completion_sampling, final_hidden_index
    from dflash_eval.cache.reader import CacheReader

    assert FORMAT_VERSION == 6
    with CacheReader(run["dir"] / "final.h5") as r:
        assert r.layer_ids == [1, 2, 3] and r.attrs["last_layer_normed"]
        assert final_hidden_index(r.attrs) == 2
        assert completion_sampling(r.attrs) == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": None}
    with CacheReader(run["dir"] / "plain.h5") as r:
        assert r.layer_ids == [1, 2] and final_hidden_index(r.attrs) is None


def test_t1_expectation_equals_the_direct_computation_and_greedy_is_unchanged(run):
    from dflash_eval.replay.anchors import iter_anchor_drafts
    from dflash_eval.cache.reader import CacheReader
    from dflash_eval.drafter.model import load_drafter
    from dflash_eval.replay.expected import response_expectations
    from dflash_eval.replay.metrics import aggregate_expected
    from dflash_eval.replay.sampling import SamplingSetting, token_probs
    from dflash_eval.target.model import load_target
    from dflash_eval.target.spec import load_embed_and_head
    from dflash_eval.report.tau_table import summary_frame

    plain = _evaluate(run, "plain.h5", "greedy.json", ddtree_budgets=[4])
    both = _evaluate(run, "final.h5", "both.json", ddtree_budgets=[4], sampling=[{"temperature": 0}, T1],
                     cross_temperature=True)
    # greedy part: identical per sample (chain and DDTree) to an evaluate without settings
    for a, b in zip(plain["samples"], both["samples"]):
        assert a["acceptance_lengths"] == b["acceptance_lengths"]
        assert a["acceptance_lengths_ddtree"] == b["acceptance_lengths_ddtree"]
    assert both["tau"] == plain["tau"] and plain["expected"] == {}
    assert [s["label"] for s in both["sampling_settings"]] == ["T0", "T1_p0.95_k20"]

    # the T = 1 expectation built directly: p from the HF target's logits, q from the all-anchor pass
    st = SamplingSetting(**T1)
    target, _, _ = load_target(run["target_dir"], "cpu", "float32")
    embed, head = (w.float() for w in load_embed_and_head(run["target_dir"]))
    drafter = load_drafter(run["dir"] / "drafter", device=torch.device("cpu"), dtype=torch.float32)
    with CacheReader(run["dir"] / "plain.h5") as r:
        samples = [r.sample(i, [1, 2]) for i in range(len(r))]
    ps = []
    for s in samples:
        with torch.inference_mode():
            logits = target(input_ids=s.input_ids[None]).logits[0]
        p = torch.ones(len(s.input_ids))
        p[1:] = token_probs(logits[:-1], s.input_ids[1:], st.temperature, st.top_p, st.top_k)
        ps.append({st.label: p})
    drafts = list(iter_anchor_drafts(drafter, embed, head, samples, 4, sampling=[st], p_tokens=ps))
    exp = response_expectations([d.survival[st.label] for d in drafts], [d.prompt_len for d in drafts],
                                [d.n_tokens for d in drafts], 4)
    want = aggregate_expected(exp, 4, [d.prompt_len for d in drafts])
    got = both["expected"][st.label]
    assert got["tau"] == pytest.approx(want.tau, rel=1e-5)
    assert got["tau_sglang"] == pytest.approx(want.tau_sglang, rel=1e-5)
    assert got["verify_steps"] == pytest.approx(want.verify_steps, rel=1e-5)
    assert 1.0 <= got["tau"] <= 4.0 and got["tau"] != both["tau"]
    print(f"greedy tau {both['tau']:.4f}, expected tau at {st.label} {got['tau']:.4f} (direct {want.tau:.4f})")

    # the tau table: one row per setting, recomputed from the per-sample data
    df = summary_frame([run["dir"] / "both.json"])
    assert df["sampling"].tolist() == ["T0"] + ["T1_p0.95_k20"] * 3
    assert df["draft"].tolist() == ["reference", "reference", "argmax", "probabilistic"]
    # evaluated on T0 completions on request (cross_temperature): not an expectation
    assert df["expected"].tolist() == [False] * 4 and df["trajectory"].tolist() == ["T0"] * 4
    assert df["tau"].iloc[0] == plain["tau"] and df["tau"].iloc[1] == pytest.approx(got["tau"], rel=1e-12)
    # argmax drafts with one-hot q: the greedy walk on the trajectory, here the greedy chain itself
    assert df["tau"].iloc[2] == pytest.approx(plain["tau"], rel=1e-12)
    assert df["tau"].iloc[3] != df["tau"].iloc[1]  # vLLM's temperature-only q differs from the filtered one
    assert "draft_sample_method=greedy" in df["engine"].iloc[2]
    assert df["engine"].iloc[3] == "vLLM draft_sample_method=probabilistic"
    assert both["sampling_settings"][1]["vllm_draft_sample_method"] == {
        "reference": None, "argmax": "greedy", "probabilistic": "probabilistic"}
    assert df["tau_ddtree_4"].iloc[0] == df["tau_ddtree_4"].iloc[1]
    assert df[["temperature", "top_p", "top_k"]].iloc[1].tolist() == [1.0, 0.95, 20]
    old = summary_frame([run["dir"] / "greedy.json"])  # no sampling settings beyond T0: one greedy row
    assert old["sampling"].tolist() == ["T0"] and old["tau"].iloc[0] == plain["tau"]

    # the report: per-pair tables on the first setting, every setting in its own section
    from dflash_eval.report.build import load_report_data, render_markdown

    data = load_report_data([str(run["dir"] / "both.json")])
    assert data.frame["sampling"].tolist() == ["T0"]
    md = render_markdown(data)
    section = md[md.index("Acceptance by sampling setting"):]
    assert "set T1_p0.95_k20 [reference] on T0 completions" in section and f"{got['tau']:.3f}" in section
    assert "set T1_p0.95_k20 [argmax] on T0 completions" in section
    assert "`T1_p0.95_k20` [argmax]: vLLM draft_sample_method=greedy (the default)" in section
    assert "Shown at temperature > 0" not in md

    # a pair whose first setting is T = 1 (a set drawn at T = 1): the per-pair tables, the histogram and the
    # legend show that setting's expected values, and a note says so
    from dflash_eval.report.figures import set_label

    r = json.loads((run["dir"] / "both.json").read_text())
    r["sampling_settings"] = r["sampling_settings"][::-1]
    (run["dir"] / "t1_first.json").write_text(json.dumps(r))  # an evaluate output of that order
    data = load_report_data([str(run["dir"] / "t1_first.json")])
    assert data.frame["sampling"].tolist() == ["T1_p0.95_k20"] and data.frame["tau"].iloc[0] == pytest.approx(got["tau"])
    hist = data.hists[("ck", "set")][1]
    assert hist == {int(k): v for k, v in got["histogram"].items()}
    assert hist != {int(k): v for k, v in both["histogram"].items()}  # not the greedy chain's counts
    assert sum(hist.values()) == pytest.approx(got["verify_steps"])
    assert ("Shown at temperature > 0: set at T1_p0.95_k20 (on T0 completions: not an expectation)."
            in render_markdown(data))
    assert set_label(data.frame, "set") == "set (T1_p0.95_k20)" and set_label(df.iloc[:1], "set") == "set"


def test_refusals_name_the_fix(run):
    with pytest.raises(InputError, match="cross_temperature"):
        _evaluate(run, "final.h5", "x.json", sampling=[T1])
    with pytest.raises(InputError, match="cache.final_hidden"):
        _evaluate(run, "plain.h5", "x.json", sampling=[T1], cross_temperature=True)


def test_plan_matches_each_setting_to_the_sets_drawn_at_its_temperature():
    """prompt_sets.<name>.sampling overrides generation.sampling field by field; each evaluate.sampling setting
    goes to the sets drawn at its temperature (every set with cross_temperature); only the caches that a T > 0
    setting is evaluated on store the final hidden state (all with cache.final_hidden); the flags the rules pass
    parse back into those stage options; a setting or a set without a partner stops the plan, naming the entry."""
    import shlex

    from dflash_eval.core import options

    from dflash_eval.workflow import plan
    from dflash_eval.cli import build_parser

    T0 = {"temperature": 0, "top_p": 1.0, "top_k": 0}  # the schema's defaults filled, as Snakemake's validate does

    def cfg(sets, settings, **over):
        return {"run": "r", "generation": {"sampling": {"temperature": 0, "seed": 3}}, "prompt_sets": sets,
                "evaluate": {"sampling": settings, **over.pop("evaluate", {})}, "cache": over.pop("cache", {}), **over}

    sets = {"g": {"source": "humaneval"}, "s": {"source": "sharegpt", "sampling": T1}}
    c = cfg(sets, [T0, T1])
    plan.check_sampling_settings(c)
    assert plan.set_sampling(c, "g") == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 3}
    assert plan.set_sampling(c, "s") == {**T1, "seed": 3}  # the seed is generation.sampling's
    assert plan.evaluate_settings(c, "g") == [T0] and plan.evaluate_settings(c, "s") == [T1]
    assert (plan.needs_final_hidden(c, "g"), plan.needs_final_hidden(c, "s")) == (False, True)

    p = plan.Plan(c, "r", ["g", "s"], plan.TargetFiles("t", False, None, ["t/config.json"], ["t/m.safetensors"]), {}, [1])
    parser = build_parser()

    def opts(stage, command, ps, *files):
        args = parser.parse_args([command, *files, *shlex.split(p.stage_flags(stage, ps))])
        return options.from_args(stage, args)

    files = {"completions": ["--target", "t", "--prompts", "x", "--out", "o"],
             "hidden_states": ["--target", "t", "--completions", "x", "--layer-ids", "1", "--out", "o"],
             "evaluate": ["--drafter", "d", "--cache", "x", "--target", "t", "--out", "o"]}
    got = {ps: (opts("completions", "completions", ps, *files["completions"]).sampling,
                opts("hidden_states", "hidden-states", ps, *files["hidden_states"]).final_hidden,
                opts("evaluate", "evaluate", ps, *files["evaluate"]).sampling) for ps in ("g", "s")}
    assert got["g"][1:] == (False, [T0]) and got["s"][1:] == (True, [T1])
    assert (got["s"][0].temperature, got["s"][0].top_p, got["s"][0].top_k, got["s"][0].seed) == (1.0, 0.95, 20, 3)
    assert (got["g"][0].temperature, got["g"][0].seed) == (0.0, 3)

    # cross_temperature: every setting on every set, so every cache needs the final hidden state
    x = cfg(sets, [T0, T1], evaluate={"cross_temperature": True})
    plan.check_sampling_settings(x)
    assert plan.evaluate_settings(x, "g") == plan.evaluate_settings(x, "s") == [T0, T1]
    assert plan.needs_final_hidden(x, "g") and plan.needs_final_hidden(x, "s")
    # cache.final_hidden: true stores it in every cache, also where only T = 0 is evaluated
    assert plan.needs_final_hidden(cfg(sets, [T0, T1], cache={"final_hidden": True}), "g")
    # generation.sampling at T = 1 for every set, no override: the T = 1 setting everywhere (the old recipe)
    every = cfg({"g": {"source": "humaneval"}}, [T1], generation={"sampling": {**T1, "seed": 0}})
    plan.check_sampling_settings(every)
    assert plan.evaluate_settings(every, "g") == [T1] and plan.needs_final_hidden(every, "g")

    def refused(c):
        with pytest.raises(InputError) as e:
            plan.check_sampling_settings(c)
        return e.value

    e = refused(cfg({"g": {"source": "humaneval"}}, [T0, T1]))  # T = 1 but no set drawn at it
    assert e.field == "evaluate.sampling[1]" and "temperature 1 matches no prompt set" in e.problem
    assert "g: 0" in e.problem and "prompt_sets.<name>.sampling: {temperature: 1}" in e.fix
    assert "evaluate.cross_temperature: true" in e.fix
    e = refused(cfg(sets, [T0]))  # a set drawn at T = 1 that no setting is evaluated on
    assert e.field == "prompt_sets.s.sampling" and "'s' is drawn at temperature 1" in e.problem
    assert "add a setting at temperature 1 to evaluate.sampling" in e.fix
    e = refused(cfg({"g": {"source": "humaneval"}, "z": {"source": "sharegpt", "sampling": {"temperature": 0}}},
                    [T0], generation={"sampling": T1}))
    assert e.field == "generation.sampling" and "'g' is drawn at temperature 1" in e.problem  # where g's comes from
    e = refused(cfg(sets, [T0, {"temperature": 0, "top_k": 5}, T1]))
    assert e.field == "evaluate.sampling[1]" and "entry 0" in e.problem


@pytest.mark.slow  # three generate runs, an extraction and an evaluate
def test_sampled_completions_are_seeded_recorded_and_evaluated_at_their_temperature(run, tmp_path):
    """generation.sampling at T = 1: the same seed draws the same tokens, another seed others; the provenance
    and the cache record the setting; evaluate at T = 1 then needs no override, and T = 0 is refused."""
    from dflash_eval.cache.reader import CacheReader
    from dflash_eval.data.completions import read_completions
    from dflash_eval.stages.completions import generate_completions
    from dflash_eval.stages.hidden_states import extract_hidden_states

    d = run["dir"]
    setting = {**T1, "seed": 7}

    def draw(name, **s):
        generate_completions(run["target_dir"], d / "prompts.jsonl", tmp_path / name, max_new_tokens=20, batch_size=3,
                             device="cpu", dtype="float32", sampling=s)
        return read_completions(tmp_path / name)

    a, b, c = draw("a.jsonl", **setting), draw("b.jsonl", **setting), draw("c.jsonl", **{**setting, "seed": 8})
    greedy = read_completions(d / "c.jsonl")
    ids = lambda rows: [r["completion_ids"] for r in rows]  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != ids(c) and ids(a) != ids(greedy)
    assert a[0]["generation"]["sampling"] == {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "seed": 7}
    assert "sampling" not in greedy[0]["generation"]  # greedy provenance unchanged
    extract_hidden_states(run["target_dir"], tmp_path / "a.jsonl", tmp_path / "a.h5", layer_ids=[1, 2], device="cpu",
                          dtype="float32", final_hidden=True)
    with CacheReader(tmp_path / "a.h5") as r:
        assert json.loads(r.attrs["completion_sampling"]) == a[0]["generation"]["sampling"]
    from dflash_eval.stages.evaluate import evaluate

    res = evaluate(d / "drafter", tmp_path / "a.h5", run["target_dir"], tmp_path / "e.json", device="cpu",
                   dtype="float32", sampling=[T1])  # sampled completions: no agreement refusal, no override
    assert res["completion_sampling"]["temperature"] == 1.0 and 1.0 <= res["expected"]["T1_p0.95_k20"]["tau"] <= 4
    with pytest.raises(InputError, match="completions drawn at temperature 1"):
        evaluate(d / "drafter", tmp_path / "a.h5", run["target_dir"], tmp_path / "x.json", device="cpu",
                 dtype="float32")


def test_server_requests_carry_the_setting_and_a_seed_per_prompt():
    from dflash_eval.serving.clients import _neutral_sampling

    assert _neutral_sampling()["temperature"] == 0.0 and "seed" not in _neutral_sampling()
    got = _neutral_sampling({"temperature": 1.0, "top_p": 0.95, "top_k": 0, "seed": 12})
    assert (got["temperature"], got["top_p"], got["top_k"], got["seed"]) == (1.0, 0.95, -1, 12)
    assert _neutral_sampling({"temperature": 0.7, "top_p": 1.0, "top_k": 20, "seed": 3}, "sampling_seed")[
        "sampling_seed"] == 3


def test_server_source_sends_seed_plus_prompt_index_and_records_the_setting():
    from types import SimpleNamespace

    from dflash_eval.serving.generation import ServerSource
    from dflash_eval.serving.clients import ServedCompletion

    sent = {}

    class Client:
        url = "http://stand-in"

        def complete(self, prompt, max_new_tokens, stop_ids, sampling=None):
            sent[tuple(prompt)] = sampling
            return ServedCompletion(ids=[5, 2], finish="stop", matched=2, text=None, n_tokens=2)

        def close(self):
            pass

    info = SimpleNamespace(engine="vllm", model="m", version="0")
    src = ServerSource(Client(), info, SimpleNamespace(eos_token_id=2), 4, [2], concurrency=2,
                       sampling={**T1, "seed": 100})
    got = []
    src.run([[1, 9], [1, 8, 7]], {0, 1}, got.extend)
    assert sent[(1, 9)] == {**T1, "seed": 100} and sent[(1, 8, 7)] == {**T1, "seed": 101}
    assert src.provenance()["sampling"] == {**T1, "seed": 100} and sorted(g[0] for g in got) == [0, 1]
    greedy = ServerSource(Client(), info, SimpleNamespace(eos_token_id=2), 4, [2])
    greedy.run([[1, 9]], {0}, lambda rows: None)
    assert sent[(1, 9)] is None and "sampling" not in greedy.provenance()
