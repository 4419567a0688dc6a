"""The README's own-kernel instructions, exactly as written, after the README's install.

The README installs the checkout editable (``pip install -e '.[dev,kernels]'``, which is what CI
does too), writes the adapter it shows into the user's ``kernel/fa.py`` (a folder named like
this project's own) and runs the command it shows from the user's repository. That route failed
once: the checkout's own ``kernel/`` came first on the import path. The test reads the code block
and the command from README.md, so the README cannot drift from what works.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
if not README.is_file():  # an installed copy: these tests need the checkout
    pytest.skip("needs the source checkout (README.md)", allow_module_level=True)


def _editable_checkout() -> Path | None:
    """The checkout this environment's editable install points at, or None (a build's
    ``*.egg-info`` in the checkout is a distribution too, without the install's record)."""
    for dist in importlib.metadata.distributions(name="attention-crossval"):
        info = json.loads(dist.read_text("direct_url.json") or "{}")
        if info.get("dir_info", {}).get("editable"):
            return Path(info["url"].removeprefix("file://")).resolve()
    return None


def _readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_shows_an_adapter_and_the_command_to_check_it() -> None:
    adapter = next(b for b in _readme_blocks("python") if b.startswith("# kernel/fa.py"))
    compile(adapter, "kernel/fa.py", "exec")
    commands = [line for b in _readme_blocks("bash") for line in b.splitlines()]
    assert any("--kernel kernel.fa:adapter" in c and c.startswith("pytest ") for c in commands)


@pytest.mark.skipif(
    _editable_checkout() != ROOT.resolve(),
    reason="needs the README's install: this checkout installed editable (pip install -e)",
)
def test_the_readme_command_passes_from_a_repository_with_its_own_kernel_folder(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("CI", "PYTHONPATH", "ATTENTION_CROSSVAL_PROFILE", "HYPOTHESIS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    adapter = next(b for b in _readme_blocks("python") if b.startswith("# kernel/fa.py"))
    pytester.mkpydir("kernel").joinpath("fa.py").write_text(adapter)
    command = next(
        line
        for b in _readme_blocks("bash")
        for line in b.splitlines()
        if line.startswith("pytest ") and "--kernel kernel.fa:adapter" in line
    )
    script = Path(sys.executable).parent / "pytest"  # the README's literal command, this venv's
    result = pytester.run(str(script), *shlex.split(command)[1:], "-p", "no:cacheprovider")
    assert result.ret == 0, "\n".join(result.outlines[-30:] + result.errlines[-30:])
    assert re.search(r"\b1[0-9] passed\b", result.outlines[-1]), result.outlines[-1]
