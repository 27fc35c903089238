# Greedy target completions (token ids + text) for one prompt set: from the target
# itself (generation.source: transformers) or from a serving engine (openai = vLLM's
# OpenAI-compatible server, sglang = SGLang's native API), either the user's server
# (generation.endpoint.url) or vLLM started and stopped by the job itself
# (generation.serve: vllm; the job owns the server's lifetime, dflash_eval/serving/clients.py).
#
# Resume: the job appends finished completions to results/<run>/completions/
# .<prompt_set>.jsonl.partial, which is NOT a declared output, so Snakemake's clean-up
# of a failed or killed job leaves it; rerunning the workflow resumes from it.


rule completions:
    input:
        unpack(lambda wildcards: PLAN.completions_inputs()),
        prompts="results/{run}/prompts/{prompt_set}.jsonl",
        prompts_meta="results/{run}/prompts/{prompt_set}.meta.json",
    output:
        completions="results/{run}/completions/{prompt_set}.jsonl",
        meta="results/{run}/completions/{prompt_set}.meta.json",  # the target's sha256 (hidden_states checks) + provenance
    log:
        main="logs/completions/{run}/{prompt_set}.log",
        server="logs/completions/{run}/{prompt_set}.vllm.log",
    benchmark:
        "benchmarks/completions/{run}/{prompt_set}.tsv"
    conda:
        "../envs/gpu.yaml"
    container:
        config["containers"]["cuda"]
    # torch intra-op threads; GPU jobs take gpu=target.devices (at least 1). A remote server
    # needs neither: several prompt sets are then sent to it side by side.
    threads: 1 if PLAN.remote_server else TORCH_THREADS
    resources:
        gpu=0 if PLAN.remote_server else PLAN.target_gpus,
    params:
        target=target_dir,
        options=lambda wildcards: PLAN.stage_flags("completions", wildcards.prompt_set),
        fingerprint=PLAN.completions_fingerprint_arg(),
    shell:
        "python -m dflash_eval completions --target {params.target:q}"
        " --prompts {input.prompts:q} {params.options}"
        " {params.fingerprint} --server-log {log.server:q}"
        " --out {output.completions:q} > {log.main:q} 2>&1"
