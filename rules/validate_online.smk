# Online validation: true speculative decoding with the target in the loop (the DFlash
# chain, and one DDTree budget verified in one target forward with an ancestor-only mask;
# at each evaluated temperature > 0 the chain's speculative sampler over several seeds)
# for the first few prompts of one prompt set, compared per sample with the offline
# replay / expected tau of the same samples -> results/{run}/validate_online.json (title + markdown for
# `report --extra`). Enabled by validate_online.enabled (off by default; checked in
# dflash_eval/workflow/plan.py).


rule validate_online:
    input:
        unpack(target_model_files),
        fingerprint=TARGET.fingerprint,
        completions=f"results/{{run}}/completions/{PLAN.validate_online_prompt_set}.jsonl",
        drafters=expand(
            "results/{{run}}/drafters/{ckpt}/{file}",
            ckpt=PLAN.validate_online_checkpoints,
            file=["model.safetensors", "config.json"],
        ),
        evals=expand(
            "results/{{run}}/eval/{ckpt}/{prompt_set}.json",
            ckpt=PLAN.validate_online_checkpoints,
            prompt_set=PLAN.validate_online_prompt_set,
        ),
    output:
        json="results/{run}/validate_online.json",
        records="results/{run}/validate_online.records.parquet",  # one row per request (dflash_eval/report/records.py)
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
        options=PLAN.stage_flags("validate_online"),
    shell:
        "python -m dflash_eval validate-online --target {params.target:q}"
        " --completions {input.completions:q} --drafter {params.drafters}"
        " --evals {input.evals:q} --target-fingerprint {input.fingerprint:q} {params.options}"
        " --out {output.json:q} --out-records {output.records:q} --run {wildcards.run:q} > {log:q} 2>&1"
