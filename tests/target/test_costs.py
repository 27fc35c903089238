"""target_costs: what is timed (shapes, masks, dedup of drafter configs), its errors, and the tree mask."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_eval.drafter.demo import drafter_config_for_target  # noqa: E402
from dflash_eval.cli import build_parser  # noqa: E402
from dflash_eval.target.costs import read_costs
from dflash_eval.stages.target_costs import _tree_mask, measure_target_costs  # noqa: E402
from dflash_eval.core.errors import InputError  # noqa: E402
from dflash_eval.target.spec import TargetSpec# noqa: E402


def _drafter_configs(tmp_path, target, specs):
    paths = []
    for name, block in specs:
        d = tmp_path / "drafters" / name
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(drafter_config_for_target(target, [1, 2], block, 1, TargetSpec.read(target).vocab_size - 1)))
        paths.append(d / "config.json")
    return paths


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tiny import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("costs") / "target", num_layers=3, hidden=64)


def test_measures_every_shape_once(llama, tmp_path):
    cfgs = _drafter_configs(tmp_path, llama, [("ck-a", 4), ("ck-b", 4), ("ck-c", 6)])
    out = tmp_path / "target_costs.json"
    r = measure_target_costs(llama, cfgs, out, budgets=[3, 8], context_tokens=32, repeats=2, warmup=1, device="cpu")
    assert read_costs(out) == json.loads(json.dumps(r))
    assert r["device"] == "cpu" and r["dtype"] == "float32" and r["context_tokens"] == 32
    # chain verify at each block size (causal), tree verify at budget + 1
    assert [(v["n"], v["mask"]) for v in r["verify"]] == [(4, "causal"), (4, "tree"), (6, "causal"), (9, "tree")]
    assert all(len(v["samples_s"]) == 2 and v["median_s"] > 0 for v in r["verify"])
    assert len(r["decode_samples_s"]) == 2 and r["decode_s"] > 0
    d = r["drafters"]
    assert set(d) == {"ck-a", "ck-b", "ck-c"}
    # identical configs are timed once and share the numbers; another block size is timed apart
    assert d["ck-a"]["config_sha256"] == d["ck-b"]["config_sha256"] != d["ck-c"]["config_sha256"]
    assert d["ck-a"]["draft_samples_s"] == d["ck-b"]["draft_samples_s"] != d["ck-c"]["draft_samples_s"]
    assert set(d["ck-c"]["draft_tree_s"]) == {"3", "8"} and d["ck-c"]["block_size"] == 6
    assert r["target"]["num_layers"] == 3 and len(r["target"]["sha256"]) == 64


def test_hybrid_target_cache_copies(tmp_path):
    """Recurrent (Gated DeltaNet) state lives in the cache too: each timed forward starts from a copy."""
    import tiny_hybrid as th

    target = th.save_target(tmp_path / "hybrid", kind="qwen3_5")
    cfgs = _drafter_configs(tmp_path, target, [("ck", 4)])
    r = measure_target_costs(target, cfgs, tmp_path / "c.json", budgets=[4], context_tokens=16, repeats=1, warmup=0,
                             device="cpu", linear_attn_backend="torch")
    assert r["linear_attn_kernel"] == "torch" and [v["n"] for v in r["verify"]] == [4, 5]


@pytest.mark.parametrize("kw, field", [
    ({"budgets": [0]}, "--budgets"),
    ({"repeats": 0}, "--repeats"),
    # tiny target: max_position_embeddings 512; 600 and the default contexts 512, 2048, ... + 9 tokens exceed it
    ({"context_tokens": 600}, "target_costs.contexts"),
])
def test_errors(llama, tmp_path, kw, field):
    cfgs = _drafter_configs(tmp_path, llama, [("ck", 4)])
    with pytest.raises(InputError) as err:
        measure_target_costs(llama, cfgs, tmp_path / "c.json", **{"context_tokens": 8, "repeats": 1, **kw}, device="cpu")
    assert err.value.field == field
    assert not (tmp_path / "c.json").exists()


def test_tree_mask():
    m = _tree_mask(3, 2, torch.float32, torch.device("cpu"))[0, 0]
    neg = torch.finfo(torch.float32).min
    assert m.shape == (3, 5)
    assert (m[:, :2] == 0).all()  # the committed past is visible to every node
    assert m[0, 3] == neg and m[0, 2] == 0 and m[2, 2:].eq(0).all()  # each node sees itself and its ancestors


def test_cli_defaults_from_schema():
    a = build_parser().parse_args(["target-costs", "--target", "t", "--drafter-config", "a/config.json", "--out", "o"])
    assert a.budgets == [8, 16, 32, 64, 128, 256] and a.context_tokens == 512 and a.repeats == 9 and a.device == "auto"
    assert a.contexts == [512, 2048, 8192, 32768] and a.batch_sizes == [1, 16] and a.tree_batch_sizes == [1]
    assert build_parser().parse_args(["target-costs", "--target", "t", "--drafter-config", "x", "--budgets", "",
                                      "--out", "o"]).budgets == []


# --------------------------------------------------------------------------- noise: min, interleaving, monotone fit
def test_cost_statistics_by_hand():
    from dflash_eval.target.cost_stats import assess, isotonic, robust_s, spread

    assert robust_s([0.79, 0.16, 0.2]) == 0.16
    assert spread([1.0, 1.0, 1.0]) == 0.0 and spread([0.16, 0.2, 0.79]) == pytest.approx(0.25)
    # measured verify costs: 33 tokens 3.46 s, 257 tokens 1.07 s -> pooled to their mean
    assert isotonic([1.0, 3.46, 1.07]) == [1.0, pytest.approx(2.265), pytest.approx(2.265)]
    assert isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0] and isotonic([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]
    quiet = {"decode_samples_s": [0.010, 0.0101, 0.0102],
             "verify": [{"n": 4, "mask": "causal", "samples_s": [0.014, 0.0141, 0.0142]},
                        {"n": 9, "mask": "tree", "samples_s": [0.019, 0.0195, 0.02]}],
             "drafters": {"ck": {"draft_samples_s": [0.002, 0.002, 0.0021]}}}
    assert assess(quiet)["reliable"] and assess(quiet)["reasons"] == []
    noisy = json.loads(json.dumps(quiet))
    noisy["decode_samples_s"] = [0.16, 0.5, 0.79]  # the demo's 5x spread
    v = assess(noisy)
    assert not v["reliable"] and v["worst"] == "decode step" and v["worst_spread"] == pytest.approx(0.5 / 0.16 - 1)
    falling = json.loads(json.dumps(quiet))
    falling["verify"][1]["samples_s"] = [0.007, 0.007, 0.007]  # 9 tokens cheaper than 4
    v = assess(falling)
    assert not v["reliable"] and v["non_monotone"] == [4, 9] and "falls as n grows" in v["reasons"][0]


def test_costs_are_minima_interleaved_and_monotone(llama, tmp_path, monkeypatch):
    import dflash_eval.stages.target_costs as tc

    order = []
    real = tc._timed_interleaved

    def spy(items, repeats, warmup, dev):
        wrapped = [(lambda arg, k=k, run=run: (order.append(k), run(arg)), setup) for k, (run, setup) in enumerate(items)]
        return real(wrapped, repeats, warmup, dev)

    monkeypatch.setattr(tc, "_timed_interleaved", spy)
    cfgs = _drafter_configs(tmp_path, llama, [("ck", 4)])
    r = measure_target_costs(llama, cfgs, tmp_path / "c.json", budgets=[3, 8], context_tokens=16, repeats=3,
                             warmup=1, device="cpu", batch_sizes=[1])
    # decode + 3 verify shapes, in rounds (warmup round included): 0 1 2 3 0 1 2 3 ...
    assert order == [0, 1, 2, 3] * 4
    assert r["statistic"] == "min" and r["decode_s"] == min(r["decode_samples_s"])
    fits = [v["fit_s"] for v in r["verify"]]
    assert fits == sorted(fits)  # non-decreasing in n
    for v in r["verify"]:
        assert v["min_s"] == min(v["samples_s"]) and v["spread"] >= 0
    assert r["drafters"]["ck"]["draft_s"] == min(r["drafters"]["ck"]["draft_samples_s"])
    assert isinstance(r["estimate_reliable"], bool) and r["reliability"]["bound"] == 0.25
    assert read_costs(tmp_path / "c.json")["format_version"] == 3


def test_costs_timed_at_another_block_size_are_refused_not_used():
    """The costs of a drafter timed at another block size than it was evaluated at (an edited config) gave the
    chain a speedup from another verify width and draft time; refused, naming the checkpoint."""
    from dflash_eval.report.tau_table import method_speedups

    costs = {"verify": [{"n": 8, "mask": "causal", "median_s": 2.0}, {"n": 4, "mask": "causal", "median_s": 1.5}],
             "decode_s": 1.0, "drafters": {"ck": {"block_size": 4, "draft_s": 0.5, "draft_tree_s": {}}},
             "output": "results/r/target_costs.json"}
    assert method_speedups({"checkpoint": "ck", "block_size": 4, "tau": 3.0}, costs, [])[0]["speedup"] == 1.5
    with pytest.raises(InputError) as err:
        method_speedups({"checkpoint": "ck", "block_size": 8, "tau": 3.0}, costs, [])
    assert (err.value.file, err.value.field) == ("results/r/target_costs.json", "drafters.ck.block_size")
