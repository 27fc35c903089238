# Hybrid (linear-attention) targets: the same few samples extracted with the fla and
# the torch Gated-DeltaNet kernels, compared per layer, and every selected drafter
# replayed on both caches -> results/{run}/kernel_parity.json (title + markdown for
# `report --extra`). Enabled by kernel_parity.enabled; on a host without CUDA + fla
# the job compares torch bf16 with torch fp32 instead and says so in the report.
#
# Include after common.smk (uses PLAN, PROMPT_SETS, CHECKPOINTS, LAYER_IDS_ARG,
# target_model_files, target_dir).

KERNEL_PARITY = config["kernel_parity"]
KERNEL_PARITY_PROMPT_SET = KERNEL_PARITY.get("prompt_set") or PROMPT_SETS[0]
KERNEL_PARITY_CHECKPOINTS = KERNEL_PARITY["checkpoints"] or list(CHECKPOINTS)

if KERNEL_PARITY["enabled"]:
    if KERNEL_PARITY_PROMPT_SET not in PROMPT_SETS:
        raise WorkflowError(
            f"config ({CONFIG_FILES}): kernel_parity.prompt_set: {KERNEL_PARITY_PROMPT_SET!r} is not one of the "
            f"prompt sets {PROMPT_SETS}. Fix: name a key of prompt_sets, or drop the setting."
        )
    _unknown = [c for c in KERNEL_PARITY_CHECKPOINTS if c not in CHECKPOINTS]
    if _unknown:
        raise WorkflowError(
            f"config ({CONFIG_FILES}): kernel_parity.checkpoints: {_unknown} are not configured checkpoints "
            f"({list(CHECKPOINTS)}). Fix: use names from checkpoints (or [] for all)."
        )

# For rule all and the report rule's input (extra=KERNEL_PARITY_ALL, passed as --extra).
KERNEL_PARITY_ALL = [PLAN.run_path("kernel_parity.json")] if KERNEL_PARITY["enabled"] else []


rule kernel_parity:
    input:
        unpack(target_model_files),
        fingerprint=TARGET.fingerprint,
        completions=f"results/{{run}}/completions/{KERNEL_PARITY_PROMPT_SET}.jsonl",
        drafters=expand(
            "results/{{run}}/drafters/{ckpt}/{file}",
            ckpt=KERNEL_PARITY_CHECKPOINTS,
            file=["model.safetensors", "config.json"],
        ),
    output:
        "results/{run}/kernel_parity.json",
    log:
        "logs/kernel_parity/{run}.log",
    benchmark:
        "benchmarks/kernel_parity/{run}.tsv"
    conda:
        "../envs/gpu.yaml"
    container:
        config["containers"]["cuda"]
    threads: TORCH_THREADS
    resources:
        gpu=1,
    params:
        target=target_dir,
        layer_ids=LAYER_IDS_ARG,
        n_samples=KERNEL_PARITY["n_samples"],
        drafters=lambda wildcards, input: " ".join(
            shlex.quote(d)
            for d in sorted({os.path.dirname(f) for f in input.drafters})
        ),
        batch_tokens=config["cache"]["batch_tokens"],
        device=config["cache"]["device"],
        dtype=config["cache"]["dtype"],
    shell:
        "python -m dflash_eval kernel-parity --target {params.target:q}"
        " --completions {input.completions:q} --layer-ids {params.layer_ids}"
        " --n-samples {params.n_samples} --drafter {params.drafters}"
        " --batch-tokens {params.batch_tokens}"
        " --target-fingerprint {input.fingerprint:q}"
        " --device {params.device:q} --dtype {params.dtype}"
        " --out {output:q} > {log:q} 2>&1"
