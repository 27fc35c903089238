"""The DFlash drafter: one compact file to check against the paper and z-lab/dflash.

DFlash ("Block Diffusion for Flash Speculative Decoding", arXiv 2602.06036;
reference code ``z-lab/dflash`` ``dflash/model.py``). The drafter has **no
embedding and no LM head of its own**: block tokens are embedded with the
target's ``embed_tokens`` and drafted logits come from the target's
``lm_head`` (reference ``dflash_generate``).

Per forward, for a block of ``B`` tokens ``[anchor, MASK x (B-1)]`` at absolute
positions ``start .. start+B-1``:

1. Context fusion, once: ``ctx = hidden_norm(fc(cat_k hidden_states[id_k + 1]))``
   over the target layers ``dflash_config.target_layer_ids`` (shape
   ``[N, T, K*H] -> [N, T, H]``).
2. KV injection, every draft layer: keys/values are
   ``[k_proj(ctx) ; k_proj(x)]`` / ``[v_proj(ctx) ; v_proj(x)]`` with the *same*
   ``k_proj``/``k_norm``/``v_proj`` weights for context and block; queries come
   from block tokens only. Context tokens never pass through the residual
   stream or MLP.
3. Absolute RoPE positions for context (position ``t``) and block (``start+j``);
   ``q_norm``/``k_norm`` are per-head RMSNorms applied before RoPE.
4. Attention mask: full-attention layers see every committed context position
   ``< start`` and all block tokens bidirectionally; ``sliding_attention``
   layers (newer reference code, ``dflash==0.1.0``) are causal within the block
   and see only keys with ``query_pos - key_pos < sliding_window`` (absolute
   positions, so the window slides over the context as decoding advances).
   A top-level ``is_causal`` overrides causality for every layer, as in the
   reference ``Qwen3DFlashAttention``; a non-causal windowed layer also hides
   keys with ``key_pos - query_pos >= sliding_window``.
5. Final ``norm``; logits = ``target.lm_head(norm(h))`` (times
   ``output_multiplier``, optional tanh softcap).

Because the context K/V of position ``t`` depends only on the target's hidden
states at ``t`` and on ``t`` itself, :meth:`DFlashDrafter.context_kv` can
compute them once per sample; the reference's draft KV cache holds exactly
these tensors.

State-dict keys match released z-lab checkpoints (``fc``, ``hidden_norm``,
``norm``, ``layers.{i}.{input_layernorm,post_attention_layernorm}``,
``layers.{i}.self_attn.{q,k,v,o}_proj``, ``layers.{i}.self_attn.{q,k}_norm``,
``layers.{i}.mlp.{gate,up,down}_proj``).

**DFlash 2** (config ``dflash_config.{conv_kernel_size, conv_group_size, selector_rank,
selector_top_k}``; reference ``dflash==0.1.0`` ``dflash/model.py`` ``DFlash2DraftModel``,
``GroupedDynamicCausalConv``, ``CandidateSelector``; blog inco.ai/blog/dflash2) adds two parts:

6. A grouped dynamic causal conv on both sides of each sublayer (:class:`GroupedDynamicCausalConv`):
   ``x -> prepare -> attention -> finish -> + residual`` and the same around the MLP. With taps
   ``o = 0 .. k-1`` (``conv_kernel_size``), groups of ``conv_group_size`` channels and ``g(c)`` the
   group of channel ``c``: ``out[j, c] = sum_o (base[o, c] + dyn[j, o, g(c)]) * x[j - o, c]``, where
   ``base`` is ``base_kernel[0]`` (input side) or ``[1]`` (output side) and both sides' per-slot
   ``dyn`` come from one ``kernel_projection`` of the sublayer's (normed) input.
7. A candidate selector on the drafted logits (:class:`CandidateSelector`): per slot the
   top-``selector_top_k`` candidates ``c`` of the logits; slot by slot, ``score(c) = logit(c) +
   <predecessor_codebook[prev] * hidden_projection(h_j), successor_codebook[c]>`` (rank
   ``selector_rank``) with ``prev`` the token picked at the slot before (the anchor at slot 1);
   greedy = the argmax, temperature > 0 = a sample of ``softmax(score / T)``.

**What the conv sees, and what it keeps between verify steps (nothing).** In the reference the
conv runs on the residual stream of one draft call, whose tokens are exactly the verify step's
block ``[anchor, MASK x (vs-1)]``: the context reaches a layer only as keys/values of the fused
target states, never through the residual stream, so never through the conv. Slot ``j``'s taps
read slots ``j-1 .. j-k+1`` of the same block; taps before slot 0 read zeros -- not the last
committed tokens, not the previous block. The draft KV cache is cropped back to ``start`` after each
call, so nothing of a block survives into the next verify step. A DFlash 2 block's drafts are
therefore, as DFlash 1's, a function of the anchor token, the context ``< t`` and the verify size
alone, so the batched all-anchor replay reproduces online decoding. (A shortened last block loses
nothing: taps look backwards only, so its masked-out tail never reaches a verified slot.) Several
blocks in one sequence (training; the replay's ``packed`` layout) restart the taps at every block
start, as SpecForge ``DFlashGroupedConv._convolve``, speculators ``grouped_dynamic_conv`` and
vLLM ``_grouped_conv`` (position modulo the block size) do: ``conv_segment`` in :meth:`forward`.

**Selector conventions.** Candidates are in descending logit order (``torch.topk(sorted=True)``,
as vLLM ``compute_candidates``; the reference leaves the order unspecified), so an exact score tie
goes to the larger logit. Scores are computed in float32 from the compute-dtype logits and
projection, as vLLM and SGLang add the bilinear term to float32 logits; in float32 the path equals
the reference's ``propose``. The codebooks are saved without ``.weight``
(``candidate_selector.predecessor_codebook``; ``DFlash2DraftModel.from_pretrained`` maps them onto
its ``nn.Embedding``), so here they are plain parameters under the saved names.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash_eval.core.errors import InputError
from dflash_eval.drafter.config import DrafterConfig
from dflash_eval.drafter.families import Selection, family_of_config  # the proposal's result (the family interface)
from dflash_eval.drafter.files import read_drafter_weights
from dflash_eval.drafter.rope import rotary_embedding

log = logging.getLogger(__name__)

class RMSNorm(nn.Module):
    """RMSNorm as in Qwen3 (``weight * (x / rms(x))``, the normalisation in float32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[N, heads, L, hd]`` by ``cos``/``sin`` ``[N, L, hd]`` (neox / half-split layout, as Qwen3)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def _repeat_heads(x: torch.Tensor, rep: int) -> torch.Tensor:
    """``x`` ``[N, n_kv, L, hd]`` with each KV head repeated ``rep`` times (``repeat_interleave`` on dim 1);
    a batch-broadcast view (stride 0 on dim 0) is repeated on one row and broadcast again."""
    if x.shape[0] > 1 and x.stride(0) == 0:
        return x[:1].repeat_interleave(rep, dim=1).expand(x.shape[0], -1, -1, -1)
    return x.repeat_interleave(rep, dim=1)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        hd, nh, nkv, bias = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_bias
        self.head_dim, self.n_heads, self.n_kv = hd, nh, nkv
        self.q_proj = nn.Linear(cfg.hidden_size, nh * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, nkv * hd, bias=bias)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.sliding = cfg.layer_types[layer_idx] == "sliding_attention"
        self.window = cfg.sliding_window if self.sliding else None
        self.causal = self.sliding if cfg.is_causal is None else cfg.is_causal

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of ``x`` ``[N, L, H]``: ``k = rope(k_norm(k_proj x))``, ``v = v_proj x``; each ``[N, n_kv, L, hd]``."""
        n, l, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(n, l, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(n, l, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, k_ctx, v_ctx, mask):
        n, b, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, b, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.kv(x, cos, sin)
        gqa = self.n_kv != self.n_heads
        if gqa and q.device.type != "cpu":
            # CUDA: SDPA's memory-efficient kernel takes the mask but not grouped heads
            # (bench/sdpa_gqa.py); with enable_gqa the online loop, the sequential and the packed
            # replay ran slower on the H200 (README, Measurements), so the heads are copied there.
            # A context shared by every row (an expanded view, batch stride 0: the batched replay's
            # one-sample chunks) is repeated once and expanded again, so the concatenation below is
            # the only per-row copy; same values as repeating after the concatenation.
            rep = self.n_heads // self.n_kv
            k_ctx, v_ctx = _repeat_heads(k_ctx, rep), _repeat_heads(v_ctx, rep)
            k_blk, v_blk, gqa = k_blk.repeat_interleave(rep, dim=1), v_blk.repeat_interleave(rep, dim=1), False
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        # CPU: grouped KV heads read in place (enable_gqa), not copied: 3.1 of 23 s per demo evaluate job
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(n, b, -1))


class GroupedDynamicCausalConv(nn.Module):
    """DFlash 2 conv around one sublayer (module docstring, item 6): ``prepare`` its input, ``finish`` its output.

    Parameters (reference names): ``base_kernel`` ``[2, taps, H]`` (input side, output side) and
    ``kernel_projection`` ``H -> 2 * taps * groups`` (both sides' per-slot kernels, from the input).
    """

    def __init__(self, hidden: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.group_size, self.groups = taps, group_size, hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)

    def prepare(self, x: torch.Tensor, segment: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Input side: ``(conv(x), dyn_out)`` for ``x`` ``[N, L, H]``; ``dyn_out`` ``[N, L, taps, groups]`` is for :meth:`finish`."""
        dyn = self.kernel_projection(x).view(*x.shape[:-1], 2, self.taps, self.groups)
        return self._convolve(x, dyn[..., 0, :, :], self.base_kernel[0], segment), dyn[..., 1, :, :]

    def finish(self, y: torch.Tensor, dyn: torch.Tensor, segment: int | None = None) -> torch.Tensor:
        """Output side: ``conv(y)`` with ``base_kernel[1]`` and the per-slot kernels from :meth:`prepare`."""
        return self._convolve(y, dyn, self.base_kernel[1], segment)

    def _convolve(self, x, dyn, base, segment):
        """``out[j] = sum_o (base[o] + dyn[j, o]) * x[j - o]`` within each run of ``segment`` positions
        (default: all ``L``), zeros before a run's start. ``x`` ``[N, L, H]`` with ``L`` a multiple of ``segment``."""
        n, length, h = x.shape
        seg = segment or length
        xs = x.view(n, length // seg, seg, self.groups, self.group_size)
        ds = dyn.reshape(n, length // seg, seg, self.taps, self.groups, 1)
        out = torch.zeros_like(xs)
        for o in range(min(self.taps, seg)):  # a tap reaching past the run start adds zeros only
            shifted = xs if o == 0 else F.pad(xs[:, :, : seg - o], (0, 0, 0, 0, o, 0))
            out = out + base[o].view(self.groups, self.group_size).to(x.dtype) * shifted
            out = torch.addcmul(out, ds[:, :, :, o], shifted)
        return out.view(n, length, h)


class CandidateSelector(nn.Module):
    """DFlash 2 candidate selector (module docstring, item 7). Parameters under the reference's saved names."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.selector_rank))
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float = 0.0,
        predecessors: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> Selection:
        """Walk the slots of ``N`` blocks at once.

        Args:
            hidden: ``[N, S, H]`` drafter states of the drafted slots (slots ``1 ..``).
            logits: ``[N, S, V]`` their logits (:meth:`DFlashDrafter.logits`).
            anchor_ids: ``[N]`` int64, the anchor token of each block (the first predecessor).
            temperature: 0 = greedy (argmax of the scores); > 0 samples ``softmax(scores / T)``
                (reference ``CandidateSelector.select``) and returns those distributions.
            predecessors: optional ``[N, S]`` int64: score slot ``j`` after ``predecessors[:, j-1]``
                (the anchor for ``j = 0``) instead of after the selector's own pick: a
                teacher-forced walk, e.g. the distribution given the committed tokens.
            generator: random source of the samples at temperature > 0.

        Returns:
            :class:`Selection` with ``path``, ``candidates``, ``scores`` (and ``probs`` when T > 0).
        """
        unary, cand = torch.topk(logits, self.top_k, dim=-1)  # [N, S, K], descending
        unary = unary.float()
        proj = self.hidden_projection(hidden).float()  # [N, S, r]
        pred_cb, succ_cb = self.predecessor_codebook, self.successor_codebook
        prev = anchor_ids
        n, slots = cand.shape[:2]
        path = torch.empty((n, slots), dtype=torch.long, device=cand.device)
        scores = torch.empty(unary.shape, dtype=torch.float32, device=cand.device)
        probs = torch.empty_like(scores) if temperature > 0 else None
        for j in range(slots):
            gate = pred_cb[prev].float() * proj[:, j]  # [N, r]
            scores[:, j] = unary[:, j] + torch.einsum("nr,nkr->nk", gate, succ_cb[cand[:, j]].float())
            if temperature > 0:
                probs[:, j] = torch.softmax(scores[:, j] / temperature, dim=-1)
                pick = torch.multinomial(probs[:, j], 1, generator=generator)[:, 0]
            else:
                pick = scores[:, j].argmax(-1)
            path[:, j] = cand[:, j].gather(-1, pick[:, None])[:, 0]
            prev = path[:, j] if predecessors is None else predecessors[:, j]
        return Selection(path, cand, scores, probs)

    def teacher_forced_scores(self, hidden, logits, predecessors, candidates) -> torch.Tensor:
        """:meth:`forward`'s float32 scores ``[N, S, K]`` of ``candidates`` ``[N, S, K]`` at every slot at once, slot
        ``j`` after ``predecessors[:, j]`` ``[N, S]`` (the anchor first); ``hidden`` ``[N, S, H]``, ``logits``
        ``[N, S, V]``; differentiable. The selector loss's teacher-forced path (speculators PR #1006
        ``models/dflash2/metrics.py`` ``compute_selector_loss``; SpecForge PR #772)."""
        gate = self.predecessor_codebook[predecessors].float() * self.hidden_projection(hidden).float()
        return logits.gather(-1, candidates).float() + torch.einsum("nsr,nskr->nsk", gate,
                                                                     self.successor_codebook[candidates].float())


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.attention_conv = self.mlp_conv = None
        if "conv" in cfg.family.parts:
            self.attention_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = GroupedDynamicCausalConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, h, cos, sin, k_ctx, v_ctx, mask, segment=None):
        """Pre-norm residual block: attention over [context ; block] keys, then the MLP. ``h``: ``[N, B, H]``.

        DFlash 2 wraps both sublayers in the conv (``segment``: block length of packed blocks).
        """
        if self.attention_conv is None:
            h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_ctx, v_ctx, mask)
            return h + self.mlp(self.post_attention_layernorm(h))
        x, dyn = self.attention_conv.prepare(self.input_layernorm(h), segment)
        h = h + self.attention_conv.finish(self.self_attn(x, cos, sin, k_ctx, v_ctx, mask), dyn, segment)
        x, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(h), segment)
        return h + self.mlp_conv.finish(self.mlp(x), dyn, segment)


#: the fix of a drafter whose drafted states are not finite (:meth:`DFlashDrafter.take_nonfinite`)
NONFINITE_FIX = ("evaluate an earlier checkpoint (this one likely diverged: check its training loss), or restore "
                 "the config.json values the training run saved")


class DFlashDrafter(nn.Module):
    """DFlash draft model (see module docstring for the maths and its sources)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        k = len(cfg.target_layer_ids)
        self.fc = nn.Linear(k * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = rotary_embedding(cfg)  # non-persistent inv_freq
        self.candidate_selector = CandidateSelector(cfg) if "selector" in cfg.family.parts else None
        self.family = cfg.family  #: what replay/, the stages and report/ ask (dflash_eval.drafter.families)
        self._nonfinite: torch.Tensor | None = None  # see take_nonfinite

    #: whether :meth:`logits` watches the drafted states for NaN / inf (:meth:`take_nonfinite`); a switch only for
    #: the bench that times its cost (``bench/replay.py --finite-check-cost``)
    check_finite = True

    def take_nonfinite(self) -> bool:
        """Whether a drafted state given to :meth:`logits` since the last call held NaN or inf (then reset).

        :meth:`logits` only accumulates a device flag (no host sync per call); a caller asks once per batch. A
        drafter whose weights overflow in its forward pass (finite weights, a diverged checkpoint), or a config
        value that breaks a norm, drafts argmax garbage, which gives tau 1.0 without an error; ``evaluate`` and ``validate_online`` refuse it (:class:`dflash_eval.core.errors.InputError`)."""
        bad, self._nonfinite = self._nonfinite, None
        return bool(bad) if bad is not None else False

    # -- context ---------------------------------------------------------------
    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(target_hidden))``: ``[N, T, K*H] -> [N, T, H]`` (layer order = ``target_layer_ids``)."""
        return self.hidden_norm(self.fc(target_hidden))

    def rope(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[N, L, hd]`` for int64 absolute ``positions`` ``[N, L]`` in ``like.dtype``."""
        return self.rotary_emb(like, positions)

    def context_kv(self, target_hidden: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context keys/values, what the reference keeps in its draft KV cache.

        Args:
            target_hidden: ``[N, T, K*H]`` concatenated target states (HF ``hidden_states[id+1]``).
            positions: ``[N, T]`` int64 absolute positions of those tokens.

        Returns:
            one ``(k, v)`` per draft layer, each ``[N, n_kv, T, head_dim]`` in the
            compute dtype; keys are ``k_norm``-ed and rotated at their positions.
        """
        ctx = self.fuse(target_hidden)
        cos, sin = self.rope(ctx, positions)
        return [layer.self_attn.kv(ctx, cos, sin) for layer in self.layers]

    # -- block -----------------------------------------------------------------
    def make_block(self, anchor_ids: torch.Tensor, embed_weight: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
        """The embedded draft blocks, the one place a DFlash block is built (replay, online loop, costs, trainer).

        Row ``n`` is ``[anchor_ids[n], MASK x (B-1)]`` embedded with the target's ``embed_tokens`` and
        multiplied by ``input_embedding_scale`` (reference ``dflash_generate``: the block is the last
        committed token followed by ``mask_token_id``; the scale is 1 for Qwen-style drafters).

        Args:
            anchor_ids: ``[N]`` int64, the last committed token of each row.
            embed_weight: ``[V, H]`` target ``embed_tokens`` on the compute device/dtype.
            block_size: B, the block length (default: the drafter's; a shortened last block passes its
                verify size).

        Returns:
            ``[N, B, H]`` in ``embed_weight.dtype``: the ``noise_embedding`` of :meth:`forward`.
        """
        B = int(block_size or self.cfg.block_size)
        ids = torch.full((anchor_ids.shape[0], B), self.cfg.mask_token_id, dtype=torch.long, device=anchor_ids.device)
        ids[:, 0] = anchor_ids
        emb = embed_weight[ids]
        if self.cfg.input_embedding_scale != 1.0:
            emb = emb * self.cfg.input_embedding_scale
        return emb

    def forward(
        self,
        noise_embedding: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        ctx_positions: torch.Tensor,
        ctx_valid: torch.Tensor,
        block_valid: torch.Tensor | None = None,
        conv_segment: int | None = None,
    ) -> torch.Tensor:
        """Draft one block per row.

        Args:
            noise_embedding: ``[N, B, H]`` target embeddings of ``[anchor, MASK x (B-1)]``
                (:meth:`make_block`).
            block_positions: ``[N, B]`` int64 absolute positions ``start .. start+B-1``.
            ctx_kv: per-layer context ``(k, v)`` ``[N, n_kv, Tc, hd]`` (:meth:`context_kv`).
            ctx_positions: ``[N, Tc]`` int64 absolute positions of the context keys.
            ctx_valid: ``[N, Tc]`` bool, True for committed context keys (positions ``< start``);
                or ``[N, B, Tc]``, per query (several anchors' blocks packed into one row, as in
                DFlash training: each block sees the context before its own anchor).
            block_valid: ``[N, B]`` bool, False for block slots past the verify size
                (the reference shortens the last block to ``max_length - start``); or
                ``[N, B, B]`` per query (packed blocks: True only within a query's own block).
            conv_segment: DFlash 2, several blocks packed in one row: the block length, where the
                conv's taps restart (default: one block per row).

        Returns:
            ``[N, B, H]`` final-normed hidden states; slot ``j >= 1`` predicts the
            token at absolute position ``start + j`` (same-position prediction).
        """
        n, b, _ = noise_embedding.shape
        if block_valid is None:
            block_valid = torch.ones(n, b, dtype=torch.bool, device=noise_embedding.device)
        masks = self._masks(block_positions, ctx_positions, ctx_valid, block_valid)
        cos, sin = self.rope(noise_embedding, block_positions)
        h = noise_embedding
        for layer, (k_ctx, v_ctx) in zip(self.layers, ctx_kv):
            attn = layer.self_attn
            h = layer(h, cos, sin, k_ctx, v_ctx, masks[attn.causal, attn.window], conv_segment)
        return self.norm(h)

    def _masks(self, block_positions, ctx_positions, ctx_valid, block_valid) -> dict:
        """Boolean masks ``[N, B, Tc+B]`` (True = visible) keyed by ``(causal, window)`` of each layer.

        ``ctx_valid`` / ``block_valid`` are ``[N, Tc]`` / ``[N, B]`` (shared by every query of a row)
        or ``[N, B, Tc]`` / ``[N, B, B]`` (per query), see :meth:`forward`.

        ``(False, None)`` is the plain DFlash mask: committed context + the whole block. Causal
        layers also need ``key_pos <= query_pos``; windowed layers ``query_pos - key_pos < window``
        (and ``key_pos - query_pos < window`` when not causal), on absolute positions, as the
        reference ``_attention_mask`` computes them on its cache (whose index is the position).
        """
        b = block_positions.shape[1]
        if ctx_valid.dim() == 2:
            ctx_valid = ctx_valid[:, None, :].expand(-1, b, -1)
        if block_valid.dim() == 2:
            block_valid = block_valid[:, None, :].expand(-1, b, -1)
        full = torch.cat([ctx_valid, block_valid], dim=2)
        kinds = {(layer.self_attn.causal, layer.self_attn.window) for layer in self.layers}
        masks = {}
        dist = None
        for causal, window in kinds:
            if not causal and window is None:
                masks[causal, window] = full
                continue
            if dist is None:
                key_pos = torch.cat([ctx_positions, block_positions], dim=1)  # [N, Tc+B]
                dist = block_positions[:, :, None] - key_pos[:, None, :]  # query_pos - key_pos
            m = full & (dist >= 0) if causal else full
            if window is not None:
                m = m & (dist < window) if causal else m & (dist < window) & (-dist < window)
            masks[causal, window] = m
        return masks

    # -- logits ----------------------------------------------------------------
    def logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Target-head logits ``[..., V]`` for drafter states ``[..., H]`` (``output_multiplier``, softcap applied).

        The states are flattened to one contiguous ``[N, H]`` matrix first: on CPU, ``F.linear`` on a
        strided 3-D view (e.g. ``h[:, 1:]``) runs about 4x slower than on its contiguous copy.
        """
        if self.check_finite:  # [H]-sized rows: cheap beside the head (bench/replay.py --finite-check-cost)
            bad = ~torch.isfinite(hidden).all()
            self._nonfinite = bad if self._nonfinite is None else self._nonfinite | bad
        logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), lm_head_weight).view(*hidden.shape[:-1], -1)
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        if self.cfg.final_logit_softcapping:
            cap = self.cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def select(self, hidden, logits, anchor_ids, temperature=0.0, predecessors=None, generator=None,
               context=None) -> Selection:
        """The candidate walk of a family whose ``selects_candidates`` is true: DFlash 2's candidate selector
        (:meth:`CandidateSelector.forward`: its arguments and result; ``context``, a
        :class:`~dflash_eval.drafter.families.WalkContext` for a family that reads one, is not read). Raises
        ValueError without one (DFlash 1)."""
        if self.candidate_selector is None:
            raise ValueError(f"a {self.family.name} drafter has no candidate walk (its drafts are each slot's argmax)")
        return self.candidate_selector(hidden, logits, anchor_ids, temperature, predecessors, generator)

    def propose(
        self,
        hidden: torch.Tensor,
        anchor_ids: torch.Tensor,
        lm_head_weight: torch.Tensor,
        temperature: float = 0.0,
        predecessors: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        context=None,
    ) -> Selection:
        """The drafts of ``N`` blocks (reference ``DFlash2DraftModel.propose`` for DFlash 2).

        Args:
            hidden: ``[N, S, H]`` states of the drafted slots (``forward(...)[:, 1:vs]``).
            anchor_ids: ``[N]`` int64 anchor tokens (the selector's first predecessor).
            lm_head_weight: target ``lm_head`` ``[V, H]``.
            temperature, predecessors, generator, context: a candidate walk only (:meth:`select`).

        Returns:
            :class:`Selection`: the candidate walk's (:meth:`select`) where the family's ``selects_candidates``,
            else the argmax of the logits per slot (greedy only).

        Raises:
            ValueError: an argmax drafter with ``temperature > 0`` (its sampling is the target-side verify's).
        """
        logits = self.logits(hidden, lm_head_weight)
        if not self.family.selects_candidates:
            if temperature > 0:
                raise ValueError("DFlash 1 drafts greedily here; sample its logits directly")
            return Selection(logits.argmax(-1))
        return self.select(hidden, logits, anchor_ids, temperature, predecessors, generator)


def load_drafter(
    folder,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> DFlashDrafter:
    """Load a stripped drafter folder (``config.json`` + ``model.safetensors``) with an exact key check; a family with
    a layout of its own loads it itself (:meth:`DrafterFamily.load <dflash_eval.drafter.families.DrafterFamily.load>`:
    LiLiCorr's backbone and head, :func:`dflash_eval.drafter.lilicorr_drafter.load_lilicorr`), in eval mode.

    Raises:
        InputError: missing/unexpected keys or shape mismatches (all listed), a bad config, a file not
            matching its sha256 in ``strip_info.json``, or a NaN/Inf tensor (named).
    """
    folder = Path(folder)
    cfg_path = folder / "config.json"
    try:
        raw = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise InputError(folder, "config.json", "not found", "run the strip_drafter rule (dflash-eval strip) first") from None
    own = family_of_config(raw, source=str(cfg_path)).load(folder, device, dtype)  # a family with its own layout
    if own is not None:
        return own.eval()
    cfg = DrafterConfig.from_dict(raw, source=str(cfg_path))
    for note in cfg.notes:
        log.warning("%s: %s", cfg_path, note)
    weights = folder / "model.safetensors"
    state = read_drafter_weights(folder)  # checksums (strip_info.json) and finite tensors verified
    model = DFlashDrafter(cfg)
    check_state_dict(state, model, str(weights))
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=dtype).eval()


def check_state_dict(state: dict[str, torch.Tensor], model: DFlashDrafter, source: str) -> None:
    """Raise :class:`InputError` listing every missing, unexpected or mis-shaped key."""
    ref = model.state_dict()
    missing = sorted(set(ref) - set(state))
    unexpected = sorted(set(state) - set(ref))
    bad_shape = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)} vs config {tuple(ref[k].shape)}"
        for k in set(ref) & set(state)
        if tuple(state[k].shape) != tuple(ref[k].shape)
    )
    if missing or unexpected or bad_shape:
        first = (missing or unexpected or [b.split(":")[0] for b in bad_shape])[0]
        def listed(keys: list[str], limit: int = 40) -> str:
            return f"{keys}" if len(keys) <= limit else f"{keys[:limit]} ... ({len(keys)} in all)"

        parts = []
        if missing:
            parts.append(f"missing keys {listed(missing)}")
        if unexpected:
            parts.append(f"unexpected keys {listed(unexpected)}")
        if bad_shape:
            parts.append(f"shape mismatches {listed(bad_shape)}")
        raise InputError(
            source, first, "; ".join(parts),
            "check that config.json belongs to these weights (num_hidden_layers, hidden_size, "
            "len(target_layer_ids) x hidden_size for fc) and that the checkpoint is a DFlash drafter",
        )
