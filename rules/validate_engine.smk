# Engine validation: acceptance and speed measured by vLLM itself. For the first few
# completions of one prompt set, one plain vLLM server (speed baseline) and, per chosen
# checkpoint, one vLLM server running the stripped drafter (speculative method dflash),
# one at a time inside the job; counters and per-request steps next to the offline
# replay of the same samples -> results/{run}/validate_engine.json (title + markdown
# for `report --extra`). Enabled by validate_engine.enabled (off by default; checked
# in dflash_eval/workflow/plan.py). Conventions and traced divergences: docs/serving-engines.md.


rule validate_engine:
    input:
        unpack(target_model_files),
        completions=f"results/{{run}}/completions/{PLAN.validate_engine_prompt_set}.jsonl",
        drafters=expand(
            "results/{{run}}/drafters/{ckpt}/{file}",
            ckpt=PLAN.validate_engine_checkpoints,
            file=["model.safetensors", "config.json"],
        ),
        evals=expand(
            "results/{{run}}/eval/{ckpt}/{prompt_set}.json",
            ckpt=PLAN.validate_engine_checkpoints,
            prompt_set=PLAN.validate_engine_prompt_set,
        ),
        costs=PLAN.target_costs_outputs(),
    output:
        json="results/{run}/validate_engine.json",
        records="results/{run}/validate_engine.records.parquet",  # one row per request (dflash_eval/report/records.py)
    log:
        "logs/validate_engine/{run}.log",
    benchmark:
        "benchmarks/validate_engine/{run}.tsv"
    conda:
        "../envs/gpu.yaml"
    container:
        config["containers"]["cuda"]
    threads: TORCH_THREADS
    resources:
        gpu=PLAN.validate_engine_gpus,
    params:
        target=target_dir,
        # one folder per checkpoint, in the order of input.evals
        drafters=lambda wildcards, input: " ".join(
            shlex.quote(os.path.dirname(f)) for f in input.drafters[::2]
        ),
        costs=lambda wildcards, input: " ".join(
            f"--target-costs {shlex.quote(f)}" for f in input.costs
        ),
        work=lambda wildcards, output: shlex.quote(output[0] + ".work"),
        options=PLAN.stage_flags("validate_engine"),
    shell:
        "python -m dflash_eval validate-engine --target {params.target:q}"
        " --completions {input.completions:q} --drafter {params.drafters}"
        " --evals {input.evals:q} {params.costs} --work-dir {params.work} {params.options}"
        " --out {output.json:q} --out-records {output.records:q} --run {wildcards.run:q} > {log:q} 2>&1"
