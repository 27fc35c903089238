"""Render a report in headless Chromium and read back what the browser saw.

:func:`render` loads a *copy* of the page with a small probe script appended (the report
itself has no scripts), lets Chromium lay it out, and returns, from ``--dump-dom``, every
image's load state and every ``<table data-table=...>`` as rows of cell texts. Chromium is
Debian's ``chromium`` package (``.ci/run`` installs it); :data:`CHROMIUM` is None elsewhere.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
SKIP_REASON = ("headless Chromium not found (Debian: apt-get install -y --no-install-recommends chromium; .ci/run installs it): "
               "the report is not rendered in a browser here")



def need_chromium() -> None:
    """Skip the calling test where Chromium is missing; fail instead under ``DFLASH_EVAL_REQUIRE_CHROMIUM=1``
    (``.ci/run`` installs it and sets that, so CI never skips the browser checks silently)."""
    import pytest

    if CHROMIUM is None:
        if os.environ.get("DFLASH_EVAL_REQUIRE_CHROMIUM") == "1":
            pytest.fail("DFLASH_EVAL_REQUIRE_CHROMIUM=1 but " + SKIP_REASON)
        pytest.skip(SKIP_REASON)


FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

PROBE = """<script>
window.addEventListener("load", () => {
  const images = Array.from(document.images).map(i => ({alt: i.alt, complete: i.complete, width: i.naturalWidth,
                                                      height: i.naturalHeight}));
  const tables = {};
  for (const t of document.querySelectorAll("table[data-table]"))
    tables[t.dataset.table] = Array.from(t.rows).map(r => Array.from(r.cells).map(c => c.textContent.trim()));
  const pre = document.createElement("pre");
  pre.id = "dflash-probe";
  pre.textContent = JSON.stringify({images, tables, title: document.title});
  document.body.appendChild(pre);
});
</script>"""


def chromium(*args: str, user_data_dir: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run headless Chromium with the flags that work as root in containers, and a fresh profile."""
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={user_data_dir}", *args],
                          capture_output=True, text=True, timeout=timeout)


def render(page: Path, workdir: Path) -> dict:
    """``{"images": [{alt, complete, width, height}], "tables": {name: [[cell, ...], ...]}, "title"}``."""
    probe = workdir / f"probe-{page.name}"
    text = page.read_text()
    assert "</body>" in text, page
    probe.write_text(text.replace("</body>", PROBE + "\n</body>"))
    proc = chromium("--dump-dom", "--virtual-time-budget=10000", probe.resolve().as_uri(),
                    user_data_dir=workdir / "chromium-profile")
    m = re.search(r'<pre id="dflash-probe">(.*?)</pre>', proc.stdout, re.S)
    assert m, f"no probe output from Chromium (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(html.unescape(m.group(1)))


def screenshot(page: Path, png: Path, workdir: Path, width: int = 1280, height: int = 3200) -> None:
    """Full-width PNG screenshot of ``page`` (``height`` px tall)."""
    proc = chromium(f"--screenshot={png}", f"--window-size={width},{height}", "--hide-scrollbars",
                    page.resolve().as_uri(), user_data_dir=workdir / "chromium-profile-shot")
    assert png.is_file(), proc.stderr[-3000:]
