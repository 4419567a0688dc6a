"""Standalone reproducers (report/repro.py, docs/repro.md): the script of a broken kernel's
failure exits 1 in a fresh venv holding only numpy (and the user's kernel module), and 0 once
the kernel is fixed; the case is trimmed only where the failure survives; every declared known
finding's trigger case gives a script that parses and calls the right public API.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from attention_crossval.kernel.contract.known_findings import trigger_case
from attention_crossval.kernel.harness.registry import resolve
from attention_crossval.kernel.harness.verdict import Finding, Verdict
from attention_crossval.properties.kernel_suite import KNOWN_FINDING_KERNELS
from attention_crossval.properties.replay import save_case
from attention_crossval.reference.case import AttentionCase, AttentionResult, Mask
from attention_crossval.reference.precision import cast_input
from attention_crossval.report.cli import main as report_main
from attention_crossval.report.repro import KNOWN_ATTEMPTS, write_repro
from attention_crossval.report.repro_case import gather, trim

pytestmark = pytest.mark.cpu

# A user's kernel, standalone: NumPy only; the framework's types are imported when the framework
# runs it, and stand-ins serve when a reproducer imports it alone. ``plain`` spells no public
# call (the reproducer falls back to the adapter); ``spelled`` names ``attention`` itself.
USER_KERNEL = '''
"""A user's float32 softmax attention for fp16 inputs, causal optional."""

import numpy as np

BUG = {bug}  # True: the causal mask is ignored

def attention(q, k, v, scale, causal):
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * np.float32(scale)
    if causal and not BUG:
        Sq, Sk = s.shape[-2:]
        s = np.where(np.arange(Sk)[None, :] <= np.arange(Sq)[:, None] + Sk - Sq, s, -np.inf)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    total = p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p / total, v).astype(np.float16)
    return o.astype(np.float64), (m + np.log(total))[..., 0].astype(np.float64)


try:
    from attention_crossval import AttentionResult
except ImportError:  # imported alone, by a reproducer

    class AttentionResult:
        def __init__(self, o, lse):
            self.o, self.lse = o, lse


class Plain:
    @property
    def spec(self):
        from attention_crossval import KernelSpec

        return KernelSpec(
            name="tiny", device="cpu", dtypes={{"float16"}}, head_dims={{16}},
            mask_kinds={{"causal"}}, gqa=True, tile_m=16, tile_n=16,
        )

    def __call__(self, case):
        o, lse = attention(case.q, case.k, case.v, case.softmax_scale, case.mask.causal)
        return AttentionResult(o=o, lse=lse)


class Spelled(Plain):
    def repro_call(self, case):
        from attention_crossval import PublicCall

        return PublicCall(
            api="tiny_kernel.attention",
            imports=("import tiny_kernel",),
            lines=("o, lse = tiny_kernel.attention(q, k, v, SCALE, CAUSAL)",),
        )


plain, spelled = Plain(), Spelled()
'''


def _importable_from(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's kernel module in ``folder`` importable here and in the workers (which inherit
    PYTHONPATH, set or not in the caller's environment)."""
    monkeypatch.syspath_prepend(str(folder))
    paths = [str(folder), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path for path in paths if path))


@pytest.fixture(scope="session")
def numpy_only_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with numpy and nothing else (made once per session: about 20 s)."""
    venv = tmp_path_factory.mktemp("numpy-only") / "venv"
    made = subprocess.run(
        [sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, check=False
    )
    if made.returncode != 0:
        pytest.skip(f"cannot create a venv here: {made.stderr.strip()[-300:]}")
    python = venv / "bin" / "python"
    pip = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "numpy"],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if pip.returncode != 0:
        pytest.skip(f"cannot install numpy into a fresh venv (offline?): {pip.stderr[-300:]}")
    return python


def _causal_case() -> AttentionCase:
    rng = np.random.default_rng(0)
    q, k, v = (cast_input(rng.standard_normal((2, 24, 2, 16)), "float16") for _ in "qkv")
    return AttentionCase(q, k, v, mask=Mask(causal=True), label="dist=gaussian")


def _user_kernel(directory: Path, *, bug: bool) -> None:
    (directory / "tiny_kernel.py").write_text(USER_KERNEL.format(bug=bug))


def _run(python: Path, script: Path, pythonpath: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": pythonpath}
    return subprocess.run(
        [str(python), str(script)], capture_output=True, text=True, env=env, timeout=120
    )


@pytest.mark.parametrize("attr", ["spelled", "plain"])
def test_the_script_fails_alone_with_numpy_until_the_kernel_is_fixed(
    attr: str,
    numpy_only_python: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    user = tmp_path / "user"
    user.mkdir()
    _user_kernel(user, bug=True)
    _importable_from(user, monkeypatch)
    path = save_case(_causal_case(), tmp_path / "cases", kernel=f"tiny_kernel:{attr}")
    out = tmp_path / "repro"
    assert report_main(["repro", str(path), "--out", str(out)]) == 0
    script = (out / "repro.py").read_text()
    assert "attention_crossval" not in script
    ast.parse(script)
    expected_call = "tiny_kernel.attention(" if attr == "spelled" else "result = kernel(make_case("
    assert expected_call in script
    report = (out / "REPORT.md").read_text()
    assert "trimmed from B=2" in report and "batch 0 of 2" in report, report

    broken = _run(numpy_only_python, out / "repro.py", str(user))
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "FAIL: the bug is there" in broken.stdout
    assert "worst element" in broken.stdout
    _user_kernel(user, bug=False)
    fixed = _run(numpy_only_python, out / "repro.py", str(user))
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "PASS" in fixed.stdout


def test_the_script_exits_2_when_the_kernel_cannot_be_imported(
    numpy_only_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    user = tmp_path / "user"
    user.mkdir()
    _user_kernel(user, bug=True)
    _importable_from(user, monkeypatch)
    adapter = resolve("tiny_kernel:spelled")
    out = write_repro(adapter, _causal_case(), tmp_path / "repro", kernel="tiny_kernel:spelled")
    done = _run(numpy_only_python, out / "repro.py", str(tmp_path / "nowhere"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot import the kernel" in done.stderr


def test_a_project_mutant_reproduces_through_the_report_command(tmp_path: Path) -> None:
    kernel = "attention_crossval.testing.broken.cpu_mistakes:no_causal_mask"
    path = save_case(_causal_case(), tmp_path, kernel=kernel)
    out = tmp_path / "repro"
    assert report_main(["repro", str(path), "--out", str(out)]) == 0
    done = subprocess.run(
        [sys.executable, str(out / "repro.py")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "outside the bound" in done.stdout


def test_a_passing_kernel_gets_no_reproducer(tmp_path: Path, capsys) -> None:
    path = save_case(_causal_case(), tmp_path, kernel="streaming-fa")
    assert report_main(["repro", str(path), "--out", str(tmp_path / "repro")]) == 2
    assert "nothing to reproduce" in capsys.readouterr().err


def test_a_trim_is_kept_only_while_the_check_still_fails() -> None:
    """Only batch 1 with query head 3 (kv head 1) fails: each trim step keeps exactly that."""
    marks = np.zeros((3, 4, 4, 8))
    for b in range(3):
        for h in range(4):
            marks[b, :, h] = 10 * b + h
    q = cast_input(marks, "float16")
    k = v = cast_input(np.ones((3, 4, 2, 8)), "float16")
    case = AttentionCase(q, k, v)

    def run(candidate: AttentionCase) -> Verdict:
        failing = (candidate.q.astype(np.float64) == 13).any()
        return Verdict("stub", "", (Finding("bound", "x"),) if failing else ())

    trimmed, _, trims = trim(case, run(case), "bound", run)
    assert (trimmed.B, trimmed.Hq, trimmed.Hkv) == (1, 1, 1)
    assert trimmed.q.astype(np.float64).max() == 13
    assert trims == ("batch 1 of 3", "kv head 1 of 2", "query head 1 of 2")


def _known_forward_findings() -> list:
    params = []
    for name in KNOWN_FINDING_KERNELS:
        spec = resolve(name).spec
        for index, known in enumerate(spec.known_findings):
            if not known.backward:
                params.append(pytest.param(name, index, id=f"{spec.name}-{known.name}-{index}"))
    return params


# The public API each built-in's script must call.
PUBLIC_API = {
    "sdpa": "torch.nn.functional.scaled_dot_product_attention(",
    "flash-attn-cute": "flash_attn_varlen_func(",
    "flex-attention": "torch.compile(flex_attention)(",
}


@pytest.mark.parametrize(("kernel", "index"), _known_forward_findings())
def test_each_known_findings_trigger_gives_a_reproducer(
    kernel: str, index: int, tmp_path: Path
) -> None:
    adapter = resolve(kernel)
    known = adapter.spec.known_findings[index]
    case = trigger_case(adapter.spec, known)
    cpu = adapter.spec.device == "cpu"
    out = write_repro(
        adapter, case, tmp_path, kernel=kernel, check=known.check, trimmed=False, run=cpu
    )
    script = (out / "repro.py").read_text()
    ast.parse(script)
    api = next((line for prefix, line in PUBLIC_API.items() if kernel.startswith(prefix)), None)
    if api is not None:
        assert api in script and "attention_crossval" not in script
    else:  # the project's own CPU kernels: their adapter is their public API
        assert f"kernel = {kernel.replace(':', '.')}()" in script
    assert known.reason in (out / "REPORT.md").read_text()
    if cpu:
        done = subprocess.run(
            [sys.executable, str(out / "repro.py")], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 1, done.stdout + done.stderr


def test_a_check_no_script_applies_is_refused(tmp_path: Path) -> None:
    adapter = resolve("attention_crossval.testing.broken.cpu_faults:wrong_shape")
    with pytest.raises(ValueError, match="none is one a standalone script can apply"):
        write_repro(adapter, _causal_case(), tmp_path, kernel=None)


def test_the_script_reference_is_float64_attention(tmp_path: Path) -> None:
    """The script's few-line reference agrees with the streaming tier in float64 on a case
    with every feature it spells: GQA, window, lengths, an explicit mask, softcap and sink."""
    from attention_crossval.reference.precision import StreamingPrecision
    from attention_crossval.reference.streaming import streaming_attention
    from attention_crossval.report.repro_script import _masks, _reference

    rng = np.random.default_rng(3)
    q = cast_input(rng.standard_normal((2, 9, 4, 8)), "bfloat16")
    k, v = (cast_input(rng.standard_normal((2, 11, 2, 8)), "bfloat16") for _ in "kv")
    explicit = rng.random((2, 1, 9, 11)) < 0.8
    mask = Mask(causal=True, window_left=4, q_lengths=(9, 5), k_lengths=(11, 7), explicit=explicit)
    case = AttentionCase(
        q, k, v, mask=mask, softcap=3.0, sink=np.array([0.5, -1, 2, 0], np.float32)
    )
    namespace = {
        "np": np,
        "SCALE": case.softmax_scale,
        "CAUSAL": True,
        "WINDOW": (4, None),
        "Q_LENGTHS": [9, 5],
        "K_LENGTHS": [11, 7],
        "SOFTCAP": 3.0,
        "SINK": [0.5, -1.0, 2.0, 0.0],
        "EXPLICIT": explicit,
    }
    exec(textwrap.dedent(_masks(case) + "\n\n" + _reference(case)), namespace)
    as32 = [getattr(case, n).astype(np.float32) for n in "qkv"]
    o, lse = namespace["reference"](*as32)
    expected = streaming_attention(case, StreamingPrecision.float64())
    valid = np.arange(9)[None, :] < np.array([9, 5])[:, None]
    np.testing.assert_allclose(o[valid], expected.o[valid], rtol=1e-12, atol=1e-12)
    rows = valid[:, None, :].repeat(4, axis=1)
    np.testing.assert_allclose(lse[rows], expected.lse[rows], rtol=1e-12)


def test_repro_dir_writes_a_reproducer_for_a_failing_kernel_test(tmp_path: Path) -> None:
    """``--repro-dir``: the free property of a mutant fails; the plugin writes the shrunk
    case's reproducer, names it under the failure, and the script exits 1."""
    kernel = "attention_crossval.testing.broken.cpu_mistakes:no_causal_mask"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "--pyargs",
            "attention_crossval.properties.test_kernels",
            "-m",
            "kernel",
            "--kernel",
            kernel,
            "-k",
            "test_kernel_passes_every_check",
            "--repro-dir",
            str(tmp_path / "repros"),
            "--report-dir",
            str(tmp_path / "cases"),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stdout[-2000:]
    scripts = list((tmp_path / "repros").glob("repro-*/repro.py"))
    assert len(scripts) == 1, done.stdout[-2000:]
    assert f"reproducer: python {scripts[0]}" in done.stdout
    again = subprocess.run(
        [sys.executable, str(scripts[0])], capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 1, again.stdout + again.stderr


def _hidden_rows_case() -> AttentionCase:
    rng = np.random.default_rng(1)
    q, k, v = (cast_input(rng.standard_normal((1, 16, 1, 16)), "float16") for _ in "qkv")
    explicit = np.ones((1, 1, 16, 16), dtype=bool)
    explicit[..., :4, :] = False  # four rows see no key
    return AttentionCase(q, k, v, mask=Mask(explicit=explicit))


BROKEN = "attention_crossval.testing.broken"


@pytest.mark.parametrize(
    ("kernel", "make_case", "check"),
    [
        (f"{BROKEN}.cpu_mistakes:wrong_row_sum", _causal_case, "lse"),
        (f"{BROKEN}.cpu_faults:flaky", _causal_case, "determinism"),
        (f"{BROKEN}.cpu_faults:raises", _causal_case, "error"),
        (f"{BROKEN}.cpu_faults:empty_finite_lse", _hidden_rows_case, "empty-rows"),
    ],
    ids=["lse", "determinism", "error", "empty-rows"],
)
def test_each_check_s_script_fails_on_its_mutant(
    kernel: str, make_case, check: str, tmp_path: Path
) -> None:
    path = save_case(make_case(), tmp_path, kernel=kernel)
    out = tmp_path / "repro"
    assert report_main(["repro", str(path), "--out", str(out), "--check", check]) == 0
    assert f"`{check}` fails" in (out / "REPORT.md").read_text()
    done = subprocess.run(
        [sys.executable, str(out / "repro.py")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL: the bug is there" in done.stdout


# A user's dense kernel with explicit masks, standalone (reached through the fallback): masked
# weights are 0, but 0 * NaN = NaN, so NaN in a hidden K/V row reaches every row (hidden-nan);
# ``unshifted`` also skips the max subtraction, so large scores overflow (nonfinite).
DENSE_KERNEL = """
import numpy as np

try:
    from attention_crossval import AttentionResult
except ImportError:  # imported alone, by a reproducer

    class AttentionResult:
        def __init__(self, o, lse):
            self.o, self.lse = o, lse


class Dense:
    checks = frozenset({"hidden-nan", "determinism", "nonfinite"})

    def __init__(self, shift):
        self.shift = shift

    @property
    def spec(self):
        from attention_crossval import KernelSpec

        return KernelSpec(
            name="dense", device="cpu", dtypes={"float16"}, head_dims={16},
            mask_kinds={"explicit"}, gqa=False, tile_m=16, tile_n=16,
        )

    def __call__(self, case):
        q, k, v = (np.asarray(x, np.float32) for x in (case.q, case.k, case.v))
        s = np.einsum("bqhd,bkhd->bhqk", q, k) * np.float32(case.softmax_scale)
        s = np.where(case.mask.explicit, s, -np.inf)
        m = s.max(-1, keepdims=True) if self.shift else np.zeros_like(s[..., :1])
        p = np.exp(s - m)
        total = p.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", p / total, v).astype(np.float16)
        return AttentionResult(o=o.astype(np.float64), lse=(m + np.log(total))[..., 0] * 1.0)


masked, unshifted = Dense(True), Dense(False)
"""


@pytest.mark.parametrize(
    ("attr", "check", "scale"), [("masked", "hidden-nan", 1.0), ("unshifted", "nonfinite", 8.0)]
)
def test_the_fallback_reproduces_hidden_nan_and_nonfinite(
    attr: str, check: str, scale: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "dense_kernel.py").write_text(DENSE_KERNEL)
    _importable_from(tmp_path, monkeypatch)
    rng = np.random.default_rng(2)
    q, k, v = (cast_input(rng.standard_normal((1, 16, 1, 16)) * scale, "float16") for _ in "qkv")
    explicit = np.ones((1, 1, 16, 17), dtype=bool)
    explicit[..., 0] = False  # key 0 hidden from every row
    k, v = (np.concatenate([x[:, :1], x], axis=1) for x in (k, v))
    case = AttentionCase(q, k, v, mask=Mask(explicit=explicit))
    path = save_case(case, tmp_path / "cases", kernel=f"dense_kernel:{attr}")
    out = tmp_path / "repro"
    assert report_main(["repro", str(path), "--out", str(out), "--check", check]) == 0
    script = (out / "repro.py").read_text()
    assert "attention_crossval" not in script and "make_case(" in script
    env = os.environ | {"PYTHONPATH": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(out / "repro.py")], capture_output=True, text=True, env=env
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAIL: the bug is there" in done.stdout


# The CUDA spellings run on the CPU once their device names are swapped: torch's math SDPA and
# uncompiled FlexAttention compute the same masked softmax, so the findings that come from the
# masking itself (NaN through a mask) show there too.
ON_CPU = {
    ".cuda()": "",
    "torch.cuda.synchronize()": "pass",
    "device='cuda'": "device='cpu'",
    "torch.compile(flex_attention)": "flex_attention",
}


@pytest.mark.parametrize(
    ("kernel", "check"), [("sdpa-math", "padding-read"), ("flex-attention", "hidden-nan")]
)
def test_a_torch_spelling_runs_and_reproduces_on_the_cpu(
    kernel: str, check: str, tmp_path: Path
) -> None:
    """The finding's script exits 1; the ``bound`` script of the same case exits 0, so the
    spelled call computes the case's attention (its mask, scale, GQA) within the bound."""
    pytest.importorskip("torch")
    adapter = resolve(kernel)
    known = next(k for k in adapter.spec.known_findings if k.check == check and not k.backward)
    case = trigger_case(adapter.spec, known)
    for shown, status in ((check, 1), ("bound", 0)):
        out = write_repro(
            adapter, case, tmp_path / shown, kernel=kernel, check=shown, trimmed=False, run=False
        )
        script = (out / "repro.py").read_text()
        for cuda, cpu in ON_CPU.items():
            script = script.replace(cuda, cpu)
        (out / "repro_cpu.py").write_text(script)
        done = subprocess.run(
            [sys.executable, str(out / "repro_cpu.py")], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == status, done.stdout + done.stderr


def test_known_writes_a_folder_per_finding_and_says_when_one_is_fixed(tmp_path: Path) -> None:
    """``--known KERNEL``: a folder per forward known finding from its trigger case (its script
    exits 1); a kernel whose declared finding no longer shows (``fixed``) exits 1, naming it."""
    kernel = f"{BROKEN}.cpu_known:reads_padding"
    assert report_main(["repro", "--known", kernel, "--out", str(tmp_path / "known")]) == 0
    (script,) = (tmp_path / "known").glob("*/repro.py")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.returncode == 1, done.stdout + done.stderr
    fixed = f"{BROKEN}.cpu_known:fixed"
    assert report_main(["repro", "--known", fixed, "--out", str(tmp_path / "fixed")]) == 1
    assert not list((tmp_path / "fixed").glob("*/repro.py"))


class Racy:
    """streaming-fa, with O moved by one ulp on every odd call after the first ``quiet`` calls:
    a race that the first runs of a case can miss."""

    checks = frozenset({"determinism"})

    def __init__(self, quiet: int) -> None:
        self.inner = resolve("streaming-fa")
        self.spec = self.inner.spec
        self.quiet, self.calls = quiet, 0

    def __call__(self, case: AttentionCase) -> AttentionResult:
        self.calls += 1
        result = self.inner(case)
        if self.calls > self.quiet and self.calls % 2:
            return AttentionResult(o=np.nextafter(result.o, np.inf), lse=result.lse)
        return result


def test_a_race_gets_several_runs_to_fail_its_check() -> None:
    """A known finding's check that fails on some runs only (flash-attn-cute's paged
    nondeterminism passed one run of its trigger on the H200) gets KNOWN_ATTEMPTS runs: one
    run (two calls) of the racy kernel passes, the third run fails."""
    case = _causal_case()
    with pytest.raises(ValueError, match="did not fail on this case"):
        gather(Racy(quiet=4), case, check="determinism", trimmed=False)
    evidence = gather(
        Racy(quiet=4), case, check="determinism", trimmed=False, attempts=KNOWN_ATTEMPTS
    )
    assert evidence.check == "determinism"
    with pytest.raises(ValueError, match=f"in {KNOWN_ATTEMPTS} runs"):
        gather(Racy(quiet=100), case, check="determinism", trimmed=False, attempts=KNOWN_ATTEMPTS)
