"""Go-to-definition in a checkout: jedi follows every package import of the representative
modules to its file under src/attention_crossval/ (the install is checked in
test_installed_package.py, on the installed copy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.jedi_imports import unresolved

pytestmark = pytest.mark.cpu

SRC = Path(__file__).resolve().parents[1] / "src"


def test_every_package_import_leads_to_its_file_in_the_checkout() -> None:
    looked_up, misses = unresolved(SRC / "attention_crossval", [SRC])
    assert looked_up >= 90, looked_up  # the representative modules were read
    assert misses == []


def test_an_import_path_without_the_package_resolves_nothing(tmp_path: Path) -> None:
    """The check can fail: with src/ off the import path no package import is followed."""
    looked_up, misses = unresolved(SRC / "attention_crossval", [tmp_path])
    assert len(misses) == looked_up > 0
