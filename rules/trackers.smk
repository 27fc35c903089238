# The tau table -> TensorBoard / W&B / MLflow at each checkpoint's training step (config section
# trackers; dflash_eval/trackers/log.py). Runs when a tracker is enabled; each (step, metric) is logged
# once, so a rerun after a new checkpoint adds only its points. No container: the trackers' client
# libraries (envs/requirements-trackers.txt) are in the host and conda environments, not in the image.


rule trackers:
    input:
        table="results/{run}/tau.parquet",
    output:
        "results/{run}/trackers.json",
    log:
        "logs/trackers/{run}.log",
    localrule: True
    conda:
        "../envs/cpu.yaml"
    params:
        options=lambda wildcards: PLAN.stage_flags("trackers"),
    shell:
        "python -m dflash_eval trackers --table {input.table:q} --run={wildcards.run:q}"
        " {params.options} --out {output:q} > {log:q} 2>&1"
