"""Progress: no bar and throttled INFO lines when stderr is not a terminal (logs, CI)."""

from __future__ import annotations

import logging

from dflash_eval.core.progress import Progress


def test_logs_instead_of_a_bar_off_terminal(caplog):
    caplog.set_level(logging.INFO, logger="dflash_eval.core.progress")
    with Progress(10, "replay", log_every=0.0) as p:  # pytest captures stderr: not a TTY
        assert p.bar.disable
        p.update(4)
        p.update(6)
    lines = [r.getMessage() for r in caplog.records]
    assert [ln.split(",")[0] for ln in lines] == ["replay: 4/10 tok", "replay: 10/10 tok"]
    assert all(ln.endswith(" tok/s") for ln in lines) and p.n == 10


def test_quiet_between_intervals(caplog):
    caplog.set_level(logging.INFO, logger="dflash_eval.core.progress")
    with Progress(None, "completions", log_every=3600.0) as p:
        for _ in range(100):
            p.update(3)
    assert caplog.records == [] and p.n == 300 and p.rate > 0
