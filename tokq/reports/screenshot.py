"""A PNG of an HTML report as a browser draws it: headless Chromium (the Debian `chromium` package).

Used by `tokq report DIR --screenshot PNG` (docs, CI artifacts) and by the test that checks the plots render.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tokq.errors import ConfigError

log = logging.getLogger("tokq")
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
        # Chromium refuses to start sandboxed as root (CI containers)
        sandboxed = not (hasattr(os, "geteuid") and os.geteuid() == 0)
        proc = _run(browser, _flags(sandboxed, profile, width, height, tmp) + [html_path.as_uri()], timeout_s)
        if sandboxed and proc.returncode != 0 and "sandbox" in (proc.stderr or "").lower():
            # No usable sandbox on this kernel (no user namespaces, no setuid helper): the only way to draw the
            # page at all. The page is still escaped, forbids scripts (its CSP) and is cut off from the network.
            log.warning("Chromium has no usable sandbox here: screenshotting %s without it", html_path)
            proc = _run(browser, _flags(False, profile, width, height, tmp) + [html_path.as_uri()], timeout_s)
        if proc.returncode != 0 or not tmp.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ConfigError(f"{browser} could not screenshot {html_path} (exit {proc.returncode}: {tail[0]})")
        shutil.move(str(tmp), png_path)
    return png_path


def _flags(sandboxed: bool, profile: str, width: int, height: int, png: Path) -> list[str]:
    """The report page is untrusted input to the browser (names, labels and texts come from a PR's tokq.toml
    or folder names; html.py escapes them, this is the second line): Chromium's sandbox stays on unless it
    cannot run (root, or none usable), and no host name resolves, so nothing on the page can load from the
    network. Scripts stay on in the browser because headless --screenshot needs them (with
    --blink-settings=scriptEnabled=false Chromium 156 exits 0 and writes no PNG); the page's own
    Content-Security-Policy (html.CSP: no script, images only from data: URIs) keeps any script on it from
    running, here and in whatever browser opens the artifact. A throwaway profile keeps runs independent;
    --disable-dev-shm-usage: containers often give /dev/shm 64 MB, where Chromium crashes on tall pages."""
    return [*([] if sandboxed else ["--no-sandbox"]), "--headless", "--disable-gpu", "--disable-dev-shm-usage",
            "--hide-scrollbars", "--no-first-run", "--host-resolver-rules=MAP * ~NOTFOUND",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}", f"--screenshot={png}"]


def _run(browser: str, args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([browser, *args], capture_output=True, text=True, timeout=timeout_s)
