"""Fixtures of this package's own tests (pytest loads this file for tests in this folder only)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_html_render.py"


@pytest.fixture
def html_render() -> SimpleNamespace:
    """``scripts/check_html_render.py`` (``check``, ``first_screen_shows_worst``) and the Chromium
    binary it drives; the test is skipped without the checkout's script or without Chromium."""
    if not SCRIPT.is_file():
        pytest.skip("needs the source checkout (scripts/check_html_render.py)")
    spec = importlib.util.spec_from_file_location("check_html_render", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    binary = script.find_chromium()
    if binary is None:
        pytest.skip("no Chromium on PATH (apt-get install -y chromium) to render the HTML report")
    return SimpleNamespace(script=script, binary=binary)
