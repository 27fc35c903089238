"""Fixtures shared by the prompt-set tests of this folder."""

from __future__ import annotations

import pytest

from tiny import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A folder holding the tiny ChatML tokenizer (tests/tiny.py), one per test module."""
    d = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer(d)
    return d
