"""Tiny random hybrid (Gated DeltaNet + full attention) targets for CPU tests and the GPU bench.

Built from transformers' own config classes (``Qwen3_5TextConfig`` / ``Qwen3NextConfig``):
``Qwen3_5TextConfig`` -> ``Qwen3_5ForCausalLM``, the VLM layout ``Qwen3_5Config`` ->
``Qwen3_5ForConditionalGeneration`` (text weights under ``model.language_model.*``,
config under ``text_config``), and ``Qwen3NextConfig`` with a small MoE. Layer
pattern ``[linear, linear, linear, full]`` (``full_attention_interval=4``), so the
last layer is full attention as in the real checkpoints. Saved folders hold
config.json, model.safetensors and a word-level tokenizer (ids ``t0 .. t{V-1}``,
``<pad>`` = 0, ``<eos>`` = 1), loadable by ``dflash_eval.target.model.load_target``.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128

#: GDN / attention shapes of the tiny models (head dims 32 keep the torch chunk path fast on CPU)
TEXT_KW = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, full_attention_interval=4, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    tie_word_embeddings=False,
)
QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
               "mrope_section": [2, 1, 1], "mrope_interleaved": True}


def qwen35_text_config(**over):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**{**TEXT_KW, "rope_parameters": QWEN35_ROPE, **over})


def qwen3_next_config(**over):
    from transformers import Qwen3NextConfig

    kw = {**TEXT_KW, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 32, "partial_rotary_factor": 0.25, **over}
    return Qwen3NextConfig(**kw)


def build_model(kind: str = "qwen3_5", seed: int = 0, **over):
    """Random-init model in float32, eval mode. ``kind``: ``qwen3_5`` | ``qwen3_5_vlm`` | ``qwen3_next``."""
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    if kind == "qwen3_5":
        return Qwen3_5ForCausalLM(qwen35_text_config(**over)).eval()
    if kind == "qwen3_next":
        return Qwen3NextForCausalLM(qwen3_next_config(**over)).eval()
    if kind == "qwen3_5_vlm":
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=TEXT_KW["hidden_size"],
                      patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
        cfg = Qwen3_5Config(text_config=qwen35_text_config(**over).to_dict(), vision_config=vision,
                            tie_word_embeddings=False)
        return Qwen3_5ForConditionalGeneration(cfg).eval()
    raise ValueError(f"unknown tiny hybrid kind {kind!r}")


def save_tokenizer(out_dir, vocab_size: int = VOCAB) -> None:
    """Word-level tokenizer over ``<pad> <eos> t2 .. t{V-1}`` (whitespace split), with a plain chat template.

    Self-contained (not tests/tiny.py's fixture) so pad/eos ids stay inside the tiny vocabulary.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(out_dir)


def save_target(out_dir, kind: str = "qwen3_5", seed: int = 0, dtype=torch.float32, **over) -> Path:
    """Build a tiny random target and save it as an HF folder (weights in ``dtype``) with a tokenizer."""
    out_dir = Path(out_dir)
    model = build_model(kind, seed, **over).to(dtype)
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir, model.config.get_text_config().vocab_size)
    return out_dir


def write_completions(path, n: int, seed: int = 0, prompt_len=(6, 20), completion_len=(10, 80),
                      vocab_size: int = VOCAB) -> Path:
    """Synthetic completions JSONL (random ids >= 2, varied lengths) in the completions-stage format."""
    import json

    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        p = int(torch.randint(prompt_len[0], prompt_len[1] + 1, (1,), generator=g))
        c = int(torch.randint(completion_len[0], completion_len[1] + 1, (1,), generator=g))
        ids = torch.randint(2, vocab_size, (p + c,), generator=g).tolist()
        rows.append({"id": f"s{i}", "prompt_ids": ids[:p], "completion_ids": ids[p:], "stop_reason": "length",
                     "max_new_tokens": c})
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Path(path)


#: the GPU benches' user-scale hybrid (bench/completions_gpu.py, bench/extraction.py): a Qwen3.5-9B-like layout
#: (hidden 4096, 32 layers, 3 GDN : 1 gated attention, GDN 16 QK / 32 V heads x 128, attention 16 / 4 heads x 256,
#: FFN 12288) with a 151,936-token vocabulary: 8.16B parameters, random init
HYBRID_7B = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}
#: the llama beside it (Llama-3-8B layout: hidden 4096, 32 layers, 32 / 8 heads, FFN 14336, vocab 128256): 8.03B
LLAMA_8B = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
}
