# Fidelity across engines: the first few completions of one prompt set extracted with the
# other hidden-state source than cache.source (vllm when the run's is hf, hf when it is
# vllm), compared per layer and per sample with the run's cache of that set, and every
# selected drafter replayed on both -> results/{run}/engine_parity.json (title + markdown
# for `report --extra`). Enabled by engine_parity.enabled (off by default; checked in
# dflash_eval/workflow/plan.py). A job-owned vLLM server's log is logs/engine_parity/{run}.vllm.log.


rule engine_parity:
    input:
        unpack(target_model_files),
        fingerprint=TARGET.fingerprint,
        completions=f"results/{{run}}/completions/{PLAN.engine_parity_prompt_set}.jsonl",
        cache=PLAN.cache_path(PLAN.engine_parity_prompt_set, "{run}"),
        drafters=expand(
            "results/{{run}}/drafters/{ckpt}/{file}",
            ckpt=PLAN.engine_parity_checkpoints,
            file=["model.safetensors", "config.json"],
        ),
    output:
        "results/{run}/engine_parity.json",
    log:
        main="logs/engine_parity/{run}.log",
        server="logs/engine_parity/{run}.vllm.log",
    benchmark:
        "benchmarks/engine_parity/{run}.tsv"
    conda:
        "../envs/gpu.yaml"
    container:
        config["containers"]["cuda"]
    threads: TORCH_THREADS
    resources:
        gpu=PLAN.engine_parity_gpus,
    params:
        target=target_dir,
        layer_ids=LAYER_IDS_ARG,
        drafters=lambda wildcards, input: " ".join(
            shlex.quote(d)
            for d in sorted({os.path.dirname(f) for f in input.drafters})
        ),
        options=PLAN.stage_flags("engine_parity"),
    shell:
        "python -m dflash_eval engine-parity --target {params.target:q}"
        " --completions {input.completions:q} --cache {input.cache:q} --layer-ids {params.layer_ids}"
        " --drafter {params.drafters} --target-fingerprint {input.fingerprint:q}"
        " {params.options} --server-log {log.server:q} --out {output:q}"
        " > {log.main:q} 2>&1"
