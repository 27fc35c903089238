"""CLI input checks: bad values end in one line naming the option, never in a traceback
or in a silently wrong result (``evaluate --max-samples -1`` used to write tau NaN with exit 0)."""

from __future__ import annotations

import json

import pytest

from dflash_eval.cli import main

REQUIRED = {
    "hidden-states": ["--target", "t", "--completions", "c", "--out", "o"],
    "evaluate": ["--drafter", "d", "--cache", "c", "--target", "t", "--out", "o"],
    "completions": ["--target", "t", "--prompts", "p", "--out", "o"],
    "prompts": ["--source", "file", "--tokenizer", "t", "--out", "o"],
    "demo-checkpoint": ["--target", "t", "--out", "o"],
    "kernel-parity": ["--target", "t", "--completions", "c", "--out", "o"],
    "engine-parity": ["--target", "t", "--completions", "c", "--cache", "h", "--out", "o"],
}


@pytest.mark.parametrize("cmd, argv, message", [
    ("hidden-states", ["--layer-ids", ""], "expected at least one 0-based layer id"),
    ("hidden-states", ["--layer-ids", "1,x"], "expected comma-separated integers"),
    ("hidden-states", ["--layer-ids=-1,2"], "0-based decoder layers (>= 0)"),
    ("hidden-states", ["--layer-ids", "1", "--batch-tokens", "0"], "0 is less than the minimum of 1 (cache.batch_tokens in the config schema)"),
    ("kernel-parity", ["--layer-ids", "1", "--n-samples", "0"], "kernel_parity.n_samples"),
    ("engine-parity", ["--layer-ids", "1", "--n-samples", "0"], "engine_parity.n_samples"),
    ("engine-parity", ["--layer-ids", "1", "--source", "sglang"], "'sglang' is not one of ['hf', 'vllm'] (cache.source"),
    ("evaluate", ["--max-samples", "-1"], "-1 is less than the minimum of 0 (evaluate.max_samples in the config schema)"),
    ("evaluate", ["--batch-size", "-1"], "evaluate.batch_size"),
    ("evaluate", ["--agreement-min", "1.5"], "1.5 is greater than the maximum of 1 (evaluate.agreement_min in the config schema)"),
    ("completions", ["--max-new-tokens", "0"], "generation.max_new_tokens"),
    ("prompts", ["--n", "-1"], "prompt_set.n"),
    ("evaluate", ["--ddtree-budgets", "8,0"], "0 is less than the minimum of 1 (evaluate.ddtree_budgets in the config schema)"),
    ("evaluate", ["--replay", "fast"], "'fast' is not one of ['batched', 'sequential'] (evaluate.replay in the config schema)"),
    ("demo-checkpoint", ["--block-size", "1"], "checkpoints.demo.block_size"),
])
def test_bad_option_values_are_refused_by_name(cmd, argv, message, capsys):
    with pytest.raises(SystemExit) as ei:
        main([cmd, *REQUIRED[cmd], *argv])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_summary_with_a_missing_or_foreign_eval_file(tmp_path, capsys):
    out = ["--out-csv", str(tmp_path / "tau.csv"), "--out-parquet", str(tmp_path / "tau.parquet")]
    assert main(["summary", "--evals", str(tmp_path / "nope.json"), *out]) == 2
    err = capsys.readouterr().err
    assert "nope.json: evaluate output not found" in err and "Fix:" in err
    (tmp_path / "other.json").write_text(json.dumps({"tau": 1.5}))
    assert main(["summary", "--evals", str(tmp_path / "other.json"), *out]) == 2
    assert "other.json: checkpoint: missing: not an evaluate output" in capsys.readouterr().err
    assert not (tmp_path / "tau.csv").exists()


@pytest.mark.parametrize("text, want", [("8,16", [8, 16]), ("8", [8]), ("", []), ("[4, 32]", [4, 32])])
def test_integer_list_flags_take_the_comma_and_the_json_form(text, want):
    """What the rules render (``--ddtree-budgets=8``: one budget) parses back to the same list."""
    from dflash_eval.core import options
    from dflash_eval.cli import build_parser

    args = build_parser("evaluate").parse_args(["evaluate", *REQUIRED["evaluate"], f"--ddtree-budgets={text}"])
    assert args.ddtree_budgets == want
    assert options.to_flags("evaluate", {"ddtree_budgets": want})[5] == f"--ddtree-budgets={','.join(map(str, want))}"
