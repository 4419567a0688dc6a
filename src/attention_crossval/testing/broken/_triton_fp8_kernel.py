"""A small Triton FP8 FlashAttention forward (imports triton: GPU, or its interpreter in tests).

The loop body, per K/V block, in exp2 form with ``c = softmax_scale log2(e) q_descale k_descale``
(the descales of the query's kv head) and FA4's two constants::

    S     = Q K^T                          (raw FP8 values, fp32 accumulation; masked: -inf)
    m'    = max(m, rowmax(S))
    m     = m' if m' > m + THRESHOLD / c   (lazy rescale: keep a stale max below the threshold)
    alpha = exp2((m_old - m) c)
    P     = exp2(S c - m c + MAX_OFFSET)   (scaled by 2^MAX_OFFSET into the FP8 range)
    l     = l alpha + rowsum(P)            (the fp32 P, as FA4 sums it)
    O     = O alpha + fp8(min(P, P_MAX)) V (P converted satfinite to V's FP8 format)

and after the last block ``O = O / l v_descale`` in bf16, ``lse = (m c + log2(l)) ln 2 -
MAX_OFFSET ln 2``: the streaming tier's order of operations (reference/streaming.py). When
``MAX_OFFSET + THRESHOLD`` exceeds log2(P_MAX), P can pass P_MAX while the row sum keeps the
unclamped value: FA4's e4m3 bug (8 + 4 > log2(448)).

V arrives transposed, ``[B, Hkv, D, keys]`` with the keys contiguous: an FP8 WGMMA on sm_90 reads
its B operand K-major only, and the reduction axis of ``P V`` is the keys (with V's head dim
contiguous Triton still emits the FP8 WGMMA, after transposing V through registers). Both dots
pass ``max_num_imprecise_acc=IMPRECISE_ACC`` (32): Triton adds every WGMMA's partial sum (32
products, summed in the tensor core's narrow FP8 accumulator) into a float32 accumulator,
instead of letting the narrow accumulation run across the whole head dimension (S) and every
key block (O), its sm_90 default. Below 32 Triton gives up the FP8 WGMMA for fp16 ``mma.sync``
on upcast operands.
"""

import triton
import triton.language as tl

LN_2 = tl.constexpr(0.6931471805599453)


@triton.jit
def attention_fp8_fwd(
    Q,
    K,
    VT,
    O,
    L,
    QLEN,
    KLEN,
    Q_DESCALE,
    K_DESCALE,
    V_DESCALE,
    sq_b,
    sq_s,
    sq_h,
    sk_b,
    sk_s,
    sk_h,
    svt_b,
    svt_h,
    svt_d,
    so_b,
    so_s,
    so_h,
    sl_b,
    sl_h,
    Hq,
    Hkv,
    group,
    scale_log2,
    MAX_OFFSET: tl.constexpr,
    THRESHOLD: tl.constexpr,
    P_MAX: tl.constexpr,
    IMPRECISE_ACC: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = (tl.program_id(1) // Hq).to(tl.int64)
    h = (tl.program_id(1) % Hq).to(tl.int64)
    kh = h // group
    q_len = tl.load(QLEN + b)
    k_len = tl.load(KLEN + b)
    c = scale_log2 * (tl.load(Q_DESCALE + b * Hkv + kh) * tl.load(K_DESCALE + b * Hkv + kh))
    threshold = THRESHOLD / c  # log2 units -> score units
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    cols0 = tl.arange(0, BLOCK_N).to(tl.int64)
    dims = tl.arange(0, D).to(tl.int64)
    q = tl.load(
        Q + b * sq_b + h * sq_h + rows[:, None] * sq_s + dims[None, :],
        mask=rows[:, None] < q_len,
        other=0.0,
    )
    key_end = k_len
    if CAUSAL:  # bottom-right: row i sees keys j <= i + k_len - q_len; later blocks add nothing
        key_end = tl.minimum(k_len, tl.maximum(0, (pid_m + 1) * BLOCK_M + k_len - q_len))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, key_end, BLOCK_N):
        cols = start + cols0
        k = tl.load(
            K + b * sk_b + kh * sk_h + cols[:, None] * sk_s + dims[None, :],
            mask=cols[:, None] < k_len,
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k), max_num_imprecise_acc=IMPRECISE_ACC)  # S = Q K^T (fp32)
        seen = cols[None, :] < k_len
        if CAUSAL:
            seen = seen & (cols[None, :] <= rows[:, None] + (k_len - q_len))
        s = tl.where(seen, s, float("-inf"))
        m_cand = tl.maximum(m_i, tl.max(s, 1))
        m_new = tl.where(m_cand > m_i + threshold, m_cand, m_i)  # lazy: keep a stale max
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2((m_i - m_safe) * c)
        p = tl.math.exp2(s * c + (MAX_OFFSET - m_safe * c)[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)  # the row sum of the unclamped fp32 P
        vt = tl.load(
            VT + b * svt_b + kh * svt_h + dims[:, None] * svt_d + cols[None, :],
            mask=cols[None, :] < k_len,
            other=0.0,
        )
        p8 = tl.minimum(p, P_MAX).to(VT.dtype.element_ty)  # satfinite: clamp, then round (RNE)
        acc = tl.dot(p8, tl.trans(vt), acc * alpha[:, None], max_num_imprecise_acc=IMPRECISE_ACC)
        m_i = m_new
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None] * tl.load(V_DESCALE + b * Hkv + kh)
    lse = (m_i * c + tl.log2(tl.where(empty, 1.0, l_i))) * LN_2 - MAX_OFFSET * LN_2
    lse = tl.where(empty, float("-inf"), lse)
    store_ok = rows < q_len
    tl.store(
        O + b * so_b + h * so_h + rows[:, None] * so_s + dims[None, :],
        o.to(O.dtype.element_ty),
        mask=store_ok[:, None],
    )
    tl.store(L + b * sl_b + h * sl_h + rows, lse, mask=store_ok)
