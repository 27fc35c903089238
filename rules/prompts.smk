# Prompt set -> chat-templated prompts (text + token ids) as JSONL.


rule prompts:
    input:
        unpack(prompts_inputs),
    output:
        "results/{run}/prompts/{prompt_set}.jsonl",
    log:
        "logs/prompts/{run}/{prompt_set}.log",
    conda:
        "../envs/cpu.yaml"
    container:
        config["containers"]["cuda"]
    params:
        source=prompt_set_param("source"),
        path=prompts_path_arg,
        n=prompt_set_param("n"),
        seed=prompt_set_param("seed"),
        max_prompt_tokens=prompt_set_param("max_prompt_tokens"),
        thinking=thinking_flag,
        tokenizer=target_dir,
    shell:
        "python -m dflash_eval prompts --source {params.source} {params.path}"
        " --tokenizer {params.tokenizer:q} --n {params.n} --seed {params.seed}"
        " --max-prompt-tokens {params.max_prompt_tokens} {params.thinking}"
        " --out {output:q} > {log:q} 2>&1"
