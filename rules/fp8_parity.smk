# cache.storage: fp8: per prompt set, its first fp8_parity.n_samples completions extracted in the run's dtype
# and in FP8, compared per stored layer, and the set's drafters (prompt_sets.<set>.checkpoints, else all) replayed
# on both ->
# results/{run}/fp8_parity/{prompt_set}.json (title + markdown for `report --extra`; dflash_eval/stages/fp8_parity.py).


rule fp8_parity:
    input:
        unpack(target_model_files),
        fingerprint=TARGET.fingerprint,
        completions="results/{run}/completions/{prompt_set}.jsonl",
        drafters=lambda wildcards: expand(
            "results/{run}/drafters/{ckpt}/{file}",
            run=wildcards.run,
            ckpt=PLAN.set_checkpoints(wildcards.prompt_set),
            file=["model.safetensors", "config.json"],
        ),
    output:
        "results/{run}/fp8_parity/{prompt_set}.json",
    log:
        "logs/fp8_parity/{run}/{prompt_set}.log",
    benchmark:
        "benchmarks/fp8_parity/{run}/{prompt_set}.tsv"
    conda:
        "../envs/gpu.yaml"
    container:
        config["containers"]["cuda"]
    threads: TORCH_THREADS
    resources:
        gpu=PLAN.target_gpus,
    params:
        target=target_dir,
        layer_ids=LAYER_IDS_ARG,
        drafters=lambda wildcards, input: " ".join(
            shlex.quote(d)
            for d in sorted({os.path.dirname(f) for f in input.drafters})
        ),
        options=lambda wildcards: PLAN.stage_flags("fp8_parity", wildcards.prompt_set),
    shell:
        "python -m dflash_eval fp8-parity --target {params.target:q}"
        " --completions {input.completions:q} --layer-ids {params.layer_ids}"
        " --drafter {params.drafters} --target-fingerprint {input.fingerprint:q}"
        " {params.options} --out {output:q} > {log:q} 2>&1"
