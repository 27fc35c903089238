"""Start-up of the stages: what ``--help`` and a drafter import (deterministic module sets, no wall times).

The fixed cost of a stage (``bench/startup.py``) was dominated by imports: transformers' Qwen3
modeling module (for the drafter's RoPE) in every drafter stage, ``torch._dynamo`` (a meta-device
``arange``) in strip-drafter. These tests pin the module sets so that the imports do not come back.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "transformers.modeling_utils", "transformers.models.qwen3.modeling_qwen3",
         "torch._dynamo", "h5py", "pandas", "matplotlib")


def imported_after(code: str) -> set[str]:
    """Which of :data:`HEAVY` a fresh interpreter has imported after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_every_stage_parser_imports_no_transformers_h5py_or_matplotlib():
    # build_parser() imports every stage module and builds every subcommand's flags (what --help needs)
    got = imported_after("from dflash_eval.cli import build_parser\nbuild_parser()")
    assert got & {"transformers", "transformers.modeling_utils", "h5py", "matplotlib", "torch._dynamo"} == set()


def test_light_stages_help_imports_no_torch():
    code = ("import contextlib, io\nfrom dflash_eval.cli import main\n"
            "for stage in ('target-fingerprint', 'prompts', 'trackers', 'watch'):\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n            main([stage, '--help'])\n        except SystemExit as e:\n"
            "            assert e.code == 0, (stage, e.code)\n")
    assert imported_after(code) == set()


def test_help_of_every_stage_prints(capsys):
    # a '%' in a schema description used to make argparse raise TypeError in 'evaluate --help'
    from dflash_eval.cli import COMMANDS, main

    for stage in COMMANDS:
        with pytest.raises(SystemExit) as exit_:
            main([stage, "--help"])
        assert exit_.value.code == 0, stage
        assert "usage:" in capsys.readouterr().out


def test_drafter_construction_imports_no_transformers_modeling():
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
           "num_target_layers": 4, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 4096,
           "vocab_size": 100, "block_size": 4,
           "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": 99, "block_size": 4}}
    code = ("import torch\nfrom dflash_eval.drafter.model import DFlashDrafter\n"
            "from dflash_eval.drafter.config import DrafterConfig\n"
            f"cfg = DrafterConfig.from_dict({cfg!r})\n"
            "DFlashDrafter(cfg)\n"
            "with torch.device('meta'):\n    m = DFlashDrafter(cfg)\n"
            "assert m.rotary_emb.inv_freq.device.type == 'cpu'\n")
    assert imported_after(code) == {"torch"}


@pytest.mark.slow
def test_startup_bench_smoke(tmp_path):
    out = tmp_path / "startup.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "startup.py"), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["stage"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["target-fingerprint", "prompts", "completions", "hidden-states", "demo-checkpoint",
                          "strip-drafter", "evaluate", "validate-online"]
    for r in rows.values():
        assert 0 < r["imports_s"] <= r["wall_s"]
    assert "transformers" not in rows["evaluate"]["help_modules"]
    assert "largest fixed cost:" in proc.stdout
