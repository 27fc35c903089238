"""Crash-safe writes: temporaries of killed runs are removed, SIGTERM/SIGINT clean up through the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash_eval.core.errors import atomic_dir, atomic_path, partial_path, remove_done_links, remove_stale_temps

REPO = Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def test_stale_temps_of_killed_writers_are_removed_live_ones_kept(tmp_path):
    dest = tmp_path / "out.json"
    # A writer killed with SIGKILL inside atomic_path: its temporary stays behind.
    script = textwrap.dedent(f"""
        import os, signal
        from dflash_eval.core.errors import atomic_path
        with atomic_path({str(dest)!r}) as tmp:
            tmp.write_text("half")
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], env=_env())
    assert proc.returncode == -signal.SIGKILL
    stale = [p for p in tmp_path.iterdir() if p.name.startswith(".out.json.")]
    assert len(stale) == 1 and stale[0].name.endswith(".tmp")
    # A live writer of the same output (holding its temporary's lock) is left alone...
    live = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from dflash_eval.core.errors import atomic_path
        with atomic_path({str(dest)!r}) as tmp:
            print(tmp.name, flush=True)
            sys.stdin.read()
            tmp.write_text("live")
    """)], env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    live_name = live.stdout.readline().strip()
    assert (tmp_path / live_name).exists()
    assert [p.name for p in remove_stale_temps(dest)] == []  # the live one, and the stale one it removed on entry
    assert not stale[0].exists()
    # ...and the next write of the output finishes with no temporary left.
    live.communicate("")
    assert live.returncode == 0 and dest.read_text() == "live"
    with atomic_path(dest) as tmp:
        tmp.write_text("final")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_stale_temp_folders_are_removed(tmp_path):
    dest = tmp_path / "drafter"
    (tmp_path / ".drafter.abc_1234").mkdir()  # what atomic_dir's mkdtemp leaves after a SIGKILL
    (tmp_path / ".drafter.abc_1234" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "drafter.partial").write_bytes(b"resumable work is never a temporary")
    with atomic_dir(dest) as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "drafter.partial"]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_a_stage_cleanly(tmp_path, sig, code):
    """SIGTERM (SLURM time limit) / SIGINT during a stage's atomic write: temporaries removed, exit 128+signal."""
    dest = tmp_path / "report.md"
    script = textwrap.dedent(f"""
        import os, sys, time
        from dflash_eval import cli
        from dflash_eval.core import errors
        from dflash_eval.stages import summary

        def slow_stage(args, opts):
            with errors.atomic_path({str(dest)!r}) as tmp:
                tmp.write_text("partial report")
                print("writing", flush=True)
                time.sleep(60)

        summary.main = slow_stage
        sys.exit(cli.main(["summary", "--evals", "x", "--out-csv", "a", "--out-parquet", "b"]))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert f"interrupted by {signal.Signals(sig).name}" in err
    assert list(tmp_path.iterdir()) == []


def test_done_links(tmp_path):
    out = tmp_path / "c.h5"
    out.write_bytes(b"cache")
    os.link(out, partial_path(out))
    other = tmp_path / "d.h5"
    other.write_bytes(b"cache")
    partial_path(other).write_bytes(b"unfinished work of a killed run")
    assert remove_done_links([out, other, tmp_path / "none.h5"]) == [partial_path(out)]
    assert out.exists() and partial_path(other).exists()
