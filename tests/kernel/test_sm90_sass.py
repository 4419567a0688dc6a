"""scripts/sm90_sass.py's reading of SASS, on a hand-written listing (no compiler needed).

The script belongs to the checkout, so it is loaded from its file; an installed copy without it
skips, saying so.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sm90_sass.py"
pytestmark = [
    pytest.mark.cpu,
    pytest.mark.skipif(not SCRIPT.is_file(), reason=f"{SCRIPT} is not in this installation"),
]

# A KV loop (0x100 .. 0x1a0) whose K wait retries out of line (0x1c0 branches back to 0x110,
# across the end of the loop and the wait of the step after it), then one more wait.
LISTING = [
    (0x100, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x10], R3"),
    (0x110, "@!P0 BRA 0x1c0"),
    (0x120, "HGMMA.64x128x16.F32.BF16 R88, gdesc[UR8], RZ, !UPT, gsb0"),
    (0x130, "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR12].tnspB, R24, gsb0"),
    (0x140, "WARPGROUP.DEPBAR.LE gsb0, 0x1"),
    (0x150, "FMNMX R5, R88, R89, !PT"),
    (0x160, "MUFU.EX2 R88, R88"),
    (0x170, "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
    (0x180, "F2FP.BF16.F32.PACK_AB R152, R89, R88"),
    (0x190, "FMUL R24, R24, R6"),
    (0x1A0, "@P1 BRA 0x100"),
    (0x1B0, "WARPGROUP.DEPBAR.LE gsb0, 0x0"),
    (0x1C0, "@!P0 BRA 0x110"),
]


@pytest.fixture(scope="module")
def sm90_sass():
    spec = importlib.util.spec_from_file_location("sm90_sass_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_kv_loop_is_found_and_the_retry_span_left_out(sm90_sass) -> None:
    """Only the loop's own back branch spans both GEMMs and exactly one of each wait."""
    (body,) = sm90_sass.overlap_loops(LISTING)
    assert body[0].startswith("SYNCS") and body[-1] == "@P1 BRA 0x100"


def test_instructions_are_counted_in_their_part(sm90_sass) -> None:
    """Before the first wait, between the waits, after the second; the waits in none."""
    (body,) = sm90_sass.overlap_loops(LISTING)
    before, between, after = sm90_sass.parts(body)
    assert before == {"SYNCS": 1, "BRA": 1, "HGMMA": 2}
    assert between == {"FMNMX": 1, "MUFU": 1}
    assert after == {"F2FP": 1, "FMUL": 1, "BRA": 1}
    assert sm90_sass.opcode("@!P0 NANOSLEEP.SYNCS 0x989680") == "NANOSLEEP"
