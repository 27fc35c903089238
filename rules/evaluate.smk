# Per (checkpoint, prompt set): offline speculative-decoding replay -> per-sample
# acceptance JSON; then the tau table (with the speedup estimate when target_costs is enabled)
# and the report (HTML + markdown + figures) for the run.
# tau.csv, report.html and the figures are marked for `snakemake --report` (captions in report/).


rule evaluate:
    input:
        unpack(target_model_files),
        fingerprint=TARGET.fingerprint,
        drafter_weights="results/{run}/drafters/{ckpt}/model.safetensors",
        drafter_config="results/{run}/drafters/{ckpt}/config.json",
        strip_info="results/{run}/drafters/{ckpt}/strip_info.json",
        cache="results/{run}/cache/{prompt_set}.h5",
        completions="results/{run}/completions/{prompt_set}.jsonl",
        record=options_record("evaluate", "prompt_set"),
        strip_record=options_record("strip_drafter", "ckpt"),  # strip_info.json must name it
    output:
        "results/{run}/eval/{ckpt}/{prompt_set}.json",
    log:
        "logs/evaluate/{run}/{ckpt}/{prompt_set}.log",
    benchmark:
        "benchmarks/evaluate/{run}/{ckpt}/{prompt_set}.tsv"
    conda:
        "../envs/gpu.yaml"
    container:
        config["containers"]["cuda"]
    threads: TORCH_THREADS
    resources:
        gpu=1,
    params:
        drafter=lambda wildcards, input: os.path.dirname(input.drafter_weights),
        target=target_dir,
        options=lambda wildcards: PLAN.stage_flags("evaluate", wildcards.prompt_set),
        checkpoint=lambda wildcards: CHECKPOINTS[wildcards.ckpt]["path"],
    shell:
        "python -m dflash_eval evaluate --drafter {params.drafter:q} --checkpoint-source {params.checkpoint:q}"
        " --drafter-settings {input.strip_record:q}"
        " --completions {input.completions:q}"
        " --cache {input.cache:q} --target {params.target:q}"
        " --target-fingerprint {input.fingerprint:q} {params.options} --settings {input.record:q}"
        " --out {output:q} > {log:q} 2>&1"


rule summary:
    input:
        evals=lambda wildcards: PLAN.evaluations(wildcards.run),
        costs=PLAN.target_costs_outputs(),
        planned=lambda wildcards: [PLAN.planned_evaluations()] if wildcards.run == PLAN.run else [],
        # each evaluate output names its options record, completions, cache and drafter: compared with the run's
        records=lambda wildcards: [record_path(wildcards.run, "evaluate", p) for p in PROMPT_SETS],
        completions=expand("results/{{run}}/completions/{prompt_set}.jsonl", prompt_set=PROMPT_SETS),
        caches=lambda wildcards: PLAN.caches(wildcards.run),
        strip_infos=expand("results/{{run}}/drafters/{ckpt}/strip_info.json", ckpt=list(CHECKPOINTS)),
        record=options_record("summary"),  # with or without the speedup columns
        run_records=lambda wildcards: run_level_records(PLAN, wildcards.run, ("target_costs",)),  # costs must name it
    output:
        csv=report(
            "results/{run}/tau.csv",
            caption="../report/tau_table.rst",
            category="Tau table",
        ),
        parquet="results/{run}/tau.parquet",
    log:
        "logs/summary/{run}.log",
    localrule: True
    conda:
        "../envs/cpu.yaml"
    container:
        config["containers"]["cuda"]
    params:
        args=lambda wildcards, input: PLAN.summary_args(input.get("costs", []), input.get("run_records", [])),
        drafters=lambda wildcards, input: [os.path.dirname(f) for f in input.strip_infos],
    shell:
        "python -m dflash_eval summary --evals {input.evals:q} {params.args}"
        " --settings {input.records:q} --completions {input.completions:q} --caches {input.caches:q}"
        " --drafters {params.drafters:q}"
        " --out-csv {output.csv:q} --out-parquet {output.parquet:q} > {log:q} 2>&1"


rule report:
    input:
        summary="results/{run}/tau.csv",
        evals=lambda wildcards: PLAN.evaluations(wildcards.run),
        caches=lambda wildcards: PLAN.caches(wildcards.run),
        prompts_meta=lambda wildcards: PLAN.prompt_metas(wildcards.run),
        extra=PLAN.extra_outputs(),
        costs=PLAN.target_costs_outputs(),
        record=options_record("report"),  # its sections and the config's sha256
        planned=lambda wildcards: [PLAN.planned_evaluations()] if wildcards.run == PLAN.run else [],  # outputs remade
        run_records=lambda wildcards: run_level_records(PLAN, wildcards.run),  # each section must name its own
    output:
        md="results/{run}/report.md",
        html=report(
            "results/{run}/report.html",
            caption="../report/report_html.rst",
            category="Report",
        ),
        figures=report(
            directory("results/{run}/figures"),
            patterns=["{name}.png"],
            caption="../report/figures.rst",
            category="Figures",
            labels={"figure": "{name}"},
        ),
    log:
        "logs/report/{run}.log",
    localrule: True
    conda:
        "../envs/cpu.yaml"
    container:
        config["containers"]["cuda"]
    params:
        args=lambda wildcards, input: PLAN.report_args(
            input.get("extra", []), input.get("costs", []), input.get("run_records", [])
        ),
    shell:
        "python -m dflash_eval report --summary {input.summary:q}"
        " --evals {input.evals:q} --caches {input.caches:q}"
        " --prompts-meta {input.prompts_meta:q} {params.args}"
        " --out {output.md:q}"
        " --out-html {output.html:q} --figures-dir {output.figures:q} > {log:q} 2>&1"
