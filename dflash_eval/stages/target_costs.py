"""Stage ``target_costs`` (rule ``target_costs``): time the target's decode and verify forwards and each drafter's block pass.

On the run's own device, at each context of ``contexts`` and each batch of ``batch_sizes``: one
autoregressive decode step of the target, one verify forward of ``n`` tokens (``n`` = each drafter's
block size, and ``budget + 1`` per DDTree budget with a tree mask, at ``tree_batch_sizes`` only) and
each drafter architecture's block pass. The target's KV cache of each (context, batch) is built with
random keys/values (:mod:`dflash_eval.target.cost_cache`), not prefilled. The report turns them into
the speedup estimate of :mod:`dflash_eval.target.costs` and, against context, the break-even tau of
:mod:`dflash_eval.target.cost_context` (the cost model, its sources and the output format).
Options: config section ``target_costs`` and ``target.linear_attn_backend``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from importlib import metadata
from pathlib import Path
from typing import Callable, Sequence

import torch

from dflash_eval import __version__
from dflash_eval.core import options as options_mod
from dflash_eval.core.errors import InputError
from dflash_eval.core.runtime import dtype_name, resolve_device, resolve_dtype
from dflash_eval.data.provenance import stage_block, write_json
from dflash_eval.drafter.config import DrafterConfig
from dflash_eval.drafter.model import DFlashDrafter
from dflash_eval.target.cost_cache import CacheRestore, random_cache
from dflash_eval.target.cost_stats import assess, isotonic, robust_s, spread
from dflash_eval.target.costs import FORMAT, FORMAT_VERSION, FORMULA
from dflash_eval.target.model import load_target, target_info
from dflash_eval.target.spec import TargetSpec

log = logging.getLogger(__name__)

STAGE = "target_costs"


def add_arguments(p) -> None:
    p.add_argument("--target", required=True, help="target HF folder")
    p.add_argument("--drafter-config", nargs="+", required=True,
                   help="stripped drafters' config.json (results/<run>/drafters/<ckpt>/config.json); the parent folder "
                        "name is the checkpoint name; identical configs are timed once (random weights: cost depends "
                        "on shapes only)")
    p.add_argument("--target-fingerprint", default=None, metavar="JSON",
                   help="record written by 'target-fingerprint' (the weights are not hashed again while it matches)")
    p.add_argument("--out", required=True, help="target_costs.json (layout: dflash_eval/target/costs.py)")


def main(args, opts) -> None:
    measure_target_costs(args.target, args.drafter_config, args.out, opts, target_fingerprint=args.target_fingerprint)


def device_name(dev) -> str:
    """Human-readable device: the CUDA device name, or the CPU model from ``/proc/cpuinfo``."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()}"
    except OSError:
        pass
    return f"CPU: {platform.processor() or platform.machine()}"


def _timed(run: Callable[[object], object], setup: Callable[[], object], repeats: int, warmup: int, dev) -> list[float]:
    """Seconds of ``run(setup())`` for ``repeats`` runs after ``warmup`` untimed ones (setup not timed)."""
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    out = []
    for i in range(warmup + repeats):
        arg = setup()
        sync()
        t0 = time.perf_counter()
        run(arg)
        sync()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def _timed_interleaved(items: Sequence[tuple[Callable, Callable]], repeats: int, warmup: int, dev) -> list[list[float]]:
    """Seconds of each ``run(setup())`` of ``items``, in rounds: every round times every item once.

    ``warmup`` untimed rounds first. Interleaving spreads a slow phase of a shared machine over all
    shapes instead of one (:mod:`dflash_eval.target.cost_stats`). Returns one list of ``repeats`` times per item.
    """
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    out: list[list[float]] = [[] for _ in items]
    for i in range(warmup + repeats):
        for k, (run, setup) in enumerate(items):
            arg = setup()
            sync()
            t0 = time.perf_counter()
            run(arg)
            sync()
            if i >= warmup:
                out[k].append(time.perf_counter() - t0)
    return out


def _tree_mask(n: int, past: int, dtype, dev):
    """A ``[1, 1, n, past + n]`` additive mask: the committed past visible, a chain-shaped tree
    (each node sees itself and its ancestors) inside the block. Any ancestor-only tree has the
    same cost; the shape is what the verify kernel sees (DDTree ``compile_ddtree_tree``)."""
    mask = torch.zeros(1, 1, n, past + n, dtype=dtype, device=dev)
    block = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=dev).triu(1)
    mask[0, 0, :, past:] = block
    return mask


def measure_target_costs(target_dir, drafter_configs: Sequence[str | os.PathLike], out, opts=None, *, seed: int = 0,
                         target_fingerprint=None, **overrides) -> dict:
    """Time the target's decode step, its verify forwards and each drafter architecture's block pass per (context, batch).

    Args:
        target_dir: target HF folder.
        drafter_configs: stripped drafters' ``config.json`` files (``results/<run>/drafters/<ckpt>/config.json``);
            the parent folder name is the checkpoint name. Identical configs are timed once.
        out: output JSON (written atomically; layout in :mod:`dflash_eval.target.costs`, docs/outputs.md).
        opts: the stage's options (config section ``target_costs`` and ``target.linear_attn_backend``):
            ``budgets`` (DDTree node budgets; each adds a verify forward of ``budget + 1`` tokens with a tree
            mask), ``contexts`` (KV-cache lengths before the timed forwards; those the target cannot hold are
            left out), ``context_tokens`` (the single-context estimate's context: the batch-1 entry nearest to it
            fills the top-level fields), ``batch_sizes`` (rows; 1 always added), ``tree_batch_sizes`` (batches
            at which the DDTree shapes are timed), ``repeats`` (timed runs per measurement, interleaved across
            shapes; the minimum is reported, seconds, with the spread and a non-decreasing fit of the verify
            costs: :mod:`dflash_eval.target.cost_stats`), ``warmup`` (untimed runs before them),
            ``device``, ``dtype``, ``linear_attn_backend`` (GDN kernel of hybrid targets).
        **overrides: option values, when ``opts`` is not given.
        seed: seed of the random token ids, caches and drafter weights.
        target_fingerprint: a ``target-fingerprint`` record (the weights are then not hashed again).

    Returns:
        the JSON dict (format 3: the top-level single-context fields and ``grid``, one entry per (context, batch)).

    Raises:
        InputError: no drafter config, a bad drafter config, a budget < 1, ``repeats`` < 1, no context the target
            can hold (context + the largest n <= ``max_position_embeddings``), or a target that cannot be loaded.
    """
    opts = opts if opts is not None else options_mod.make(STAGE, **overrides)
    budgets, repeats, warmup = opts.budgets, opts.repeats, opts.warmup
    if not drafter_configs:
        raise InputError(None, "--drafter-config", "no drafter config given", "pass at least one drafter's config.json")
    dev = resolve_device(opts.device)
    dt = resolve_dtype(opts.dtype, dev)
    torch.manual_seed(seed)

    drafters: dict[str, dict] = {}
    by_hash: dict[str, DrafterConfig] = {}
    for path in drafter_configs:
        path = Path(path)
        try:
            data = path.read_bytes()
            raw = json.loads(data)
        except (OSError, ValueError) as err:
            raise InputError(path, None, f"cannot read the drafter config ({err})", "run the strip_drafter rule first") from None
        cfg = DrafterConfig.from_dict(raw, source=str(path))
        sha = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()
        by_hash.setdefault(sha, cfg)
        drafters[path.parent.name] = {"config": str(path), "config_sha256": sha, "block_size": cfg.block_size,
                                      "num_layers": cfg.num_hidden_layers}

    spec = TargetSpec.read(target_dir, fingerprint_file=target_fingerprint)
    model, _tok, kernel = load_target(spec, device=dev, dtype=dt, backend=opts.linear_attn_backend,
                                      devices=opts.devices, max_memory=opts.max_memory)
    info = target_info(model)
    n_max = max([cfg.block_size for cfg in by_hash.values()] + [int(b) + 1 for b in budgets])
    contexts, skipped = _usable_contexts(sorted({*opts.contexts, opts.context_tokens}), n_max,
                                         spec.max_position_embeddings)
    batches = sorted({1, *opts.batch_sizes})
    gen = torch.Generator().manual_seed(seed)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    drafter_models = {sha: DFlashDrafter(cfg).to(device=dev, dtype=dt).eval() for sha, cfg in by_hash.items()}
    grid = []
    for c in contexts:
        for b in batches:
            tree = b in opts.tree_batch_sizes
            try:
                grid.append(_measure_entry(model, drafter_models, embed, head, info["vocab_size"], c, b,
                                           budgets if tree else [], repeats, warmup, dev, dt, gen))
            except torch.OutOfMemoryError as err:
                log.warning("context %d at batch %d left out: out of memory (%s)", c, b, str(err).splitlines()[0])
                skipped.append({"context_tokens": c, "batch_size": b, "reason": "out of memory"})
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    del drafter_models
    primary = _primary(grid, opts.context_tokens)
    for name, entry in drafters.items():
        entry.update(primary["drafters"][entry["config_sha256"]])
    for e in grid:
        e["drafters"] = {name: e["drafters"][d["config_sha256"]] for name, d in drafters.items()}

    result = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "device": dev.type,
        "device_name": device_name(dev),
        "dtype": dtype_name(dt),
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": _transformers_version(),
        "dflash_eval_version": __version__,
        "linear_attn_kernel": kernel.backend,
        "target": {"path": str(target_dir), "sha256": spec.weights_sha256(), "model_type": info["model_type"],
                   "num_layers": info["num_hidden_layers"], "hidden_size": info["hidden_size"],
                   "params": sum(p.numel() for p in model.parameters()),
                   "max_position_embeddings": spec.max_position_embeddings},
        "context_tokens": primary["context_tokens"],
        "batch_size": 1,
        "repeats": repeats,
        "warmup": warmup,
        "statistic": "min",
        "formula": FORMULA,
        "decode_s": primary["decode_s"],
        "decode_samples_s": primary["decode_samples_s"],
        "verify": primary["verify"],
        "drafters": drafters,
        "contexts": sorted({e["context_tokens"] for e in grid}),
        "batch_sizes": sorted({e["batch_size"] for e in grid}),
        "tree_batch_sizes": sorted(set(opts.tree_batch_sizes) & set(batches)),
        "skipped": skipped,
        "grid": grid,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    for e in grid:
        verdict = assess(e)
        e["estimate_reliable"], e["reliability"] = verdict["reliable"], verdict
    verdict = assess(result)
    result["estimate_reliable"], result["reliability"] = verdict["reliable"], verdict
    if not verdict["reliable"]:
        log.warning("the speedup estimate is unreliable (spread bound %.0f%%): %s", 100 * verdict["bound"],
                    "; ".join(verdict["reasons"]))
    result["provenance"] = stage_block(STAGE, opts, {"target": result["target"]["sha256"]})
    result = write_json(out, result)
    log.info("target costs on %s (%s, %s) -> %s", result["device_name"], result["device"], result["dtype"], out)
    return result


def _usable_contexts(contexts: list[int], n_max: int, max_pos: int | None) -> tuple[list[int], list[dict]]:
    """The contexts the target can hold (``context + n_max <= max_pos``) and a note per one left out.

    Raises:
        InputError: none remains.
    """
    keep = [c for c in contexts if not max_pos or c + n_max <= max_pos]
    skipped = [{"context_tokens": c, "batch_size": None,
                "reason": f"{c} + {n_max} new tokens exceed max_position_embeddings {max_pos}"}
               for c in contexts if c not in keep]
    for s in skipped:
        log.info("context %d left out: %s", s["context_tokens"], s["reason"])
    if not keep:
        raise InputError(None, "target_costs.contexts", f"every context ({contexts}) + {n_max} new tokens exceeds the "
                         f"target's max_position_embeddings {max_pos}", f"add a context <= {max_pos - n_max}")
    return keep, skipped


def _primary(grid: list[dict], context_tokens: int) -> dict:
    """The batch-1 entry at the timed context nearest to ``context_tokens`` (the smaller on a tie)."""
    ones = [e for e in grid if e["batch_size"] == 1]
    if not ones:
        raise InputError(None, "target_costs.contexts", "no context could be timed at batch 1 (out of memory)",
                         "use shorter contexts or a device with more memory")
    return min(ones, key=lambda e: (abs(e["context_tokens"] - context_tokens), e["context_tokens"]))


def _measure_entry(model, drafters: dict, embed, head, vocab: int, context: int, batch: int, budgets, repeats: int,
                   warmup: int, dev, dt, gen) -> dict:
    """One grid entry: the decode step, every verify shape and each drafter's passes at ``context`` x ``batch``.

    The target's cache is built with random keys/values (:func:`dflash_eval.target.cost_cache.random_cache`) and
    restored (:class:`~dflash_eval.target.cost_cache.CacheRestore`) before every timed forward. ``budgets``: the
    DDTree budgets timed at this batch (``[]``: chain shapes only). Times in seconds.
    """
    with torch.inference_mode():
        restore = CacheRestore(random_cache(model, context, batch, vocab, dev, gen))

        def ids(n: int):
            return torch.randint(0, vocab, (batch, n), generator=gen).to(dev)

        def forward(n: int, mask: str):
            new = ids(n)
            pos = torch.arange(context, context + n, device=dev)[None].expand(batch, -1)
            attn = _tree_mask(n, context, dt, dev).expand(batch, -1, -1, -1) if mask == "tree" else None

            def run(kv):
                # as the DFlash / DDTree verify: all n rows' logits, hidden states kept for the drafter
                model(new, position_ids=pos, attention_mask=attn, past_key_values=kv, use_cache=True,
                      output_hidden_states=True)

            return run, restore

        one = ids(1)
        one_pos = torch.full((batch, 1), context, device=dev)
        shapes = sorted({(cfg.block_size, "causal") for cfg in (d.cfg for d in drafters.values())}
                        | {(int(b) + 1, "tree") for b in budgets})
        # the decode step and every verify shape timed in interleaved rounds; statistic: the minimum
        decode, *per_shape = _timed_interleaved(
            [(lambda kv: model(one, position_ids=one_pos, past_key_values=kv, use_cache=True), restore)]
            + [forward(n, mask) for n, mask in shapes], repeats, warmup, dev)
        log.info("context %d, batch %d: decode step %.3f ms (min of %d, spread %.0f%%)", context, batch,
                 1e3 * robust_s(decode), repeats, 100 * spread(decode))
        fit = isotonic([robust_s(x) for x in per_shape])  # shapes are sorted by n: non-decreasing in n
        verify = []
        for (n, mask), samples, fit_s in zip(shapes, per_shape, fit):
            verify.append({"n": n, "mask": mask, "min_s": robust_s(samples), "fit_s": fit_s,
                           "median_s": statistics.median(samples), "spread": spread(samples), "samples_s": samples})
            log.info("  verify forward of %d tokens (%s mask): %.3f ms (fit %.3f ms), %.2fx a decode step", n, mask,
                     1e3 * verify[-1]["min_s"], 1e3 * fit_s, fit_s / robust_s(decode))
        restore = None  # the target cache is not needed for the drafter passes: free it
        draft = {}
        for sha, drafter in drafters.items():
            draft[sha] = _drafter_costs(drafter, embed, head, context, batch, budgets, repeats, warmup, dev, dt)
            log.info("  drafter %s (%d layers, block %d): %.3f ms per block", sha[:12], drafter.cfg.num_hidden_layers,
                     drafter.cfg.block_size, 1e3 * draft[sha]["draft_s"])
    return {"context_tokens": context, "batch_size": batch, "decode_s": robust_s(decode), "decode_samples_s": decode,
            "verify": verify, "drafters": draft}


def _drafter_costs(drafter, embed, head, context_tokens, batch, budgets, repeats, warmup, dev, dt) -> dict:
    """Seconds (minimum of the runs, :mod:`dflash_eval.target.cost_stats`) of one block pass of ``drafter`` over ``batch``
    rows after ``context_tokens`` committed positions (chain), and with log-softmax + top-``budget`` (trees)."""
    cfg = drafter.cfg
    B = cfg.block_size
    K = len(cfg.target_layer_ids)
    new_ctx = B  # context positions committed by the previous step (<= B), projected once per step
    positions = torch.arange(context_tokens + new_ctx, device=dev)[None].expand(batch, -1)
    # the draft KV cache of the committed context: projected at one row, the same for every row (cost: shapes only)
    kv_old = [(k.expand(batch, -1, -1, -1).contiguous(), v.expand(batch, -1, -1, -1).contiguous())
              for k, v in drafter.context_kv(torch.randn(1, context_tokens, K * cfg.hidden_size, dtype=dt, device=dev),
                                             positions[:1, :context_tokens])]
    hidden_new = torch.randn(batch, new_ctx, K * cfg.hidden_size, dtype=dt, device=dev)
    anchor = torch.zeros(batch, dtype=torch.long, device=dev)  # any token: the cost depends on shapes only
    start = context_tokens + new_ctx
    block_pos = torch.arange(start, start + B, device=dev)[None].expand(batch, -1)
    ctx_valid = torch.ones(batch, start, dtype=torch.bool, device=dev)

    def block(topk: int):
        # the reference's draft KV cache grows by the committed positions' context K/V each step
        kv_new = drafter.context_kv(hidden_new, positions[:, context_tokens:])
        kv = [(torch.cat([ko, kn], 2), torch.cat([vo, vn], 2)) for (ko, vo), (kn, vn) in zip(kv_old, kv_new)]
        emb = drafter.make_block(anchor, embed, B)
        h = drafter(emb, block_pos, kv, positions, ctx_valid)
        logits = drafter.logits(h[:, 1:], head)
        if topk:
            return torch.log_softmax(logits.float(), -1).topk(min(topk, logits.shape[-1]), -1)
        return logits.argmax(-1)

    chain = _timed(lambda _: block(0), lambda: None, repeats, warmup, dev)
    tree = {str(b): robust_s(_timed(lambda _, b=b: block(int(b)), lambda: None, repeats, warmup, dev))
            for b in budgets}
    return {"draft_s": robust_s(chain), "draft_samples_s": chain, "draft_tree_s": tree}


def _transformers_version() -> str:
    """transformers' version (from its metadata: ``target-costs --help`` stays transformers-free)."""
    return metadata.version("transformers")
