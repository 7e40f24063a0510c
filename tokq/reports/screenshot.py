"""A PNG of an HTML report as a browser draws it: headless Chromium (the Debian `chromium` package).

Used by `tokq report DIR --screenshot PNG` (docs, CI artifacts) and by the test that checks the plots render.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tokq.errors import ConfigError

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> str | None:
    """The browser binary: $TOKQ_CHROMIUM, else the first of BROWSERS on PATH."""
    explicit = os.environ.get("TOKQ_CHROMIUM")
    if explicit:
        return explicit if shutil.which(explicit) else None
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


def screenshot(html_path: Path, png_path: Path, width: int = 1200, height: int = 3000, timeout_s: float = 120) -> Path:
    """Render `html_path` at width x height CSS pixels into `png_path` (written atomically)."""
    browser = find_chromium()
    if browser is None:
        raise ConfigError("no Chromium found for --screenshot: install the `chromium` package (apt-get install "
                          "chromium) or set TOKQ_CHROMIUM to the browser binary")
    html_path, png_path = Path(html_path).resolve(), Path(png_path)
    if not html_path.is_file():
        raise ConfigError(f"{html_path} does not exist: render the report first")
    png_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tokq-chromium-") as profile:
        tmp = Path(profile) / "shot.png"
        # --no-sandbox: CI containers run as root, where Chromium's sandbox refuses to start; the page is
        # our own file with no scripts. A throwaway profile keeps runs independent.
        # --disable-dev-shm-usage: containers often give /dev/shm 64 MB, where Chromium crashes on tall pages.
        cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
               "--hide-scrollbars", "--no-first-run",
               f"--user-data-dir={profile}", f"--window-size={width},{height}", f"--screenshot={tmp}",
               html_path.as_uri()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not tmp.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ConfigError(f"{browser} could not screenshot {html_path} (exit {proc.returncode}: {tail[0]})")
        shutil.move(str(tmp), png_path)
    return png_path
