"""Tier 2 backward: the FlashAttention backward pass in NumPy, with the kernel's precision chain.

The loop body of :func:`_backward_kv_block` is the algorithm, one step per line, so a reader can
check it against a kernel's backward and a mutant can break one step at a time. Per batch and
query head (``c = scale_log2``, ``LOG2_E = log2(e)``)::

    preprocess:  D = rowsum(dO * O) - dlse          (dlse = 0 when the case has none)
                 LSE2 = lse * LOG2_E                 (+inf on empty rows, as FlashAttention stores)
    for each K/V block (outer loop; one CTA):
        dK = dV = 0
        for each Q block (inner loop):
            S   = Q K^T                              (masked entries -inf)
            P   = exp2(S * c - LSE2)                 (recomputed from the saved LSE; one FMA)
            dV += P^T dO                             (P rounded to p_dtype)
            dP  = dO V^T
            dS  = P * (dP - D)                       (the fp32 P; the rounded one if
                                                      ds_from_rounded_p; times scale if
                                                      ds_scaled)
            dK += dS^T Q                             (dS rounded to ds_dtype; below its
                                                      smallest normal to 0 if
                                                      ds_flushes_subnormals)
            dQ += dS K                               (into the dQ accumulator, K blocks in dq_order)
        dk[kv head] += dK, dv[kv head] += dV         (summed over the query heads of the group;
                                                      dK * scale and dV rounded to the output
                                                      first if dkv_rounded_per_head)
    dq = dQ * scale,  dk = dk * scale                (softmax_scale once, at the end, unless
                                                      ds_scaled put it into dS)

Memory is O(block_m * block_n + outputs): no ``[Sq, Sk]`` matrix is ever formed.
"""

from __future__ import annotations

import numpy as np

from attention_crossval.reference.case import AttentionCase, AttentionResult
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.masks import visible
from attention_crossval.reference.precision import LOG2_E, BackwardPrecision, round_to
from attention_crossval.reference.streaming import _fma, streaming_attention


class BackwardTraceRecorder:
    """Null recorder: the loop calls this hook unconditionally; this one keeps nothing."""

    def start(self, case: BackwardCase) -> None:
        """Called once before the first block."""

    def block(
        self, b: int, h: int, rows: slice, P: np.ndarray, dP: np.ndarray, dS: np.ndarray
    ) -> None:
        """Called with the unrounded P, dP and dS of one (K block, Q block) tile."""


class RowSumTrace(BackwardTraceRecorder):
    """Row sums over every visited tile, so a property can check the softmax identities
    ``sum_j P_ij = 1`` (P recomputed from the right LSE) and ``sum_j dS_ij = 0`` (the D term).

    Fields after a run, each ``float64 [B, Hq, Sq]``: ``p_sum`` and ``ds_sum``.
    """

    def start(self, case: BackwardCase) -> None:
        shape = (case.forward.B, case.forward.Hq, case.forward.Sq)
        self.p_sum = np.zeros(shape)
        self.ds_sum = np.zeros(shape)

    def block(self, b, h, rows, P, dP, dS) -> None:
        self.p_sum[b, h, rows] += P.sum(axis=1, dtype=np.float64)
        self.ds_sum[b, h, rows] += dS.sum(axis=1, dtype=np.float64)


_NO_TRACE = BackwardTraceRecorder()
FLOAT64_BACKWARD = BackwardPrecision.float64()  # the default: the algorithm without rounding


def streaming_backward(
    case: BackwardCase,
    precision: BackwardPrecision = FLOAT64_BACKWARD,
    *,
    block_m: int = 128,
    block_n: int = 128,
    seed: int = 0,
    forward: AttentionResult | None = None,
    trace: BackwardTraceRecorder | None = None,
) -> Gradients:
    """dq, dk, dv over ``block_m x block_n`` tiles with ``precision``'s chain.

    ``forward`` is the O and LSE the backward reads (default: the streaming forward under
    ``precision.forward`` with the same blocks). ``seed`` picks the K-block order of the dQ
    adds when ``precision.dq_order == "permuted"`` and is ignored when it is ``fixed``.
    Returns float64 arrays holding values of ``precision.output_dtype`` (or of the accumulator
    dtype when that is None). Padding (query rows past ``q_lengths``, keys past ``k_lengths``,
    in q, k, v and do) is never read and gets zero gradient.
    """
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an int >= 0")
    if not isinstance(case, BackwardCase):
        raise ValueError(f"case must be a BackwardCase, got {type(case).__name__}")
    if not isinstance(precision, BackwardPrecision):
        raise ValueError(f"precision must be a BackwardPrecision, got {type(precision).__name__}")
    if case.forward.softcap is not None or case.forward.sink is not None:
        raise NotImplementedError("the backward of softcap or sink cases is not modelled yet")
    trace = _NO_TRACE if trace is None else trace
    if not isinstance(trace, BackwardTraceRecorder):
        raise ValueError(f"trace must be a RowSumTrace (or None), got {type(trace).__name__}")
    fwd = case.forward
    if forward is None:
        forward = streaming_attention(fwd, precision.forward, block_m=block_m, block_n=block_n)
    _check_forward(forward, fwd)
    trace.start(case)
    acc = np.dtype(precision.accum_dtype)
    dq = np.zeros((fwd.B, fwd.Sq, fwd.Hq, fwd.D))
    dk_acc = np.zeros((fwd.B, fwd.Sk, fwd.Hkv, fwd.D), acc)  # dK summed over each GQA group
    dv_acc = np.zeros((fwd.B, fwd.Sk, fwd.Hkv, fwd.Dv), acc)
    scale = acc.type(fwd.softmax_scale)
    out = precision.output_dtype or acc.name
    per_head = precision.dkv_rounded_per_head and fwd.group_size > 1
    scale_at_end = acc.type(1) if precision.ds_scaled else scale  # else dS carried it
    for b in range(fwd.B):
        q_len, k_len = fwd.q_length(b), fwd.k_length(b)
        # Blocks stop at the valid lengths, so padding (possibly NaN) is never multiplied.
        row_blocks = [slice(m0, min(m0 + block_m, q_len)) for m0 in range(0, q_len, block_m)]
        col_blocks = [slice(n0, min(n0 + block_n, k_len)) for n0 in range(0, k_len, block_n)]
        for h in range(fwd.Hq):
            kv_head = fwd.kv_head(h)
            # Preprocess: D = rowsum(dO * O) - dlse, and the LSE in the log2 domain.
            dO = case.do[b, :q_len, h, :].astype(acc)
            O = forward.o[b, :q_len, h, :].astype(acc)
            D = (dO * O).sum(axis=1, dtype=acc)  # D = rowsum(dO * O)
            if case.dlse is not None:
                D = D - case.dlse[b, h, :q_len].astype(acc)  # D = D - dlse (LSE's gradient)
            lse = forward.lse[b, h, :q_len]
            LSE2 = np.where(lse == -np.inf, np.inf, lse.astype(acc) * acc.type(LOG2_E))  # +inf: P=0
            dQ = np.zeros((q_len, fwd.D), acc)  # the dQ accumulator (fp32 in a kernel)
            for cols in _dq_order(col_blocks, precision.dq_order, seed, b, h):
                dK, dV = _backward_kv_block(
                    case, precision, b, h, cols, row_blocks, dO, D, LSE2, dQ, trace
                )
                if per_head:  # each head's gradient written in the output dtype, then summed
                    dK, dV = round_to(dK * scale_at_end, out), round_to(dV, out)
                dk_acc[b, cols, kv_head] += dK  # summed over the query heads of the group
                dv_acc[b, cols, kv_head] += dV  # summed over the query heads of the group
            dq[b, :q_len, h, :] = round_to(dQ * scale_at_end, out)
    dk_acc = dk_acc if per_head else dk_acc * scale_at_end  # per head: scaled before the sum
    return Gradients(dq=dq, dk=round_to(dk_acc, out), dv=round_to(dv_acc, out))


def _backward_kv_block(
    case: BackwardCase,
    precision: BackwardPrecision,
    b: int,
    h: int,
    cols: slice,
    row_blocks: list[slice],
    dO_all: np.ndarray,
    D_all: np.ndarray,
    LSE2_all: np.ndarray,
    dQ: np.ndarray,
    trace: BackwardTraceRecorder,
) -> tuple[np.ndarray, np.ndarray]:
    """One K/V block against every Q block of query head ``h``: returns its dK and dV and adds
    its dS K partials into ``dQ`` in place.

    Every array lives in ``accum_dtype``; a matmul in that dtype of the exact 16-bit or fp32
    operands stands for the MMA (the summation order inside it is not a specification).
    """
    fwd = case.forward
    acc = np.dtype(precision.accum_dtype)
    scale_log2 = acc.type(LOG2_E * fwd.softmax_scale)  # c = fl(log2(e) * softmax_scale)
    kv_head = fwd.kv_head(h)
    K = fwd.k[b, cols, kv_head, :].astype(acc)
    V = fwd.v[b, cols, kv_head, :].astype(acc)
    dK = np.zeros((K.shape[0], fwd.D), acc)  # dK = 0
    dV = np.zeros((K.shape[0], fwd.Dv), acc)  # dV = 0
    for rows in row_blocks:
        Q = fwd.q[b, rows, h, :].astype(acc)
        dO, D, LSE2 = dO_all[rows], D_all[rows], LSE2_all[rows]
        seen = visible(fwd, b, h, rows, cols)
        S = Q @ K.T  # S = Q K^T
        S = np.where(seen, S, -np.inf)  # masked scores are -inf, so exp2 gives P = 0
        P = np.exp2(_fma(S, scale_log2, -LSE2[:, None]))  # P = exp2(S * c - LSE2)
        P_mma = round_to(P, precision.p_dtype or acc.name).astype(acc)  # P as fed to P^T dO
        dV += P_mma.T @ dO  # dV += P^T dO
        dP = dO @ V.T  # dP = dO V^T
        P_ds = P_mma if precision.ds_from_rounded_p else P  # the P that dS is formed from
        dS = P_ds * (dP - D[:, None])  # dS = P * (dP - D)
        if precision.ds_scaled:
            dS = dS * acc.type(fwd.softmax_scale)  # dS = dS * scale (before its rounding)
        dS_mma = round_to(  # dS as fed to MMAs (subnormals flushed to 0 if declared)
            dS, precision.ds_dtype or acc.name, flush_subnormals=precision.ds_flushes_subnormals
        ).astype(acc)
        with np.errstate(invalid="ignore"):  # a dS that overflowed: inf - inf is the chain's NaN
            dK += dS_mma.T @ Q  # dK += dS^T Q
            dQ[rows] += dS_mma @ K  # dQ += dS K (this K block's partial, in dq_order)
        trace.block(b, h, rows, P, dP, dS)
    return dK, dV


def _dq_order(col_blocks: list[slice], dq_order: str, seed: int, b: int, h: int) -> list[slice]:
    """The order in which the K blocks' dQ partials land: in order for a deterministic kernel,
    else a permutation seeded by ``(seed, b, h)`` (atomic adds from CTAs finishing in any
    order). dK and dV of a block do not depend on it."""
    if dq_order == "fixed":
        return col_blocks
    order = np.random.default_rng([seed, b, h]).permutation(len(col_blocks))
    return [col_blocks[i] for i in order]


def _check_forward(forward: AttentionResult, case: AttentionCase) -> None:
    """``forward`` must hold ``o [B, Sq, Hq, Dv]`` and ``lse [B, Hq, Sq]`` for ``case``."""
    if not isinstance(forward, AttentionResult):
        raise ValueError(f"forward must be an AttentionResult, got {type(forward).__name__}")
    o_shape, lse_shape = (case.B, case.Sq, case.Hq, case.Dv), (case.B, case.Hq, case.Sq)
    if np.shape(forward.o) != o_shape:
        raise ValueError(f"forward.o shape {np.shape(forward.o)} must be [B, Sq, Hq, Dv]={o_shape}")
    if forward.lse is None or np.shape(forward.lse) != lse_shape:
        raise ValueError(
            f"forward.lse must be given with shape [B, Hq, Sq]={lse_shape}, "
            f"got {None if forward.lse is None else np.shape(forward.lse)}"
        )
