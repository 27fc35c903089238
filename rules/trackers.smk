# The tau table -> TensorBoard / W&B / MLflow at each checkpoint's training step (config section
# trackers; dflash_eval/trackers/log.py). Runs when a tracker is enabled; each (step, metric) is logged
# once, so a rerun after a new checkpoint adds only its points. No container: the trackers' client
# libraries (envs/requirements-trackers.txt) are in the host and conda environments, not in the image.


rule trackers:
    input:
        table="results/{run}/tau.parquet",
        evals=lambda wildcards: PLAN.evaluations(wildcards.run),  # the table must be what summary makes of them
        costs=PLAN.target_costs_outputs(),  # and of the target costs (its speedup columns)
        run_records=lambda wildcards: run_level_records(PLAN, wildcards.run, ("target_costs",)),  # costs must name it
        record=options_record("trackers"),
        planned=lambda wildcards: [PLAN.planned_evaluations()] if wildcards.run == PLAN.run else [],  # outputs remade
    output:
        "results/{run}/trackers.json",
    log:
        "logs/trackers/{run}.log",
    localrule: True
    conda:
        "../envs/cpu.yaml"
    params:
        options=lambda wildcards: PLAN.stage_flags("trackers"),
        args=lambda wildcards, input: PLAN.summary_args(input.get("costs", []), input.get("run_records", [])),
    shell:
        "python -m dflash_eval trackers --table {input.table:q} --run={wildcards.run:q}"
        " --evals {input.evals:q} {params.args} {params.options} --out {output:q} > {log:q} 2>&1"
