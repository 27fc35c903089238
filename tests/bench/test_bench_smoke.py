"""The GPU benches' CPU smoke runs (``--smoke``): each script runs end to end and prints its side-by-side figures.

The figures themselves say nothing on this CPU; the runs check that the scripts the GPU host runs
(docs/measurements.md) work, and the values they print that do not depend on speed: identical ids
or acceptance between the loops compared, identical tau across the replay's layouts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def bench(name: str, *argv: str, timeout: int = 900) -> str:
    proc = subprocess.run([sys.executable, str(REPO / "bench" / name), "--smoke", *argv], capture_output=True,
                          text=True, cwd=REPO, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_replay_real_size_case_smoke(tmp_path):
    out = bench("replay.py", "--case", "real", "--out", str(tmp_path / "r.json"))
    assert "tau identical across layouts: True" in out
    assert out.count("projected") == 3 and ".. [real] batched groups" in out
    (row,) = json.loads((tmp_path / "r.json").read_text())
    assert set(row["layouts"]) == {"rows", "packed", "groups"} and row["tokens_per_sample"] == 64


def test_completions_gpu_smoke(tmp_path):
    out = bench("completions_gpu.py", "--out", str(tmp_path / "c.json"))
    rows = json.loads((tmp_path / "c.json").read_text())
    assert [r["batch"] for r in rows] == [2, 4, 16] and rows[-1]["auto"]  # CPU: memory-sized = 16
    for r in rows:  # float32 on the CPU: every variant decodes the stage's ids
        assert {v["same_ids_as_stage"] for v in r["variants"].values()} == {1.0}
    assert "ratio stage / generate" in out


def test_online_smoke(tmp_path):
    out = bench("online.py", "--out", str(tmp_path / "o.json"))
    rows = json.loads((tmp_path / "o.json").read_text())["rows"]
    assert rows and all(r["same_output"] and r["same_acceptance"] for r in rows)
    assert "(goal <= 1.5x)" in out


def test_extraction_smoke():
    out = bench("extraction.py", "--models", "llama-1.66b")
    assert "forward only" in out and "ratio dflash-eval / forward-only ceiling" in out
    assert "argmax agreement 1.0000" in out


def test_extraction_kernel_parity_smoke(tmp_path):
    """--kernel-parity N: only the kernel_parity timing runs (no loop, ceiling or RSS runs); on the CPU the stage's
    fallback plan (torch bf16 vs torch fp32, two model loads), said so, and the ratio line with its load counting."""
    out = bench("extraction.py", "--models", "hybrid-7b", "--kernel-parity", "2", "--no-rss", "--out-dir", str(tmp_path))
    assert "plain HF loop" not in out and "forward only" not in out and "GEMM" not in out
    assert "kernel_parity timing on 2 samples" in out and "first call (warm-up)" in out
    assert "A = torch bfloat16, B = torch float32" in out and "NOTE: fla unavailable here" in out
    (line,) = [x for x in out.splitlines() if "ratio kernel_parity / (fla + torch extraction)" in x]
    assert "(hybrid-7b, 2 samples, warm): " in line and "(goal <= 1.0x)" in line
    assert "model load included on both sides" in line and "the stage once per extraction (two dtypes)" in line
    assert "model load excluded" not in out  # two dtypes: the stage loads per extraction, nothing to exclude
    assert not (tmp_path / "hybrid-7b").exists()


def test_extraction_kernel_parity_shared_model(tmp_path, monkeypatch, capsys):
    """The GPU plan's path (one model, the kernel rebound) run on the CPU: the stage's plan patched to torch float32
    on both sides, so the stage loads once and the bench also prints the load-excluded ratio; identical kernels and
    dtypes give identical states (rel-L2 0, argmax agreement 1)."""
    import importlib.util

    import dflash_eval.stages.kernel_parity as kp_mod

    spec = importlib.util.spec_from_file_location("bench_extraction", REPO / "bench" / "extraction.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    same = {"backend": "torch", "dtype": "float32"}
    monkeypatch.setattr(kp_mod, "plan", lambda *a: {"a": same, "b": dict(same), "fla_available": False, "note": "test"})
    target = tmp_path / "target"
    info = ex.build_target(target, "TINY_HYBRID")
    comp = tmp_path / "completions.jsonl"
    lengths = ex.write_completions(comp, 2, 16, 60, info["cfg"]["vocab_size"])
    res = ex.kernel_parity_timing("tiny", target, comp, [1, 3], "cpu", 512, 2, tmp_path)
    out = capsys.readouterr().out
    assert res["kp_load_s"] > 0 and res["load_s"] > 0 and set(res["x_loaded_s"]) == {"a", "b"}
    assert res["ratio_no_load"] == pytest.approx((res["kp_s"] - res["kp_load_s"]) / sum(res["x_loaded_s"].values()))
    assert res["ratio_whole"] == pytest.approx(res["kp_s"] / sum(res["x_s"].values()))
    assert res["n_tokens"] == sum(lengths) and res["argmax_agreement"] == 1.0
    layers = json.loads((tmp_path / "kp.json").read_text())["layers"]
    assert [r["layer"] for r in layers] == [1, 3] and all(r["rel_l2"] == 0.0 for r in layers)
    assert "[model load excluded on both sides]" in out and "the stage once, each extraction once]" in out
    assert out.count("ratio kernel_parity / (fla + torch extraction) (tiny, 2 samples, warm)") == 2



def test_hybrid_gpu_driver_smoke(tmp_path):
    """bench/hybrid_gpu.sh --smoke: the four runs the GPU host makes (completions and extraction, tiny hybrid with
    torch GDN kernels and tiny llama), their files and the ratio summary."""
    env = {**os.environ, "OUT": str(tmp_path), "PY": sys.executable}
    proc = subprocess.run(["bash", str(REPO / "bench" / "hybrid_gpu.sh"), "--smoke"], capture_output=True, text=True,
                          cwd=REPO, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.count("ratio stage / generate") == 2 and summary.count("ratio dflash-eval / loop") == 2
    assert sorted(x.name for x in tmp_path.iterdir()) == ["hybrid_gpu.tgz", "summary.txt"]
    with tarfile.open(tmp_path / "hybrid_gpu.tgz") as tar:
        tar.extractall(tmp_path, filter="data")
    (row,) = json.loads((tmp_path / "completions_hybrid.json").read_text())
    assert row["batch"] == 4 and set(row["variants"]) == {"stage", "stage, plain sdpa", "generate"}
    assert {v["same_ids_as_stage"] for v in row["variants"].values()} == {1.0}  # float32: same ids everywhere
    assert all(len(v["runs_s"]) == 2 for v in row["variants"].values())  # the warm figure + the first call apart
    hyb = (tmp_path / "extraction_hybrid.txt").read_text()
    assert "right-padded" in hyb and "stage, first run" in hyb and "argmax agreement 1.0000" in hyb
    assert "linear-attention kernel: torch" in (tmp_path / "completions_hybrid.txt").read_text()
    assert "plain loop's first pass" in hyb and "forward only" not in hyb  # --no-ceiling
    assert summary.count("per-token extraction cost at 256 vs 64 tokens") == 2
    for model in ("hybrid", "llama"):
        rows = json.loads((tmp_path / f"long_context_{model}.json").read_text())[f"{model}-{'7b' if model == 'hybrid' else '8b'}"]
        assert [(r["context"], r["samples"]) for r in rows] == [(64, 2), (128, 1), (256, 1)]
        assert all("loop_tps" not in r and r["replay_tps"] > 0 for r in rows)  # --no-loop in the driver's smoke


def test_long_context_smoke(tmp_path):
    """bench/long_context.py --smoke: the tiny hybrid at 128 / 512 / 1024-token samples (4, 2, 1 of them, 32-token
    completions): per context the stage, the warm plain loop (batch min(samples, 1024 // context): 4, 2, 1) and
    evaluate's replay, each with its peak RSS; the per-token cost line against the shortest context."""
    out = bench("long_context.py", "--models", "hybrid-7b", "--out", str(tmp_path / "lc.json"))
    rows = json.loads((tmp_path / "lc.json").read_text())["hybrid-7b"]
    assert [(r["context"], r["samples"], r["loop_batch"]) for r in rows] == [(128, 4, 4), (512, 2, 2), (1024, 1, 1)]
    assert all(r["stage_tps"] > 0 and r["loop_tps"] > 0 and r["replay_tps"] > 0 for r in rows)
    assert all(r["stage_gpu_gb"] is None and 0 < r["stage_rss_gb"] < 4 for r in rows)  # CPU: no GPU figure
    assert [r["held_tokens"] for r in rows] == [512, 1024, 1024]  # one batch of the context's samples at a time
    assert "max_position_embeddings 1025" in out and "stage warm-up run over every context's samples" in out
    assert "per-token extraction cost at 1,024 vs 128 tokens (hybrid-7b): " in out and "(goal <= 1.5x)" in out
    assert out.count("plain loop (batch") == 3 and out.count("replay (evaluate, 1-layer random drafter)") == 3


def test_context_costs_smoke(tmp_path):
    """bench/context_costs.py: both tiny models timed at 2 contexts x 2 batches through the target-costs CLI; the
    printed break-even tau is (verify + draft) / decode of the same row (speed-independent: checked per row)."""
    out = tmp_path / "costs.json"
    text = bench("context_costs.py", "--out", str(out))
    data = json.loads(out.read_text())
    assert sorted(data) == ["hybrid-7b", "llama-8b"]
    for name, costs in data.items():
        assert costs["format_version"] == 3
        assert sorted((e["context_tokens"], e["batch_size"]) for e in costs["grid"]) == [(64, 1), (64, 16), (256, 1), (256, 16)]
    rows = [line.split() for line in text.splitlines() if line.startswith("  ") and line.split()[0] in ("64", "256")]
    assert len(rows) == 16  # 4 per model, printed twice (per model, then the summary)
    for _c, _b, dec, ver, dra, be in rows:
        assert abs((float(ver) + float(dra)) / float(dec) - float(be)) <= 0.02 * float(be) + 0.01
    assert "context 256 / 64" in text
