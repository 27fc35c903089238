# Online validation: true speculative decoding with the target in the loop (the DFlash
# chain, and one DDTree budget verified in one target forward with an ancestor-only mask)
# for the first few prompts of one prompt set, compared per sample with the offline
# replay of the same samples -> results/{run}/validate_online.json (title + markdown for
# `report --extra`). Enabled by validate_online.enabled (off by default).
#
# Include after common.smk (uses PLAN, PROMPT_SETS, CHECKPOINTS, TORCH_THREADS, target_model_files,
# target_dir) and before evaluate.smk (the report rule reads VALIDATE_ONLINE_ALL).

VALIDATE_ONLINE = config["validate_online"]
VALIDATE_ONLINE_PROMPT_SET = VALIDATE_ONLINE.get("prompt_set") or PROMPT_SETS[0]
VALIDATE_ONLINE_CHECKPOINTS = VALIDATE_ONLINE["checkpoints"] or list(CHECKPOINTS)
VALIDATE_ONLINE_BUDGET = VALIDATE_ONLINE.get(
    "ddtree_budget", min(config["evaluate"]["ddtree_budgets"], default=0)
)

if VALIDATE_ONLINE["enabled"]:
    if VALIDATE_ONLINE_PROMPT_SET not in PROMPT_SETS:
        raise WorkflowError(
            f"config ({CONFIG_FILES}): validate_online.prompt_set: {VALIDATE_ONLINE_PROMPT_SET!r} is not one of the "
            f"prompt sets {PROMPT_SETS}. Fix: name a key of prompt_sets, or drop the setting."
        )
    _unknown = [c for c in VALIDATE_ONLINE_CHECKPOINTS if c not in CHECKPOINTS]
    if _unknown:
        raise WorkflowError(
            f"config ({CONFIG_FILES}): validate_online.checkpoints: {_unknown} are not configured checkpoints "
            f"({list(CHECKPOINTS)}). Fix: use names from checkpoints (or [] for all)."
        )
    if (
        VALIDATE_ONLINE_BUDGET
        and VALIDATE_ONLINE_BUDGET not in config["evaluate"]["ddtree_budgets"]
    ):
        raise WorkflowError(
            f"config ({CONFIG_FILES}): validate_online.ddtree_budget: {VALIDATE_ONLINE_BUDGET} is not one of "
            f"evaluate.ddtree_budgets {config['evaluate']['ddtree_budgets']} (the offline side of "
            "the comparison). Fix: add it there, pick one of them, or set 0 (chain only)."
        )

# For rule all and the report rule's input (passed as --extra).
VALIDATE_ONLINE_ALL = (
    [PLAN.run_path("validate_online.json")] if VALIDATE_ONLINE["enabled"] else []
)


rule validate_online:
    input:
        unpack(target_model_files),
        completions=f"results/{{run}}/completions/{VALIDATE_ONLINE_PROMPT_SET}.jsonl",
        drafters=expand(
            "results/{{run}}/drafters/{ckpt}/{file}",
            ckpt=VALIDATE_ONLINE_CHECKPOINTS,
            file=["model.safetensors", "config.json"],
        ),
        evals=expand(
            "results/{{run}}/eval/{ckpt}/{prompt_set}.json",
            ckpt=VALIDATE_ONLINE_CHECKPOINTS,
            prompt_set=VALIDATE_ONLINE_PROMPT_SET,
        ),
    output:
        "results/{run}/validate_online.json",
    log:
        "logs/validate_online/{run}.log",
    benchmark:
        "benchmarks/validate_online/{run}.tsv"
    conda:
        "../envs/gpu.yaml"
    container:
        config["containers"]["cuda"]
    threads: TORCH_THREADS
    resources:
        gpu=1,
    params:
        target=target_dir,
        # one folder per checkpoint, in the order of input.evals
        drafters=lambda wildcards, input: " ".join(
            shlex.quote(os.path.dirname(f)) for f in input.drafters[::2]
        ),
        n_samples=VALIDATE_ONLINE["n_samples"],
        budget=VALIDATE_ONLINE_BUDGET,
        device=VALIDATE_ONLINE["device"],
        dtype=VALIDATE_ONLINE["dtype"],
    shell:
        "python -m dflash_eval validate-online --target {params.target:q}"
        " --completions {input.completions:q} --drafter {params.drafters}"
        " --evals {input.evals:q} --n-samples {params.n_samples}"
        " --ddtree-budget {params.budget}"
        " --device {params.device:q} --dtype {params.dtype}"
        " --out {output:q} > {log:q} 2>&1"
