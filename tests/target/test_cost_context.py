"""The cost model against context and batch (hand-built costs, exact numbers), reading format 1/2 files, the
random-keys cache against a real prefill (tiny llama and tiny hybrid targets), and the stage at 2 contexts x 2 batches."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_eval.target import cost_context as C  # noqa: E402
from dflash_eval.target.costs import FORMAT, read_costs  # noqa: E402


def _entry(c, b, dec, ver, draft, tree=None):
    return {"context_tokens": c, "batch_size": b, "decode_s": dec, "decode_samples_s": [dec],
            "verify": [{"n": 4, "mask": "causal", "fit_s": ver, "median_s": ver, "samples_s": [ver]}]
            + ([{"n": 9, "mask": "tree", "fit_s": tree[0], "median_s": tree[0], "samples_s": [tree[0]]}] if tree else []),
            "drafters": {"ck": {"draft_s": draft, "draft_samples_s": [draft],
                                "draft_tree_s": {"8": tree[1]} if tree else {}}}}


#: batch 1: contexts 1000 / 3000 -> decode 1 / 2 s, verify(4) 2 / 6 s, draft 1 / 2 s (break-even 3 / 4);
#: batch 16: decode 2 / 4, verify 8 / 20, draft 2 / 4 (break-even 5 / 6); trees at batch 1 only
COSTS = {"format": FORMAT, "format_version": 3, "grid": [
    _entry(3000, 1, 2.0, 6.0, 2.0, tree=(10.0, 3.0)), _entry(1000, 1, 1.0, 2.0, 1.0, tree=(4.0, 2.0)),
    _entry(1000, 16, 2.0, 8.0, 2.0), _entry(3000, 16, 4.0, 20.0, 4.0)]}


def test_interpolation_flat_outside_and_nan_points():
    assert C.interpolate([1000, 3000], [1.0, 2.0], 2000) == 1.5
    assert C.interpolate([3000, 1000], [2.0, 1.0], 1500) == 1.25  # any order
    assert C.interpolate([1000, 3000], [1.0, 2.0], 10) == 1.0 and C.interpolate([1000, 3000], [1.0, 2.0], 1e6) == 2.0
    assert C.interpolate([1000, 3000], [1.0, math.nan], 5000) == 1.0 and math.isnan(C.interpolate([1], [math.nan], 1))


def test_terms_and_break_even_by_hand():
    assert C.terms_at(COSTS, 2000, 1, "ck", 4, "causal") == (1.5, 4.0, 1.5)
    assert C.break_even_at(COSTS, 1000, 1, "ck", 4, "causal") == 3.0
    assert C.break_even_at(COSTS, 3000, 1, "ck", 4, "causal") == 4.0
    assert C.break_even_at(COSTS, 2000, 1, "ck", 4, "causal") == pytest.approx(5.5 / 1.5)
    assert C.break_even_at(COSTS, 500, 1, "ck", 4, "causal") == 3.0  # flat below the shortest timed context
    assert C.break_even_at(COSTS, 1000, 16, "ck", 4, "causal") == 5.0
    assert C.break_even_at(COSTS, 9000, 16, "ck", 4, "causal") == 6.0
    # DDTree budget 8: verify of 9 tokens (tree) + the top-8 pass: (4 + 2) / 1 and (10 + 3) / 2
    assert C.break_even_at(COSTS, 1000, 1, "ck", 9, "tree", 8) == 6.0
    assert C.break_even_at(COSTS, 3000, 1, "ck", 9, "tree", 8) == 6.5
    assert math.isnan(C.break_even_at(COSTS, 1000, 16, "ck", 9, "tree", 8))  # not timed at batch 16
    assert math.isnan(C.break_even_at(COSTS, 1000, 4, "ck", 4, "causal"))  # batch 4 not timed
    assert C.batch_sizes(COSTS) == [1, 16] and C.contexts(COSTS) == [1000, 3000]
    assert C.nearest_context(COSTS, 512) == 1000 and C.nearest_context(COSTS, 2000) == 1000
    assert C.nearest_context(COSTS, 2001) == 3000


def test_bins_speedups_and_pays_up_to_by_hand():
    assert C.parse_bin("512_1024") == (512, 1024.0) and C.parse_bin("32768-inf") == (32768, math.inf)
    assert C.bin_context(0, 128) == 64 and C.bin_context(1024, 2048) == 1536 and C.bin_context(32768, math.inf) == 49152
    taus = {"256_512": 3.2, "0_128": 3.5, "128_256": math.nan, "1024_2048": 3.4, "32768_inf": 9.0}
    rows = C.bin_speedups(COSTS, taus, 1, "ck", 4)
    assert [r["bin"] for r in rows] == ["0_128", "128_256", "256_512", "1024_2048", "32768_inf"]
    assert rows[0]["context"] == 64 and rows[0]["break_even"] == 3.0 and rows[0]["speedup"] == pytest.approx(3.5 / 3)
    assert math.isnan(rows[1]["speedup"])
    # bin 1024-2048 at context 1536: decode 1.268, verify 3.072, draft 1.268 -> break-even 4.34 / 1.268
    assert rows[3]["break_even"] == pytest.approx(4.34 / 1.268)
    assert rows[3]["speedup"] == pytest.approx(3.4 * 1.268 / 4.34)
    assert rows[4]["context"] == 49152 and rows[4]["break_even"] == 4.0 and rows[4]["speedup"] == 9.0 / 4.0
    assert C.pays_up_to(rows) == ("pays up to", 1024)  # 3.4 <= 3.423 in the first failing bin
    assert C.pays_label(C.pays_up_to(rows)) == "pays up to context 1024"
    assert C.pays_up_to(C.bin_speedups(COSTS, taus, 16, "ck", 4)) == (C.NEVER_PAYS, None)  # 3.5 <= 5
    assert C.pays_up_to(C.bin_speedups(COSTS, {"0_128": 10.0, "32768_inf": 6.5}, 16, "ck", 4)) == (C.PAYS_EVERYWHERE, None)
    assert C.pays_up_to(C.bin_speedups(COSTS, {"0_128": math.nan}, 1, "ck", 4)) == (C.NO_DATA, None)


def test_v2_file_reads_as_a_grid_of_one(tmp_path):
    v2 = {"format": FORMAT, "format_version": 2, "context_tokens": 512, "batch_size": 1, "decode_s": 0.01,
          "decode_samples_s": [0.01], "verify": [{"n": 4, "mask": "causal", "median_s": 0.02, "fit_s": 0.02}],
          "drafters": {"ck": {"block_size": 4, "config_sha256": "x", "draft_s": 0.005, "draft_tree_s": {}}}}
    (tmp_path / "v2.json").write_text(json.dumps(v2))
    (tmp_path / "v1.json").write_text(json.dumps({**v2, "format_version": 1}))
    for name in ("v1.json", "v2.json"):
        c = read_costs(tmp_path / name)
        assert c["contexts"] == [512] and c["batch_sizes"] == [1] and len(c["grid"]) == 1
        assert c["grid"][0]["drafters"] == {"ck": {"draft_s": 0.005, "draft_tree_s": {}}}
        assert C.break_even_at(c, 4096, 1, "ck", 4, "causal") == pytest.approx(2.5)  # (0.02 + 0.005) / 0.01, flat
        assert c["decode_s"] == 0.01 and c["verify"] == v2["verify"]  # the single-context fields unchanged


# --------------------------------------------------------------------------- the cache built without a prefill
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tiny import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("cc") / "target", num_layers=2, hidden=64)


@pytest.mark.parametrize("kind", ["llama", "qwen3_5", "qwen3_next"])
def test_random_cache_has_the_shapes_of_a_real_prefill(kind, llama_dir):
    """Every layer (attention K/V, GDN conv and recurrent states) as after a prefill of batch x context tokens,
    the same sequence length, and the forward after it gives the same shapes; the restore makes runs identical."""
    from dflash_eval.target.cost_cache import CacheRestore, cache_shapes, random_cache

    if kind == "llama":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    else:
        import tiny_hybrid as th

        model = th.build_model(kind)
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    for context, batch in [(3, 1), (37, 3)]:
        with torch.inference_mode():
            real = model(torch.randint(0, vocab, (batch, context), generator=g), use_cache=True).past_key_values
            built = random_cache(model, context, batch, vocab, torch.device("cpu"), g)
            shapes = cache_shapes(built)
            assert shapes == cache_shapes(real) and built.get_seq_length() == real.get_seq_length() == context
            kv = [s["keys"] for s in shapes if s["keys"]]
            assert kv and all(k[0] == batch and k[2] == context for k in kv)
            if kind != "llama":
                assert any(s["recurrent_states"] for s in shapes) and any(s["conv_states"] for s in shapes)
            new = torch.randint(0, vocab, (batch, 5), generator=g)
            pos = torch.arange(context, context + 5)[None].expand(batch, -1)
            restore = CacheRestore(built)
            a = model(new, position_ids=pos, past_key_values=built, use_cache=True)
            after_built = cache_shapes(built)
            b = model(new, position_ids=pos, past_key_values=real, use_cache=True)
            assert a.logits.shape == b.logits.shape and after_built == cache_shapes(real)
            assert after_built != shapes  # the forward grew the keys ...
            again = model(new, position_ids=pos, past_key_values=restore(), use_cache=True)
            assert torch.equal(a.logits, again.logits)  # ... and the restore put every state back


# --------------------------------------------------------------------------- the stage on the tiny target
def test_stage_two_contexts_two_batches(llama_dir, tmp_path):
    from test_costs import _drafter_configs

    from dflash_eval.stages.target_costs import measure_target_costs

    cfgs = _drafter_configs(tmp_path, llama_dir, [("ck", 4)])
    out = tmp_path / "c.json"
    r = measure_target_costs(llama_dir, cfgs, out, budgets=[3], contexts=[16, 64, 510], context_tokens=60,
                             batch_sizes=[2], repeats=2, warmup=0, device="cpu")
    c = read_costs(out)
    assert c["format_version"] == 3 and c["contexts"] == [16, 60, 64] and c["batch_sizes"] == [1, 2]
    assert c["skipped"] == [{"context_tokens": 510, "batch_size": None,
                             "reason": "510 + 4 new tokens exceed max_position_embeddings 512"}]
    assert [(e["context_tokens"], e["batch_size"]) for e in c["grid"]] == [(16, 1), (16, 2), (60, 1), (60, 2),
                                                                             (64, 1), (64, 2)]
    for e in c["grid"]:
        shapes = [(v["n"], v["mask"]) for v in e["verify"]]
        # DDTree shapes (budget 3 -> 4 tokens, tree mask; the top-3 pass) at batch 1 only (tree_batch_sizes)
        assert shapes == ([(4, "causal"), (4, "tree")] if e["batch_size"] == 1 else [(4, "causal")])
        assert set(e["drafters"]["ck"]["draft_tree_s"]) == ({"3"} if e["batch_size"] == 1 else set())
        assert e["decode_s"] > 0 and isinstance(e["estimate_reliable"], bool)
    # the top-level (single-context) fields are the batch-1 entry at context_tokens 60
    assert c["context_tokens"] == 60 and c["decode_s"] == c["grid"][2]["decode_s"]
    assert c["drafters"]["ck"]["draft_s"] == c["grid"][2]["drafters"]["ck"]["draft_s"]
    assert c["drafters"]["ck"]["block_size"] == 4 and r["tree_batch_sizes"] == [1]
    assert C.break_even_at(c, 16, 2, "ck", 4, "causal") > 0
