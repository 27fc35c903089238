"""Stage ``demo_checkpoint`` (rule ``demo_checkpoint``): a training-style ``.pt`` checkpoint for a demo entry.

Each ``checkpoints.demo`` entry wraps a committed stripped drafter (the trained demo drafters in
``demo/drafters/``) or is randomly initialised; the written file has the layout real trainers use
(:mod:`dflash_eval.drafter.demo`), so the demo's checkpoints go through ``strip_drafter`` like a user's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from dflash_eval.core.errors import InputError
from dflash_eval.core.options import schema_type
from dflash_eval.drafter.config import DrafterConfig
from dflash_eval.drafter.demo import DEMO_FAMILIES, drafter_config_for_target, pick_mask_token, random_init_, save_training_checkpoint
from dflash_eval.drafter.model import DFlashDrafter
from dflash_eval.target.spec import TargetSpec, load_embed_and_head

log = logging.getLogger(__name__)


def _layer_ids(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x != ""]


def add_arguments(p) -> None:
    p.add_argument("--target", required=True, help="target HF folder")
    p.add_argument("--drafter", default=None, help="stripped drafter folder to wrap (trained demo drafters)")
    p.add_argument("--random-init", action="store_true", help="random weights (labelled random_init in the checkpoint)")
    p.add_argument("--layer-ids", type=_layer_ids, default=None, help="target_layer_ids of a random-init drafter")
    p.add_argument("--block-size", type=schema_type("checkpoints.demo.block_size"), default=16,
                   help="block size of a random-init drafter (>= 2)")
    p.add_argument("--num-layers", type=schema_type("checkpoints.demo.num_layers"), default=1,
                   help="draft decoder layers of a random-init drafter")
    p.add_argument("--step", type=schema_type("checkpoints.demo.step"), default=0,
                   help="training step recorded in the checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--variant", choices=DEMO_FAMILIES, default=DEMO_FAMILIES[0],
                   help="variant of a random-init drafter (dflash2: DFlash 2, dflash_eval.drafter.demo.DFLASH2_DEMO_FIELDS)")
    p.add_argument("--out", required=True, help="the .pt checkpoint")


def main(args, opts) -> None:
    write_demo_checkpoint(target_dir=args.target, out=args.out, drafter_dir=args.drafter, random_init=args.random_init,
                          layer_ids=args.layer_ids, block_size=args.block_size, num_layers=args.num_layers,
                          step=args.step, seed=args.seed, variant=args.variant)


def write_demo_checkpoint(target_dir, out, drafter_dir=None, random_init=False, layer_ids=None, block_size=16,
                          num_layers=1, step=0, seed=0, variant="dflash") -> Path:
    """Write a training-style ``.pt`` demo checkpoint (layout: :mod:`dflash_eval.drafter.demo`).

    Either wraps a committed stripped drafter (``drafter_dir``: the trained demo drafters) or
    random-initialises one (``random_init``; labelled so in the checkpoint and every table; its
    mask token follows :func:`pick_mask_token`, as the trainer's; ``variant`` ``'dflash2'``: a DFlash 2
    drafter, :func:`~dflash_eval.drafter.demo.drafter_config_for_target`). A wrapped drafter gets an optimizer
    state in AdamW's layout with zero moments (a realistic file without a training step); a random-init one is
    written without it (the drafter and the target's embedding / LM head copies only: at a real drafter's size the
    float32 moments were ~9 GB of a ~12 GB file).

    Raises:
        InputError: neither ``drafter_dir`` nor ``random_init``.
    """
    spec = TargetSpec.read(target_dir)
    if drafter_dir:
        cfg_dict = json.loads((Path(drafter_dir) / "config.json").read_text())
        model = DFlashDrafter(DrafterConfig.from_dict(cfg_dict, source=str(drafter_dir)))
        model.load_state_dict(load_file(str(Path(drafter_dir) / "model.safetensors")), strict=True)
    elif random_init:
        from transformers import AutoTokenizer  # deferred: --help stays transformers-free (tests/core/test_startup.py); --random-init only

        try:
            mask = pick_mask_token(AutoTokenizer.from_pretrained(str(spec.path)))
        except InputError:
            mask = spec.vocab_size - 1
            log.warning("%s: the tokenizer has no unused special token; the random-init demo drafter uses the last "
                        "embedding row %d as its mask token (an ordinary token of this vocabulary)", spec.path, mask)
        cfg_dict = drafter_config_for_target(spec, layer_ids, block_size, num_layers, mask, variant)
        torch.manual_seed(seed)
        model = random_init_(DFlashDrafter(DrafterConfig.from_dict(cfg_dict)))
    else:
        raise InputError(None, "checkpoints.demo", "entry has neither drafter nor random_init", "set one of them")
    model = model.to(torch.bfloat16)
    opt_state = None
    if drafter_dir:  # a random-init drafter is written alone: float32 moments would be 4x its bf16 weights
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for p in model.parameters():
            opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": torch.zeros_like(p, dtype=torch.float32),
                            "exp_avg_sq": torch.zeros_like(p, dtype=torch.float32)}
        opt_state = opt.state_dict()
    embed, head = load_embed_and_head(spec)
    return save_training_checkpoint(out, model, cfg_dict, opt_state, embed, head, step,
                                    random_init=bool(random_init and not drafter_dir))
