#!/usr/bin/env python3
"""flex-attention fails hidden-nan on B=1 Sq=128 Sk=129 Hq=1 Hkv=1 D=64 Dv=64 bfloat16
mask=explicit scale=0.125 [trigger:hidden-nan]

Check: hidden-nan: rows finite until NaN goes into K/V rows that no query sees. Needs: numpy,
torch with a CUDA GPU, the kernel's package (torch.nn.attention.flex_attention.flex_attention
(torch.compile)). The case's inputs are in case.npz beside this script.

    python repro.py    # exit 1 while the bug is there, 0 once it is fixed (2: cannot run)
"""

import sys
from pathlib import Path

import numpy as np

try:  # the kernel's public API
    import torch
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask
    from torch.nn.attention.flex_attention import flex_attention
except ImportError as error:
    print(f"cannot import the kernel: {error}", file=sys.stderr)
    sys.exit(2)

DTYPE = 'bfloat16'
SCALE = 0.125  # softmax scale
CAUSAL = False
ALIGNMENT = 'bottom_right'  # the causal diagonal when Sq != Sk
WINDOW = (None, None)  # (left, right); None: unbounded
Q_LENGTHS = None  # valid query rows per batch; None: all
K_LENGTHS = None  # valid keys per batch; None: all
SOFTCAP = None  # logits = SOFTCAP * tanh(SCALE * q.k / SOFTCAP)
SINK = None  # one extra logit per query head, no value
PAGE_SIZE = None  # K/V through a page table of pages this long
NUM_SPLITS = 1
EMPTY_ROWS_NAN = False  # declared: a row that sees no key gives NaN
PADDED_ROWS_UNWRITTEN = False  # declared: rows past Q_LENGTHS are left unwritten
# What attention-crossval recorded when it wrote this script (its derivation of the
# bound from the kernel's declared precision chain, reference/bounds.py):
RECORDED = {'finding': 'hidden-nan: 128 rows turned non-finite with NaN in 1 K/V rows that no '
            'query sees (masked keys read and weighted by 0), first at (b, i, h) = (0, '
            '0, 0)',
 'kernel': 'flex-attention'}

def load_inputs():
    with np.load(Path(__file__).with_name("case.npz")) as data:
        return {name: data[name] for name in data.files}


INPUTS = load_inputs()
EXPLICIT = INPUTS.get("explicit")  # a boolean mask broadcast to [B, Hq, Sq, Sk], True = visible

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

def to_torch(x):
    """``x`` (exact values, float32) as a CUDA tensor of the input dtype."""
    import torch

    if DTYPE == "bfloat16":
        bits = (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(x.astype(DTYPE))).cuda()

def visible_keys(B, Sq, Sk):
    """Bool [B, Hq or 1, Sq, Sk]: the keys each query row may see."""
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    planes = []
    for b in range(B):
        q_len = Sq if Q_LENGTHS is None else Q_LENGTHS[b]
        k_len = Sk if K_LENGTHS is None else K_LENGTHS[b]
        seen = (i < q_len) & (j < k_len)
        planes.append(seen)
    visible = np.stack(planes)[:, None]
    visible = visible & EXPLICIT
    return visible


def rows_seeing_keys(B, Sq, Hq, Sk):
    """Bool [B, Sq, Hq]: rows that see at least one key."""
    seen = visible_keys(B, Sq, Sk).any(axis=-1)
    return np.broadcast_to(seen, (B, Hq, Sq)).transpose(0, 2, 1)


def valid_rows(B, Sq, Hq):
    """Bool [B, Sq, Hq]: query rows inside Q_LENGTHS."""
    lengths = np.array([Sq] * B if Q_LENGTHS is None else Q_LENGTHS)
    valid = np.arange(Sq)[None, :] < lengths[:, None]
    return np.broadcast_to(valid[..., None], (B, Sq, Hq))

def reference(q, k, v):
    """Softmax attention in float64 on the exact inputs: o [B, Sq, Hq, Dv] and
    lse [B, Hq, Sq]."""
    B, Sq, Hq, _ = q.shape
    Sk = k.shape[1]
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), k.astype(np.float64)) * SCALE
    s = np.where(visible_keys(B, Sq, Sk), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)  # a row that sees no key
    p = np.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    weights = p / np.where(total > 0, total, 1.0)
    o = np.einsum("bhqk,bkhd->bqhd", weights, v.astype(np.float64))
    with np.errstate(divide="ignore"):
        lse = (np.log(total) + m)[..., 0]  # -inf where a row sees no key
    return o, lse

def run_kernel(q, k, v, pad):
    """The kernel through its public API: torch.nn.attention.flex_attention.flex_attention (torch.compile)."""
    visible = visible_keys(q.shape[0], q.shape[1], k.shape[1])  # the keys each row may see
    qt, kt, vt = (to_torch(x).transpose(1, 2) for x in (q, k, v))
    seen = torch.from_numpy(np.ascontiguousarray(np.broadcast_to(visible, (q.shape[0], q.shape[2], q.shape[1], k.shape[1])))).cuda()
    B, Hq, Sq, Sk = seen.shape
    block_mask = create_block_mask(
        lambda b, h, i, j: seen[b, h, i, j], B, Hq, Sq, Sk, device='cuda'
    )
    out, aux = torch.compile(flex_attention)(
        qt, kt, vt, score_mod=None, block_mask=block_mask, scale=SCALE,
        return_aux=AuxRequest(lse=True),
    )
    out = out.transpose(1, 2)
    torch.cuda.synchronize()
    o = out.double().cpu().numpy()
    lse = aux.lse.double().cpu().numpy()
    o = np.asarray(o, np.float64)
    return o, None if lse is None else np.asarray(lse, np.float64)

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

def main():
    q, k, v = (as_float32(INPUTS[name]) for name in "qkv")
    print(f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} {DTYPE}")
    print(f"recorded: {RECORDED['finding']}")
    failed = check(q, k, v, INPUTS)
    print("FAIL: the bug is there" if failed else "PASS: the check holds")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
