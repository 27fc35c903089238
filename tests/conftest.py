"""Fixtures shared by several test modules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A full local run of the workflow on a tiny random target, tiny random drafters and the tiny trained
    drafter (CI profile); the reference that the SLURM and container runs are compared with."""
    from test_workflow import run_tiny_locally

    return run_tiny_locally(tmp_path_factory.mktemp("tiny") / "wf")
