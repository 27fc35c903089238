"""Static check of the Python sources: pyflakes' rules (ruff ``F``): undefined names, unused imports
and variables, redefinitions. An undefined name in a branch the other tests do not reach would
otherwise surface only in a user's run (as a ``NameError``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_pyflakes_rules_pass():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "F", "--output-format",
                           "concise", "dflash_eval", "bench", "scripts", "tests"], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
