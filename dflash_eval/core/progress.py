"""Progress of the long stages (completions, hidden-state extraction, replay), in tokens per second.

On a terminal: a tqdm bar on stderr (log lines are routed through ``tqdm.write`` while it is
shown, so they do not break it). Elsewhere -- a Snakemake log file, SLURM output -- tqdm's
``disable=None`` turns the bar off and a plain INFO line is logged at most every
``log_every`` seconds instead, so logs stay short but a long job still shows it is moving.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger(__name__)


class Progress(contextlib.AbstractContextManager):
    """``with Progress(total, "replay") as p: ... p.update(n_tokens)`` (or call :meth:`close` at the end).

    Args:
        total: expected units (tokens), or None when unknown.
        desc: label (stage name).
        unit: unit name shown with the rate (``tok`` -> ``tok/s``).
        log_every: seconds between INFO lines when stderr is not a terminal.
        logger: where those lines go.
    """

    def __init__(self, total: int | None, desc: str, unit: str = "tok", log_every: float = 60.0,
                 logger: logging.Logger | None = None):
        self.bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, dynamic_ncols=True, file=sys.stderr,
                        disable=None, mininterval=0.5)
        self.total, self.desc, self.unit, self.log_every = total, desc, unit, log_every
        self.log = logger or log
        self.n = 0
        self.t0 = self.t_last = time.perf_counter()
        self._redirect = contextlib.ExitStack()
        if not self.bar.disable:
            self._redirect.enter_context(logging_redirect_tqdm())

    def update(self, n: int) -> None:
        """Add ``n`` units; on a non-terminal, log a line when ``log_every`` seconds have passed."""
        self.n += n
        self.bar.update(n)
        now = time.perf_counter()
        if self.bar.disable and now - self.t_last >= self.log_every:
            self.t_last = now
            of = f"/{self.total}" if self.total else ""
            self.log.info("%s: %d%s %s, %.1f %s/s", self.desc, self.n, of, self.unit, self.n / (now - self.t0), self.unit)

    @property
    def rate(self) -> float:
        """Units per second since the start."""
        return self.n / max(time.perf_counter() - self.t0, 1e-9)

    def close(self) -> None:
        """Close the bar (idempotent); also what leaving the ``with`` block does."""
        self.bar.close()
        self._redirect.close()

    def __exit__(self, *exc):
        self.close()
        return None
