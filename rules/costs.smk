# Measured decode costs for the report's speedup estimate: on this run's device, at each
# context and batch of target_costs.contexts x batch_sizes, one decode step of the target, one
# verify forward of n tokens (n = each drafter's block size, and budget + 1 per DDTree budget)
# and each drafter architecture's block pass -> results/{run}/target_costs.json (dflash_eval/target/costs.py).
# The drafters' config.json are the inputs (timing depends on shapes, not weights).


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
    threads: PLAN.target_costs_threads
    resources:
        gpu=PLAN.target_gpus,
    params:
        target=target_dir,
        options=PLAN.stage_flags("target_costs"),
        threads=PLAN.target_costs_threads,  # the timings depend on them: a params value, so a change reruns the job
    shell:
        "python -m dflash_eval target-costs --target {params.target:q}"
        " --drafter-config {input.drafter_configs:q} {params.options}"
        " --target-fingerprint {input.fingerprint:q}"
        " --out {output:q} > {log:q} 2>&1"
