#!/usr/bin/env python3
"""Open a report's HTML page in headless Chromium and check that every plot rendered and that
the first screen shows the per-kernel summary with its worst error-to-bound.

A copy of the page gets a small script that, on the window's load event, writes into the DOM how
many ``<img class="plot">`` elements decoded (``naturalWidth > 0``) and the text of the
summary table (``#summary``) when all of it lies inside the first screen
(:data:`FIRST_SCREEN`, a laptop's window); Chromium's ``--dump-dom`` prints that DOM, and this
script parses it. With ``--screenshot`` the original page is also captured as PNG for a human
look.

    python scripts/check_html_render.py attention-report-out/report.html --screenshot shot.png

Exit status: 0 when at least one plot exists, all of them decoded and the first screen shows a
worst error-to-bound, 1 otherwise, 2 when no Chromium is found (install: apt-get install -y
chromium).
"""

from __future__ import annotations

import argparse
import html as html_module
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FIRST_SCREEN = (1400, 900)  # width, height in CSS pixels
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
PROBE = r"""<script>
window.addEventListener('load', function () {
  var plots = Array.from(document.querySelectorAll('img.plot'));
  var ok = plots.filter(function (img) { return img.complete && img.naturalWidth > 0; });
  var out = document.createElement('div');
  out.id = 'render-check';
  out.setAttribute('data-total', plots.length);
  out.setAttribute('data-loaded', ok.length);
  out.setAttribute('data-sizes', ok.map(function (i) {
    return i.naturalWidth + 'x' + i.naturalHeight; }).join(','));
  var summary = document.getElementById('summary');
  var seen = summary && summary.getBoundingClientRect().bottom <= window.innerHeight;
  out.setAttribute('data-first-screen', seen ? summary.innerText.replace(/\s+/g, ' ') : '');
  document.body.appendChild(out);
});
</script>"""
RESULT = re.compile(
    r'id="render-check"[^>]*?data-total="(\d+)"[^>]*?data-loaded="(\d+)"[^>]*?data-sizes="([^"]*)"'
    r'[^>]*?data-first-screen="([^"]*)"'
)
WORST = re.compile(r"worst err/bound \(forward\).*?(?:\d|inf)", re.IGNORECASE)


def find_chromium(explicit: str | None = None) -> str | None:
    if explicit:
        return shutil.which(explicit) or (explicit if Path(explicit).exists() else None)
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


def _chromium(binary: str, profile: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    command = [binary, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=10000", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def check(html: Path, binary: str, screenshot: Path | None = None, timeout: float = 120) -> dict:
    """``{"total", "loaded", "sizes", "first_screen", "screenshot"}`` for ``html`` rendered by
    ``binary``; ``first_screen`` is the summary table's text when it fits the first screen."""
    with tempfile.TemporaryDirectory(prefix="report-render-") as work:
        probe_page = Path(work) / "probe.html"
        probe_page.write_text(html.read_text().replace("</body>", PROBE + "</body>"))
        dumped = _chromium(
            binary,
            str(Path(work) / "profile-dom"),
            "--dump-dom",
            "--window-size={},{}".format(*FIRST_SCREEN),
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
            "first_screen": html_module.unescape(match.group(4)),
            "screenshot": None,
        }
        if screenshot is not None:
            screenshot = screenshot.resolve()
            _chromium(
                binary,
                str(Path(work) / "profile-shot"),
                f"--screenshot={screenshot}",
                f"--window-size={FIRST_SCREEN[0]},2400",
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
    shows_worst = first_screen_shows_worst(result)
    print(
        f"check_html_render: {result['loaded']}/{result['total']} plots decoded "
        f"({', '.join(result['sizes']) or 'none'}); first screen "
        + ("shows the worst error-to-bound" if shows_worst else "LACKS the worst error-to-bound")
        + (f"; screenshot {result['screenshot']}" if result["screenshot"] else "")
    )
    plots_ok = result["total"] > 0 and result["loaded"] == result["total"]
    return 0 if plots_ok and shows_worst else 1


def first_screen_shows_worst(result: dict) -> bool:
    """Whether the first screen held the summary table, with its worst error-to-bound column."""
    return WORST.search(result["first_screen"]) is not None


if __name__ == "__main__":
    sys.exit(main())
