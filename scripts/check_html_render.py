#!/usr/bin/env python3
"""Open a report's HTML page in headless Chromium and check that every plot rendered.

A copy of the page gets a small script that, on the window's load event, writes how many
``<img class="plot">`` elements decoded (``naturalWidth > 0``) into the DOM; Chromium's
``--dump-dom`` prints that DOM, and this script parses it. With ``--screenshot`` the original
page is also captured as PNG for a human look.

    python scripts/check_html_render.py attention-report-out/report.html --screenshot shot.png

Exit status: 0 when at least one plot exists and all of them decoded, 1 otherwise, 2 when no
Chromium is found (install: apt-get install -y chromium).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
)
PROBE = """<script>
window.addEventListener('load', function () {
  var plots = Array.from(document.querySelectorAll('img.plot'));
  var ok = plots.filter(function (img) { return img.complete && img.naturalWidth > 0; });
  var out = document.createElement('div');
  out.id = 'render-check';
  out.setAttribute('data-total', plots.length);
  out.setAttribute('data-loaded', ok.length);
  out.setAttribute('data-sizes', ok.map(function (i) {
    return i.naturalWidth + 'x' + i.naturalHeight; }).join(','));
  document.body.appendChild(out);
});
</script>"""
RESULT = re.compile(
    r'id="render-check"[^>]*?data-total="(\d+)"[^>]*?data-loaded="(\d+)"[^>]*?data-sizes="([^"]*)"'
)


def find_chromium(explicit: str | None = None) -> str | None:
    if explicit:
        return shutil.which(explicit) or (explicit if Path(explicit).exists() else None)
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


def _chromium(binary: str, profile: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    command = [binary, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=10000", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def check(html: Path, binary: str, screenshot: Path | None = None, timeout: float = 120) -> dict:
    """``{"total", "loaded", "sizes", "screenshot"}`` for ``html`` rendered by ``binary``."""
    with tempfile.TemporaryDirectory(prefix="report-render-") as work:
        probe_page = Path(work) / "probe.html"
        probe_page.write_text(html.read_text().replace("</body>", PROBE + "</body>"))
        dumped = _chromium(
            binary,
            str(Path(work) / "profile-dom"),
            "--dump-dom",
            probe_page.as_uri(),
            timeout=timeout,
        )
        match = RESULT.search(dumped.stdout)
        if match is None:
            raise RuntimeError(
                f"no render result in Chromium's DOM dump (rc {dumped.returncode}): "
                f"{dumped.stderr.strip()[-500:]}"
            )
        result = {
            "total": int(match.group(1)),
            "loaded": int(match.group(2)),
            "sizes": [s for s in match.group(3).split(",") if s],
            "screenshot": None,
        }
        if screenshot is not None:
            screenshot = screenshot.resolve()
            _chromium(
                binary,
                str(Path(work) / "profile-shot"),
                f"--screenshot={screenshot}",
                "--window-size=1400,2400",
                html.resolve().as_uri(),
                timeout=timeout,
            )
            result["screenshot"] = str(screenshot) if screenshot.exists() else None
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("html", type=Path)
    parser.add_argument(
        "--screenshot", type=Path, help="also save a PNG screenshot of the page here"
    )
    parser.add_argument(
        "--chromium",
        help=f"Chromium binary (default: first of {', '.join(CHROMIUM_NAMES)} on PATH)",
    )
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args(argv)
    binary = find_chromium(args.chromium)
    if binary is None:
        print("check_html_render: no Chromium found (apt-get install -y chromium)", file=sys.stderr)
        return 2
    result = check(args.html, binary, args.screenshot, args.timeout)
    print(
        f"check_html_render: {result['loaded']}/{result['total']} plots decoded "
        f"({', '.join(result['sizes']) or 'none'})"
        + (f"; screenshot {result['screenshot']}" if result["screenshot"] else "")
    )
    return 0 if result["total"] > 0 and result["loaded"] == result["total"] else 1


if __name__ == "__main__":
    sys.exit(main())
