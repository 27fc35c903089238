"""YAML that refuses a key written twice in one mapping (every YAML file dflash-eval reads).

PyYAML, like most YAML loaders, keeps the *last* of two equal keys in one mapping and says
nothing, so a prompt set defined twice in a config silently loses its first definition. The
YAML specification (1.2.2, section 3.2.1.3 "Node Comparison": "keys of a mapping must be
unique") makes such a document invalid; this module enforces that, naming both lines.

Used for the workflow configs and the profile in use (``rules/common.smk`` re-reads
``workflow.configfiles`` before validation; Snakemake's own loader would keep the last key), the
config schema (:func:`dflash_eval.core.schema.load_schema`) and the configs the ``watch`` command merges.
Merge keys (``<<: *anchor``) are YAML's way to override on purpose and are left alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence

import yaml

from dflash_eval.core.errors import InputError

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (no Python objects are ever constructed)."""


def _key_text(key) -> str:
    return key if isinstance(key, str) else repr(key)


def _check_node(loader: _Loader, node, path: str, file: str) -> None:
    """Raise InputError at the first mapping of ``node``'s tree holding one key twice (depth first)."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[object, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                _check_node(loader, value_node, path, file)
                continue
            try:
                key = loader.construct_object(key_node, deep=True)
                hash(key)
            except (TypeError, yaml.YAMLError):  # an unhashable (complex) key: PyYAML refuses it itself
                continue
            line = key_node.start_mark.line + 1
            where = f"{path}.{_key_text(key)}" if path else _key_text(key)
            if key in seen:
                raise InputError(file, where, f"defined twice, on line {seen[key]} and on line {line} (a YAML "
                                 "mapping's keys must be unique; a loader would silently keep only the last)",
                                 "keep one of the two (merge their contents if both are wanted)")
            seen[key] = line
            _check_node(loader, value_node, where, file)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_node(loader, item, f"{path}[{i}]", file)


def loads(text: str, file: str | os.PathLike | None = None):
    """Parse one YAML document like ``yaml.safe_load`` but refuse duplicate keys.

    Args:
        text: the document.
        file: its name, for the error messages.

    Returns:
        the document (``None`` for an empty one).

    Raises:
        InputError: a key that appears twice in one mapping (its dotted path and both line numbers
            named), or text that is not YAML (the parser's message, with line and column).
    """
    name = str(file) if file is not None else "<yaml>"
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_node(loader, node, "", name)
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        raise InputError(name, None, f"not valid YAML: {' '.join(str(err).split())}", "fix the YAML syntax") from None
    finally:
        loader.dispose()


def load_file(path: str | os.PathLike):
    """:func:`loads` of a file's text (UTF-8).

    Raises:
        InputError: the file cannot be read, is not YAML, or holds a duplicate key.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(path, None, f"cannot read it ({err})", "check the path and that it is UTF-8 text") from None
    return loads(text, path)


# --------------------------------------------------------------------------- the workflow's config files
def profile_files(argv: Sequence[str], environ=None, snakefile_dir: str | os.PathLike = ".") -> list[Path]:
    """The profile config files a Snakemake command line uses (``--profile``, ``--workflow-profile``,
    ``$SNAKEMAKE_PROFILE``, and ``profiles/default`` next to the Snakefile when no workflow profile is given),
    resolved as Snakemake resolves them (``snakemake.cli.get_profile_dir``). Missing ones are left out."""
    from snakemake.cli import get_profile_dir  # deferred: 1 s, and every --help imports this module (core.schema)

    env = os.environ if environ is None else environ
    profiles, workflow_profile = [], None
    args = list(argv)
    for i, word in enumerate(args):
        for flag in ("--profile", "--workflow-profile"):
            value = None
            if word == flag and i + 1 < len(args):
                value = args[i + 1]
            elif word.startswith(flag + "="):
                value = word[len(flag) + 1:]
            if value is None:
                continue
            if flag == "--profile":
                profiles.append(value)
            else:
                workflow_profile = value
    if not profiles and env.get("SNAKEMAKE_PROFILE"):
        profiles.append(env["SNAKEMAKE_PROFILE"])
    files = []
    for p in profiles:
        if p != "none":
            found = get_profile_dir(p)
            if found:
                files.append(Path(found[1]))
    if workflow_profile != "none":
        candidates = [Path(workflow_profile)] if workflow_profile else [Path(snakefile_dir, "profiles", "default")]
        for c in candidates:
            if c.is_file():
                files.append(c)
            elif c.is_dir():
                found = get_profile_dir(str(c))
                if found:
                    files.append(Path(found[1]))
    return files


def check_yaml_files(files: Iterable[str | os.PathLike]) -> None:
    """Re-read each YAML file strictly (:func:`dflash_eval.core.yaml_strict.load_file`).

    Raises:
        InputError: a key defined twice in one mapping (both lines named), or a file that is not YAML.
    """
    for f in files:
        if Path(f).is_file():
            load_file(f)


def check_config_files(files: Iterable[str | os.PathLike], argv: Sequence[str], snakefile_dir) -> None:
    """:func:`check_yaml_files` of the config files and the profile files in use (:func:`profile_files`).

    Raises:
        InputError: see :func:`check_yaml_files`.
    """
    check_yaml_files(list(files) + profile_files(argv, snakefile_dir=snakefile_dir))
