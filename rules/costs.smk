# Measured decode costs for the report's speedup estimate: on this run's device, at
# batch 1, one decode step of the target, one verify forward of n tokens (n = each
# drafter's block size, and budget + 1 per DDTree budget) and each drafter
# architecture's block pass -> results/{run}/target_costs.json (dflash_eval/costs.py).
# The drafters' config.json are the inputs (timing depends on shapes, not weights).
#
# Include after common.smk (uses CHECKPOINTS, run_path, target_model_files, target_dir).
# Constants only, no functions (snakemake --lint).

TARGET_COSTS = config["target_costs"]

# For the report rule's input (costs=TARGET_COSTS_ALL, passed as --costs).
TARGET_COSTS_ALL = [run_path("target_costs.json")] if TARGET_COSTS["enabled"] else []


rule target_costs:
    input:
        unpack(target_model_files),
        drafter_configs=expand(
            "results/{{run}}/drafters/{ckpt}/config.json", ckpt=CHECKPOINTS
        ),
    output:
        "results/{run}/target_costs.json",
    log:
        "logs/target_costs/{run}.log",
    benchmark:
        "benchmarks/target_costs/{run}.tsv"
    conda:
        "../envs/gpu.yaml"
    container:
        config["containers"]["cuda"]
    threads: workflow.cores  # torch intra-op threads; GPU jobs run one at a time (gpu=1)
    resources:
        gpu=1,
    params:
        target=target_dir,
        budgets=",".join(str(b) for b in TARGET_COSTS["budgets"]),
        context_tokens=TARGET_COSTS["context_tokens"],
        repeats=TARGET_COSTS["repeats"],
        warmup=TARGET_COSTS["warmup"],
        backend=config["target"]["linear_attn_backend"],
        device=TARGET_COSTS["device"],
        dtype=TARGET_COSTS["dtype"],
    shell:
        "python -m dflash_eval target-costs --target {params.target:q}"
        " --drafter-config {input.drafter_configs:q} --budgets {params.budgets:q}"
        " --context-tokens {params.context_tokens} --repeats {params.repeats}"
        " --warmup {params.warmup} --linear-attn-backend {params.backend}"
        " --device {params.device:q} --dtype {params.dtype}"
        " --out {output:q} > {log:q} 2>&1"
