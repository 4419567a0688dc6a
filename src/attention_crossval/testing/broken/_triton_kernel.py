"""A tiny Triton FlashAttention forward with switchable bugs (imports triton: GPU only).

The loop body is the streaming tier's, in exp2 form:
S = Q K^T; m_new = max(m, rowmax(S)); alpha = exp2((m - m_new) scale_log2);
P = exp2(S scale_log2 - m_new scale_log2); l = l alpha + rowsum(P); O = O alpha + P V.
Offsets are int64 (a K of more than 2^31 elements is addressed right) unless ``OFFSETS_64`` is
off: then ``key * stride`` is int32 and wraps past element 2^31.
"""

import triton
import triton.language as tl


@triton.jit
def attention_fwd(
    Q,
    K,
    V,
    O,
    L,
    QLEN,
    KLEN,
    sq_b,
    sq_s,
    sq_h,
    sk_b,
    sk_s,
    sk_h,
    sv_b,
    sv_s,
    sv_h,
    so_b,
    so_s,
    so_h,
    sl_b,
    sl_h,
    Hq,
    group,
    Sk,
    scale_log2,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    RESCALE: tl.constexpr,
    MASK_STORE: tl.constexpr,
    SKIP_LAST: tl.constexpr,
    KEY_LIMIT_PADDED: tl.constexpr,
    LATE_BLOCK: tl.constexpr,
    OFFSETS_64: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1) // Hq
    h = tl.program_id(1) % Hq
    kh = h // group
    q_len = tl.load(QLEN + b)
    k_len = tl.load(KLEN + b)
    key_limit = Sk if KEY_LIMIT_PADDED else k_len  # bug: padded keys read and used
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    if OFFSETS_64:
        b, h, kh, rows = b.to(tl.int64), h.to(tl.int64), kh.to(tl.int64), rows.to(tl.int64)
        cols0 = cols0.to(tl.int64)  # bug when off: key * stride in int32 wraps past 2^31
    dims = tl.arange(0, D)
    q = tl.load(
        Q + b * sq_b + h * sq_h + rows[:, None] * sq_s + dims[None, :],
        mask=rows[:, None] < q_len,
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, key_limit, BLOCK_N):
        cols = start + cols0
        kv_ok = cols[:, None] < key_limit
        k = tl.load(
            K + b * sk_b + kh * sk_h + cols[:, None] * sk_s + dims[None, :], mask=kv_ok, other=0.0
        )
        s = tl.dot(q, tl.trans(k))  # S = Q K^T (fp32)
        s = tl.where(cols[None, :] < key_limit, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2((m_i - m_safe) * scale_log2)
        p = tl.math.exp2(s * scale_log2 - (m_safe * scale_log2)[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + b * sv_b + kh * sv_h + cols[:, None] * sv_s + dims[None, :], mask=kv_ok, other=0.0
        )
        if RESCALE:
            if LATE_BLOCK > 0:  # bug: O not rescaled from K block LATE_BLOCK on
                acc = acc * tl.where(start < LATE_BLOCK * BLOCK_N, alpha, 1.0)[:, None]
            else:
                acc = acc * alpha[:, None]  # O = O * alpha (the no_rescale bug drops this line)
        acc = tl.dot(p.to(v.dtype), v, acc)  # O += P V
        m_i = m_new
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i * scale + tl.log(tl.where(empty, 1.0, l_i)))
    store_ok = rows < q_len
    if not MASK_STORE:
        store_ok = rows < pid_m * BLOCK_M + BLOCK_M  # bug: whole tile written, past the end
    if SKIP_LAST:
        store_ok = store_ok & (pid_m != tl.num_programs(0) - 1)  # bug: last tile never written
    tl.store(
        O + b * so_b + h * so_h + rows[:, None] * so_s + dims[None, :],
        o.to(O.dtype.element_ty),
        mask=store_ok[:, None],
    )
    tl.store(L + b * sl_b + h * sl_h + rows, lse, mask=store_ok)
