"""The engine_parity stage without vLLM: the comparison on hand-altered caches, the drafter table on hand-built
evaluations, and the stage in both directions on the tiny target (seconds, CPU float32).

The real vLLM side runs in ``tests/serving/test_vllm_states.py`` (the stage against the servers that module already
starts); here the vLLM extraction is stood in for by the HF extraction with right-padded instead of packed
batches, which differs from the run's packed cache by rounding (rel-L2 ~1e-6), as vLLM's kernels do.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_workflow import PROMPTS_A, TRAINED_DRAFTER  # noqa: E402

from dflash_eval.cache.reader import CacheReader  # noqa: E402
from dflash_eval.core.errors import InputError  # noqa: E402
from dflash_eval.stages import engine_parity as ep  # noqa: E402

LAYERS = [1, 2, 3]  # the trained drafter's target_layer_ids


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny target, its float32 greedy completions of PROMPTS_A (24 new tokens) and their packed HF cache."""
    pytest.importorskip("h5py")
    from tiny import make_tiny_target

    from dflash_eval.data.prompts import build_prompt_set, write_prompts
    from dflash_eval.stages.completions import generate_completions
    from dflash_eval.stages.hidden_states import extract_hidden_states

    root = tmp_path_factory.mktemp("engine-parity")
    target = make_tiny_target(root / "tiny_target", arch="llama", num_layers=4, hidden=64, seed=0)
    (root / "a.jsonl").write_text("".join(json.dumps({"id": f"a{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS_A)))
    prompts = write_prompts(build_prompt_set("file", target, n=0, seed=0, path=root / "a.jsonl"), root / "p.jsonl")
    comp = generate_completions(target, prompts, root / "set_a.jsonl", max_new_tokens=24, batch_size=4, device="cpu",
                                dtype="float32")
    cache = extract_hidden_states(target, comp, root / "set_a.h5", LAYERS, device="cpu", dtype="float32",
                                  batch_tokens=512)
    return target, comp, cache


def _altered_copy(cache: Path, out: Path, sample: int, layer: int, scale: float, argmax_pos: int | None = None) -> Path:
    """A copy of ``cache`` with one layer of one sample multiplied by ``scale`` (and one target argmax changed):
    its checksums no longer match, so it is read with ``verify=False``."""
    import h5py

    shutil.copyfile(cache, out)
    with h5py.File(out, "r+") as f:
        g = f[f"samples/{sample:06d}"]
        h = g["hidden"][()]
        h[:, layer] *= scale
        g["hidden"][...] = h
        if argmax_pos is not None:
            a = g["target_argmax"][()]
            a[argmax_pos] += 1
            g["target_argmax"][...] = a
    return out


def test_compare_caches_on_a_hand_altered_copy(tiny, tmp_path):
    """Layer 1 (cache column 1: target layer 2) of sample 1 scaled by 1.5 and one argmax changed: per-sample
    rel-L2 0.5 exactly there and 0 elsewhere; per-layer rel-L2 and max-abs as computed by hand; cosines 1
    (a scaled vector); argmax agreement (T-1)/T for that sample."""
    _, _, cache = tiny
    alt = _altered_copy(cache, tmp_path / "alt.h5", sample=1, layer=1, scale=1.5, argmax_pos=3)
    with CacheReader(cache) as hf, CacheReader(alt, verify=False) as vl:
        n = len(hf)
        r = ep.compare_caches(hf, vl, n)
        x = [hf.sample(i).hidden.double() for i in range(n)]
    assert r["ids_identical"] and r["n_tokens"] == sum(len(s) for s in x)
    assert [row["layer"] for row in r["layers"]] == LAYERS
    for i, s in enumerate(r["samples"]):
        want = [0.0, 0.5, 0.0] if i == 1 else [0.0, 0.0, 0.0]
        assert s["rel_l2"] == pytest.approx(want, abs=1e-7), i
        assert s["argmax_agreement"] == ((len(x[i]) - 1) / len(x[i]) if i == 1 else 1.0)
    norm2 = sum(float(h[:, 1].pow(2).sum()) for h in x)
    l1 = r["layers"][1]
    assert l1["rel_l2"] == pytest.approx((0.25 * float(x[1][:, 1].pow(2).sum()) / norm2) ** 0.5, rel=1e-6)
    assert l1["rel_l2_max_sample"] == pytest.approx(0.5, rel=1e-6)
    assert l1["max_abs"] == pytest.approx(0.5 * float(x[1][:, 1].abs().max()), rel=1e-6)
    assert l1["cos_min"] == pytest.approx(1.0, abs=1e-9)
    assert [r["layers"][k]["rel_l2"] for k in (0, 2)] == [0.0, 0.0]
    assert r["argmax_agreement"] == pytest.approx((r["n_tokens"] - 1) / r["n_tokens"], abs=1e-12)


def test_compare_caches_refuses_other_samples(tiny, tmp_path):
    target, comp, cache = tiny
    from dflash_eval.stages.hidden_states import extract_hidden_states

    rows = [json.loads(line) for line in comp.read_text().splitlines()][::-1]  # the same rows in reverse
    (tmp_path / "rev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rev = extract_hidden_states(target, tmp_path / "rev.jsonl", tmp_path / "rev.h5", LAYERS, device="cpu",
                                dtype="float32")
    with CacheReader(cache) as a, CacheReader(rev) as b, pytest.raises(InputError, match="sample_ids") as err:
        ep.compare_caches(a, b, 2)
    assert err.value.file == str(cache)
    with CacheReader(cache) as a, CacheReader(cache) as b, pytest.raises(InputError, match="sample_ids"):
        ep.compare_caches(a, b, len(rows) + 1)  # more samples than cached


def test_drafter_parity_per_sample_and_macro():
    def ev(taus, lists):
        return {"tau": sum(t for t in taus if t is not None) / sum(t is not None for t in taus),
                "samples": [{"id": f"s{i}", "tau": t, "acceptance_lengths": a} for i, (t, a) in enumerate(zip(taus, lists))]}

    hf = ev([2.0, 1.5, None], [[2, 2], [1, 2], []])
    vl = ev([2.0, 1.0, None], [[2, 2], [1, 1], []])
    d = ep.drafter_parity("ck", hf, vl)
    assert (d["tau_hf"], d["tau_vllm"], d["diff"]) == (1.75, 1.5, -0.25)
    assert [s["diff"] for s in d["samples"]] == [0.0, -0.5, None]
    assert [s["same_acceptance"] for s in d["samples"]] == [True, False, True]
    assert (d["n_same_acceptance"], d["n_samples"], d["max_abs_sample_diff"]) == (2, 3, 0.5)
    with pytest.raises(InputError, match="other samples"):
        ep.drafter_parity("ck", hf, {**vl, "samples": vl["samples"][:2]})


def test_stage_run_hf_extracts_the_vllm_side_and_replays_the_drafter(tiny, tmp_path, monkeypatch):
    """cache.source hf: the stage asks the extraction dispatch for source vllm with the run's cache settings
    (stood in for here: the HF path, right-padded); rounding-level states and identical tau per sample."""
    target, comp, cache = tiny
    real, seen = ep.extract_cache, []

    def stand_in(target_dir, completions, out, layer_ids, opts, **kw):
        seen.append((opts.source, opts.vllm.python, opts.batch_tokens, layer_ids, kw["server_log"]))
        return real(target_dir, completions, out, layer_ids, dataclasses.replace(opts, source="hf", packing="off"), **kw)

    monkeypatch.setattr(ep, "extract_cache", stand_in)
    out = tmp_path / "engine_parity.json"
    r = ep.engine_parity(target, comp, cache, LAYERS, out, n_samples=3, device="cpu", dtype="float32", batch_tokens=512,
                         vllm={"python": "/opt/vllm/bin/python"}, drafters=[str(TRAINED_DRAFTER)])
    assert seen == [("vllm", "/opt/vllm/bin/python", 512, LAYERS, f"{out}.vllm.log")]
    assert json.loads(out.read_text()) == r
    assert (r["run_source"], r["other_source"], r["n_samples"], r["prompt_set"]) == ("hf", "vllm", 3, "set_a")
    assert r["ids_identical"] and r["argmax_agreement"] == 1.0
    for row in r["layers"]:  # packed vs right-padded: the same math in another order
        assert row["rel_l2"] <= row["rel_l2_max_sample"] < 1e-5 and row["cos_min"] > 1 - 1e-9
    (d,) = r["drafters"]
    assert d["checkpoint"] == "step300" and d["n_samples"] == 3 and d["n_same_acceptance"] == 3
    assert d["tau_hf"] == d["tau_vllm"] > 1.3 and d["diff"] == 0.0
    assert [s["diff"] for s in d["samples"]] == [0.0] * 3
    with CacheReader(cache) as rd:
        assert [s["id"] for s in d["samples"]] == [s["id"] for s in r["samples"]] == rd.sample_ids[:3]
    md = r["markdown"]
    assert md.startswith("The run's caches come from **HF** (`cache.source: hf`)")
    assert "| step300 | " in md and "| 3/3 |" in md and "| 1 | attention |" in md
    assert not list(tmp_path.glob(".engine_parity.*"))  # temporary caches removed


def test_stage_run_vllm_extracts_the_hf_side(tiny, tmp_path):
    """cache.source vllm: the HF side is extracted for real (no server); a run cache that is not the vLLM
    source's is refused by name."""
    from cache_edit import set_file_attrs

    target, comp, cache = tiny
    with pytest.raises(InputError, match="comes from source hf, but cache.source is vllm") as err:
        ep.engine_parity(target, comp, cache, LAYERS, tmp_path / "x.json", n_samples=2, source="vllm", device="cpu")
    assert err.value.field == "engine" and not (tmp_path / "x.json").exists()
    labelled = tmp_path / "set_a.h5"  # the HF cache labelled as vLLM's (its header rewritten to match)
    shutil.copyfile(cache, labelled)
    set_file_attrs(labelled, engine="vllm", engine_version="0.0-test")
    r = ep.engine_parity(target, comp, labelled, LAYERS, tmp_path / "ep.json", n_samples=2, source="vllm",
                         device="cpu", dtype="float32", batch_tokens=512, drafters=[str(TRAINED_DRAFTER)])
    assert (r["run_source"], r["other_source"]) == ("vllm", "hf")
    assert r["caches"]["vllm"]["engine_version"] == "0.0-test" and "engine" not in r["caches"]["hf"]
    # the HF side of 2 samples alone, packed as the run's cache: the run's states bit for bit, or rounding
    assert all(row["rel_l2"] < 1e-5 for row in r["layers"])
    (d,) = r["drafters"]
    assert d["tau_hf"] == d["tau_vllm"] and d["n_same_acceptance"] == 2
    assert r["markdown"].startswith("The run's caches come from **vLLM** (`cache.source: vllm`)")


def test_extraction_options_are_the_hidden_states_stage_s():
    from dflash_eval.core import options

    opts = options.make("engine_parity", n_samples=2, source="hf", final_hidden=True, vllm={"concurrency": 2})
    hs = ep.extraction_options(opts, "vllm")
    assert type(hs) is options.options_class("hidden_states")
    assert (hs.source, hs.final_hidden, hs.vllm.concurrency) == ("vllm", True, 2)
    assert ep.other_source("hf") == "vllm" and ep.other_source("vllm") == "hf"
    with pytest.raises(InputError, match="unknown value 'sglang'"):
        ep.other_source("sglang")
