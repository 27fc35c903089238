"""The LiLiCorr reranker head: a small transformer over a DFlash block's top-k candidate lattice.

LiLiCorr (NVIDIA, "LiLiCorr: Lightweight Likelihood Correlation of Parallel Drafts for Speculative
Decoding", arXiv 2608.20530) keeps a DFlash backbone and replaces the per-slot argmax with a path through
the lattice of each drafted slot's top-``k`` candidates. This file is the head; the family and its strict
config: :mod:`dflash_eval.drafter.families.lilicorr`; the checkpoint layout and the path walks:
:mod:`dflash_eval.drafter.lilicorr_drafter`.

Read in (never copied): training ``NVIDIA/Model-Optimizer`` ``modelopt/torch/speculative/plugins/
modeling_lilicorr.py`` (``LiLiCorrHead``, ``LiLiCorrModule``; commit 33d8c76d, PR #2342); serving
``sgl-project/sglang`` ``python/sglang/srt/models/lilicorr.py`` (commit 085551a8, PR #37462),
``vllm-project/vllm`` ``vllm/model_executor/models`` LiLiCorr head (PR #57934) and ``NVIDIA/TensorRT-LLM``
``tensorrt_llm/_torch/models/modeling_lilicorr.py`` (commit 8d62b3e5).

Per block with ``S = block_size - 1`` drafted slots and ``K = candidate_topk`` candidates per slot, model
width ``Hm`` (the drafter's ``hidden_size``) and head width ``h``:

1. Inputs per candidate ``(s, c)``: the target's input embedding of the candidate token (``embed_tokens``,
   no ``input_embedding_scale``), the drafter's final-normed state of slot ``s`` (``pass_hidden``, what goes
   into the LM head), and the candidate's log-probability under the drafter's full-vocabulary softmax.
   ``x = token_proj(e) + pass_hidden_proj(pass_hidden) + feature_mlp(f) + slot_embedding[s] +
   rank_embedding[c]`` with the five features ``f = [log p, p, log p - max_c log p, c / (K - 1), c == 0]``
   (``c / (K - 1)`` is 0 at ``K = 1``) and ``feature_mlp = Sequential(LayerNorm(5), Linear(5, h), SiLU,
   Linear(h, h))``; ``token_proj`` is the identity when ``h == Hm``.
2. ``num_layers`` pre-norm layers over the ``S * K`` lattice rows, bidirectional: ``x + attn(rms(x))`` with
   ``nn.MultiheadAttention``'s parameters (``in_proj_weight``, ``in_proj_bias``, ``out_proj``) and an additive
   per-head bias ``relative_slot_bias[:, s_q - s_k + B - 1] + same_slot_bias * [s_q == s_k]``, then
   ``x + mlp(rms(x))`` with ``mlp = Sequential(Linear(h, int(h * mlp_ratio)), SiLU, Linear(., h))``; then
   ``output_norm``.
3. The anchor: one projected target row per block, ``a = anchor_norm(context_proj(hidden_norm(fc(T[start -
   1]))))`` (the drafter's fused context row of the position before the anchor token, Model-Optimizer
   ``build_anchor_rows``; zeroed after ``context_proj`` when that row does not exist).
4. Factors: ``z = silu(factor_input_proj([x, a, x * a]))``; ``out = normalize(out_head(z))``, ``in =
   normalize(in_head(z))``, ``a_out = normalize(anchor_out_head(a))`` (L2 along ``factor_dim``, ``eps =
   vector_eps``). ``start[c] = <a_out, in[0, c]>``, ``pair[s, c', c] = <out[s, c'], in[s + 1, c]>``: cosines
   in [-1, 1]. The log-potentials are ``logit_scale * start`` and ``logit_scale * pair`` in float32
   (``compose_log_factors`` / ``log_factors``); there is no additive log-prob prior.

RMSNorms use the drafter's ``rms_norm_eps``. Parameter names are the trained module's (``nn.Sequential``
indices for the MLPs, ``[1, 1, S, 1, h]`` / ``[1, 1, 1, K, h]`` embeddings), which vLLM loads as they are and
SGLang / TensorRT-LLM map onto their named modules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_eval.drafter.model import RMSNorm

#: the per-candidate features, in the order the trained ``feature_mlp`` reads them
NUM_FEATURES = 5


class LatticeAttention(nn.Module):
    """``nn.MultiheadAttention``'s parameters (``in_proj_weight`` ``[3h, h]``, ``in_proj_bias``, ``out_proj``), run
    through SDPA with an additive float bias (the same function: scale ``1 / sqrt(h / heads)``)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * hidden, hidden))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * hidden))
        self.out_proj = nn.Linear(hidden, hidden)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``x`` ``[N, L, h]``, ``bias`` ``[heads, L, L]`` -> ``[N, L, h]``."""
        n, length, width = x.shape
        q, k, v = (t.view(n, length, self.heads, -1).transpose(1, 2)
                   for t in F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None].to(x.dtype))
        return self.out_proj(out.transpose(1, 2).reshape(n, length, width))


class LatticeLayer(nn.Module):
    """One pre-norm attention + SiLU-MLP layer over the lattice (Model-Optimizer ``LiLiCorrLayer``)."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        width = int(hidden * mlp_ratio)
        self.attn_norm = RMSNorm(hidden, eps)
        self.attn = LatticeAttention(hidden, heads)
        self.mlp_norm = RMSNorm(hidden, eps)
        self.mlp = nn.Sequential(nn.Linear(hidden, width), nn.SiLU(), nn.Linear(width, hidden))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrHead(nn.Module):
    """The reranker (module docstring); its state-dict keys are the checkpoint's ``lilicorr.*`` keys without the prefix.

    Args:
        geometry: a :class:`~dflash_eval.drafter.families.lilicorr.LiLiCorrConfig` (``candidate_topk``,
            ``hidden_size`` (0 = ``model_hidden``), ``num_layers``, ``num_heads``, ``mlp_ratio``, ``factor_dim``,
            ``vector_eps``, ``logit_scale``).
        model_hidden: the drafter's hidden size ``Hm``. block_size: the drafter's block size ``B`` (``S = B - 1``).
        rms_norm_eps: the drafter's.
    """

    def __init__(self, geometry, model_hidden: int, block_size: int, rms_norm_eps: float):
        super().__init__()
        h = int(geometry.hidden_size) or int(model_hidden)
        self.hidden, self.block_size, self.slots = h, int(block_size), int(block_size) - 1
        self.topk, self.heads = int(geometry.candidate_topk), int(geometry.num_heads)
        self.factor_dim = int(geometry.factor_dim)
        self.vector_eps, self.logit_scale = float(geometry.vector_eps), float(geometry.logit_scale)
        self.token_proj = nn.Identity() if h == model_hidden else nn.Linear(model_hidden, h)
        self.pass_hidden_proj = nn.Linear(model_hidden, h)
        self.feature_mlp = nn.Sequential(nn.LayerNorm(NUM_FEATURES), nn.Linear(NUM_FEATURES, h), nn.SiLU(),
                                         nn.Linear(h, h))
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, self.slots, 1, h))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, self.topk, h))
        self.relative_slot_bias = nn.Parameter(torch.zeros(self.heads, 2 * self.block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(self.heads))
        self.context_proj = nn.Linear(model_hidden, h)
        self.layers = nn.ModuleList(LatticeLayer(h, self.heads, float(geometry.mlp_ratio), rms_norm_eps)
                                    for _ in range(int(geometry.num_layers)))
        self.output_norm = RMSNorm(h, rms_norm_eps)
        self.anchor_norm = RMSNorm(h, rms_norm_eps)
        self.factor_input_proj = nn.Linear(3 * h, h)
        self.out_head = nn.Linear(h, self.factor_dim)
        self.in_head = nn.Linear(h, self.factor_dim)
        self.anchor_out_head = nn.Linear(h, self.factor_dim)

    def init_weights_(self, std: float = 0.02) -> LiLiCorrHead:
        """Training init (Model-Optimizer ``_init_head_weights`` + ``reset_factor_heads``): every Linear ~ N(0, std)
        with zero bias, the embeddings and attention biases zero, norms one. Returns ``self``."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                nn.init.zeros_(m.bias)
        for layer in self.layers:
            nn.init.normal_(layer.attn.in_proj_weight, std=std)
        return self

    def attention_bias(self, slots: int) -> torch.Tensor:
        """``[heads, slots * K, slots * K]``: the relative-slot bias plus the same-slot term (row = ``slot * K + rank``)."""
        slot = torch.arange(slots, device=self.same_slot_bias.device).repeat_interleave(self.topk)
        rel = slot[:, None] - slot[None, :]
        bias = self.relative_slot_bias[:, rel + self.block_size - 1]
        return bias + (rel == 0)[None].to(bias.dtype) * self.same_slot_bias[:, None, None]

    def forward(self, token_embeddings: torch.Tensor, candidate_log_probs: torch.Tensor, pass_hidden: torch.Tensor,
                anchor_hidden: torch.Tensor, anchor_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cosine factors of ``N`` blocks' lattices.

        Args:
            token_embeddings: ``[N, S, K, Hm]`` the target's ``embed_tokens`` rows of the candidates.
            candidate_log_probs: ``[N, S, K]`` their full-vocabulary log-probabilities under the drafter, rank order
                (descending; rank ``c`` is ``rank_embedding[c]``).
            pass_hidden: ``[N, S, Hm]`` the drafter's final-normed states of slots ``1 .. S``.
            anchor_hidden: ``[N, Hm]`` the fused context row ``hidden_norm(fc(.))`` of position ``start - 1``.
            anchor_valid: ``[N]`` bool, False where that row does not exist (None = all valid).

        ``S`` may be below the trained ``B - 1`` (a shortened last block: the first ``S`` slot embeddings; SGLang
        ``set_active_block_size``, vLLM and TensorRT-LLM score any ``1 <= S <= B - 1``).

        Returns:
            ``(start [N, K], pair [N, S - 1, K, K])`` float32 cosines (``pair[n, s, c', c]``: candidate ``c'`` of
            slot ``s`` to candidate ``c`` of slot ``s + 1``, slots counted from 0).

        Raises:
            ValueError: ``K`` other than the trained width, or ``S`` outside ``1 .. B - 1``.
        """
        n, slots, k = candidate_log_probs.shape
        if k != self.topk or not 1 <= slots <= self.slots:
            raise ValueError(f"lattice of {slots} slots x {k} candidates; the head was built for 1..{self.slots} x "
                             f"{self.topk}")
        dtype = self.pass_hidden_proj.weight.dtype
        lp = candidate_log_probs.float()
        rank = torch.arange(k, device=lp.device, dtype=torch.float32)
        feats = torch.stack([lp, lp.exp(), lp - lp.amax(-1, keepdim=True),
                             (rank / max(k - 1, 1)).expand_as(lp), (rank == 0).float().expand_as(lp)], dim=-1)
        x = (self.token_proj(token_embeddings.to(dtype)) + self.pass_hidden_proj(pass_hidden.to(dtype))[:, :, None]
             + self.feature_mlp(feats.to(dtype)) + self.slot_embedding[0, :, :slots] + self.rank_embedding[0])
        x = x.reshape(n, slots * k, self.hidden)
        bias = self.attention_bias(slots)
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).view(n, slots, k, self.hidden)
        anchor = self.context_proj(anchor_hidden.to(dtype))
        if anchor_valid is not None:
            anchor = anchor * anchor_valid[:, None].to(anchor.dtype)
        anchor = self.anchor_norm(anchor)
        a = anchor[:, None, None, :].expand_as(x)
        z = F.silu(self.factor_input_proj(torch.cat([x, a, x * a], dim=-1)))
        out_vec = F.normalize(self.out_head(z), dim=-1, eps=self.vector_eps)
        in_vec = F.normalize(self.in_head(z), dim=-1, eps=self.vector_eps)
        a_out = F.normalize(self.anchor_out_head(anchor), dim=-1, eps=self.vector_eps)
        start = (a_out[:, None, :] * in_vec[:, 0]).sum(-1)
        pair = out_vec[:, :-1] @ in_vec[:, 1:].transpose(-1, -2)
        return start.float(), pair.float()

    def log_factors(self, start: torch.Tensor, pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chain's log-potentials: ``logit_scale * start``, ``logit_scale * pair`` in float32 (Model-Optimizer
        ``compose_log_factors``, SGLang ``log_factors``)."""
        return self.logit_scale * start.float(), self.logit_scale * pair.float()
