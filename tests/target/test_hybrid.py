"""Hybrid (Gated DeltaNet) targets on CPU, torch path: extraction, batch invariance, kernel binding,
backend refusal, the evaluate backend check and the kernel-parity stage."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import h5py
import pytest
import torch

import tiny_hybrid as th
from dflash_eval.target import hybrid
from dflash_eval.cache.extract import run_target
from dflash_eval.stages.hidden_states import extract_hidden_states
from dflash_eval.cli import main
from dflash_eval.core.errors import InputError

LAYERS = [0, 2, 3]  # 0, 2: linear attention; 3: the last layer (full attention, HF's entry is final-normed)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return th.save_target(tmp_path_factory.mktemp("qwen35") / "target", "qwen3_5")


@pytest.fixture(scope="module")
def completions(tmp_path_factory):
    return th.write_completions(tmp_path_factory.mktemp("comp") / "humaneval.jsonl", n=3)


@pytest.fixture(scope="module")
def drafter(target, tmp_path_factory):
    from safetensors.torch import save_file

    from dflash_eval.drafter.demo import drafter_config_for_target
    from dflash_eval.drafter.model import DFlashDrafter
    from dflash_eval.drafter.config import DrafterConfig

    cfg = drafter_config_for_target(target, layer_ids=[0, 3], block_size=4, num_layers=1, mask_token_id=th.VOCAB - 1)
    torch.manual_seed(0)
    model = DFlashDrafter(DrafterConfig.from_dict(cfg))
    out = tmp_path_factory.mktemp("drafter") / "d-step1"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_hooks_match_hf_hidden_states(kind):
    model = th.build_model(kind)
    hybrid.check_bound_kernel(model, hybrid.KernelBinding("torch"))
    seqs = [torch.randint(2, th.VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (70, 33)]
    outs = run_target(model, seqs, LAYERS, "cpu")
    for seq, (hidden, argmax) in zip(seqs, outs):
        assert hidden.shape == (len(seq), len(LAYERS), 64)
        with torch.no_grad():
            ref = model(torch.tensor([seq]), output_hidden_states=True)
        for k, i in enumerate(LAYERS):
            torch.testing.assert_close(hidden[:, k], ref.hidden_states[i + 1][0], rtol=1e-5, atol=1e-5)
        assert torch.equal(argmax, ref.logits[0].argmax(-1))


def test_vlm_checkpoint_loads_text_only_and_matches(tmp_path):
    """A Qwen3_5ForConditionalGeneration folder (text_config, model.language_model.* weights) loads as a causal LM."""
    from dflash_eval.target.model import load_target, target_info
    from dflash_eval.target.spec import load_embed_and_head

    vlm = th.build_model("qwen3_5_vlm")
    vlm.save_pretrained(tmp_path)
    th.save_tokenizer(tmp_path)
    model, _, _ = load_target(tmp_path, device="cpu", dtype="float32")
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    info = target_info(model)
    assert info["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] and info["num_hidden_layers"] == 4
    hybrid.check_bound_kernel(model, hybrid.bind_linear_attention("torch", "cpu", tmp_path))
    seq = list(range(2, 60))
    (hidden, _), = run_target(model, [seq], LAYERS, "cpu")
    with torch.no_grad():
        ref = vlm(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
    for k, i in enumerate(LAYERS):
        torch.testing.assert_close(hidden[:, k], ref[i + 1][0], rtol=1e-5, atol=1e-5)
    embed, _ = load_embed_and_head(tmp_path)
    assert torch.equal(embed, vlm.model.language_model.embed_tokens.weight.detach())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_right_padding_is_batch_invariant(kind):
    """Same sample alone vs right-padded next to longer ones.

    Measured (float32, this CPU, see docs/targets.md): rel-L2 <= 4e-8 on these tiny models,
    <= 3e-7 on an 8-layer hidden-512 one. A state leak through padding or packing would be O(1);
    1e-5 leaves room for BLAS blocking differences on other CPUs.
    """
    model = th.build_model(kind)
    hybrid.check_bound_kernel(model, hybrid.KernelBinding("torch"))
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(2, th.VOCAB, (n,), generator=g).tolist() for n in (37, 150, 90)]
    alone = run_target(model, [seqs[0]], LAYERS, "cpu")[0][0]
    batched = run_target(model, [seqs[1], seqs[0], seqs[2]], LAYERS, "cpu")
    got = batched[1][0]
    assert got.shape == alone.shape == (37, len(LAYERS), 64)  # padding stripped
    for k in range(len(LAYERS)):
        rel = float((got[:, k] - alone[:, k]).norm() / alone[:, k].norm())
        assert rel < 1e-5, (k, rel)
    assert [h.shape[0] for h, _ in batched] == [150, 37, 90]


def test_torch_binding_is_recorded_and_refuses_packing():
    import transformers
    import transformers.models.qwen3_5.modeling_qwen3_5 as M

    model = th.build_model("qwen3_5")
    b = hybrid.check_bound_kernel(model, hybrid.KernelBinding("torch", {"requested": "auto"}))
    desc = json.loads(b.describe())
    fns = desc["functions"][M.__name__]
    assert desc["backend"] == "torch" and desc["requested"] == "auto"
    assert fns["chunk_rule"] == f"{M.__name__}.torch_chunk_gated_delta_rule"
    assert fns["conv_fn"] == f"{M.__name__}.causal_conv1d_fn"
    assert desc["gated_norm"] == [f"{M.__name__}.Qwen3_5RMSNormGated"]
    assert desc["versions"]["transformers"] == transformers.__version__
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="cannot keep packed sequences apart"):
        M.torch_chunk_gated_delta_rule(q, q, q, g=torch.zeros(1, 4, 2), beta=torch.ones(1, 4, 2),
                                       cu_seqlens=torch.tensor([0, 2, 4]))


def test_backend_resolution_and_refusals(target, tmp_path, monkeypatch):
    assert hybrid.bind_linear_attention("auto", "cpu", target).backend == "torch"
    with pytest.raises(InputError, match="fla has GPU Triton kernels only"):
        hybrid.bind_linear_attention("fla", "cpu", target)
    monkeypatch.setattr(hybrid, "fla_status", lambda: (False, "ModuleNotFoundError: No module named 'fla'"))
    with pytest.raises(InputError, match="fla is not importable"):
        hybrid.bind_linear_attention("fla", torch.device("cuda"), target)  # device object only, no GPU needed
    assert hybrid.bind_linear_attention("auto", torch.device("cuda"), target).backend == "torch"
    monkeypatch.setattr(hybrid, "fla_status", lambda: (True, "0.6.0"))
    assert hybrid.bind_linear_attention("auto", torch.device("cuda"), target).backend == "fla"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    assert hybrid.bind_linear_attention("fla", "cpu", tmp_path).backend == "none"  # no GDN layers: nothing to refuse
    with pytest.raises(InputError, match="unknown backend"):
        hybrid.bind_linear_attention("triton", "cpu", target)


FAKE_FLA = '''
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")
fused_recurrent_gated_delta_rule = chunk_gated_delta_rule
'''


@pytest.mark.slow
def test_fla_bound_at_import_is_detected_and_overridden(tmp_path):
    """With an importable fla, transformers binds it at import and a CPU forward crashes (reference §2.3).

    A stand-in ``fla`` package (same import path, raises like Triton on CPU tensors) in a fresh
    interpreter: the binding is read as fla, ``torch`` is forced and the forward works, and
    ``fla`` restores transformers' original dispatcher.
    """
    pkg = tmp_path / "fla" / "ops" / "gated_delta_rule"
    pkg.mkdir(parents=True)
    (tmp_path / "fla" / "__init__.py").write_text("")
    (tmp_path / "fla" / "ops" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text(FAKE_FLA)
    script = textwrap.dedent("""
        import json, sys, torch
        import tiny_hybrid as th
        from dflash_eval.target import hybrid
        import transformers.models.qwen3_5.modeling_qwen3_5 as M
        out = {"at_import": hybrid.describe_module(M)}
        model = th.build_model("qwen3_5")
        ids = torch.randint(2, 100, (1, 20))
        out["fla"] = json.loads(hybrid.check_bound_kernel(model, hybrid.KernelBinding("fla")).describe())
        try:
            model(ids)
        except ValueError as err:
            out["fla_forward"] = str(err)
        out["torch"] = json.loads(hybrid.check_bound_kernel(model, hybrid.KernelBinding("torch")).describe())
        out["torch_forward"] = list(model(ids).logits.shape)
        hybrid.check_bound_kernel(model, hybrid.KernelBinding("fla"))
        out["back_to_fla"] = hybrid.describe_module(M)
        print("RESULT" + json.dumps(out))
    """)
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}:{REPO / 'tests'}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    mod = "transformers.models.qwen3_5.modeling_qwen3_5"
    assert out["at_import"]["chunk_rule"] == "fla.ops.gated_delta_rule.chunk_gated_delta_rule"
    assert out["at_import"]["conv_fn"] == f"{mod}.causal_conv1d_fn"  # causal-conv1d absent: torch conv
    assert out["fla"]["backend"] == "fla"
    assert "cannot be accessed from Triton" in out["fla_forward"]
    assert out["torch"]["functions"][mod]["chunk_rule"] == f"{mod}.torch_chunk_gated_delta_rule"
    assert out["torch_forward"] == [1, 20, th.VOCAB]
    assert out["back_to_fla"] == out["at_import"]


def test_cache_records_backend_and_evaluate_refuses_mismatch(target, completions, drafter, tmp_path, monkeypatch):
    from dflash_eval.stages.evaluate import evaluate

    monkeypatch.setenv("DFLASH_EVAL_IMAGE", "dflash-eval/cuda:9.9.9")  # as containers/cuda/Dockerfile sets it
    monkeypatch.setenv("FLA_FLASH_QLA", "0")
    cache = extract_hidden_states(target, completions, tmp_path / "c.h5", [0, 3], device="cpu")
    with h5py.File(cache) as f:
        a = dict(f.attrs)
    kernel = json.loads(a["linear_attn_kernel"])
    assert a["linear_attn_backend"] == "torch" and kernel["backend"] == "torch" and kernel["requested"] == "auto"
    assert kernel["functions"]["transformers.models.qwen3_5.modeling_qwen3_5"]["recurrent_rule"].endswith(
        "modeling_qwen3_5.torch_recurrent_gated_delta_rule")
    assert json.loads(a["layer_types"]) == ["linear_attention"] * 3 + ["full_attention"]
    assert a["image"] == "dflash-eval/cuda:9.9.9" and kernel["versions"]["image"] == "dflash-eval/cuda:9.9.9"
    assert kernel["env"]["FLA_FLASH_QLA"] == "0" and json.loads(a["env"])["FLA_FLASH_QLA"] == "0"
    assert a["fla_version"] == kernel["versions"]["fla"] == "absent"
    with pytest.raises(InputError, match="made with the 'torch' kernel but the drafter was trained on 'fla'"):
        evaluate(drafter, cache, target, tmp_path / "e.json", device="cpu", training_backend="fla",
                 allow_low_agreement=True)  # synthetic completions: not the target's greedy output
    assert not (tmp_path / "e.json").exists()
    r = evaluate(drafter, cache, target, tmp_path / "e.json", device="cpu", training_backend="torch",
                 allow_low_agreement=True)
    assert r["n_samples"] == 3 and r["tau"] >= 1.0
    args = ["evaluate", "--drafter", str(drafter), "--cache", str(cache), "--target", str(target), "--device", "cpu",
            "--out", str(tmp_path / "e2.json"), "--training-backend", "fla", "--allow-low-agreement"]
    assert main(args) == 2 and not (tmp_path / "e2.json").exists()
    assert main(args + ["--allow-backend-mismatch"]) == 0
    assert json.loads((tmp_path / "e2.json").read_text())["tau"] == r["tau"]


def test_kernel_parity_cli_on_cpu_reports_fla_unavailable(target, completions, drafter, tmp_path):
    out = tmp_path / "kp.json"
    rc = main(["kernel-parity", "--target", str(target), "--completions", str(completions), "--layer-ids", "0,2,3",
               "--n-samples", "2", "--drafter", str(drafter), "--device", "cpu", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["plan"]["fla_available"] is False
    assert r["markdown"].startswith("**fla unavailable: the device is cpu")
    assert r["title"] == "Linear-attention kernel parity: A = torch bfloat16, B = torch float32"
    assert r["n_samples"] == 2 and [x["layer"] for x in r["layers"]] == [0, 2, 3]
    assert [x["type"] for x in r["layers"]] == ["linear_attention", "linear_attention", "full_attention"]
    for x in r["layers"]:  # bf16 vs fp32: small but not zero (bf16 has ~3 significant digits)
        assert 1e-4 < x["rel_l2"] < 3e-2 and x["cos_min"] > 0.999 and 0 < x["max_abs"] < 0.5
    assert r["extractions"]["a"]["linear_attn_kernel"]["backend"] == "torch"
    (d,) = r["drafters"]
    assert d["checkpoint"] == "d-step1" and d["tau_a"] >= 1.0 and d["tau_b"] >= 1.0
    assert "| d-step1 |" in r["markdown"] and "| 3 | full_attention |" in r["markdown"]
    assert not list(tmp_path.glob(".kernel_parity.*"))  # temporary caches removed


def test_kernel_parity_skips_targets_without_linear_attention(tmp_path):
    from dflash_eval.stages.kernel_parity import kernel_parity

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2}))
    r = kernel_parity(tmp_path, tmp_path / "missing.jsonl", [0], tmp_path / "kp.json", n_samples=2, device="cpu")
    assert r["markdown"].startswith("Skipped: target has no linear-attention layers")
    assert json.loads((tmp_path / "kp.json").read_text())["layers"] == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_whole_pipeline_through_the_cli(kind, tmp_path):
    """prompts -> completions -> hidden-states -> demo checkpoint -> strip -> evaluate -> kernel-parity -> report."""
    import h5py

    tgt = th.save_target(tmp_path / "tgt", kind)
    (tmp_path / "p.txt").write_text("t5 t9 t20 t33\nt7 t8 t100 t3 t4\nt50 t51\n")

    def run(*args):
        assert main([str(a) for a in args]) == 0, args

    d = tmp_path
    run("prompts", "--source", "file", "--path", d / "p.txt", "--tokenizer", tgt, "--n", 0, "--out", d / "prompts.jsonl")
    run("completions", "--target", tgt, "--prompts", d / "prompts.jsonl", "--max-new-tokens", 24, "--device", "cpu",
        "--out", d / "comp.jsonl")
    run("hidden-states", "--target", tgt, "--completions", d / "comp.jsonl", "--layer-ids", "1,3", "--device", "cpu",
        "--out", d / "cache.h5")
    run("demo-checkpoint", "--target", tgt, "--random-init", "--layer-ids", "1,3", "--block-size", 4,
        "--out", d / "step10.pt")
    run("strip", "--checkpoint", d / "step10.pt", "--target", tgt, "--out-dir", d / "dr")
    run("evaluate", "--drafter", d / "dr", "--cache", d / "cache.h5", "--target", tgt, "--device", "cpu",
        "--training-backend", "torch", "--out", d / "ev.json")
    run("kernel-parity", "--target", tgt, "--completions", d / "comp.jsonl", "--layer-ids", "1,3", "--n-samples", 2,
        "--drafter", d / "dr", "--device", "cpu", "--out", d / "kp.json")
    run("summary", "--evals", d / "ev.json", "--out-csv", d / "tau.csv", "--out-parquet", d / "tau.parquet")
    run("report", "--summary", d / "tau.csv", "--evals", d / "ev.json", "--caches", d / "cache.h5",
        "--extra", d / "kp.json", "--out", d / "report.md")
    with h5py.File(d / "cache.h5") as f:
        assert json.loads(f.attrs["linear_attn_kernel"])["backend"] == "torch"
        # generation (cached recurrent decode) and extraction (chunked prefill) agree on every greedy token in fp32
        assert f["argmax_agreement"][()].tolist() == [1.0, 1.0, 1.0]
    ev = json.loads((d / "ev.json").read_text())
    assert ev["n_samples"] == 3 and ev["tau"] >= 1.0
    report = (d / "report.md").read_text()
    assert "## Linear-attention kernel parity: A = torch bfloat16, B = torch float32" in report
    assert re.search(r"cache: linear_attn_kernel\s*\|\s*torch\s*\|", report), report  # provenance table


def test_parity_counts_zero_states_of_pad_tokens_as_equal():
    """A token equal to the pad id (zero embedding row) has exactly zero states at every Gated DeltaNet layer in
    both backends' runs; the per-token cosine there is undefined and must not read as 0 ("orthogonal")."""
    from dflash_eval.stages.kernel_parity import Parity

    model = th.build_model()  # pad_token_id 0: embedding row 0 is zero (nn.Embedding padding_idx)
    ids = torch.tensor([[5, 7, 0, 9, 11, 0, 13]])
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    a = torch.stack([hs[i + 1][0] for i in (0, 1, 3)], dim=1)  # [T, K, H]: layers 0, 1 (GDN), 3 (attention)
    assert (a[[2, 5]][:, :2] == 0).all() and (a[[2, 5]][:, 2] != 0).any(-1).all()
    b = a.to(torch.bfloat16).float()  # the other side: same zeros, rounded elsewhere
    par = Parity(3)
    par.add(a, b)
    rows = par.rows([0, 1, 3])
    assert [r["zero_tokens"] for r in rows] == [2, 2, 0] and all(r["zero_one_side"] == 0 for r in rows)
    assert all(r["cos_min"] > 0.999 for r in rows)  # was 0.0 at layers 0 and 1
    b[3, 1] = 0  # one side only: a real difference, cosine 0, found where it is
    par = Parity(3)
    par.add(a, b)
    r1 = par.rows([0, 1, 3])[1]
    assert r1["cos_min"] == 0.0 and r1["cos_min_at"] == [0, 3] and r1["zero_one_side"] == 1


def test_kernel_parity_loads_the_target_once_when_both_sides_share_a_dtype(target, completions, tmp_path, monkeypatch):
    """fla vs torch (one dtype): one model, the kernel rebound between the two extractions; here torch vs torch in
    float32, which must give identical caches (rel-L2 0, cosine 1) from that one load."""
    from dflash_eval.stages import kernel_parity as kp

    same = {"a": {"backend": "torch", "dtype": "float32"}, "b": {"backend": "torch", "dtype": "float32"},
            "fla_available": False, "note": "torch vs torch"}
    monkeypatch.setattr(kp, "plan", lambda *a: same)
    loads = []
    real = kp.load_target
    monkeypatch.setattr(kp, "load_target", lambda *a, **k: loads.append(1) or real(*a, **k))
    r = kp.kernel_parity(target, completions, [0, 3], tmp_path / "kp.json", n_samples=2, device="cpu")
    assert loads == [1] and r["model_loads"] == 1
    assert all(x["rel_l2"] == 0 and x["max_abs"] == 0 and x["cos_min"] > 1 - 1e-12 for x in r["layers"])
    assert r["argmax_agreement"] == 1.0 and "loaded once for both" in r["markdown"]
