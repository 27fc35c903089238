"""Measured decode costs of the target and the drafters, and the tau -> speedup estimate.

Why: tau (acceptance length) counts tokens per verify step; what a user wants is wall-clock
speed on their hardware. With greedy speculative decoding each verify step costs one drafter
pass plus one target forward over ``n`` tokens and commits ``tau`` tokens on average, while
autoregressive decoding commits one token per single-token target forward. Hence the
estimate used in the report::

    speedup(n) = tau * t_decode / (t_verify(n) + t_draft)

* ``t_decode``: one autoregressive decode step of the target (1 new token) at batch 1;
* ``t_verify(n)``: one target forward over ``n`` new tokens at batch 1 -- ``n = block_size``
  for the DFlash chain (``[bonus, B-1 drafts]``, causal), ``n = budget + 1`` for a DDTree of
  ``budget`` drafted nodes (root + nodes, ancestor-only 4-D mask);
* ``t_draft``: one drafter pass over one block (context K/V of the newly committed
  positions, the block forward, the target LM head over the ``B - 1`` draft slots, argmax;
  for a tree also the full-vocabulary log-softmax + top-``budget`` per slot).

All three are medians of ``repeats`` timed runs after ``warmup`` untimed ones, with the
target's KV cache prefilled to ``context_tokens`` random tokens (copied before every timed
forward, outside the timed region), ``torch.cuda.synchronize()`` around each timed call on
GPU. Random token ids and random drafter weights: the costs depend on shapes, not values.

Sources of the cost model:

* DFlash (Chen, Liang, Liu, arXiv:2602.06036): one drafter pass per block instead of
  ``B - 1`` sequential drafter steps, so the drafting term stays a single forward; the
  per-token latency of speculative decoding is (draft time + verify time) / tau.
* DDTree (Ringel, Romano, arXiv:2604.12989; ``liranringel/ddtree``): a budget-``B`` tree is
  verified in one target forward over ``B + 1`` rows; its speedup peaks at a budget where
  the growth of tau no longer pays for the larger verify forward (paper Fig. 3).
* CaDDTree (arXiv:2606.01813; ``ZhangShuai1230/CaDDTree`` ``cost_model.py``): the
  throughput-optimal budget maximises ``(1 + Phi(n)) / (C_d + C_v(n; l))`` with a measured
  draft cost ``C_d`` and verify cost ``C_v`` for ``n`` nodes at context length ``l`` -- the
  same ratio as above with ``tau = 1 + Phi(n)``; the report picks the best measured budget
  per checkpoint with it (per run, not per round as CaDDTree does).

What the estimate leaves out (so it is an upper bound on what an implementation with the
same kernels gets): KV-cache bookkeeping, host-side tree construction, sampling, the
prefill, the drafter's own context prefill, and any difference between offline and online
tau. Costs are measured on the run's own device and never hard-coded.

Output JSON (``results/<run>/target_costs.json``, ``format = "dflash-eval/target-costs"``)::

    device, device_name, dtype, threads, torch_version, transformers_version, dflash_eval_version,
    target {path, sha256, model_type, num_layers, hidden_size, params},
    context_tokens, repeats, warmup, statistic = "median",
    decode_s, decode_samples_s,
    verify: [{n, mask: "causal" | "tree", median_s, samples_s}, ...],
    drafters: {<checkpoint>: {config, config_sha256, block_size, num_layers, draft_s,
                              draft_tree_s {<budget>: s}}},
    measured_at
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

from .errors import InputError, atomic_path

log = logging.getLogger(__name__)

FORMAT = "dflash-eval/target-costs"
FORMAT_VERSION = 1
#: the formula as printed in the reports
FORMULA = "tau * t_decode / (t_verify(n) + t_draft)"


# --------------------------------------------------------------------------- measurement

def device_name(dev) -> str:
    """Human-readable device: the CUDA device name, or the CPU model from ``/proc/cpuinfo``."""
    import torch

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
    import torch

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


def _tree_mask(n: int, past: int, dtype, dev):
    """A ``[1, 1, n, past + n]`` additive mask: the committed past visible, a chain-shaped tree
    (each node sees itself and its ancestors) inside the block. Any ancestor-only tree has the
    same cost; the shape is what the verify kernel sees (DDTree ``compile_ddtree_tree``)."""
    import torch

    mask = torch.zeros(1, 1, n, past + n, dtype=dtype, device=dev)
    block = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype, device=dev).triu(1)
    mask[0, 0, :, past:] = block
    return mask


def measure_target_costs(
    target_dir,
    drafter_configs: Sequence[str | os.PathLike],
    out,
    budgets: Sequence[int] = (),
    context_tokens: int = 512,
    repeats: int = 7,
    warmup: int = 2,
    device: str = "auto",
    dtype: str = "auto",
    linear_attn_backend: str = "auto",
    seed: int = 0,
    target_fingerprint=None,
) -> dict:
    """Time the target's decode step, its verify forwards and each drafter architecture's block pass.

    Args:
        target_dir: target HF folder.
        drafter_configs: stripped drafters' ``config.json`` files (``results/<run>/drafters/<ckpt>/config.json``);
            the parent folder name is the checkpoint name. Identical configs are timed once.
        out: output JSON (written atomically; layout in the module docstring).
        budgets: DDTree node budgets; each adds a verify forward of ``budget + 1`` tokens with a tree mask.
        context_tokens: KV-cache length (tokens) before every timed forward.
        repeats: timed runs per measurement (the median is reported, seconds).
        warmup: untimed runs before them.
        device, dtype: see :func:`dflash_eval.runtime.resolve_device` / ``resolve_dtype``.
        linear_attn_backend: GDN kernel of hybrid targets (``auto`` | ``fla`` | ``torch``).
        seed: seed of the random token ids and drafter weights.
        target_fingerprint: a ``target-fingerprint`` record (the weights are then not hashed again).

    Returns:
        the JSON dict.

    Raises:
        InputError: no drafter config, a bad drafter config, a budget < 1, ``repeats`` < 1, a context
            longer than the target's ``max_position_embeddings``, or a target that cannot be loaded.
    """
    import torch

    from . import __version__
    from .drafter import DFlashDrafter
    from .drafter_config import DrafterConfig
    from .runtime import dtype_name, resolve_device, resolve_dtype
    from .target import TargetSpec, load_target, target_info

    if not drafter_configs:
        raise InputError(None, "--drafter-config", "no drafter config given", "pass at least one drafter's config.json")
    if repeats < 1 or warmup < 0 or context_tokens < 1:
        raise InputError(None, "target_costs", f"repeats={repeats}, warmup={warmup}, context_tokens={context_tokens}",
                         "use repeats >= 1, warmup >= 0, context_tokens >= 1")
    bad = [b for b in budgets if int(b) < 1]
    if bad:
        raise InputError(None, "target_costs.budgets", f"budgets must be >= 1, got {bad}", "fix the budget list")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    torch.manual_seed(seed)

    drafters: dict[str, dict] = {}
    by_hash: dict[str, DrafterConfig] = {}
    for path in drafter_configs:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise InputError(path, None, f"cannot read the drafter config ({err})", "run the strip_drafter rule first") from None
        cfg = DrafterConfig.from_dict(raw, source=str(path))
        sha = hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()
        by_hash.setdefault(sha, cfg)
        drafters[path.parent.name] = {"config": str(path), "config_sha256": sha, "block_size": cfg.block_size,
                                      "num_layers": cfg.num_hidden_layers}

    spec = TargetSpec.read(target_dir, fingerprint_file=target_fingerprint)
    model, _tok, kernel = load_target(spec, device=dev, dtype=dt, backend=linear_attn_backend)
    info = target_info(model)
    max_pos = spec.max_position_embeddings
    n_max = max([cfg.block_size for cfg in by_hash.values()] + [int(b) + 1 for b in budgets])
    if max_pos and context_tokens + n_max > max_pos:
        raise InputError(None, "target_costs.context_tokens", f"{context_tokens} + {n_max} new tokens exceed the "
                         f"target's max_position_embeddings {max_pos}", "use a shorter context")
    vocab = info["vocab_size"]
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int):
        return torch.randint(0, vocab, (1, n), generator=gen).to(dev)

    with torch.inference_mode():
        prefill = model(ids(context_tokens), use_cache=True, logits_to_keep=1)
        cache = prefill.past_key_values
        del prefill

        def forward(n: int, mask: str):
            new = ids(n)
            pos = torch.arange(context_tokens, context_tokens + n, device=dev)[None]
            attn = _tree_mask(n, context_tokens, dt, dev) if mask == "tree" else None

            def run(kv):
                # as the DFlash / DDTree verify: all n rows' logits, hidden states kept for the drafter
                model(new, position_ids=pos, attention_mask=attn, past_key_values=kv, use_cache=True,
                      output_hidden_states=True)

            return _timed(run, lambda: copy.deepcopy(cache), repeats, warmup, dev)

        one, one_pos = ids(1), torch.tensor([[context_tokens]], device=dev)
        decode = _timed(lambda kv: model(one, position_ids=one_pos, past_key_values=kv, use_cache=True),
                        lambda: copy.deepcopy(cache), repeats, warmup, dev)
        log.info("decode step at context %d: %.3f ms (median of %d)", context_tokens, 1e3 * statistics.median(decode), repeats)
        shapes = sorted({(cfg.block_size, "causal") for cfg in by_hash.values()} | {(int(b) + 1, "tree") for b in budgets})
        verify = []
        for n, mask in shapes:
            samples = forward(n, mask)
            verify.append({"n": n, "mask": mask, "median_s": statistics.median(samples), "samples_s": samples})
            log.info("verify forward of %d tokens (%s mask): %.3f ms, %.2fx a decode step", n, mask,
                     1e3 * verify[-1]["median_s"], verify[-1]["median_s"] / statistics.median(decode))

        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        draft_costs = {}
        for sha, cfg in by_hash.items():
            drafter = DFlashDrafter(cfg).to(device=dev, dtype=dt).eval()
            draft_costs[sha] = _drafter_costs(drafter, embed, head, context_tokens, budgets, repeats, warmup, dev, dt)
            log.info("drafter %s (%d layers, block %d): %.3f ms per block", sha[:12], cfg.num_hidden_layers,
                     cfg.block_size, 1e3 * draft_costs[sha]["draft_s"])
            del drafter
    for entry in drafters.values():
        entry.update(draft_costs[entry["config_sha256"]])

    import transformers

    result = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "device": dev.type,
        "device_name": device_name(dev),
        "dtype": dtype_name(dt),
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "dflash_eval_version": __version__,
        "linear_attn_kernel": kernel.backend,
        "target": {"path": str(target_dir), "sha256": spec.weights_sha256(), "model_type": info["model_type"],
                   "num_layers": info["num_hidden_layers"], "hidden_size": info["hidden_size"],
                   "params": sum(p.numel() for p in model.parameters())},
        "context_tokens": context_tokens,
        "batch_size": 1,
        "repeats": repeats,
        "warmup": warmup,
        "statistic": "median",
        "formula": FORMULA,
        "decode_s": statistics.median(decode),
        "decode_samples_s": decode,
        "verify": verify,
        "drafters": drafters,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(result, indent=1))
    log.info("target costs on %s (%s, %s) -> %s", result["device_name"], result["device"], result["dtype"], out)
    return result


def _drafter_costs(drafter, embed, head, context_tokens, budgets, repeats, warmup, dev, dt) -> dict:
    """Median seconds of one block pass of ``drafter`` (chain), and with log-softmax + top-``budget`` (trees)."""
    import torch

    cfg = drafter.cfg
    B = cfg.block_size
    K = len(cfg.target_layer_ids)
    new_ctx = B  # context positions committed by the previous step (<= B), projected once per step
    hidden = torch.randn(1, context_tokens + new_ctx, K * cfg.hidden_size, dtype=dt, device=dev)
    positions = torch.arange(context_tokens + new_ctx, device=dev)[None]
    kv_old = drafter.context_kv(hidden[:, :context_tokens], positions[:, :context_tokens])
    block_ids = torch.full((1, B), cfg.mask_token_id, dtype=torch.long, device=dev)
    start = context_tokens + new_ctx
    block_pos = torch.arange(start, start + B, device=dev)[None]
    ctx_valid = torch.ones(1, start, dtype=torch.bool, device=dev)

    def block(topk: int):
        # the reference's draft KV cache grows by the committed positions' context K/V each step
        kv_new = drafter.context_kv(hidden[:, context_tokens:], positions[:, context_tokens:])
        kv = [(torch.cat([ko, kn], 2), torch.cat([vo, vn], 2)) for (ko, vo), (kn, vn) in zip(kv_old, kv_new)]
        emb = embed[block_ids] * cfg.input_embedding_scale
        h = drafter(emb, block_pos, kv, positions, ctx_valid)
        logits = drafter.logits(h[:, 1:], head)
        if topk:
            return torch.log_softmax(logits.float(), -1).topk(min(topk, logits.shape[-1]), -1)
        return logits.argmax(-1)

    chain = _timed(lambda _: block(0), lambda: None, repeats, warmup, dev)
    tree = {str(b): statistics.median(_timed(lambda _, b=b: block(int(b)), lambda: None, repeats, warmup, dev))
            for b in budgets}
    return {"draft_s": statistics.median(chain), "draft_samples_s": chain, "draft_tree_s": tree}


# --------------------------------------------------------------------------- estimate

def read_costs(path) -> dict:
    """Load a ``target_costs.json``.

    Raises:
        InputError: unreadable, or not a dflash-eval target-costs file of this version.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InputError(path, None, f"cannot read the target costs ({err})", "re-run the target_costs rule") from None
    if data.get("format") != FORMAT or data.get("format_version") != FORMAT_VERSION:
        raise InputError(path, "format", f"expected {FORMAT} v{FORMAT_VERSION}, got {data.get('format')} "
                         f"v{data.get('format_version')}", "re-run the target_costs rule")
    return data


def speedup(tau: float, t_decode: float, t_verify: float, t_draft: float) -> float:
    """``tau * t_decode / (t_verify + t_draft)`` (all times in seconds; NaN when a term is missing)."""
    if any(x is None or (isinstance(x, float) and math.isnan(x)) for x in (tau, t_decode, t_verify, t_draft)):
        return math.nan
    return tau * t_decode / (t_verify + t_draft)


def ddtree_budgets(frame) -> list[int]:
    """Budgets of the ``tau_ddtree_<budget>`` columns of a tau table, ascending (``[]`` when none)."""
    return sorted(int(c[len("tau_ddtree_"):]) for c in frame.columns
                  if c.startswith("tau_ddtree_") and c[len("tau_ddtree_"):].isdigit())


def speedup_frame(frame, costs: dict):
    """Estimated speedup per (checkpoint, prompt set, method).

    Args:
        frame: the tau table (:func:`dflash_eval.summary.summary_frame`): ``checkpoint``, ``step``,
            ``prompt_set``, ``block_size``, ``tau`` and any ``tau_ddtree_<budget>`` columns.
        costs: :func:`read_costs` output.

    Returns:
        DataFrame with ``checkpoint, step, prompt_set, method`` (``chain`` or ``ddtree_<budget>``),
        ``budget`` (nodes; NA for the chain), ``verify_tokens`` (n), ``tau``, ``t_verify_s``,
        ``t_draft_s``, ``t_decode_s``, ``speedup`` (NaN where a cost was not measured) and
        ``best`` (True on the fastest method per checkpoint and prompt set).
    """
    import pandas as pd

    verify = {(int(v["n"]), v["mask"]): float(v["median_s"]) for v in costs["verify"]}
    t_dec = float(costs["decode_s"])
    rows = []
    for r in frame.to_dict("records"):
        d = costs["drafters"].get(r["checkpoint"], {})
        methods = [("chain", None, int(r["block_size"]), "causal", r["tau"], d.get("draft_s"))]
        for b in ddtree_budgets(frame):
            methods.append((f"ddtree_{b}", b, b + 1, "tree", r[f"tau_ddtree_{b}"], d.get("draft_tree_s", {}).get(str(b))))
        for method, b, n, mask, tau, t_draft in methods:
            t_ver = verify.get((n, mask), math.nan)
            t_draft = math.nan if t_draft is None else float(t_draft)
            rows.append({"checkpoint": r["checkpoint"], "step": r["step"], "prompt_set": r["prompt_set"],
                         "method": method, "budget": b, "verify_tokens": n, "tau": tau, "t_verify_s": t_ver,
                         "t_draft_s": t_draft, "t_decode_s": t_dec,
                         "speedup": speedup(float(tau) if pd.notna(tau) else math.nan, t_dec, t_ver, t_draft)})
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    df["budget"] = df["budget"].astype("Int64")
    key = ["checkpoint", "prompt_set"]
    best = df.dropna(subset=["speedup"]).groupby(key)["speedup"].idxmax()
    df["best"] = df.index.isin(best.values)
    return df


def device_label(costs: dict) -> str:
    """e.g. ``"CPU (CPU: Intel Xeon ..., float32, 2 threads)"`` or ``"GPU (NVIDIA H200, bfloat16)"``."""
    if costs["device"] == "cuda":
        return f"GPU ({costs['device_name']}, {costs['dtype']})"
    return f"{costs['device'].upper()} ({costs['device_name']}, {costs['dtype']}, {costs['threads']} threads)"
