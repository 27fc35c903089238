# Measured decode costs for the report's speedup estimate: on this run's device, at
# batch 1, one decode step of the target, one verify forward of n tokens (n = each
# drafter's block size, and budget + 1 per DDTree budget) and each drafter
# architecture's block pass -> results/{run}/target_costs.json (dflash_eval/costs.py).
# The drafters' config.json are the inputs (timing depends on shapes, not weights).
#
# Include after common.smk (uses PLAN, TARGET, TORCH_THREADS, target_dir).

# For the report rule's input (costs=TARGET_COSTS_ALL, passed as --costs).
TARGET_COSTS_ALL = PLAN.target_costs_outputs()


rule target_costs:
    input:
        unpack(lambda wildcards: PLAN.target_costs_inputs(wildcards.run)),
        fingerprint=TARGET.fingerprint,
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
    threads: config["target_costs"]["threads"] or TORCH_THREADS
    resources:
        gpu=1,
    params:
        target=target_dir,
        args=PLAN.target_costs_args(),
    shell:
        "python -m dflash_eval target-costs --target {params.target:q}"
        " --drafter-config {input.drafter_configs:q} {params.args}"
        " --target-fingerprint {input.fingerprint:q}"
        " --out {output:q} > {log:q} 2>&1"
