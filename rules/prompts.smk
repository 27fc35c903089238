# Prompt set -> chat-templated prompts (text + token ids) as JSONL, and <set>.meta.json beside it
# (what was skipped and why, read by the report, and the provenance block: dflash_eval/data/provenance.py).


rule prompts:
    input:
        unpack(lambda wildcards: PLAN.prompts_inputs(wildcards.prompt_set)),
    output:
        prompts="results/{run}/prompts/{prompt_set}.jsonl",
        meta="results/{run}/prompts/{prompt_set}.meta.json",  # skip counts per reason (report)
    log:
        "logs/prompts/{run}/{prompt_set}.log",
    conda:
        "../envs/cpu.yaml"
    container:
        config["containers"]["cuda"]
    params:
        source=lambda wildcards: PLAN.prompt_set_options(wildcards.prompt_set)["source"],
        path=lambda wildcards: PLAN.prompts_path_arg(wildcards.prompt_set),
        options=lambda wildcards: PLAN.stage_flags("prompts", wildcards.prompt_set),
        tokenizer=target_dir,
    shell:
        "python -m dflash_eval prompts --source {params.source} {params.path}"
        " --tokenizer {params.tokenizer:q} {params.options}"
        " --out {output.prompts:q} > {log:q} 2>&1"
