"""The text of a standalone reproducer script (``repro.py``): numpy, the kernel's public call
(:class:`kernel.public_call.PublicCall`) and, when that call needs it, torch.

The script holds the case's constants, loads its arrays (``case.npz`` beside it, or inline when
small), computes softmax attention in float64 in a few lines that use only what the case has
(GQA, softcap, sink, each mask kind), runs the kernel and applies the one check that failed,
printing expected against got where it is worst. It exits 1 while the check fails, 0 once it
passes. Nothing in it imports this package (but the project call of this package's own kernels).
"""

from __future__ import annotations

import base64
import io
import pprint
import textwrap
from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_crossval.kernel.contract.public_call import PublicCall
from attention_crossval.reference.case import AttentionCase, CausalAlignment

# The checks a script can apply on its own, and what each compares.
SCRIPT_CHECKS = {
    "bound": "O against float64 attention, element by element, within the derived bound",
    "lse": "the LSE against float64 attention, row by row, within the derived bound",
    "empty-rows": "rows that see no key: O = 0 and LSE = -inf (or the sink)",
    "nonfinite": "O and LSE finite on every row that must be written, clean inputs",
    "padding-read": "rows finite with zero padding but not with NaN padding",
    "hidden-nan": "rows finite until NaN goes into K/V rows that no query sees",
    "determinism": "ten runs on the same inputs agree bit for bit (a race shows on some only)",
    "error": "the call returns instead of raising",
}
INLINE_BYTES = 3000  # a compressed case up to this size goes inline, as base64


@dataclass(frozen=True)
class ScriptCase:
    """What the script needs besides the arrays: the failed check, the kernel's declared row
    conventions, and the figures recorded when the folder was written."""

    case: AttentionCase
    check: str
    call: PublicCall
    title: str
    recorded: dict[str, Any]
    empty_rows_nan: bool = False
    padded_rows_unwritten: bool = False


def case_arrays(case: AttentionCase, extra: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The arrays the script loads: q, k, v in their dtype's bits (bfloat16 as uint16), the
    explicit mask when there is one, and ``extra`` (the per-element bounds)."""
    arrays = {
        name: getattr(case, name).view(np.uint16)
        if case.dtype == "bfloat16"
        else getattr(case, name)
        for name in "qkv"
    }
    if case.mask.explicit is not None:
        arrays["explicit"] = np.asarray(case.mask.explicit)
    return arrays | extra


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """``arrays`` as compressed .npz bytes."""
    stream = io.BytesIO()
    np.savez_compressed(stream, **arrays)
    return stream.getvalue()


def render(spec: ScriptCase, data: bytes) -> tuple[str, bool]:
    """``(script text, inline)``: the script; ``inline`` when ``data`` (the .npz) is small
    enough to sit in it as base64, else the script reads ``case.npz`` beside it."""
    if spec.check not in SCRIPT_CHECKS:
        raise ValueError(
            f"check={spec.check!r}: a standalone script checks one of {sorted(SCRIPT_CHECKS)}"
        )
    inline = len(data) <= INLINE_BYTES
    parts = [
        _header(spec, inline),
        _constants(spec),
        _loader(data if inline else None),
        _DTYPES + (_TORCH if spec.call.torch else ""),
        _masks(spec.case),
        _reference(spec.case),
        _case_container() if "make_case(" in "\n".join(spec.call.lines) else "",
        _run_kernel(spec.call),
        _CHECKS[spec.check],
        _MAIN,
    ]
    return "\n\n".join(part.strip("\n") for part in parts if part) + "\n", inline


def _header(spec: ScriptCase, inline: bool) -> str:
    needs = ["numpy"] + (["torch with a CUDA GPU"] if spec.call.torch else [])
    needs.append(f"the kernel's package ({spec.call.api})")
    where = "inline below (base64 .npz)" if inline else "in case.npz beside this script"
    about = textwrap.fill(
        f"Check: {spec.check}: {SCRIPT_CHECKS[spec.check]}. Needs: {', '.join(needs)}. "
        f"The case's inputs are {where}.",
        width=96,
    )
    imports = textwrap.indent("\n".join(dict.fromkeys(spec.call.imports)), "    ")
    return f'''#!/usr/bin/env python3
"""{textwrap.fill(spec.title, width=96)}

{about}

    python repro.py    # exit 1 while the bug is there, 0 once it is fixed (2: cannot run)
"""

import sys
from pathlib import Path

import numpy as np

try:  # the kernel's public API
{imports}
except ImportError as error:
    print(f"cannot import the kernel: {{error}}", file=sys.stderr)
    sys.exit(2)'''


def _constants(spec: ScriptCase) -> str:
    case, mask = spec.case, spec.case.mask
    sink = None if case.sink is None else [float(x) for x in case.sink]
    lines = [
        f"DTYPE = {case.dtype!r}",
        f"SCALE = {case.softmax_scale!r}  # softmax scale",
        f"CAUSAL = {mask.causal!r}",
        f"ALIGNMENT = {mask.alignment.value!r}  # the causal diagonal when Sq != Sk",
        f"WINDOW = {(mask.window_left, mask.window_right)!r}  # (left, right); None: unbounded",
        f"Q_LENGTHS = {None if mask.q_lengths is None else list(mask.q_lengths)!r}"
        "  # valid query rows per batch; None: all",
        f"K_LENGTHS = {None if mask.k_lengths is None else list(mask.k_lengths)!r}"
        "  # valid keys per batch; None: all",
        f"SOFTCAP = {case.softcap!r}  # logits = SOFTCAP * tanh(SCALE * q.k / SOFTCAP)",
        f"SINK = {sink!r}  # one extra logit per query head, no value",
        f"PAGE_SIZE = {case.page_size!r}  # K/V through a page table of pages this long",
        f"NUM_SPLITS = {case.num_splits!r}",
        f"EMPTY_ROWS_NAN = {spec.empty_rows_nan!r}  # declared: a row that sees no key gives NaN",
        f"PADDED_ROWS_UNWRITTEN = {spec.padded_rows_unwritten!r}"
        "  # declared: rows past Q_LENGTHS are left unwritten",
        "# What attention-crossval recorded when it wrote this script (its derivation of the",
        "# bound from the kernel's declared precision chain, reference/bounds.py):",
        f"RECORDED = {pprint.pformat(spec.recorded, width=88, sort_dicts=False)}",
    ]
    return "\n".join(lines)


def _loader(data: bytes | None) -> str:
    if data is None:
        return """def load_inputs():
    with np.load(Path(__file__).with_name("case.npz")) as data:
        return {name: data[name] for name in data.files}


INPUTS = load_inputs()
EXPLICIT = INPUTS.get("explicit")  # a boolean mask broadcast to [B, Hq, Sq, Sk], True = visible"""
    text = base64.b64encode(data).decode()
    chunks = "\n".join(f'    "{text[i : i + 76]}"' for i in range(0, len(text), 76))
    return f"""CASE_NPZ = (
{chunks}
)


def load_inputs():
    import base64
    import io

    with np.load(io.BytesIO(base64.b64decode(CASE_NPZ))) as data:
        return {{name: data[name] for name in data.files}}


INPUTS = load_inputs()
EXPLICIT = INPUTS.get("explicit")  # a boolean mask broadcast to [B, Hq, Sq, Sk], True = visible"""


_DTYPES = '''
def as_float32(stored):
    """The exact input values as float32 (bfloat16 is stored as its 16-bit pattern)."""
    if DTYPE == "bfloat16":
        return (stored.astype(np.uint32) << 16).view(np.float32)
    return stored.astype(np.float32)


def as_dtype(x):
    """``x`` (exact values) as a NumPy array of the input dtype."""
    if DTYPE == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x.astype(DTYPE)
'''

_TORCH = '''
def to_torch(x):
    """``x`` (exact values, float32) as a CUDA tensor of the input dtype."""
    import torch

    if DTYPE == "bfloat16":
        bits = (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(x.astype(DTYPE))).cuda()
'''


def _masks(case: AttentionCase) -> str:
    mask = case.mask
    lines = [
        "def visible_keys(B, Sq, Sk):",
        '    """Bool [B, Hq or 1, Sq, Sk]: the keys each query row may see."""',
        "    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]",
        "    planes = []",
        "    for b in range(B):",
        "        q_len = Sq if Q_LENGTHS is None else Q_LENGTHS[b]",
        "        k_len = Sk if K_LENGTHS is None else K_LENGTHS[b]",
        "        seen = (i < q_len) & (j < k_len)",
    ]
    if mask.causal or "window" in mask.kinds:
        offset = "k_len - q_len" if mask.alignment is CausalAlignment.BOTTOM_RIGHT else "0"
        lines.append(f"        diagonal = i + {offset}  # {mask.alignment.value} alignment")
    if mask.causal:
        lines.append("        seen &= j <= diagonal")
    if mask.window_left is not None:
        lines.append("        seen &= j >= diagonal - WINDOW[0]")
    if mask.window_right is not None:
        lines.append("        seen &= j <= diagonal + WINDOW[1]")
    lines += ["        planes.append(seen)", "    visible = np.stack(planes)[:, None]"]
    if mask.explicit is not None:
        lines.append("    visible = visible & EXPLICIT")
    lines.append("    return visible")
    lines += [
        "",
        "",
        "def rows_seeing_keys(B, Sq, Hq, Sk):",
        '    """Bool [B, Sq, Hq]: rows that see at least one key."""',
        "    seen = visible_keys(B, Sq, Sk).any(axis=-1)",
        "    return np.broadcast_to(seen, (B, Hq, Sq)).transpose(0, 2, 1)",
        "",
        "",
        "def valid_rows(B, Sq, Hq):",
        '    """Bool [B, Sq, Hq]: query rows inside Q_LENGTHS."""',
        "    lengths = np.array([Sq] * B if Q_LENGTHS is None else Q_LENGTHS)",
        "    valid = np.arange(Sq)[None, :] < lengths[:, None]",
        "    return np.broadcast_to(valid[..., None], (B, Sq, Hq))",
    ]
    return "\n".join(lines)


def _reference(case: AttentionCase) -> str:
    lines = [
        "def reference(q, k, v):",
        '    """Softmax attention in float64 on the exact inputs: o [B, Sq, Hq, Dv] and',
        '    lse [B, Hq, Sq]."""',
        "    B, Sq, Hq, _ = q.shape",
        "    Sk = k.shape[1]",
    ]
    if case.group_size > 1:
        lines += [
            "    heads = np.arange(Hq) // (Hq // k.shape[2])  # GQA: the kv head of each head",
            "    k, v = k[:, :, heads], v[:, :, heads]",
        ]
    lines.append(
        '    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64)) * SCALE'
    )
    if case.softcap is not None:
        lines.append("    s = SOFTCAP * np.tanh(s / SOFTCAP)")
    lines += [
        "    s = np.where(visible_keys(B, Sq, Sk), s, -np.inf)",
        "    m = s.max(axis=-1, keepdims=True)",
    ]
    if case.sink is not None:
        lines += [
            "    sink = np.array(SINK, np.float64)[None, :, None, None]",
            "    m = np.maximum(m, sink)",
        ]
    lines += [
        "    m = np.where(np.isfinite(m), m, 0.0)  # a row that sees no key",
        "    p = np.exp(s - m)",
        "    total = p.sum(axis=-1, keepdims=True)",
    ]
    if case.sink is not None:
        lines.append("    total = total + np.exp(sink - m)  # the sink's weight, with no value")
    lines += [
        "    weights = p / np.where(total > 0, total, 1.0)",
        '    o = np.einsum("bhqk,bkhd->bqhd", weights, v.astype(np.float64))',
        '    with np.errstate(divide="ignore"):',
        "        lse = (np.log(total) + m)[..., 0]  # -inf where a row sees no key",
        "    return o, lse",
    ]
    return "\n".join(lines)


def _case_container() -> str:
    return '''from dataclasses import dataclass


@dataclass(frozen=True)
class Mask:
    """The case's mask, as attention-crossval's Mask names its fields."""

    causal: bool
    window_left: object
    window_right: object
    alignment: str
    q_lengths: object
    k_lengths: object
    explicit: object

    @property
    def kinds(self):
        kinds = {"causal"} if self.causal else set()
        kinds |= {"window"} if (self.window_left, self.window_right) != (None, None) else set()
        kinds |= {"varlen"} if (self.q_lengths, self.k_lengths) != (None, None) else set()
        return frozenset(kinds | ({"explicit"} if self.explicit is not None else set()))


@dataclass(frozen=True)
class Case:
    """The case as an adapter reads it: attention-crossval's AttentionCase field names."""

    q: object
    k: object
    v: object
    softmax_scale: float
    mask: Mask
    softcap: object
    sink: object
    page_size: object
    num_splits: int
    page_fill: float
    layout: str = "padded"
    label: str = ""

    B = property(lambda self: self.q.shape[0])
    Sq = property(lambda self: self.q.shape[1])
    Hq = property(lambda self: self.q.shape[2])
    D = property(lambda self: self.q.shape[3])
    Sk = property(lambda self: self.k.shape[1])
    Hkv = property(lambda self: self.k.shape[2])
    Dv = property(lambda self: self.v.shape[3])
    dtype = property(lambda self: DTYPE)
    group_size = property(lambda self: self.Hq // self.Hkv)

    def kv_head(self, h):
        return h // self.group_size

    def q_length(self, b):
        return self.Sq if self.mask.q_lengths is None else self.mask.q_lengths[b]

    def k_length(self, b):
        return self.Sk if self.mask.k_lengths is None else self.mask.k_lengths[b]


def make_case(q, k, v, pad):
    """The inputs as a Case, ``pad`` in the unused slots of a paged layout."""
    lengths = [None if x is None else tuple(x) for x in (Q_LENGTHS, K_LENGTHS)]
    mask = Mask(CAUSAL, WINDOW[0], WINDOW[1], ALIGNMENT, *lengths, EXPLICIT)
    sink = None if SINK is None else np.array(SINK, np.float32)
    arrays = (as_dtype(q), as_dtype(k), as_dtype(v))
    return Case(*arrays, SCALE, mask, SOFTCAP, sink, PAGE_SIZE, NUM_SPLITS, pad)'''


def _run_kernel(call: PublicCall) -> str:
    body = "\n".join(f"    {line}" for line in call.lines)
    return f'''def run_kernel(q, k, v, pad):
    """The kernel through its public API: {call.api}."""
    visible = visible_keys(q.shape[0], q.shape[1], k.shape[1])  # the keys each row may see
{body}
    o = np.asarray(o, np.float64)
    return o, None if lse is None else np.asarray(lse, np.float64)'''


_ROWS = '''
def with_padding(q, k, v, value):
    """q rows past Q_LENGTHS and k, v rows past K_LENGTHS set to ``value``."""
    q, k, v = q.copy(), k.copy(), v.copy()
    for b in range(q.shape[0]):
        if Q_LENGTHS is not None:
            q[b, Q_LENGTHS[b] :] = value
        if K_LENGTHS is not None:
            k[b, K_LENGTHS[b] :] = value
            v[b, K_LENGTHS[b] :] = value
    return q, k, v


def must_be_finite(B, Sq, Hq, Sk):
    """Bool [B, Sq, Hq]: rows the kernel must write with finite values."""
    rows = valid_rows(B, Sq, Hq)
    return rows & rows_seeing_keys(B, Sq, Hq, Sk) if EMPTY_ROWS_NAN else rows


def nonfinite_rows(o, lse, seen):
    """Bool [B, Sq, Hq]: a non-finite O, a NaN LSE, or an infinite LSE on a row seeing keys."""
    bad = ~np.isfinite(o).all(axis=-1)
    if lse is not None:
        lse = lse.transpose(0, 2, 1)
        bad |= np.isnan(lse) | (np.isinf(lse) & seen)
    return bad
'''

_RATIO = '''
def bound_ratios(got, expected, bound, seen):
    """(|got - expected|, its ratio to ``bound``) where ``seen``, 0 elsewhere: a NaN error
    counts as inf, and so does any error where the bound is 0."""
    error = np.abs(got - expected)
    error = np.where(np.isnan(error), np.inf, error)
    ratio = np.divide(error, bound, out=np.where(error > 0, np.inf, 0.0), where=bound > 0)
    return error, np.where(seen, ratio, 0.0)
'''

_BOUND = '''
def check(q, k, v, inputs):
    """O within the per-element bound (inputs["bound"]) of float64 attention."""
    o, _ = run_kernel(q, k, v, 0.0)
    expected, _ = reference(q, k, v)
    bound = inputs["bound"]
    seen = (rows_seeing_keys(*q.shape[:3], k.shape[1]) & valid_rows(*q.shape[:3]))[..., None]
    error, ratio = bound_ratios(o, expected, bound, seen)
    at = np.unravel_index(np.argmax(ratio), ratio.shape)
    print(f"worst element (b, i, h, d) = {tuple(int(x) for x in at)}:")
    print(f"  kernel            {float(o[at])!r}")
    print(f"  float64 attention {float(expected[at])!r}")
    print(f"  |error| {error[at]:.6g}, bound {bound[at]:.6g} ({ratio[at]:.4g}x the bound)")
    outside = int((ratio > 1).sum())
    print(f"{outside} of {int(seen.sum()) * o.shape[-1]} elements outside the bound")
    return outside > 0
'''

_LSE = '''
def check(q, k, v, inputs):
    """The LSE within the per-row bound (inputs["lse_bound"]) of float64 attention."""
    _, lse = run_kernel(q, k, v, 0.0)
    if lse is None:
        print("the kernel returned no LSE")
        return True
    _, expected = reference(q, k, v)
    bound = inputs["lse_bound"]
    seen = rows_seeing_keys(*q.shape[:3], k.shape[1]) & valid_rows(*q.shape[:3])
    seen = seen.transpose(0, 2, 1)
    error, ratio = bound_ratios(lse, expected, bound, seen)
    at = np.unravel_index(np.argmax(ratio), ratio.shape)
    print(f"worst row (b, h, i) = {tuple(int(x) for x in at)}:")
    print(f"  kernel LSE            {float(lse[at])!r}")
    print(f"  float64 attention LSE {float(expected[at])!r}")
    print(f"  |error| {error[at]:.6g}, bound {bound[at]:.6g} ({ratio[at]:.4g}x the bound)")
    outside = int((ratio > 1).sum())
    print(f"{outside} of {int(seen.sum())} LSE values outside the bound")
    return outside > 0
'''

_EMPTY = '''
def check(q, k, v, inputs):
    """Rows that see no key: O = 0 and LSE = -inf (or the head's sink)."""
    o, lse = run_kernel(q, k, v, 0.0)
    B, Sq, Hq = q.shape[:3]
    empty = ~rows_seeing_keys(B, Sq, Hq, k.shape[1])
    if PADDED_ROWS_UNWRITTEN:
        empty &= valid_rows(B, Sq, Hq)
    size = np.where(np.isnan(o), 0.0 if EMPTY_ROWS_NAN else np.inf, np.abs(o)).max(axis=-1)
    wrong = empty & (size > 0)
    if lse is not None:
        expected = np.full(Hq, -np.inf) if SINK is None else np.array(SINK, np.float64)
        got = lse.transpose(0, 2, 1)
        wrong |= empty & ~np.isclose(got, expected[None, None, :], rtol=2.0**-20, atol=0.0) & ~(
            np.isinf(got) & np.isinf(expected) & (got == expected)
        )
    print(f"{int(empty.sum())} rows see no key; {int(wrong.sum())} of them are not O = 0 and "
          "LSE = -inf (or the sink)")
    if wrong.any():
        b, i, h = (int(x) for x in np.argwhere(wrong)[0])
        got = "" if lse is None else f", LSE {float(lse[b, h, i])!r}"
        print(f"first at (b, i, h) = ({b}, {i}, {h}): kernel max |O| "
              f"{float(size[b, i, h])!r}{got}; "
              "expected O = 0")
    return bool(wrong.any())
'''

_NONFINITE = '''
def check(q, k, v, inputs):
    """O and LSE finite on every row the kernel must write, with zero padding."""
    o, lse = run_kernel(*with_padding(q, k, v, 0.0), 0.0)
    B, Sq, Hq = q.shape[:3]
    seen = rows_seeing_keys(B, Sq, Hq, k.shape[1])
    bad = nonfinite_rows(o, lse, seen) & must_be_finite(B, Sq, Hq, k.shape[1])
    print(f"{int(bad.sum())} of {bad.size} rows non-finite on clean inputs")
    if bad.any():
        b, i, h = (int(x) for x in np.argwhere(bad)[0])
        expected, expected_lse = reference(q, k, v)
        print(f"first at (b, i, h) = ({b}, {i}, {h}): kernel O[..., :4] {o[b, i, h, :4]}, "
              f"float64 attention {expected[b, i, h, :4]}")
        if lse is not None:
            print(f"  kernel LSE {float(lse[b, h, i])!r}, "
              f"float64 attention LSE {float(expected_lse[b, h, i])!r}")
    return bool(bad.any())
'''

_PADDING = '''
def check(q, k, v, inputs):
    """Rows finite with zero padding must stay finite with NaN in the padding (rows past the
    valid lengths, and the unused tail of K/V pages), which no query may read."""
    B, Sq, Hq = q.shape[:3]
    seen = rows_seeing_keys(B, Sq, Hq, k.shape[1])
    rows = must_be_finite(B, Sq, Hq, k.shape[1])
    clean = nonfinite_rows(*run_kernel(*with_padding(q, k, v, 0.0), 0.0), seen) & rows
    poisoned = nonfinite_rows(*run_kernel(*with_padding(q, k, v, np.nan), np.nan), seen) & rows
    leaked = poisoned & ~clean
    print(f"non-finite rows: {int(clean.sum())} with zero padding, {int(poisoned.sum())} with NaN "
          f"padding, of {int(rows.sum())} rows")
    if leaked.any():
        b, i, h = (int(x) for x in np.argwhere(leaked)[0])
        print(f"first row reached by the padding at (b, i, h) = ({b}, {i}, {h})")
    return bool(leaked.any())
'''

_HIDDEN = '''
def check(q, k, v, inputs):
    """Rows finite on the case must stay finite with NaN in K/V rows no query sees."""
    B, Sq, Hq = q.shape[:3]
    Sk, Hkv = k.shape[1], k.shape[2]
    visible = np.broadcast_to(visible_keys(B, Sq, Sk), (B, Hq, Sq, Sk))
    seen_by = visible.any(axis=2).reshape(B, Hkv, Hq // Hkv, Sk).any(axis=2)  # [B, Hkv, Sk]
    hidden = ~seen_by.transpose(0, 2, 1)[..., None]  # [B, Sk, Hkv, 1]
    q, k, v = with_padding(q, k, v, 0.0)
    seen = rows_seeing_keys(B, Sq, Hq, Sk)
    rows = valid_rows(B, Sq, Hq) & seen
    clean = nonfinite_rows(*run_kernel(q, k, v, 0.0), seen) & rows
    k_nan, v_nan = np.where(hidden, np.nan, k), np.where(hidden, np.nan, v)
    poisoned = nonfinite_rows(*run_kernel(q, k_nan, v_nan, 0.0), seen) & rows
    turned = poisoned & ~clean
    print(f"{int(hidden.sum())} K/V rows no query sees; NaN there made {int(turned.sum())} of "
          f"{int(rows.sum())} rows non-finite")
    if turned.any():
        b, i, h = (int(x) for x in np.argwhere(turned)[0])
        print(f"first at (b, i, h) = ({b}, {i}, {h})")
    return bool(turned.any())
'''

_DETERMINISM = '''
def check(q, k, v, inputs, runs=10):
    """Every run on the same inputs gives the first run's bits. Several runs, not two: a race
    between thread blocks shows on some runs only."""
    q, k, v = with_padding(q, k, v, 0.0)
    o1, lse1 = run_kernel(q, k, v, 0.0)
    rows = valid_rows(*q.shape[:3])
    differing = 0
    for run in range(2, runs + 1):
        o2, lse2 = run_kernel(q, k, v, 0.0)
        differ = (o1.view(np.uint64) != o2.view(np.uint64)) & rows[..., None]
        lse_differ = np.zeros(1, bool)
        if lse1 is not None and lse2 is not None:
            lse_differ = (lse1.view(np.uint64) != lse2.view(np.uint64)) & rows.transpose(0, 2, 1)
        if differ.any() or lse_differ.any():
            differing += 1
            print(f"run {run}: {int(differ.sum())} elements of O and {int(lse_differ.sum())} "
                  f"LSE values differ from run 1")
            if differ.any():
                at = tuple(int(x) for x in np.argwhere(differ)[0])
                print(f"  first at (b, i, h, d) = {at}: {float(o1[at])!r} then {float(o2[at])!r}")
    print(f"{differing} of {runs - 1} reruns differ from the first run")
    return differing > 0
'''

_ERROR = '''
def check(q, k, v, inputs):
    """The call returns instead of raising."""
    import traceback

    try:
        run_kernel(q, k, v, 0.0)
    except Exception:  # the finding: the kernel's call raised
        traceback.print_exc()
        return True
    print("the call returned")
    return False
'''

_CHECKS = {
    "bound": _RATIO + _BOUND,
    "lse": _RATIO + _LSE,
    "empty-rows": _EMPTY,
    "nonfinite": _ROWS + _NONFINITE,
    "padding-read": _ROWS + _PADDING,
    "hidden-nan": _ROWS + _HIDDEN,
    "determinism": _ROWS + _DETERMINISM,
    "error": _ERROR,
}

_MAIN = """
def main():
    q, k, v = (as_float32(INPUTS[name]) for name in "qkv")
    print(f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} {DTYPE}")
    print(f"recorded: {RECORDED['finding']}")
    failed = check(q, k, v, INPUTS)
    print("FAIL: the bug is there" if failed else "PASS: the check holds")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
"""
