# Hybrid (linear-attention) targets: the same few samples extracted with the fla and
# the torch Gated-DeltaNet kernels, compared per layer, and every selected drafter
# replayed on both caches -> results/{run}/kernel_parity.json (title + markdown for
# `report --extra`). Enabled by kernel_parity.enabled (checked in dflash_eval/workflow/plan.py);
# on a host without CUDA + fla the job compares torch bf16 with torch fp32 instead and
# says so in the report.


rule kernel_parity:
    input:
        unpack(target_model_files),
        fingerprint=TARGET.fingerprint,
        completions=f"results/{{run}}/completions/{PLAN.kernel_parity_prompt_set}.jsonl",
        drafters=expand(
            "results/{{run}}/drafters/{ckpt}/{file}",
            ckpt=PLAN.kernel_parity_checkpoints,
            file=["model.safetensors", "config.json"],
        ),
    output:
        "results/{run}/kernel_parity.json",
    log:
        "logs/kernel_parity/{run}.log",
    benchmark:
        "benchmarks/kernel_parity/{run}.tsv"
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
        options=PLAN.stage_flags("kernel_parity"),
    shell:
        "python -m dflash_eval kernel-parity --target {params.target:q}"
        " --completions {input.completions:q} --layer-ids {params.layer_ids}"
        " --drafter {params.drafters} --target-fingerprint {input.fingerprint:q}"
        " {params.options} --out {output:q} > {log:q} 2>&1"
