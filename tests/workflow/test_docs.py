"""The documentation: a short README that links every docs page, links and anchors that resolve,
a layout table that matches the tree, no tracker issue numbers in prose, a cache-reading example
that runs.

Each check is a function returning the problems it found, tested twice: on the repository (no
problems) and on a hand-built case where the exact problems are known, so none of them can pass
by finding nothing. Anchors follow GitHub's heading slugs (github-slugger, which github.com uses:
lower-case, punctuation other than ``-`` and ``_`` removed, each space a ``-``, ``-1``, ``-2``, ...
appended to repeated headings).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
ISSUE_RE = re.compile(r"\b[Ii]ssues? [0-9]+")
LINK_RE = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE_RE = re.compile(r"^\s*(```|~~~)")
HEADING_RE = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


# --------------------------------------------------------------------------- helpers
def repo_files(root: Path = REPO) -> list[str]:
    """Paths (relative, POSIX) of the files git tracks or would track (untracked, not ignored)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                         cwd=root, check=True, capture_output=True).stdout.decode()
    return sorted({p for p in out.split("\0") if p and (root / p).is_file()})


def tree_paths(files: list[str]) -> set[str]:
    """The files and every folder above them (``a/b.py`` gives ``a/b.py`` and ``a``)."""
    paths = set(files)
    for f in files:
        parts = f.split("/")
        paths.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return paths


def prose_lines(text: str):
    """(line number, line) of a markdown text outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE_RE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def github_slug(heading: str) -> str:
    """The anchor github.com gives a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = re.sub(r"[^\w\- ]", "", text.lower())  # \w: letters, digits, marks, '_'
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor of a markdown text's headings, repeated headings numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(text):
        m = HEADING_RE.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(text: str):
    """(line number, target) of every inline link outside code blocks and code spans."""
    for n, line in prose_lines(text):
        for m in LINK_RE.finditer(re.sub(r"`[^`]*`", "", line)):
            yield n, m.group(1)


def broken_links(md_files: list[str], root: Path, files: list[str]) -> list[str]:
    """Relative links of ``md_files`` whose file is not in the tree, or whose ``#anchor`` is not a
    heading of the markdown file it points to; external links (``https:``, ``mailto:``) are not
    fetched."""
    tree = tree_paths(files)
    problems = []
    for md in md_files:
        text = (root / md).read_text(encoding="utf-8")
        for n, target in links(text):
            if SCHEME_RE.match(target):
                continue
            path, _, anchor = target.partition("#")
            path = path.split("?")[0]
            if path.startswith("/"):
                problems.append(f"{md}:{n}: {target}: absolute link (write it relative to {md})")
                continue
            if path:
                resolved = (Path(md).parent / path).as_posix()
                resolved = normalise(resolved)
                if resolved not in tree:
                    problems.append(f"{md}:{n}: {target}: {resolved or '.'} is not in the repository")
                    continue
            else:
                resolved = md
            if anchor and resolved.endswith(".md") and anchor not in anchors(
                    (root / resolved).read_text(encoding="utf-8")):
                problems.append(f"{md}:{n}: {target}: no heading '#{anchor}' in {resolved}")
    return problems


def normalise(path: str) -> str:
    """``a/./b/../c`` -> ``a/c``; ``..`` above the repository root is kept."""
    parts: list[str] = []
    for p in path.split("/"):
        if p == ".." and parts and parts[-1] != "..":
            parts.pop()
        elif p not in ("", "."):
            parts.append(p)
    return "/".join(parts)


def unlinked_docs(readme: str, files: list[str]) -> list[str]:
    """``docs/*.md`` pages the README does not link to."""
    linked = set()
    for _, target in links(readme):
        path = target.partition("#")[0]
        if not SCHEME_RE.match(target) and path:
            linked.add(normalise(path))
    pages = [f for f in files if re.fullmatch(r"docs/[^/]+\.md", f)]
    return [p for p in pages if p not in linked]


def layout_paths(readme: str) -> list[str]:
    """The paths named in the first column of the README's ``## Layout`` table; a row indented
    with ``&nbsp;`` names paths inside the last unindented row's folder."""
    section = re.search(r"^## Layout\n(.*?)(?=^## )", readme + "\n## end", re.S | re.M)
    assert section, "README has no '## Layout' section"
    paths, folder = [], ""
    for line in section.group(1).splitlines():
        if not line.startswith("|") or re.match(r"^\|\s*(-+|Path)\s*\|", line):
            continue
        cell = line.split("|")[1].strip()
        nested = cell.startswith("&nbsp;")
        names = re.findall(r"`([^`]+)`", cell)
        if not nested:
            folder = names[0] if len(names) == 1 and names[0].endswith("/") else ""
        paths += [(folder if nested else "") + n for n in names]
    return paths


def layout_problems(readme: str, files: list[str]) -> list[str]:
    """Layout rows naming what is not in the tree, and top-level folders the table leaves out."""
    tree = tree_paths(files)
    named = layout_paths(readme)
    problems = [f"layout table: {p} does not exist" for p in named if p.rstrip("/") not in tree]
    top = {f.split("/")[0] for f in files if "/" in f and not f.startswith(".")}
    listed = {p.rstrip("/").split("/")[0] for p in named}
    problems += [f"layout table: folder {d}/ is not listed" for d in sorted(top - listed)]
    return problems


def issue_mentions(root: Path, files: list[str]) -> list[str]:
    """``issue N`` in tracked text files other than Python sources (their prose is for readers who
    do not have the project's tracker; public references such as 'vLLM PR #17908' are fine)."""
    hits = []
    for f in files:
        if f.endswith(".py"):
            continue
        data = (root / f).read_bytes()
        if b"\0" in data:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for m in ISSUE_RE.finditer(line):
                hits.append(f"{f}:{n}: {m.group(0)!r}")
    return hits


# --------------------------------------------------------------------------- the repository
@pytest.fixture(scope="module")
def files():
    return repo_files()


@pytest.fixture(scope="module")
def readme():
    return (REPO / "README.md").read_text(encoding="utf-8")


def test_readme_is_short(readme):
    n = len(readme.splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move details to docs/"


def test_readme_links_every_docs_page(readme, files):
    assert [f for f in files if f.startswith("docs/")], "no docs/ pages found"
    assert unlinked_docs(readme, files) == []


def test_links_and_anchors_resolve(files):
    md = [f for f in files if f.endswith(".md")]
    assert "README.md" in md and "docs/design.md" in md
    assert broken_links(md, REPO, files) == []


def test_layout_table_matches_the_tree(readme, files):
    assert layout_problems(readme, files) == []


def test_no_issue_numbers_in_prose(files):
    assert issue_mentions(REPO, files) == []


def test_cache_reading_example_runs(tmp_path):
    """The h5py example of docs/cache-format.md, run on a cache written by the real writer."""
    import torch

    from dflash_eval.cache.writer import write_cache

    text = (REPO / "docs" / "cache-format.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    example_path = "results/demo/cache/humaneval.h5"
    assert example_path in code
    x = (torch.arange(5 * 2 * 8, dtype=torch.float32).reshape(5, 2, 8) / 7).to(torch.bfloat16)
    cache = tmp_path / "c.h5"
    write_cache(cache, {"format": "dflash-eval/hidden-state-cache", "format_version": 6,
                        "target_layer_ids": [3, 7], "dtype": "bfloat16"},
                [{"sample_id": "s0", "input_ids": [5, 6, 7, 8, 9], "prompt_len": 2, "hidden": x,
                  "target_argmax": [6, 7, 8, 9, 1], "stop_reason": "eos", "max_new_tokens": 8}])
    scope: dict = {}
    exec(compile(code.replace(example_path, str(cache)), "docs/cache-format.md", "exec"), scope)
    assert scope["layers"] == [3, 7] and scope["sample_ids"] == ["s0"]
    assert scope["completion_ids"].tolist() == [7, 8, 9]
    assert scope["hidden"].dtype == np.float32 and scope["hidden"].shape == (5, 2, 8)
    np.testing.assert_array_equal(scope["hidden"], x.float().numpy())  # bf16 -> float32 is exact
    np.testing.assert_array_equal(scope["state"], x[:, 0].float().numpy())
    assert isinstance(scope["runs"], list)


# --------------------------------------------------------------------------- the checks can fail
def test_slugs_follow_github():
    assert github_slug("tau → speedup") == "tau--speedup"
    assert github_slug("Online validation (`validate_online`)") == "online-validation-validate_online"
    assert github_slug("The tau table: `tau.csv`, `tau.parquet`") == "the-tau-table-taucsv-tauparquet"
    assert github_slug("See [the docs](docs/x.md) now") == "see-the-docs-now"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n### A b!\n") == {"a", "a-1", "a-b"}


def _tree(tmp_path, pages: dict[str, str]) -> list[str]:
    for name, text in pages.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    return sorted(pages)


def test_broken_links_are_found(tmp_path):
    files = _tree(tmp_path, {
        "README.md": "# Top\n[ok](docs/a.md#part-two) [gone](docs/missing.md) [bad](docs/a.md#nope)\n"
                     "[dir](docs/) [web](https://example.org/x#y) [self](#top) [selfbad](#none)\n"
                     "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n",
        "docs/a.md": "# A\n## Part two\n[up](../README.md#top) [out](../../x.md) [abs](/README.md)\n",
    })
    assert broken_links(files, tmp_path, files) == [
        "README.md:2: docs/missing.md: docs/missing.md is not in the repository",
        "README.md:2: docs/a.md#nope: no heading '#nope' in docs/a.md",
        "README.md:3: #none: no heading '#none' in README.md",
        "docs/a.md:3: ../../x.md: ../x.md is not in the repository",
        "docs/a.md:3: /README.md: absolute link (write it relative to docs/a.md)",
    ]


def test_unlinked_docs_are_found():
    files = ["README.md", "docs/a.md", "docs/b.md", "docs/img/c.md"]
    assert unlinked_docs("[a](docs/a.md#x) [b](https://x/docs/b.md)\n", files) == ["docs/b.md"]
    assert unlinked_docs("[a](./docs/a.md) [b](docs/b.md)\n", files) == []


def test_layout_problems_are_found():
    readme = ("## Layout\n\n| Path | What |\n| --- | --- |\n| `Snakefile` | x |\n| `pkg/` | y |\n"
              "| &nbsp;&nbsp;`a.py`, `gone.py` | z |\n| `old/` | w |\n\n## Next\n")
    files = ["Snakefile", "pkg/a.py", "tests/t.py", ".ci/run"]
    assert layout_paths(readme) == ["Snakefile", "pkg/", "pkg/a.py", "pkg/gone.py", "old/"]
    assert layout_problems(readme, files) == ["layout table: pkg/gone.py does not exist",
                                              "layout table: old/ does not exist",
                                              "layout table: folder tests/ is not listed"]


def test_issue_mentions_are_found(tmp_path):
    files = _tree(tmp_path, {"a.md": "fine: vLLM PR #17908, z-lab/dflash #170\nas issue 11 asks\n",
                             "b.smk": "# Issues 8 and 9\n", "c.py": "# issue 3 (Python: listed, not checked)\n"})
    (tmp_path / "d.bin").write_bytes(b"\0issue 4")
    assert issue_mentions(tmp_path, files + ["d.bin"]) == ["a.md:2: 'issue 11'", "b.smk:1: 'Issues 8'"]
