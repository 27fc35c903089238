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
        cache=f"results/{{run}}/cache/{{prompt_set}}{CACHE_SUFFIX}",
    output:
        json="results/{run}/eval/{ckpt}/{prompt_set}.json",
        records="results/{run}/eval/{ckpt}/{prompt_set}.records.parquet",  # one row per request and method
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
    shell:
        "python -m dflash_eval evaluate --drafter {params.drafter:q}"
        " --cache {input.cache:q} --target {params.target:q}"
        " --target-fingerprint {input.fingerprint:q} {params.options}"
        " --out {output.json:q} --out-records {output.records:q} --run {wildcards.run:q} > {log:q} 2>&1"


# summary compares the settings each evaluate output (and target_costs.json) records with this config's
# (params.expected): results copied without .snakemake/ and an option changed since are refused, naming the fix.
rule summary:
    input:
        records=lambda wildcards: records_of(PLAN.evaluations(wildcards.run)),  # tau.csv is computed from them
        completions=lambda wildcards: PLAN.completions(wildcards.run),  # the loop columns (config section loops)
        costs=PLAN.target_costs_outputs(),
    output:
        csv=report(
            "results/{run}/tau.csv",
            caption="../report/tau_table.rst",
            category="Tau table",
        ),
        parquet="results/{run}/tau.parquet",
        provenance="results/{run}/tau.provenance.json",
        compare="results/{run}/tau_compare.csv",
    log:
        "logs/summary/{run}.log",
    localrule: True
    conda:
        "../envs/cpu.yaml"
    container:
        config["containers"]["cuda"]
    params:
        args=lambda wildcards, input: PLAN.summary_args(input.get("costs", [])),
        expected=PLAN.expected_settings(),
        options=PLAN.stage_flags("summary"),
    shell:
        "python -m dflash_eval summary --evals {input.records:q} --completions {input.completions:q} {params.options}"
        " {params.args} --expected-settings {params.expected:q}"
        " --out-csv {output.csv:q} --out-parquet {output.parquet:q} --out-provenance {output.provenance:q}"
        " --out-compare {output.compare:q} > {log:q} 2>&1"


# asked for by name (snakemake results/<run>/tau_reslice.csv, the bins in config section reslice): re-bins the
# records, runs no target or drafter
rule reslice:
    input:
        records=lambda wildcards: records_of(PLAN.evaluations(wildcards.run)),
    output:
        "results/{run}/tau_reslice.csv",
    log:
        "logs/reslice/{run}.log",
    localrule: True
    conda:
        "../envs/cpu.yaml"
    container:
        config["containers"]["cuda"]
    params:
        options=PLAN.stage_flags("reslice"),
    shell:
        "python -m dflash_eval reslice --records {input.records:q} {params.options} --out {output:q} > {log:q} 2>&1"


rule report:
    input:
        summary="results/{run}/tau.csv",
        provenance="results/{run}/tau.provenance.json",
        records=lambda wildcards: records_of(PLAN.evaluations(wildcards.run)),  # tables, comparisons, histograms
        caches=lambda wildcards: PLAN.caches(wildcards.run),
        prompts_meta=lambda wildcards: PLAN.prompt_metas(wildcards.run),
        extra=PLAN.extra_outputs(),
        costs=PLAN.target_costs_outputs(),
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
        args=lambda wildcards, input: PLAN.report_args(input.get("extra", []), input.get("costs", [])),
    shell:
        "python -m dflash_eval report --summary {input.summary:q} --provenance {input.provenance:q}"
        " --evals {input.records:q} --caches {input.caches:q}"
        " --prompts-meta {input.prompts_meta:q} {params.args}"
        " --out {output.md:q}"
        " --out-html {output.html:q} --figures-dir {output.figures:q} > {log:q} 2>&1"
