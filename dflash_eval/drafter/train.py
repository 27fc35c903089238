"""A compact DFlash trainer (for the demo drafters of the SmolLM2 target).

Recipe (SpecForge ``OnlineDFlashModel`` after PR #473, the z-lab paper):

* Data: responses regenerated greedily by the target (prompt + completion token ids); only
  completion tokens are supervised. The target runs online each step (no grad) and its
  hidden states at ``target_layer_ids`` feed the drafter (HF ``hidden_states[i+1]``).
* Per sequence, ``anchors`` random anchor positions ``a`` (without replacement) among positions
  whose next token is a completion token, ``a in [P, T-2]`` — the positions an online decode
  uses as the last committed token.
* Each anchor gets one block ``[x[a], MASK x (B-1)]`` at positions ``a .. a+B-1``; the context is
  every position strictly before ``a``; attention within the block is bidirectional; blocks
  never see each other (one row per block).
* Same-position labels: slot ``k`` predicts ``x[a+k]`` for ``k = 1..B-1`` (slot 0 unscored),
  cross-entropy weighted by ``exp(-(k-1)/gamma)`` (gamma 7 for B=16, 5 for B=10, 4 for B=8),
  normalised by the weight sum.
* AdamW, linear warmup then cosine decay, grad clip 1.0; bf16 activations (autocast) over fp32
  master weights on GPU; checkpoints are written with bf16 weights.

**DFlash 2** (``variant='dflash2'``, ``--variant dflash2``; the public recipes: speculators PR #1006
``src/speculators/models/dflash2/{core,metrics,model_definitions}.py``, SpecForge PR #772): the same
backbone, blocks and unary loss, plus

* the grouped dynamic causal convs, identity-initialised (``base_kernel[:, 0] = 1``, the rest and
  ``kernel_projection`` zero: the drafter starts as its DFlash 1 backbone) and trained with it;
* the candidate selector (codebooks and ``hidden_projection`` ~ N(0, 0.02)), trained on the
  **teacher-forced path**: slot ``k``'s predecessor is the data token ``x[a+k-1]`` (the anchor for slot 1),
  its candidates are the unary top-``selector_top_k`` of the slot's logits, and the loss is the K-way
  cross-entropy of the selector scores (:meth:`~dflash_eval.drafter.model.CandidateSelector.teacher_forced_scores`)
  with the label's rank as the class. When the label is not among the top-K it replaces the K-th
  candidate in the loss only (speculators ``selector_training_candidates``; SpecForge PR #772 "insert the gold
  token when it is missing"). Same slot weights ``exp(-(k-1)/gamma)`` and mask as the unary loss; the
  total is ``unary + selector_loss_alpha * selector`` (both recipes' default alpha 1.0), gradients flowing
  into the backbone too (SpecForge PR #772's default; PR #793 made a stop-gradient optional).
* logged metrics (every ``log_every`` steps, ``train_log.jsonl``): ``candidate_recall_at_k`` (the label is
  among the strict unary top-K: speculators ``unary_candidate_recall_at_K``), ``selector_acc`` (the
  teacher-forced selector argmax over those candidates is the label: ``teacher_forced_selector_acc``),
  ``tau_proxy`` (the selector's own greedy path, self-conditioned, as the replay and the engines walk
  it: ``self_conditioned_path_accepted_length``), ``tau_proxy_unary`` (the per-slot argmax) and
  ``tau_proxy_oracle`` (the prefix whose labels are all candidates: ``unary_top_K_oracle_accepted_length``),
  ``unary_loss`` and ``selector_loss``.

Training checkpoints (``step<N>.pt``) are written by :func:`dflash_eval.drafter.demo.save_training_checkpoint`
(the layout ``dflash-eval strip`` reads, documented there), with ``train_loss`` added.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash_eval.cache.extract import capture_layers, pad_right
from dflash_eval.core.errors import InputError
from dflash_eval.core.runtime import resolve_device
from dflash_eval.data.completions import read_completions
from dflash_eval.data.prompts import build_prompt_set, write_prompts
from dflash_eval.drafter.config import DrafterConfig
from dflash_eval.drafter.demo import (
    DEMO_FAMILIES,
    DFLASH2_DEMO_FIELDS,
    drafter_config_for_target,
    identity_convs_,
    pick_mask_token,
    random_init_,
    save_training_checkpoint,
)
from dflash_eval.drafter.families import family_of
from dflash_eval.drafter.model import DFlashDrafter
from dflash_eval.target.model import load_target
from dflash_eval.target.spec import TargetSpec

log = logging.getLogger(__name__)

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
#: DFlash 2 entries of a ``train_log.jsonl`` line (:func:`selector_loss`; ``tau_proxy`` is then the selector path's)
DFLASH2_LOG_KEYS = ("unary_loss", "selector_loss", "candidate_recall_at_k", "selector_acc", "tau_proxy_unary",
                    "tau_proxy_oracle")


@dataclass
class TrainConfig:
    """Trainer options (units: steps, seconds; lr per AdamW step)."""

    block_size: int = 16
    num_layers: int = 1
    intermediate_size: int | None = None  # default: the target's
    target_layer_ids: list[int] | None = None  # default: 5 layers spread over the target
    mask_token_id: int | None = None  # default: pick_mask_token()
    seqs_per_step: int = 32
    anchors: int = 32
    max_len: int = 640
    lr: float = 6e-4
    warmup_frac: float = 0.04
    min_lr_frac: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    gamma: float | None = None
    max_steps: int = 1000
    time_budget_s: float = 0.0  # 0 = no limit; else stop (and save) when exceeded
    max_wall_s: float = 0.0  # 0 = none; else stop (and save) when exceeded, without steering the lr schedule
    save_steps: list[int] = field(default_factory=list)  # extra checkpoints
    save_fracs: list[float] = field(default_factory=list)  # extra checkpoints at fractions of max_steps/budget
    log_every: int = 50
    seed: int = 0
    init_from: str | None = None  # training checkpoint to start from (weights only)
    linear_attn_backend: str = "auto"  # GDN kernel of hybrid targets (dflash_eval.target.hybrid); recorded in the log
    variant: str = "dflash"  # or "dflash2": convs + candidate selector (module docstring)
    conv_kernel_size: int | None = None  # DFlash 2; None = DFLASH2_DEMO_FIELDS (capped by drafter_config_for_target)
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    selector_loss_alpha: float = 1.0


def sample_anchors(prompt_lens: torch.Tensor, lens: torch.Tensor, n: int, gen: torch.Generator, L: int):
    """Random anchors per sequence among positions ``[P, T-2]``.

    Returns ``(anchors [b, n] int64, valid [b, n] bool)``; sequences with fewer than ``n``
    candidates get invalid (zero-weight) rows.
    """
    b = len(lens)
    pos = torch.arange(L)
    ok = (pos[None] >= prompt_lens[:, None]) & (pos[None] <= lens[:, None] - 2)
    scores = torch.rand(b, L, generator=gen).masked_fill(~ok, -1.0)
    k = min(n, L)
    top = scores.topk(k, dim=1)
    return top.indices, top.values >= 0


def block_logits(drafter, embed, head, hidden, ids, anchors, block_size):
    """The training pass's draft logits (:func:`block_states` through :meth:`~dflash_eval.drafter.model.DFlashDrafter.logits`).

    Returns:
        ``(logits, block_pos, row_seq)``: ``[b*A, B-1, V]`` logits of slots 1..B-1 (compute dtype), and the
        block positions and sequence of :func:`block_states`.
    """
    h, block_pos, row_seq = block_states(drafter, embed, hidden, ids, anchors, block_size)
    return drafter.logits(h, head), block_pos, row_seq


def block_states(drafter, embed, hidden, ids, anchors, block_size):
    """The training pass's drafter states: one block per anchor, built and read out exactly as the replay does.

    Blocks come from :meth:`~dflash_eval.drafter.model.DFlashDrafter.make_block` (``input_embedding_scale``
    applied) and logits from :meth:`~dflash_eval.drafter.model.DFlashDrafter.logits` (``output_multiplier``
    and the tanh softcap applied), the same two calls as :mod:`dflash_eval.replay.anchors`, so the trainer
    optimises the model the evaluation measures.

    Args:
        hidden: ``[b, L, K*H]`` target states; ids ``[b, L]`` int64; anchors ``[b, A]`` int64 (block starts).

    Returns:
        ``(h, block_pos, row_seq)``: ``[b*A, B-1, H]`` final-normed states of slots 1..B-1 (compute dtype),
        ``[b*A, B]`` absolute positions of each block, ``[b*A]`` the sequence of each block.
    """
    b, L = ids.shape
    A = anchors.shape[1]
    dev = ids.device
    B = block_size
    pos = torch.arange(L, device=dev)
    ctx_kv = drafter.context_kv(hidden, pos[None].expand(b, -1))
    row_seq = torch.arange(b, device=dev).repeat_interleave(A)
    a = anchors.reshape(-1)
    kv = [(k[row_seq], v[row_seq]) for k, v in ctx_kv]
    ctx_valid = pos[None] < a[:, None]
    slot = torch.arange(B, device=dev)
    block_pos = a[:, None] + slot[None]
    h = drafter(drafter.make_block(ids[row_seq, a], embed, B), block_pos, kv, pos[None].expand(len(a), -1), ctx_valid)
    return h[:, 1:], block_pos, row_seq


def block_loss(drafter, embed, head, hidden, ids, lens, anchors, valid, block_size, gamma, selector_alpha=1.0,
               selector_stats=True):
    """Weighted same-position CE over all blocks (logits of :func:`block_logits`); DFlash 2 adds the selector's.

    Args:
        hidden: ``[b, L, K*H]`` target states; ids ``[b, L]``; lens ``[b]``;
        anchors/valid: ``[b, A]`` from :func:`sample_anchors`; selector_alpha: weight of the selector
        loss (DFlash 2 only, :func:`selector_loss`); selector_stats: DFlash 2, compute the selector's metrics
        (the trainer asks only at its logging steps: they walk the selector path).

    Returns:
        ``(loss, stats)`` with per-slot teacher-forced accuracy ``acc`` (unary argmax) and the cumprod-based
        acceptance proxy ``tau_proxy`` (mean a+1 over blocks, SpecForge ``compute_accept_len``); DFlash 2:
        ``tau_proxy`` is the selector's own path's and the stats of :func:`selector_loss` are added.
    """
    L = ids.shape[1]
    dev = ids.device
    slot = torch.arange(block_size, device=dev)
    h, block_pos, row_seq = block_states(drafter, embed, hidden, ids, anchors, block_size)
    logits = drafter.logits(h, head)
    label_pos = block_pos[:, 1:]
    in_seq = label_pos < lens[row_seq, None]
    labels = ids[row_seq[:, None], label_pos.clamp(max=L - 1)]
    w = torch.exp(-(slot[1:].float() - 1) / gamma)[None].expand(len(row_seq), -1)
    mask = in_seq & valid.reshape(-1)[:, None]
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view_as(w)
    wm = w * mask
    loss = (ce * wm).sum() / wm.sum().clamp(min=1e-6)
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & mask
        acc = (correct.float().sum(0) / mask.float().sum(0).clamp(min=1)).tolist()
        stats = {"acc": acc, "tau_proxy": _accept_proxy(correct, mask)}
    if "selector" in drafter.family.parts:
        sel, sel_stats = selector_loss(drafter.candidate_selector, h, logits, ids[row_seq, block_pos[:, 0]], labels,
                                       wm, selector_stats)
        if selector_stats:
            stats.update(sel_stats, unary_loss=float(loss.detach()), tau_proxy_unary=stats["tau_proxy"],
                         tau_proxy=sel_stats["tau_proxy"])
        loss = loss + selector_alpha * sel
    return loss, stats


def _accept_proxy(correct: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean ``accepted + 1`` over blocks with a scored slot 1: ``correct``/``mask`` ``[N, S]`` bool, the accepted
    prefix cut at the end of the sequence (masked slots neither accept nor stop it)."""
    rows = mask[:, 0]
    accept = (correct | ~mask).long().cumprod(-1) * mask
    return float((accept.sum(-1)[rows].float() + 1).mean()) if rows.any() else float("nan")


def selector_loss(selector, hidden, logits, anchor_ids, labels, weights, with_stats: bool = True):
    """DFlash 2 selector objective on the teacher-forced path over the drafter's top-K (module docstring).

    Args:
        selector: :class:`~dflash_eval.drafter.model.CandidateSelector` (``top_k`` = K).
        hidden: ``[N, S, H]`` drafter states of slots 1..S; logits ``[N, S, V]`` their logits.
        anchor_ids: ``[N]`` int64, the anchor token of each block (slot 1's predecessor).
        labels: ``[N, S]`` int64, the data token of each slot (slot ``k``'s predecessor is ``labels[:, k-2]``).
        weights: ``[N, S]`` float, slot weight times the scored-slot mask (0 = unscored).
        with_stats: False: only the loss (``stats`` empty).

    Returns:
        ``(loss, stats)``: the weighted mean K-way CE (scalar, normalised by the weight sum as the unary loss),
        and ``{"selector_loss", "candidate_recall_at_k", "selector_acc", "tau_proxy", "tau_proxy_oracle"}``
        (floats; rates over scored slots, ``tau_proxy`` of the selector's self-conditioned greedy path,
        ``tau_proxy_oracle`` of the longest prefix whose labels are all candidates).
    """
    K = selector.top_k
    mask = weights > 0
    predecessors = torch.cat([anchor_ids[:, None], labels[:, :-1]], dim=1)
    with torch.no_grad():
        cand = logits.topk(K, dim=-1).indices  # [N, S, K], strict serving candidates
        hit = cand == labels[..., None]
        in_cand = hit.any(-1)
        target = torch.where(in_cand, hit.long().argmax(-1), torch.full_like(labels, K - 1))
        train_cand = cand.clone()
        train_cand[..., -1] = torch.where(in_cand, cand[..., -1], labels)  # the label replaces the K-th if missing
    scores = selector.teacher_forced_scores(hidden, logits, predecessors, train_cand)
    ce = F.cross_entropy(scores.reshape(-1, K), target.reshape(-1), reduction="none").view_as(weights)
    loss = (ce * weights).sum() / weights.sum().clamp(min=1e-6)
    if not with_stats:
        return loss, {}
    with torch.no_grad():
        n = mask.float().sum().clamp(min=1)
        strict = selector.teacher_forced_scores(hidden, logits, predecessors, cand)
        picked = cand.gather(-1, strict.argmax(-1, keepdim=True))[..., 0]
        path = selector(hidden, logits, anchor_ids).path  # greedy, each slot after the selector's own pick
        stats = {"selector_loss": float(loss), "candidate_recall_at_k": float((in_cand & mask).float().sum() / n),
                 "selector_acc": float(((picked == labels) & mask).float().sum() / n),
                 "tau_proxy": _accept_proxy((path == labels) & mask, mask),
                 "tau_proxy_oracle": _accept_proxy(in_cand & mask, mask)}
    return loss, stats


def train(
    target_dir,
    data_path,
    out_dir,
    cfg: TrainConfig,
    device: str = "auto",
) -> list[Path]:
    """Train a drafter on target-generated completions and write training checkpoints.

    Args:
        target_dir: HF target folder.
        data_path: completions JSONL (``prompt_ids``, ``completion_ids``) from the completions stage.
        out_dir: folder for ``step<N>.pt`` checkpoints and ``train_log.jsonl``.
        cfg: :class:`TrainConfig`.

    Returns:
        the checkpoint paths written (early/middle/... and final).
    """
    dev = resolve_device(device)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = read_completions(Path(data_path))
    seqs = [(list(r["prompt_ids"]) + list(r["completion_ids"]))[: cfg.max_len] for r in rows]
    plens = [len(r["prompt_ids"]) for r in rows]
    keep = [i for i in range(len(seqs)) if len(seqs[i]) - 2 >= plens[i]]
    seqs, plens = [seqs[i] for i in keep], [plens[i] for i in keep]
    if not seqs:
        raise InputError(data_path, None, "no sequence has a completion to supervise", "generate longer completions")

    amp_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    spec = TargetSpec.read(target_dir)
    target, tok, kernel = load_target(spec, device=dev, dtype="bfloat16" if dev.type == "cuda" else "float32",
                                      backend=cfg.linear_attn_backend)
    log.info("target linear-attention kernel: %s", kernel.describe())
    target.requires_grad_(False)
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else pick_mask_token(tok, seqs)
    dcfg = drafter_config_for_target(spec, cfg.target_layer_ids, cfg.block_size, cfg.num_layers, mask_id, cfg.variant)
    if cfg.intermediate_size:
        dcfg["intermediate_size"] = cfg.intermediate_size
    family = family_of(cfg.variant)  # its fields from the flags over its defaults (DFlash 2: DFLASH2_DEMO_FIELDS)
    dcfg["dflash_config"].update(family.demo_fields(spec.hidden_size, spec.vocab_size,
                                                    {k: getattr(cfg, k) for k in family.config_fields}))
    dcfg["dflash_config"]["training"] = {"trainer": "dflash_eval.drafter.train", **{k: v for k, v in asdict(cfg).items() if k not in ("save_steps", "save_fracs")}}
    drafter = identity_convs_(random_init_(DFlashDrafter(DrafterConfig.from_dict(dcfg, source="dflash-eval train")))).to(dev)
    with torch.no_grad():
        # the drafter's states go through the target's LM head: start from the target's final-norm scale
        drafter.norm.weight.copy_(target.get_decoder().norm.weight.float())
        if cfg.init_from:
            init = torch.load(cfg.init_from, map_location="cpu", weights_only=True)["model"]
            drafter.load_state_dict({k: v for k, v in init.items() if k not in ("embed_tokens.weight", "lm_head.weight")})
            log.info("initialised from %s", cfg.init_from)
    embed = target.get_input_embeddings().weight.detach()
    head = target.get_output_embeddings().weight.detach()
    gamma = cfg.gamma or DEFAULT_GAMMA.get(cfg.block_size, 7.0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    def lr_at(step, elapsed=0.0):
        """Linear warmup over ``warmup_frac`` of the run, then cosine to ``min_lr_frac``.

        Progress is measured in steps or, with a time budget, in seconds — whichever is further.
        (The shipped demo drafters were trained before this was time-aware: their warmup spanned
        4,000 steps, i.e. the whole 3,507-step run; see demo/drafters/PROVENANCE.md.)
        """
        prog = (step + 1) / cfg.max_steps
        if cfg.time_budget_s:
            prog = max(prog, elapsed / cfg.time_budget_s)
        prog = min(1.0, prog)
        if prog < cfg.warmup_frac:
            return cfg.lr * max(prog / cfg.warmup_frac, 1.0 / cfg.max_steps)
        rest = (prog - cfg.warmup_frac) / max(1e-9, 1 - cfg.warmup_frac)
        return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * rest)))

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    saved: list[Path] = []
    save_steps = set(cfg.save_steps) | ({max(1, int(f * cfg.max_steps)) for f in cfg.save_fracs} if not cfg.time_budget_s else set())
    budget_marks = sorted(cfg.save_fracs) if cfg.time_budget_s else []
    order: list[int] = []
    t0 = time.perf_counter()
    logf = open(out_dir / "train_log.jsonl", "a")
    log.info("training: %d sequences, %d drafter params, mask token %d, gamma %.1f, %s", len(seqs),
             sum(p.numel() for p in drafter.parameters()), mask_id, gamma, dev)
    step = 0
    loss_val = float("nan")
    while step < cfg.max_steps:
        if len(order) < cfg.seqs_per_step:
            more = list(range(len(seqs)))
            rng.shuffle(more)
            order += more
        batch, order = order[: cfg.seqs_per_step], order[cfg.seqs_per_step :]
        ids, _ = pad_right([seqs[i] for i in batch], 0, dev)
        lens = torch.tensor([len(seqs[i]) for i in batch], device=dev)
        pl = torch.tensor([plens[i] for i in batch])
        anchors, valid = sample_anchors(pl, lens.cpu(), cfg.anchors, gen, ids.shape[1])
        mask = (torch.arange(ids.shape[1], device=dev)[None] < lens[:, None]).long()
        with torch.no_grad():
            hidden, _ = capture_layers(target, ids, mask, drafter.cfg.target_layer_ids)
        hidden = hidden.flatten(2)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, time.perf_counter() - t0)
        with torch.autocast(dev.type, dtype=amp_dtype, enabled=amp_dtype != torch.float32):
            logged = step + 1 == 1 or (step + 1) % cfg.log_every == 0
            loss, stats = block_loss(drafter, embed, head, hidden, ids, lens, anchors.to(dev), valid.to(dev),
                                     cfg.block_size, gamma, cfg.selector_loss_alpha, selector_stats=logged)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        loss_val = float(loss)
        elapsed = time.perf_counter() - t0
        if step == 1 or step % cfg.log_every == 0:
            rec = {"step": step, "loss": loss_val, "lr": opt.param_groups[0]["lr"], "grad_norm": float(gnorm),
                   "tau_proxy": stats["tau_proxy"], "acc_slot1": stats["acc"][0],
                   "acc_slot2": stats["acc"][1] if len(stats["acc"]) > 1 else None, "elapsed_s": round(elapsed, 1)}
            rec.update({k: stats[k] for k in DFLASH2_LOG_KEYS if k in stats})
            logf.write(json.dumps(rec) + "\n")
            logf.flush()
            log.info("step %d loss %.4f tau_proxy %.3f acc1 %.3f%s %.0fs", step, loss_val, stats["tau_proxy"],
                     stats["acc"][0], "".join(f" {k} {stats[k]:.3f}" for k in DFLASH2_LOG_KEYS if k in stats), elapsed)
        over_budget = (cfg.time_budget_s and elapsed >= cfg.time_budget_s) or (cfg.max_wall_s and elapsed >= cfg.max_wall_s)
        due = step in save_steps
        while budget_marks and elapsed >= budget_marks[0] * cfg.time_budget_s:
            budget_marks.pop(0)
            due = True
        if due or over_budget or step == cfg.max_steps:
            saved.append(save_training_checkpoint(out_dir / f"step{step}.pt", drafter, dcfg, opt.state_dict(), embed, head,
                                                  step, train_loss=loss_val))
            log.info("saved %s (step %d, loss %.4f)", saved[-1], step, loss_val)
        if over_budget:
            log.info("time limit %.0f s reached at step %d", min(x for x in (cfg.time_budget_s, cfg.max_wall_s) if x), step)
            break
    logf.close()
    return saved


def build_train_prompts(tokenizer_dir, out, holdout_n: int = 128, seed: int = 0, eval_max_prompt_tokens: int = 1024,
                        max_prompt_tokens: int = 256, limit: int = 0, enable_thinking: bool = False) -> dict:
    """ShareGPT first user turns for drafter training, with every possible eval prompt held out by id.

    The demo evaluates ``build_prompt_set("sharegpt", n, seed, max_prompt_tokens=eval_max_prompt_tokens)``
    for some ``n <= holdout_n``; that selection is a prefix of the one with ``n = holdout_n``, so
    holding those ids out covers it. HumanEval is a different source and never used for training.

    Returns:
        ``{"n_train", "n_holdout", "holdout_ids"}``; writes the training prompts JSONL to ``out``.
    """
    held = build_prompt_set("sharegpt", tokenizer_dir, n=holdout_n, seed=seed, max_prompt_tokens=eval_max_prompt_tokens,
                            enable_thinking=enable_thinking)
    held_ids = {r["id"] for r in held}
    rows = build_prompt_set("sharegpt", tokenizer_dir, n=0, seed=seed + 1, max_prompt_tokens=max_prompt_tokens,
                            enable_thinking=enable_thinking)
    rows = [r for r in rows if r["id"] not in held_ids]
    if limit:
        rows = rows[:limit]
    write_prompts(rows, out)
    log.info("training prompts: %d (held out %d eval candidates) -> %s", len(rows), len(held_ids), out)
    return {"n_train": len(rows), "n_holdout": len(held_ids), "holdout_ids": sorted(held_ids)}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x != ""]


def add_arguments(p) -> None:
    """``python -m dflash_eval train``: the demo-drafter trainer (not a workflow stage)."""
    p.add_argument("--target", required=True, help="target HF folder")
    p.add_argument("--data", required=True, help="completions JSONL (prompt_ids + completion_ids) generated by the target")
    p.add_argument("--out-dir", required=True, help="folder for step<N>.pt training checkpoints + train_log.jsonl")
    p.add_argument("--block-size", type=int, default=16, help="block size B (>= 2)")
    p.add_argument("--num-layers", type=int, default=1, help="draft decoder layers")
    p.add_argument("--intermediate-size", type=int, default=0, help="draft MLP width (0 = the target's)")
    p.add_argument("--layer-ids", type=_ints, default=None, help="target_layer_ids (default: 5 spread over the target)")
    p.add_argument("--mask-token-id", type=int, default=None, help="default: an unused special token of the tokenizer")
    p.add_argument("--seqs-per-step", type=int, default=32, help="sequences per optimizer step")
    p.add_argument("--anchors", type=int, default=32, help="anchor blocks per sequence")
    p.add_argument("--max-len", type=int, default=640, help="tokens per training sequence (prompt + completion, truncated)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate")
    p.add_argument("--max-steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--time-budget-s", type=float, default=0.0, help="stop and save when exceeded (seconds; 0 = none)")
    p.add_argument("--max-wall-s", type=float, default=0.0,
                   help="safety stop: stop and save when exceeded (seconds; 0 = none); unlike --time-budget-s it does "
                        "not set the lr schedule, so runs with the same --max-steps share it")
    p.add_argument("--save-steps", type=_ints, default=[], help="comma-separated extra checkpoint steps")
    p.add_argument("--save-fracs", type=lambda t: [float(x) for x in t.split(",") if x], default=[],
                   help="extra checkpoints at these fractions of the time budget (or of max-steps without one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50, help="steps between train_log.jsonl lines (and the first step)")
    p.add_argument("--init-from", default=None, help="training checkpoint (.pt) to start from")
    p.add_argument("--device", default="auto", help="torch device ('auto' = cuda if available, else cpu)")
    p.add_argument("--variant", choices=DEMO_FAMILIES, default=DEMO_FAMILIES[0],
                   help="dflash2: add the grouped dynamic causal convs and the candidate selector, trained with the "
                        "selector loss (speculators PR #1006, SpecForge PR #772; dflash_eval.drafter.train docstring)")
    d2 = DFLASH2_DEMO_FIELDS
    p.add_argument("--conv-kernel-size", type=int, default=d2["conv_kernel_size"], help="DFlash 2 conv taps")
    p.add_argument("--conv-group-size", type=int, default=d2["conv_group_size"],
                   help="DFlash 2 conv channels per dynamic-kernel group (must divide the hidden size)")
    p.add_argument("--selector-rank", type=int, default=d2["selector_rank"],
                   help="DFlash 2 selector rank r (capped at the hidden size); the codebooks hold 2 x vocab x r weights")
    p.add_argument("--selector-top-k", type=int, default=d2["selector_top_k"],
                   help="DFlash 2 candidates per slot K (capped at the vocabulary)")
    p.add_argument("--selector-loss-alpha", type=float, default=1.0,
                   help="DFlash 2: loss = unary + alpha x selector (K-way CE on the teacher-forced path)")


def main(args, opts) -> None:
    if args.block_size < 2 or args.num_layers < 1 or min(args.seqs_per_step, args.anchors, args.max_len - 1,
                                                          args.max_steps, args.log_every) < 1:
        raise InputError(None, "train", "block size >= 2, and layers, sequences per step, anchors, max steps, log every >= 1, "
                         "max length >= 2 are required", "fix the flags")
    d2 = (args.conv_kernel_size, args.conv_group_size, args.selector_rank, args.selector_top_k)
    if family_of(args.variant).config_fields and min(d2) < 1:
        raise InputError(None, "train", f"conv kernel size, conv group size, selector rank and top-K must be >= 1, got {d2}",
                         "fix the --conv-* / --selector-* flags")
    train(args.target, args.data, args.out_dir, TrainConfig(
        block_size=args.block_size, num_layers=args.num_layers, intermediate_size=args.intermediate_size or None,
        target_layer_ids=args.layer_ids, mask_token_id=args.mask_token_id, seqs_per_step=args.seqs_per_step,
        anchors=args.anchors, max_len=args.max_len, lr=args.lr, max_steps=args.max_steps,
        time_budget_s=args.time_budget_s, save_steps=args.save_steps, save_fracs=args.save_fracs, seed=args.seed,
        log_every=args.log_every, max_wall_s=args.max_wall_s,
        init_from=args.init_from, variant=args.variant, conv_kernel_size=args.conv_kernel_size,
        conv_group_size=args.conv_group_size, selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
        selector_loss_alpha=args.selector_loss_alpha), device=args.device)
