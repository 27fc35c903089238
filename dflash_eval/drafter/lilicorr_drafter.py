"""A LiLiCorr drafter in torch: its checkpoint layout, the path through its lattice, one block's drafts.

The family, the strict geometry and the algorithm with its sources: :mod:`dflash_eval.drafter.families.lilicorr`;
the head: :mod:`dflash_eval.drafter.lilicorr_model`.

* Layout (:func:`load_lilicorr`, :func:`save_lilicorr`, :func:`strip_lilicorr`): ``config.json`` naming
  ``LiLiCorrDraftModel`` with ``dflash_config.lilicorr_*``; bf16 ``model.safetensors`` holding the DFlash backbone's
  keys and the head's under ``lilicorr.``; keys checked both ways (SGLang ``check_head_weight_coverage``).
* Walks (pure torch, no module state): :func:`greedy_path` (every engine at T = 0), :func:`sample_path_sglang`
  (SGLang ``lilicorr_sample_path``), :func:`sample_path_vllm` (vLLM ``_selector_walk_kernel``),
  :func:`lattice_transitions` (every predecessor's distribution, for the replay's exact expectations).
* One block (:func:`rerank_block`): LiLiCorr's drafts beside the backbone's chain (per-slot argmax), the oracle
  prefix over the top-K lattice and the per-slot candidate recall.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dflash_eval.core.errors import InputError, atomic_dir
from dflash_eval.core.io import read_json_object
from dflash_eval.drafter.checkpoints import (
    IGNORABLE_BUFFERS,
    SHARED_KEYS,
    load_checkpoint,
)
from dflash_eval.drafter.config import DrafterConfig
from dflash_eval.drafter.families import Selection, WalkContext, family_of_architecture
from dflash_eval.drafter.families.lilicorr import (
    ARCHITECTURE,
    LiLiCorrConfig,
    backbone_dict,
    export_config,
    is_lilicorr,
    without_selector,
)
from dflash_eval.drafter.files import file_checksums, read_drafter_weights
from dflash_eval.drafter.lilicorr_model import LiLiCorrHead
from dflash_eval.drafter.model import DFlashDrafter

#: the prefix of the head's weights in ``model.safetensors``
PREFIX = "lilicorr."


def backbone_config(cfg: dict, source: str = "config.json") -> DrafterConfig:
    """The DFlash backbone's :class:`DrafterConfig` of a LiLiCorr ``config.json``
    (:func:`~dflash_eval.drafter.families.lilicorr.backbone_dict`).

    Raises:
        InputError: as :meth:`DrafterConfig.from_dict`.
    """
    return DrafterConfig.from_dict(backbone_dict(cfg), source=source)


def build_backbone(cfg: DrafterConfig) -> DFlashDrafter:
    """A DFlash backbone for ``cfg`` without a candidate selector (LiLiCorr drafts from the unary logits)."""
    return without_selector(DFlashDrafter(cfg))


class LiLiCorrDrafter(nn.Module):
    """A loaded LiLiCorr drafter: the DFlash ``backbone``, the ``head``, its ``geometry`` and the ``config`` dict.

    To the replay it is a drafter as :class:`~dflash_eval.drafter.model.DFlashDrafter` is: ``cfg``, ``fuse``,
    ``context_kv``, ``make_block``, ``forward`` and ``logits`` are the backbone's; ``family`` is LiLiCorr's
    (``selects_candidates``, ``walk_reads_context``), and :meth:`select` walks the head's lattice.
    """

    def __init__(self, backbone: DFlashDrafter, head: LiLiCorrHead, geometry: LiLiCorrConfig, config: dict):
        super().__init__()
        self.backbone, self.head = backbone, head
        self.geometry, self.config = geometry, config
        self.family = family_of_architecture(ARCHITECTURE)

    def to(self, *args, device=None, dtype=None, **kwargs) -> LiLiCorrDrafter:
        """``nn.Module.to``; ``device`` / ``dtype`` None are left as they are."""
        kwargs.update({k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None})
        return super().to(*args, **kwargs) if args or kwargs else self

    # the backbone's drafter interface (the replay's calls)
    @property
    def cfg(self) -> DrafterConfig:
        return self.backbone.cfg

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.backbone.fuse(target_hidden)

    def rope(self, like: torch.Tensor, positions: torch.Tensor):
        return self.backbone.rope(like, positions)

    def context_kv(self, target_hidden: torch.Tensor, positions: torch.Tensor):
        return self.backbone.context_kv(target_hidden, positions)

    def make_block(self, anchor_ids: torch.Tensor, embed_weight: torch.Tensor, block_size: int | None = None):
        return self.backbone.make_block(anchor_ids, embed_weight, block_size)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        """The backbone's block forward (:meth:`DFlashDrafter.forward`)."""
        return self.backbone(*args, **kwargs)

    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        return self.backbone.logits(hidden, lm_head_weight)

    def take_nonfinite(self) -> bool:
        return self.backbone.take_nonfinite()

    def walk_context(self, embed_weight: torch.Tensor, anchor_hidden: torch.Tensor,
                     anchor_valid: torch.Tensor) -> WalkContext:
        """The :class:`WalkContext` the replay passes to :meth:`select` (its attributes' shapes there); the replay
        calls this where ``family.walk_reads_context``, as it cannot import the drafter package."""
        return WalkContext(embed_weight, anchor_hidden, anchor_valid)

    def propose(self, hidden, anchor_ids, lm_head_weight, temperature=0.0, predecessors=None, generator=None,
                context: WalkContext | None = None) -> Selection:
        """:meth:`select` on the backbone's logits of ``hidden``."""
        return self.select(hidden, self.logits(hidden, lm_head_weight), anchor_ids, temperature, predecessors,
                           generator, context)

    @torch.no_grad()
    def select(self, hidden, logits, anchor_ids, temperature=0.0, predecessors=None, generator=None,
               context: WalkContext | None = None) -> Selection:
        """The head's walk over ``N`` blocks: the candidate interface of ``DFlashDrafter.select``.

        Args:
            hidden: ``[N, S, H]`` the backbone's final-normed states of the drafted slots. logits: ``[N, S, V]``.
            anchor_ids: ``[N]`` (unused: the head's first slot reads the anchor row, not the anchor token).
            temperature: 0 = the greedy walk (:func:`greedy_indices`: argmax per slot, ties to the lower rank);
                > 0 samples slot j from ``softmax(row_j / T)`` by inverse CDF, one uniform per slot from
                ``generator`` (SGLang ``lilicorr_sample_path``; vLLM's Gumbel-max walk has the same distribution).
            predecessors: optional ``[N, S]`` int64: slot ``j + 1``'s row is read out of the rank of
                ``predecessors[:, j]`` among slot j's candidates (the walk teacher-forced on a trajectory); a
                predecessor that is no candidate reads rank 0's row (the walk cannot reach it: its q is 0).
            context: :class:`WalkContext` (required): the target's embeddings and the anchor rows.

        Returns:
            :class:`Selection`: ``path`` ``[N, S]``, ``candidates`` ``[N, S, K]`` (top-K of the full-vocabulary
            log-softmax), ``scores`` ``[N, S, K]`` float32 (each slot's log-potential row given the predecessor
            used), ``probs`` ``softmax(scores / T)`` at T > 0.

        Raises:
            ValueError: no ``context``.
        """
        if context is None:
            raise ValueError("LiLiCorr's walk reads the target's embeddings and the anchor row: pass a WalkContext")
        logits = logits.float()
        vals, cand = logits.topk(self.geometry.candidate_topk, dim=-1)
        log_probs = vals - torch.logsumexp(logits, dim=-1, keepdim=True)
        dt = hidden.dtype
        anchor = self.backbone.fuse(context.anchor_hidden[:, None].to(dt))[:, 0]
        valid = context.anchor_valid
        anchor = anchor * valid[:, None].to(dt)
        start, pair = self.head.log_factors(*self.head(context.embed_weight[cand].to(dt), log_probs.to(dt), hidden,
                                                       anchor, valid))
        n, slots, k = cand.shape
        index = torch.zeros(n, dtype=torch.long, device=cand.device)
        scores = torch.empty((n, slots, k), dtype=torch.float32, device=cand.device)
        picks = torch.empty((n, slots), dtype=torch.long, device=cand.device)
        rank = torch.arange(k, device=cand.device)
        for j in range(slots):
            if j and predecessors is not None:
                hit = cand[:, j - 1] == predecessors[:, j - 1, None]
                index = hit.long().argmax(-1)
            scores[:, j] = _rows(start, pair, index, j)
            if temperature > 0:
                probs = torch.softmax(scores[:, j] / temperature, dim=-1)
                u = torch.rand(n, 1, generator=generator, device=cand.device)
                index = torch.minimum((u >= probs.cumsum(-1)).sum(-1), torch.where(probs > 0, rank, 0).amax(-1))
            else:
                index = scores[:, j].argmax(-1)
            picks[:, j] = index
        path = cand.gather(2, picks[..., None])[..., 0]
        return Selection(path, cand, scores, torch.softmax(scores / temperature, -1) if temperature > 0 else None)


def build_lilicorr(cfg: dict, source: str = "config.json") -> LiLiCorrDrafter:
    """Backbone and head (untrained) for a LiLiCorr ``config.json`` object. Raises :class:`InputError` as the readers."""
    bcfg = backbone_config(cfg, source)
    geometry = LiLiCorrConfig.from_dict(cfg, source, model_hidden=bcfg.hidden_size)
    head = LiLiCorrHead(geometry, bcfg.hidden_size, bcfg.block_size, bcfg.rms_norm_eps)
    return LiLiCorrDrafter(build_backbone(bcfg), head, geometry, copy.deepcopy(cfg))


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """``(backbone keys, head keys without "lilicorr.")`` of a LiLiCorr state dict."""
    head = {k[len(PREFIX):]: v for k, v in state.items() if k.startswith(PREFIX)}
    return {k: v for k, v in state.items() if not k.startswith(PREFIX)}, head


def check_keys(state: dict[str, torch.Tensor], module: torch.nn.Module, source, prefix: str = "") -> None:
    """Refuse a state dict that does not match ``module`` exactly.

    Raises:
        InputError: field = the first offending key (with ``prefix``); the message lists every missing, unexpected
            and mis-shaped key (SGLang ``check_head_weight_coverage`` refuses both directions the same way).
    """
    ref = module.state_dict()
    missing = sorted(prefix + k for k in set(ref) - set(state))
    unexpected = sorted(prefix + k for k in set(state) - set(ref))
    shapes = sorted(f"{prefix}{k}: {tuple(state[k].shape)} vs {tuple(ref[k].shape)}"
                    for k in set(ref) & set(state) if state[k].shape != ref[k].shape)
    if missing or unexpected or shapes:
        first = (missing or unexpected or [s.split(":")[0] for s in shapes])[0]
        parts = [f"{what} {keys}" for what, keys in (("missing keys", missing), ("unexpected keys", unexpected),
                                                      ("shape mismatches (checkpoint vs config)", shapes)) if keys]
        raise InputError(source, first, "; ".join(parts),
                         "check that config.json (dflash_config.lilicorr_* and the backbone fields) belongs to these "
                         "weights")


def load_state(model: LiLiCorrDrafter, state: dict[str, torch.Tensor], source) -> LiLiCorrDrafter:
    """Load a full LiLiCorr state dict (backbone + ``lilicorr.*``) strictly (:func:`check_keys`); returns ``model``."""
    back, head = split_state(state)
    check_keys(back, model.backbone, source)
    check_keys(head, model.head, source, PREFIX)
    model.backbone.load_state_dict(back, strict=True)
    model.head.load_state_dict(head, strict=True)
    return model


def load_lilicorr(folder, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> LiLiCorrDrafter:
    """Load a stripped LiLiCorr folder (``config.json`` + ``model.safetensors``), eval mode.

    Raises:
        InputError: ``config.json`` missing or not LiLiCorr, a geometry field missing / non-finite / mistyped
            (:meth:`LiLiCorrConfig.from_dict`), a bad backbone config, a NaN / Inf tensor, or missing / unexpected /
            mis-shaped keys (:func:`check_keys`).
    """
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise InputError(folder, "config.json", "not found", "strip the checkpoint first (strip_lilicorr)")
    cfg = read_json_object(cfg_path, "the drafter's config.json", "strip the checkpoint again (strip_lilicorr)")
    if not is_lilicorr(cfg):
        raise InputError(cfg_path, "architectures", f"{cfg.get('architectures')!r}: not a LiLiCorr drafter",
                         f"evaluate it as DFlash, or give a config naming {ARCHITECTURE} with its lilicorr_* fields")
    model = build_lilicorr(cfg, str(cfg_path))
    load_state(model, read_drafter_weights(folder), folder / "model.safetensors")
    model.backbone.eval()
    model.head.eval()
    return model.to(device=device, dtype=dtype)


def save_lilicorr(model: LiLiCorrDrafter, out_dir, info: dict | None = None) -> Path:
    """Write the engines' layout to ``out_dir`` (atomically): ``config.json`` (:func:`export_config` of the model's
    config), bf16 ``model.safetensors`` (backbone keys + ``lilicorr.*``), ``strip_info.json`` (``info`` + sha256)."""
    state = {k: v for k, v in model.backbone.state_dict().items() if not IGNORABLE_BUFFERS.search(k)}
    state.update({PREFIX + k: v for k, v in model.head.state_dict().items()})
    out = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in sorted(state.items())}
    cfg = export_config(model.config, model.geometry)
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    info = dict(info or {})
    with atomic_dir(out_dir) as tmp:
        save_file(out, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        info["sha256"] = file_checksums(tmp)
        (tmp / "strip_info.json").write_text(json.dumps(info, indent=2))
    return Path(out_dir)


def strip_lilicorr(checkpoint, out_dir) -> Path:
    """A LiLiCorr checkpoint (any format :func:`~dflash_eval.drafter.checkpoints.load_checkpoint` reads, e.g. a
    ``train_lilicorr`` ``step<N>.pt`` or a Model-Optimizer export) -> ``out_dir`` in the engines' layout.

    Shared target tensors (``embed_tokens``, ``lm_head``) and rotary buffers are dropped; every other key must match
    the config exactly.

    Raises:
        InputError: no config, not a LiLiCorr config, or as :func:`load_state`; nothing is written.
    """
    ck = load_checkpoint(checkpoint)
    if ck.config is None:
        raise InputError(checkpoint, "config", "the checkpoint carries no config", "strip from a folder with config.json")
    if not is_lilicorr(ck.config):
        raise InputError(checkpoint, "architectures", f"{ck.config.get('architectures')!r}: not a LiLiCorr config",
                         f"strip it with strip-drafter, or give a config naming {ARCHITECTURE} with its lilicorr_* "
                         "fields")
    model = build_lilicorr(ck.config, str(ck.config_source or checkpoint))
    state = {k: v for k, v in ck.state.items() if k not in SHARED_KEYS and not IGNORABLE_BUFFERS.search(k)}
    load_state(model, state, checkpoint)
    return save_lilicorr(model, out_dir, {"source": str(checkpoint), "format": ck.format, "step": ck.meta.get("step"),
                                          "notes": list(model.geometry.notes)})


# ----------------------------------------------------------------------------- the path through the lattice

def greedy_indices(start: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
    """Left-to-right locally-optimal walk: ``[N, K]`` and ``[N, S - 1, K, K]`` log-potentials -> ``[N, S]`` int64 ranks.

    ``c_1 = argmax start``, ``c_j = argmax_c pair[:, j - 2, c_{j-1}, c]``; ties go to the lower rank (SGLang
    ``_greedy_path_torch``, Model-Optimizer ``_lattice_metrics``)."""
    cur = start.argmax(-1)
    cols = [cur]
    for j in range(pair.shape[1]):
        cur = pair[:, j].gather(1, cur[:, None, None].expand(-1, 1, pair.shape[-1]))[:, 0].argmax(-1)
        cols.append(cur)
    return torch.stack(cols, dim=1)


def greedy_path(start_scores: torch.Tensor, pair_scores: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
    """The drafted tokens at T = 0 (every engine): :func:`greedy_indices` mapped through ``candidate_ids``.

    Args:
        start_scores: ``[N, K]`` float. pair_scores: ``[N, S - 1, K, K]`` float (``[n, j, c', c]``: slot j's
            candidate c' to slot j + 1's c). candidate_ids: ``[N, S, K]`` int64, rank order.

    Returns:
        ``[N, S]`` int64 token ids.
    """
    return candidate_ids.gather(2, greedy_indices(start_scores, pair_scores)[..., None])[..., 0]


def _rows(start: torch.Tensor, pair: torch.Tensor, index: torch.Tensor, j: int) -> torch.Tensor:
    """Slot ``j``'s log-potential row ``[N, K]`` given the previous pick ``index`` (ignored at ``j = 0``)."""
    return start.float() if j == 0 else pair[:, j - 1].float().gather(1, index[:, None, None].expand(
        -1, 1, pair.shape[-1]))[:, 0]


def _temperatures(temperature, n: int, device) -> torch.Tensor:
    return torch.as_tensor(temperature, dtype=torch.float32, device=device).reshape(-1).expand(n)


def _candidate_filter(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``top_p(top_k(probs))`` renormalised over the last axis (SGLang ``build_draft_probs``: top-k keeps the k most
    probable candidates, top-p each one whose more probable candidates' mass is ``< top_p``; 0 / 1 = off)."""
    if (not top_k or top_k >= probs.shape[-1]) and top_p >= 1:
        return probs
    ranked, order = probs.sort(-1, descending=True)
    keep = torch.ones_like(ranked, dtype=torch.bool)
    if top_k and top_k < probs.shape[-1]:
        keep[..., top_k:] = False
    ranked = ranked * keep
    ranked = ranked / ranked.sum(-1, keepdim=True)
    if top_p < 1:
        ranked = ranked * ((ranked.cumsum(-1) - ranked) < top_p)
        ranked = ranked / ranked.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter(-1, order, ranked)


def sample_path_sglang(start_scores: torch.Tensor, pair_scores: torch.Tensor, candidate_ids: torch.Tensor,
                       uniforms: torch.Tensor, temperature, top_k: int = 0,
                       top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's sampled commit (``lilicorr_sample_path``; served only with ``SGLANG_ENABLE_LILICORR_SAMPLING``).

    Slot j: ``q = softmax(row_j / T)`` in float32 over the K candidates (``models/lilicorr.py`` 085551a8 and its
    kernels' ``_sample_path_torch``: temperature only); the newest kernels file (0b79ccf2, ``candidate_probs`` ->
    ``build_draft_probs``) then applies the request's draft ``top_k`` / ``top_p`` to the K candidates
    (:func:`_candidate_filter`). Pick = the number of cumulative sums ``<= u_j``, clamped to the last candidate
    with ``q > 0`` (0b79ccf2 ``sample_indices_from_probs``; ``K - 1`` before, the same where nothing is filtered).
    A row with ``T = 0`` takes the argmax and reports one-hot q.

    Args:
        start_scores, pair_scores, candidate_ids: as :func:`greedy_path`. uniforms: ``[N, S]`` float in [0, 1).
        temperature: float or ``[N]`` (0 = greedy row). top_k, top_p: the draft filter (0 / 1 = off).

    Returns:
        ``(tokens [N, S] int64, q [N, S, K] float32)``.
    """
    n, slots, k = candidate_ids.shape
    temps = _temperatures(temperature, n, start_scores.device)
    greedy = temps == 0
    index = torch.zeros(n, dtype=torch.long, device=start_scores.device)
    rank = torch.arange(k, device=start_scores.device)
    picks, qs = [], []
    for j in range(slots):
        row = _rows(start_scores, pair_scores, index, j)
        probs = _candidate_filter(torch.softmax(row / temps.clamp_min(1e-5)[:, None], dim=-1), top_k, top_p)
        last = torch.where(probs > 0, rank, 0).amax(-1)
        drawn = torch.minimum((uniforms[:, j:j + 1].float() >= probs.cumsum(-1)).sum(-1), last)
        index = torch.where(greedy, row.argmax(-1), drawn)
        qs.append(torch.where(greedy[:, None], torch.nn.functional.one_hot(index, k).float(), probs))
        picks.append(index)
    return candidate_ids.gather(2, torch.stack(picks, 1)[..., None])[..., 0], torch.stack(qs, 1)


def sample_path_vllm(start_scores: torch.Tensor, pair_scores: torch.Tensor, candidate_ids: torch.Tensor,
                     gumbel: torch.Tensor, temperature) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's sampled walk (``dflash2/speculator.py`` ``_selector_walk_kernel`` on LiLiCorr's lattice): slot j picks
    ``argmax(row_j / T + g_j)`` (Gumbel-max; the lower rank on ties), ``T = 0`` the argmax of ``row_j``.

    vLLM draws ``g = -log(-log u)`` from ``u`` keyed by the request seed, the position and the candidate id; the
    noise here is the caller's (same distribution, not vLLM's draws). Its rejection sampler tests the cached rows
    at the temperature, i.e. ``q = softmax(row_j / T)``.

    Args:
        gumbel: ``[N, S, K]`` float noise. Others as :func:`sample_path_sglang`.

    Returns:
        ``(tokens [N, S] int64, q [N, S, K] float32)`` (one-hot q at ``T = 0``).
    """
    n, slots, k = candidate_ids.shape
    temps = _temperatures(temperature, n, start_scores.device)
    greedy = temps == 0
    index = torch.zeros(n, dtype=torch.long, device=start_scores.device)
    picks, qs = [], []
    for j in range(slots):
        row = _rows(start_scores, pair_scores, index, j)
        t = temps.clamp_min(1e-30)[:, None]
        index = torch.where(greedy, row.argmax(-1), (row / t + gumbel[:, j].float()).argmax(-1))
        qs.append(torch.where(greedy[:, None], torch.nn.functional.one_hot(index, k).float(),
                              torch.softmax(row / t, dim=-1)))
        picks.append(index)
    return candidate_ids.gather(2, torch.stack(picks, 1)[..., None])[..., 0], torch.stack(qs, 1)


def lattice_transitions(start_scores: torch.Tensor, pair_scores: torch.Tensor,
                        temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The walk's distributions for every predecessor, for the replay's expectations over paths
    (``dflash_eval.replay.sampling.survival_selector`` takes them as DFlash 2's).

    Returns:
        ``(first [N, K], trans [N, S - 1, K, K])`` float32: ``softmax(. / T)`` along the last axis (one-hot argmax
        at ``T = 0``, the lower rank on ties).
    """
    def dist(x):
        x = x.float()
        if temperature == 0:
            return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).float()
        return torch.softmax(x / temperature, dim=-1)
    return dist(start_scores), dist(pair_scores)


def trajectory_probs(start_scores: torch.Tensor, pair_scores: torch.Tensor, candidate_ids: torch.Tensor,
                     tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """The walk's probability of drafting ``tokens`` slot by slot, each slot after the trajectory's previous token as
    predecessor: what the replay's estimator given the trajectory needs (``q_j(x_j | x_{j-1})``, as
    ``dflash_eval.replay.sampling.selector_path_probs`` for DFlash 2).

    Args:
        start_scores, pair_scores, candidate_ids: as :func:`greedy_path`. tokens: ``[N, S]`` int64. temperature: >= 0.

    Returns:
        ``[N, S]`` float32: slot 1 ``softmax(start / T)`` at the token's rank, slot j the row of ``pair`` out of the rank
        of ``tokens[:, j - 1]`` (one-hot argmax at ``T = 0``); 0 where the token is not a candidate, or its
        predecessor is not one (the walk cannot reach that slot with the trajectory's tokens).
    """
    first, trans = lattice_transitions(start_scores, pair_scores, temperature)
    hit = candidate_ids == tokens[..., None]
    rank, found = hit.long().argmax(-1), hit.any(-1)
    rows = [first] + [trans[:, j - 1].gather(1, rank[:, j - 1, None, None].expand(-1, 1, trans.shape[-1]))[:, 0]
                      for j in range(1, tokens.shape[1])]
    reached = torch.cat([torch.ones_like(found[:, :1]), found[:, :-1]], dim=1)
    return torch.stack(rows, 1).gather(-1, rank[..., None])[..., 0] * (found & reached)


def prefix_length(match: torch.Tensor) -> torch.Tensor:
    """``[N, S]`` bool -> ``[N]`` int64: the leading run of True."""
    return match.long().cumprod(-1).sum(-1)


@dataclass
class BlockDrafts:
    """One LiLiCorr pass over ``N`` blocks (:func:`rerank_block`); ``S`` drafted slots, ``K`` candidates.

    Attributes:
        path: ``[N, S]`` int64, LiLiCorr's drafts (greedy, or sampled with :func:`sample_path_sglang` when
            ``uniforms`` were given). chain: ``[N, S]`` int64, the backbone's own drafts (per-slot argmax = rank 0).
        candidates: ``[N, S, K]`` int64. log_probs: ``[N, S, K]`` float32 (full-vocabulary log-softmax).
        start, pair: ``[N, K]``, ``[N, S - 1, K, K]`` float32 log-potentials (``logit_scale`` applied).
        q: ``[N, S, K]`` the sampled path's proposal (None at T = 0).
        in_candidates, path_prefix, chain_prefix, oracle_prefix: with ``target``: ``[N, S]`` bool (the target's
            token is a candidate: per-slot recall), and ``[N]`` int64 accepted prefixes of the path, the chain and
            the oracle (the longest prefix whose target tokens are all candidates). None without ``target``.
    """

    path: torch.Tensor
    chain: torch.Tensor
    candidates: torch.Tensor
    log_probs: torch.Tensor
    start: torch.Tensor
    pair: torch.Tensor
    q: torch.Tensor | None = None
    in_candidates: torch.Tensor | None = None
    path_prefix: torch.Tensor | None = None
    chain_prefix: torch.Tensor | None = None
    oracle_prefix: torch.Tensor | None = None


def anchor_rows(backbone: DFlashDrafter, target_hidden: torch.Tensor, starts: torch.Tensor,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's anchor per block: the fused context row ``hidden_norm(fc(target_hidden[start - 1]))``
    (Model-Optimizer ``build_anchor_rows``; serving: the last accepted row, SGLang ``publish_anchor``, vLLM
    ``prepare_context_anchor``).

    Args:
        target_hidden: ``[b, T, K*H]`` concatenated target states. starts: ``[N]`` int64 anchor positions (the
            block's position 0). rows: ``[N]`` int64 sequence of each block (default ``arange(N)``).

    Returns:
        ``(anchor [N, H], valid [N] bool)``; a block at position 0 has no row (zeros, invalid).
    """
    rows = torch.arange(len(starts), device=starts.device) if rows is None else rows
    idx = starts - 1
    valid = idx >= 0
    anchor = backbone.fuse(target_hidden[rows, idx.clamp_min(0)][:, None])[:, 0]
    return anchor * valid[:, None].to(anchor.dtype), valid


def lattice_inputs(model: LiLiCorrDrafter, hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                   embed_weight: torch.Tensor):
    """``(candidates [N, S, K] int64, log_probs [N, S, K] float32, embeddings [N, S, K, H])`` of drafter states
    ``hidden`` ``[N, S, H]``: the top-K of the full-vocabulary log-softmax of the drafter's logits (SGLang
    ``lilicorr_candidates``, vLLM ``lilicorr_topk_log_probs``), rank order, and the target's embeddings of them."""
    logits = model.backbone.logits(hidden, lm_head_weight).float()
    vals, cand = logits.topk(model.geometry.candidate_topk, dim=-1)
    log_probs = vals - torch.logsumexp(logits, dim=-1, keepdim=True)
    return cand, log_probs, embed_weight[cand]


@torch.no_grad()
def rerank_block(model: LiLiCorrDrafter, hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                 embed_weight: torch.Tensor, anchor: torch.Tensor, anchor_valid: torch.Tensor | None = None,
                 target: torch.Tensor | None = None, temperature: float = 0.0,
                 uniforms: torch.Tensor | None = None) -> BlockDrafts:
    """LiLiCorr's drafts of ``N`` blocks from the backbone's states, with the backbone's chain and the oracle.

    Args:
        hidden: ``[N, S, H]`` the backbone's final-normed states of slots ``1 .. S`` (what DFlash 2's selector
            receives: ``forward(...)[:, 1:vs]``). lm_head_weight, embed_weight: the target's ``[V, H]``.
        anchor, anchor_valid: ``[N, H]``, ``[N]`` from :func:`anchor_rows`.
        target: optional ``[N, S]`` int64, the target's tokens at the slots (the committed trajectory).
        temperature, uniforms: with ``temperature > 0`` and ``uniforms`` ``[N, S]``, SGLang's sampled commit.

    Returns:
        :class:`BlockDrafts`.
    """
    cand, log_probs, emb = lattice_inputs(model, hidden, lm_head_weight, embed_weight)
    start, pair = model.head.log_factors(*model.head(emb, log_probs, hidden, anchor, anchor_valid))
    q = None
    if temperature > 0 and uniforms is not None:
        path, q = sample_path_sglang(start, pair, cand, uniforms, temperature)
    else:
        path = greedy_path(start, pair, cand)
    out = BlockDrafts(path, cand[..., 0], cand, log_probs, start, pair, q)
    if target is not None:
        out.in_candidates = (cand == target[..., None]).any(-1)
        out.path_prefix = prefix_length(path == target)
        out.chain_prefix = prefix_length(cand[..., 0] == target)
        out.oracle_prefix = prefix_length(out.in_candidates)
    return out
