"""Train a LiLiCorr head on a frozen DFlash backbone (``python -m dflash_eval train-lilicorr``).

The objective is Model-Optimizer's (PR #2342, ``modelopt/torch/speculative/plugins/hf_lilicorr.py``
``_compute_lilicorr_loss`` and ``_distractor_penalty``, commit eea939b0) without its DFlash term: the backbone
here is frozen (``--init-from`` a stripped DFlash 1 or DFlash 2 folder, or a LiLiCorr folder to continue), so only
the head trains. Per block, with candidates the top-K of the backbone's logits (rank order) and ``g_j`` the rank
of the data token at slot j:

* the **teacher-forced walk**: slot 1 is scored by ``log_start``, slot j by the row of ``log_pair[j - 1]`` out of
  ``g_{j-1}`` (the data token's candidate), the serving walk's rows along the data path;
* supervised slots: those inside the *forced prefix* (the data token is a candidate at that slot and at every
  slot before it), in blocks whose every slot lies inside the sequence;
* ``loss = w_ce * CE + w_margin * hinge + w_pen * penalty``: the K-way cross-entropy of the row toward
  ``g_j``; ``relu(margin - (z_g - max_{c != g} z_c))``; and ``E_{softmax(row)}[relu(l(g) - l(c))]`` with ``l``
  the target's logits at the candidates (a candidate the target finds as likely as the data token costs
  nothing). Means over the supervised slots. Defaults: Model-Optimizer's ``base`` variant (0.25, 0, 0.25; the
  ``margin`` variant is 0.125 / 0.125 / 0.25 with margin 2).

Logged (``train_log.jsonl``): the loss and its terms, ``selected_prefix`` (the greedy walk's accepted prefix,
what the engines commit), ``top1_prefix`` (the backbone's chain), ``oracle_prefix`` and ``recall`` (the data
token among the candidates), as Model-Optimizer's ``_lattice_metrics``. Checkpoints ``step<N>.pt``
(``{"step", "draft_config", "model", "train_loss"}``, weights bf16) strip to the engines' layout with
:func:`dflash_eval.drafter.lilicorr_drafter.strip_lilicorr`; the last one is also written stripped
(``<out-dir>/stripped``).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash_eval.cache.extract import capture_layers, pad_right
from dflash_eval.core.errors import InputError, atomic_path
from dflash_eval.core.runtime import resolve_device
from dflash_eval.data.completions import read_completions
from dflash_eval.drafter.families.lilicorr import (
    GEOMETRY_FIELDS,
    LiLiCorrConfig,
    export_config,
    is_lilicorr,
    without_selector,
)
from dflash_eval.drafter.lilicorr_drafter import (
    PREFIX,
    LiLiCorrDrafter,
    anchor_rows,
    greedy_indices,
    lattice_inputs,
    load_lilicorr,
    prefix_length,
    save_lilicorr,
)
from dflash_eval.drafter.lilicorr_model import LiLiCorrHead
from dflash_eval.drafter.model import load_drafter
from dflash_eval.drafter.train import block_states, sample_anchors
from dflash_eval.target.model import load_target
from dflash_eval.target.spec import TargetSpec

log = logging.getLogger(__name__)


@dataclass
class LiLiCorrTrainConfig:
    """Trainer options: the head's geometry (written to the checkpoint), the objective's weights, the schedule
    (steps, seconds, lr per AdamW step)."""

    candidate_topk: int = 8
    hidden_size: int = 0  # 0 = the backbone's width
    num_layers: int = 2
    num_heads: int = 4
    mlp_ratio: float = 2.0
    factor_dim: int = 64
    vector_eps: float = 1e-4
    logit_scale: float = 8.0
    w_ce: float = 0.25
    w_margin: float = 0.0
    w_pen: float = 0.25
    margin: float = 2.0
    seqs_per_step: int = 8
    anchors: int = 16
    max_len: int = 640
    lr: float = 1e-3
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_steps: int = 1000
    time_budget_s: float = 0.0  # 0 = no limit; else stop (and save) when exceeded
    log_every: int = 20
    seed: int = 0
    init_from: str = ""


def lattice_loss(log_start: torch.Tensor, log_pair: torch.Tensor, candidates: torch.Tensor, labels: torch.Tensor,
                 block_ok: torch.Tensor, target_logits: torch.Tensor | None, w_ce: float, w_margin: float = 0.0,
                 w_pen: float = 0.0, margin: float = 2.0) -> tuple[torch.Tensor, dict]:
    """Model-Optimizer's LiLiCorr objective on the teacher-forced walk (module docstring).

    Args:
        log_start: ``[N, K]``, log_pair: ``[N, S - 1, K, K]`` float32 log-potentials.
        candidates: ``[N, S, K]`` int64 rank-ordered; labels: ``[N, S]`` int64 data tokens.
        block_ok: ``[N]`` bool, blocks whose every slot is a supervised position.
        target_logits: ``[N, S, K]`` the target's logits at the candidates (for the penalty; None when ``w_pen`` 0).
        w_ce, w_margin, w_pen, margin: the weights and the hinge width.

    Returns:
        ``(loss, stats)``: the scalar loss (0 with no supervised slot) and floats ``ce``, ``hinge``, ``penalty``,
        ``supervised`` (slots), ``selected_prefix``, ``top1_prefix``, ``oracle_prefix`` (means over ``block_ok``
        blocks) and ``recall`` (the data token among the candidates, over their slots).
    """
    _, slots, k = candidates.shape
    hit = candidates == labels[..., None]
    in_cand = hit.any(-1)
    gt = hit.long().argmax(-1)  # [N, S]; 0 where absent (those slots are not supervised)
    rows = [log_start]
    for j in range(1, slots):
        rows.append(log_pair[:, j - 1].gather(1, gt[:, j - 1, None, None].expand(-1, 1, k))[:, 0])
    node = torch.stack(rows, dim=1)  # [N, S, K]
    sup = (in_cand.long().cumprod(-1).bool() & block_ok[:, None]).float()
    denom = sup.sum().clamp_min(1.0)
    ce = -F.log_softmax(node, -1).gather(-1, gt[..., None])[..., 0]
    loss = w_ce * (ce * sup).sum() / denom
    z_gt = node.gather(-1, gt[..., None])[..., 0]
    runner_up = node.scatter(-1, gt[..., None], torch.finfo(node.dtype).min).amax(-1)
    hinge = (torch.relu(margin - (z_gt - runner_up)) * sup).sum() / denom
    if w_margin > 0:
        loss = loss + w_margin * hinge
    penalty = torch.zeros((), device=node.device)
    if w_pen > 0:
        if target_logits is None:
            raise ValueError("w_pen > 0 needs the target's logits at the candidates")
        tl = target_logits.detach().float()
        weight = (tl.gather(-1, gt[..., None]) - tl).clamp_min(0.0)
        penalty = ((F.softmax(node, -1) * weight).sum(-1) * sup).sum() / denom
        loss = loss + w_pen * penalty
    with torch.no_grad():
        picked = candidates.gather(2, greedy_indices(log_start, log_pair)[..., None])[..., 0]
        blocks = block_ok.float().sum().clamp_min(1.0)

        def mean(prefix):
            return float((prefix.float() * block_ok).sum() / blocks)

        stats = {"ce": float((ce * sup).sum() / denom), "hinge": float(hinge.detach()), "penalty": float(penalty.detach()),
                 "supervised": float(sup.sum()), "selected_prefix": mean(prefix_length(picked == labels)),
                 "top1_prefix": mean(prefix_length(candidates[..., 0] == labels)),
                 "oracle_prefix": mean(prefix_length(in_cand)),
                 "recall": float((in_cand & block_ok[:, None]).float().sum() / (blocks * slots))}
    return loss, stats


def initial_model(cfg: LiLiCorrTrainConfig) -> LiLiCorrDrafter:
    """The frozen backbone of ``cfg.init_from`` and a freshly initialised head of ``cfg``'s geometry (a LiLiCorr folder:
    its own backbone and head, the geometry options ignored).

    Raises:
        InputError: no ``init_from``, or as the loaders.
    """
    if not cfg.init_from:
        raise InputError(None, "--init-from", "a LiLiCorr head trains on a frozen backbone; none given",
                         "pass a stripped DFlash 1 or DFlash 2 drafter folder (dflash-eval strip-drafter)")
    folder = Path(cfg.init_from)
    raw = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    if is_lilicorr(raw):
        log.info("continuing the LiLiCorr drafter %s (its geometry; the geometry options are ignored)", folder)
        model = load_lilicorr(folder)
        if not model.geometry.hidden_size:  # written resolved: TensorRT-LLM refuses lilicorr_hidden_size 0
            model.geometry = replace(model.geometry, hidden_size=model.cfg.hidden_size, notes=())
        return model
    backbone = without_selector(load_drafter(folder))  # LiLiCorr drafts from the backbone's unary logits
    dcfg = {f"lilicorr_{name}": getattr(cfg, name) for name, _, _ in GEOMETRY_FIELDS}
    # 0 means the drafter's width in vLLM / SGLang; written resolved, since TensorRT-LLM refuses 0
    dcfg["lilicorr_hidden_size"] = dcfg["lilicorr_hidden_size"] or backbone.cfg.hidden_size
    geometry = LiLiCorrConfig.from_dict({"dflash_config": dcfg}, "train-lilicorr options", backbone.cfg.hidden_size)
    head = LiLiCorrHead(geometry, backbone.cfg.hidden_size, backbone.cfg.block_size,
                        backbone.cfg.rms_norm_eps).init_weights_()
    return LiLiCorrDrafter(backbone, head, geometry, backbone.cfg.raw)


def save_checkpoint(path: Path, model: LiLiCorrDrafter, step: int, loss: float, train_cfg: dict) -> Path:
    """``step<N>.pt``: ``{"step", "draft_config" (the engines' config.json), "model" (backbone + lilicorr.*, bf16),
    "train_loss"}``, atomically."""
    state = {k: v.detach().to(torch.bfloat16).cpu() for k, v in model.backbone.state_dict().items()}
    state.update({PREFIX + k: v.detach().to(torch.bfloat16).cpu() for k, v in model.head.state_dict().items()})
    cfg = export_config(model.config, model.geometry)
    cfg["dflash_config"]["training"] = {"trainer": "dflash_eval.drafter.train_lilicorr", **train_cfg}
    with atomic_path(path) as tmp:
        torch.save({"step": int(step), "draft_config": cfg, "model": state, "train_loss": float(loss)}, tmp)
    return Path(path)


def train_lilicorr(target_dir, data_path, out_dir, cfg: LiLiCorrTrainConfig, device: str = "auto") -> list[Path]:
    """Train the head (module docstring); returns the ``step<N>.pt`` paths written (the last also stripped to
    ``out_dir/stripped``).

    Raises:
        InputError: no sequence with a completion, no ``--init-from``, or as the loaders.
    """
    dev = resolve_device(device)
    torch.manual_seed(cfg.seed)
    rng, gen = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    rows = read_completions(Path(data_path))
    seqs = [(list(r["prompt_ids"]) + list(r["completion_ids"]))[: cfg.max_len] for r in rows]
    plens = [len(r["prompt_ids"]) for r in rows]
    keep = [i for i in range(len(seqs)) if len(seqs[i]) - 2 >= plens[i]]
    seqs, plens = [seqs[i] for i in keep], [plens[i] for i in keep]
    if not seqs:
        raise InputError(data_path, None, "no sequence has a completion to supervise", "generate longer completions")
    model = initial_model(cfg)
    model.to(device=dev)
    model.backbone.requires_grad_(False).eval()
    B = model.backbone.cfg.block_size
    spec = TargetSpec.read(target_dir)
    target, _tok, _kernel = load_target(spec, device=dev, dtype="bfloat16" if dev.type == "cuda" else "float32")
    target.requires_grad_(False)
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.get_output_embeddings().weight.detach()
    opt = torch.optim.AdamW(model.head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    amp = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    saved, order, step, loss_val = [], [], 0, math.nan
    train_cfg = asdict(cfg)
    t0 = time.perf_counter()
    with open(out_dir / "train_log.jsonl", "a") as logf:
        while step < cfg.max_steps:
            if len(order) < cfg.seqs_per_step:
                more = list(range(len(seqs)))
                rng.shuffle(more)
                order += more
            batch, order = order[: cfg.seqs_per_step], order[cfg.seqs_per_step:]
            ids, _ = pad_right([seqs[i] for i in batch], 0, dev)
            lens = torch.tensor([len(seqs[i]) for i in batch], device=dev)
            anchors, valid = sample_anchors(torch.tensor([plens[i] for i in batch]), lens.cpu(), cfg.anchors, gen,
                                            ids.shape[1])
            anchors, valid = anchors.to(dev), valid.to(dev)
            mask = (torch.arange(ids.shape[1], device=dev)[None] < lens[:, None]).long()
            elapsed = time.perf_counter() - t0
            prog = max((step + 1) / cfg.max_steps, elapsed / cfg.time_budget_s if cfg.time_budget_s else 0.0)
            for g in opt.param_groups:  # linear warmup, then cosine to 0.1 of the peak
                rest = min(1.0, max(0.0, (prog - cfg.warmup_frac) / max(1e-9, 1 - cfg.warmup_frac)))
                g["lr"] = cfg.lr * (min(1.0, prog / cfg.warmup_frac) if prog < cfg.warmup_frac
                                    else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * rest)))
            with torch.no_grad(), torch.autocast(dev.type, dtype=amp, enabled=amp != torch.float32):
                hidden, last = capture_layers(target, ids, mask, model.backbone.cfg.target_layer_ids)
                hidden = hidden.flatten(2)
                h, block_pos, row_seq = block_states(model.backbone, embed, hidden, ids, anchors, B)
                cand, log_probs, emb = lattice_inputs(model, h, lm_head, embed)
                anchor, anchor_ok = anchor_rows(model.backbone, hidden, block_pos[:, 0], row_seq)
                label_pos = block_pos[:, 1:].clamp(max=ids.shape[1] - 1)
                labels = ids[row_seq[:, None], label_pos]
                block_ok = valid.reshape(-1) & (block_pos[:, 1:] < lens[row_seq, None]).all(-1)
                t_rows = last[row_seq[:, None], (label_pos - 1)]  # the target row predicting each slot's token
                target_logits = (t_rows[:, :, None, :].float() * lm_head[cand].float()).sum(-1)
            with torch.autocast(dev.type, dtype=amp, enabled=amp != torch.float32):
                start, pair = model.head(emb, log_probs, h, anchor, anchor_ok)
                log_start, log_pair = model.head.log_factors(start, pair)
            loss, stats = lattice_loss(log_start, log_pair, cand, labels, block_ok, target_logits, cfg.w_ce,
                                       cfg.w_margin, cfg.w_pen, cfg.margin)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.head.parameters(), cfg.grad_clip)
            opt.step()
            step += 1
            loss_val = float(loss.detach())
            elapsed = time.perf_counter() - t0
            if step == 1 or step % cfg.log_every == 0:
                rec = {"step": step, "loss": loss_val, "lr": opt.param_groups[0]["lr"], "grad_norm": float(gnorm),
                       **stats, "elapsed_s": round(elapsed, 1)}
                logf.write(json.dumps(rec) + "\n")
                logf.flush()
                log.info("step %d loss %.4f selected %.3f top1 %.3f oracle %.3f %.0fs", step, loss_val,
                         stats["selected_prefix"], stats["top1_prefix"], stats["oracle_prefix"], elapsed)
            over = bool(cfg.time_budget_s) and elapsed >= cfg.time_budget_s
            if over or step == cfg.max_steps:
                saved.append(save_checkpoint(out_dir / f"step{step}.pt", model, step, loss_val, train_cfg))
                break
    save_lilicorr(model, out_dir / "stripped", {"source": str(saved[-1]), "format": "train_lilicorr", "step": step,
                                                "notes": list(model.geometry.notes)})
    return saved


#: ``--help`` of each trainer option beyond the head's geometry (units; Model-Optimizer's ``base`` loss weights)
OPTION_HELP = {
    "w_ce": "weight of the K-way cross-entropy toward the data token's candidate",
    "w_margin": "weight of the hinge relu(margin - (z_data - max other z))",
    "w_pen": "weight of the target-weighted distractor penalty",
    "margin": "hinge margin, in score units (logit_scale x cosine)",
    "lr": "peak AdamW learning rate: linear warmup over the first 4 %% of the run, then cosine to 10 %% of the peak; "
          "the run's progress is the larger of step / max_steps and elapsed / time_budget_s",
    "time_budget_s": "seconds of training: with --max-steps it sets the schedule's progress; then save and stop "
                     "(0: no limit)",
    "seqs_per_step": "completions per step (each runs the target and the frozen backbone once)",
    "anchors": "random anchors (draft blocks) per completion per step",
    "max_len": "tokens per completion at most (prompt + response, cut at the end)",
    "max_steps": "optimizer steps at most",
    "log_every": "steps between train_log.jsonl lines",
    "seed": "seed of the batches, anchors and the head's initialisation",
}
GEOMETRY_HELP = {
    "candidate_topk": "K: candidates per slot, the backbone's top-K (SGLang and vLLM serve K <= 16)",
    "hidden_size": "head width (0: the backbone's; written resolved, as TensorRT-LLM refuses 0)",
    "num_layers": "lattice transformer layers",
    "num_heads": "attention heads (must divide the width)",
    "mlp_ratio": "MLP width / head width",
    "factor_dim": "width of the start/pair factor vectors",
    "vector_eps": "L2-normalisation epsilon of the factor vectors",
    "logit_scale": "multiplier of the cosine scores (the walk's log-potentials)",
}


def add_arguments(p) -> None:
    """``python -m dflash_eval train-lilicorr``: the LiLiCorr head trainer (not a workflow stage); every option
    shows its default (:class:`LiLiCorrTrainConfig`)."""
    p.add_argument("--target", required=True, help="target HF folder")
    p.add_argument("--data", required=True, help="completions JSONL (prompt_ids + completion_ids) generated by the target")
    p.add_argument("--init-from", required=True,
                   help="stripped DFlash 1 / DFlash 2 drafter folder (the frozen backbone), or a LiLiCorr folder")
    p.add_argument("--out-dir", required=True, help="folder for step<N>.pt, train_log.jsonl and stripped/")
    d = LiLiCorrTrainConfig()
    for name, kind, _ in GEOMETRY_FIELDS:
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=getattr(d, name),
                       help=f"{GEOMETRY_HELP[name]}; written as dflash_config.lilicorr_{name} (default %(default)s)")
    for name in ("w_ce", "w_margin", "w_pen", "margin", "lr", "time_budget_s"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name),
                       help=f"{OPTION_HELP[name]} (default %(default)s)")
    for name in ("seqs_per_step", "anchors", "max_len", "max_steps", "log_every", "seed"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name),
                       help=f"{OPTION_HELP[name]} (default %(default)s)")
    p.add_argument("--device", default="auto", help="torch device ('auto' = cuda if available, else cpu)")


def main(args, opts) -> None:
    names = [n for n, _, _ in GEOMETRY_FIELDS] + ["w_ce", "w_margin", "w_pen", "margin", "lr", "time_budget_s",
                                                   "seqs_per_step", "anchors", "max_len", "max_steps", "log_every",
                                                   "seed"]
    cfg = LiLiCorrTrainConfig(init_from=args.init_from, **{n: getattr(args, n) for n in names})
    if min(cfg.seqs_per_step, cfg.anchors, cfg.max_steps, cfg.log_every, cfg.max_len - 1) < 1:
        raise InputError(None, "train-lilicorr", "sequences per step, anchors, max steps, log every >= 1 and max length "
                         ">= 2 are required", "fix the flags")
    train_lilicorr(args.target, args.data, args.out_dir, cfg, device=args.device)
