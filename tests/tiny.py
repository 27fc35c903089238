"""Tiny offline fixtures: a byte-level BPE chat tokenizer and random-init causal LMs.

Everything is built in-process (no hub access) and saved as ordinary HF
folders, so the code under test loads them exactly as it loads a real target.
"""

from __future__ import annotations

from pathlib import Path

import torch

#: special tokens, ids 0..3 in this order
ENDOFTEXT, IM_START, IM_END, PAD = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END, PAD]

#: ChatML; like Qwen3's, an empty think block is emitted when enable_thinking is explicitly false
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)

_CORPUS = [
    "Write a solution to the following problem and make sure that it passes the tests:",
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Summarize the main ideas of the text in bullet points.",
    "<think>\n\n</think>\n\n",
    "user\nassistant\nsystem\n",
]


def make_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 384):
    """Train a byte-level BPE (``tokenizers``) on a few sentences and save it as an HF tokenizer.

    Specials: ``<|endoftext|>`` (0, unk/bos), ``<|im_start|>`` (1), ``<|im_end|>``
    (2, eos), ``<|pad|>`` (3, pad); ChatML :data:`CHAT_TEMPLATE`. Any text encodes
    (byte alphabet), and decode(encode(x)) == x.

    Returns:
        the ``PreTrainedTokenizerFast`` (also saved with ``save_pretrained`` in ``out_dir``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=ENDOFTEXT, eos_token=IM_END, pad_token=PAD,
                                 unk_token=ENDOFTEXT, chat_template=CHAT_TEMPLATE)
    hf.save_pretrained(str(out_dir))
    return hf


def make_tiny_target(out_dir: str | Path, arch: str = "llama", num_layers: int = 4, hidden: int = 64, seed: int = 0,
                     tie_word_embeddings: bool = False, initializer_range: float = 0.2) -> Path:
    """Save a random-init tiny causal LM as an HF target folder.

    bf16 ``model.safetensors`` + ``config.json`` + the tiny tokenizer +
    ``generation_config.json`` (eos = ``<|im_end|>``, pad = ``<|pad|>``).
    ``vocab_size`` = the tokenizer's length. ``initializer_range`` is larger than
    the usual 0.02 so logits are peaked enough that greedy argmax has no near-ties.

    Args:
        out_dir: folder to create.
        arch: ``"llama"`` (LlamaForCausalLM) or ``"qwen3"`` (Qwen3ForCausalLM, with q/k norms).
        num_layers, hidden: decoder layers and hidden size (4 heads, 2 KV heads).
        seed: ``torch.manual_seed`` for the weights.
        tie_word_embeddings: share ``lm_head`` with ``embed_tokens``.

    Returns:
        ``Path(out_dir)``.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen3Config

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = make_tiny_tokenizer(out_dir)
    eos, pad, bos = tok.convert_tokens_to_ids([IM_END, PAD, ENDOFTEXT])
    common = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
                  bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=tie_word_embeddings,
                  initializer_range=initializer_range)
    if arch == "llama":
        cfg = LlamaConfig(**common)
    elif arch == "qwen3":
        cfg = Qwen3Config(**common)
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    model.to(torch.bfloat16).save_pretrained(str(out_dir))
    return out_dir


def make_random_drafter(out_dir: str | Path, target_dir: str | Path, layer_ids: list[int], block_size: int,
                        seed: int = 0):
    """A random-init one-layer DFlash drafter for the tiny target, saved as an HF folder (config.json +
    model.safetensors) in ``out_dir``; its mask token is the target's last vocabulary id.

    Returns:
        ``(config dict, the drafter module)``.
    """
    import json

    from safetensors.torch import save_file

    from dflash_eval.drafter.demo import drafter_config_for_target
    from dflash_eval.drafter.model import DFlashDrafter
    from dflash_eval.drafter.config import DrafterConfig
    from dflash_eval.target.spec import TargetSpec

    cfg = drafter_config_for_target(target_dir, layer_ids=layer_ids, block_size=block_size, num_layers=1,
                                    mask_token_id=TargetSpec.read(target_dir).vocab_size - 1)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(DrafterConfig.from_dict(cfg))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(out_dir / "model.safetensors"))
    return cfg, drafter


#: three short chat-shaped prompts (token ids of the tiny tokenizer) shared by the tiny pipelines
TINY_PROMPTS = [[1, 40, 41, 42, 2, 1, 50], [1, 60, 61, 2, 1, 50, 51, 52], [1, 70, 2, 1, 50]]


def make_tiny_pipeline(d: str | Path, layer_ids: list[int], block_size: int, max_new_tokens: int,
                       prompt_ids: list[list[int]] = TINY_PROMPTS) -> dict:
    """The tiny target (llama, 4 layers, hidden 64, seed 0), a random drafter for it in ``d/drafter``,
    ``d/prompts.jsonl`` and their greedy float32 completions ``d/c.jsonl`` (the caches are the caller's).

    Returns:
        ``{"dir": d, "target_dir": d/target}``.
    """
    import json

    from dflash_eval.stages.completions import generate_completions

    d = Path(d)
    target_dir = make_tiny_target(d / "target", arch="llama", num_layers=4, hidden=64, seed=0)
    make_random_drafter(d / "drafter", target_dir, layer_ids, block_size=block_size)
    prompts = [{"id": f"p{i}", "source": "file", "prompt": "", "text": "", "prompt_ids": p}
               for i, p in enumerate(prompt_ids)]
    (d / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    generate_completions(target_dir, d / "prompts.jsonl", d / "c.jsonl", max_new_tokens=max_new_tokens,
                         batch_size=len(prompts), device="cpu", dtype="float32")
    return {"dir": d, "target_dir": target_dir}
