"""Command line: one subcommand per pipeline stage (``python -m dflash_eval <stage> ...``).

Every Snakemake rule calls exactly one of these; a stage's module is
``dflash_eval/stages/<rule>.py`` (the subcommand is the rule's name with dashes). A stage module
defines ``add_arguments(parser)`` (its files and the switches that are not config options) and
``main(args, opts)``; its config options become flags here, generated from the config schema
(:mod:`dflash_eval.core.options`), so the CLI accepts exactly what a workflow config may set, with the
schema's defaults and descriptions (``--help``). Only the chosen stage's module is imported.

Errors in user input exit with status 2 and a one-line message naming the file, the field and
the fix; nothing partial is left behind. SIGTERM / SIGINT / SIGHUP stop a stage cleanly
(temporary files removed, a partial cache committed for resuming; exit status 128 + signal):
:func:`dflash_eval.core.errors.install_signal_handlers`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from dflash_eval.core import gpu_pool

from dflash_eval.core import options

from dflash_eval.core import threads

from dflash_eval.core import watchdog
from dflash_eval.core.errors import InputError, Interrupted, install_signal_handlers
from dflash_eval.serving.clients import ServerError, ServerUnavailable

#: subcommand -> (module under dflash_eval, one-line help). Stages are named as their Snakemake rules.
COMMANDS: dict[str, tuple[str, str]] = {
    "target-from-gguf": ("stages.target_from_gguf", "convert a GGUF target to an HF folder (bf16 safetensors + tokenizer)"),
    "target-fingerprint": ("stages.target_fingerprint", "sha256 of a target's weights, recorded once for every later job"),
    "prompts": ("stages.prompts", "build one prompt set (chat-templated text + token ids) as JSONL"),
    "completions": ("stages.completions", "target completions (token ids + text; greedy or seeded sampled) for a prompt set"),
    "hidden-states": ("stages.hidden_states", "run the target over prompt+completion ids and write the HDF5 cache"),
    "hidden-states-shard": ("stages.hidden_states_shard", "hidden-states --shard K/N: one of N jobs writing a prompt "
                                                          "set's cache (config cache.shards)"),
    "merge-cache-shards": ("stages.merge_cache_shards", "N shard caches of one prompt set (hidden-states --shard K/N) "
                                                        "-> its one cache (samples linked, not copied)"),
    "strip-drafter": ("stages.strip_drafter", "training checkpoint -> stripped bf16 drafter folder "
                                              "(config.json + model.safetensors)"),
    "demo-checkpoint": ("stages.demo_checkpoint", "write a training-style .pt checkpoint for the demo"),
    "evaluate": ("stages.evaluate", "offline speculative-decoding replay -> per-sample acceptance (greedy; expected tau at T > 0)"),
    "kernel-parity": ("stages.kernel_parity", "extract a few samples with fla and with torch linear-attention kernels; "
                                              "per-layer cos / rel-L2 / max-abs and tau per drafter on each"),
    "fp8-parity": ("stages.fp8_parity", "cache.storage: fp8: a few samples of a prompt set extracted in FP8 and in "
                                        "the run's dtype; per-layer cos / rel-L2 / max-abs and tau per drafter on each"),
    "engine-parity": ("stages.engine_parity", ("extract a few samples with the other hidden-state source (vLLM / HF) "
                                               "than the run's; per-layer and per-sample parity and tau per drafter "
                                               "on each")),
    "validate-online": ("stages.validate_online", ("true speculative decoding (target in the loop: chain and one "
                                                   "DDTree budget; at temperature > 0 the chain's speculative sampler "
                                                   "over seeds) of a few prompts vs the offline replay / expected tau")),
    "validate-engine": ("stages.validate_engine", "acceptance and speed measured by vLLM (plain and DFlash servers) "
                                                  "vs the offline replay of the same samples"),
    "target-costs": ("stages.target_costs", "time the target's decode step, its verify forwards of n tokens and the "
                                            "drafters' block pass per context and batch (inputs of the report's speedup estimate)"),
    "summary": ("stages.summary", "collect per-checkpoint results into tau.csv / tau.parquet"),
    "reslice": ("stages.reslice", "tau table by new position / prompt-length bins or a sample subset, from the "
                                  "per-request records only (no target or drafter runs)"),
    "report": ("stages.report", "HTML + markdown report (tau curves and table, histograms, speedup estimate, "
                                "target agreement, provenance)"),
    "trackers": ("stages.trackers", "log the tau table to TensorBoard / W&B / MLflow at each checkpoint's step"),
    "train": ("drafter.train", "train a DFlash drafter on target-generated completions (the demo drafters)"),
    "train-lilicorr": ("drafter.train_lilicorr", "train a LiLiCorr reranker head on a frozen DFlash backbone "
                                                 "(writes step<N>.pt and the stripped engines' layout)"),
    "records": ("records_cmd", "write the per-request records of a results folder made before they existed, from its "
                               "evaluate JSONs (an upgrade step; not a rule: no drafter replay reruns)"),
    "watch": ("watch", "follow a training output folder and evaluate each checkpoint once it is complete "
                       "(not a rule: runs Snakemake per checkpoint)"),
}
#: older spellings still accepted
ALIASES = {"strip": "strip-drafter"}


def _module(command: str):
    return importlib.import_module(f"dflash_eval.{COMMANDS[command][0]}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The argument parser; with ``command`` only that subcommand's options are built (and its module imported).

    Raises:
        KeyError: an unknown ``command``.
    """
    ap = argparse.ArgumentParser(prog="dflash-eval", description=__doc__.splitlines()[0])
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="STAGE")
    for name, (_, help_) in COMMANDS.items():
        aliases = [a for a, target in ALIASES.items() if target == name]
        p = sub.add_parser(name, help=help_, description=help_, aliases=aliases)
        if command is not None and name != command:
            continue
        mod = _module(name)
        mod.add_arguments(p)
        p.add_argument("--threads", type=int, default=None, metavar="N",
                       help="CPU threads for torch (default: $OMP_NUM_THREADS, else the config's torch_threads "
                            "default capped by the cores this process may use; dflash_eval/core/threads.py)")
        if getattr(mod, "STAGE", None):
            options.add_flags(p, mod.STAGE)
    return ap


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (aliases resolved), or None (``--help``, a typo: argparse explains)."""
    for word in argv:
        if not word.startswith("-"):
            word = ALIASES.get(word, word)
            return word if word in COMMANDS else None
    return None


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Exit status: 0 done, 2 bad input (message names file, field and fix), 3 a server
    failed (work done is kept), ``128 + signal`` after SIGTERM (143) / SIGINT (130), once the stage cleaned up."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_command_of(argv)).parse_args(argv)
    args.cmd = ALIASES.get(args.cmd, args.cmd)
    if not sys.stderr.isatty():
        # a log file (Snakemake, SLURM): no carriage-return progress bars from transformers
        # ("Loading weights"; read by huggingface_hub at import) or other libraries' tqdm defaults.
        # dflash-eval's own bars (progress.py) decide for themselves and log lines instead.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_signal_handlers()
    try:
        watchdog.start()  # a job whose Snakemake is gone stops (SIGTERM -> Interrupted), keeping what resumes
        threads.apply(getattr(args, "threads", None))
        mod = _module(args.cmd)
        opts = options.from_args(mod.STAGE, args) if getattr(mod, "STAGE", None) else None
        if opts is not None:
            gpu_pool.claim(mod.STAGE, opts)  # the job's own GPU(s) on a multi-GPU host, before CUDA starts
        code = mod.main(args, opts) or 0
    except InputError as err:
        logging.getLogger("dflash_eval").error("%s", err)
        print(f"dflash-eval {args.cmd}: error: {err}", file=sys.stderr)
        code = 2
    except (ServerError, ServerUnavailable) as err:
        logging.getLogger("dflash_eval").error("%s: %s", type(err).__name__, err)
        print(f"dflash-eval {args.cmd}: server error: {err}. Work already done is kept; rerun to resume.", file=sys.stderr)
        code = 3
    except Interrupted as err:
        logging.getLogger("dflash_eval").error("%s: %s stopped; temporary files removed", err, args.cmd)
        print(f"dflash-eval {args.cmd}: {err}", file=sys.stderr)
        code = 128 + err.signum
    writer = sys.modules.get("dflash_eval.cache.writer")
    if writer is not None and writer.DETACHED:  # HDF5 after a failed write: skip its shutdown (it can crash)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
