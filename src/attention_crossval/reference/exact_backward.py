"""Tier 1 backward: certified dq on sampled query rows, dk/dv on sampled key columns.

The math (``docs/backward.md`` derives it and the bound)::

    P_ij = exp(c (s_ij - m_i)) / l_i,   D_i = dO_i . O_i - dlse_i,   g_ij = dO_i . v_j
    dS_ij = P_ij (g_ij - D_i)
    dq_i = c sum_j dS_ij k_j,   dk_j = c sum_i dS_ij q_i,   dv_j = sum_i P_ij dO_i

with ``c = softmax_scale``, sums over visible pairs, and dk/dv of a kv head summed over the query
heads of its group. A key column needs every query row that sees it, so the *row statistics*
``(m_i, l_i, D_i)`` are computed once per row, for the sampled rows and every row that sees a
sampled key, and shared by all columns:

1. Scores ``s_ij`` are exact integers (limb float64 GEMMs, as the forward tier), held with
   their row maxima and gaps as int64 words of 30 bits: no Python int per pair.
2. Unnormalized weights ``W_ij ~ exp(c (s_ij - m_i)) 2^G`` in ``G = 28 L >= prec_bits`` bit fixed
   point, vectorized: the integer gap ``x = m_i - s_ij`` is cut into ``K`` chunks of ``b <= 12``
   bits and ``exp(-c x) = prod_k T_k[x_k]`` multiplies table entries (``exp_fixed``, rounded to
   ``G`` bits) as int64 limb arrays, truncating each product. Each weight is within
   ``delta = 2 K 2^-G`` of the true one; the row maximum's weight is exactly 1.
3. ``l_i = sum_j W_ij``, ``sum_j W_ij v_j`` (a limb GEMM) and ``N_i = dO_i . sum_j W_ij v_j`` are
   exact integers, so ``D~_i = N_i / l_i`` is an exact rational of the computed weights.
4. ``dS~_ij = W_ij (g_ij l_i - N_i) / l_i^2`` and ``P~_ij = W_ij / l_i`` are rounded to nearest
   on a ``2^-G``-relative grid; the dq/dk/dv sums of these integers are exact (limb GEMMs).

Certified radius per element (``A_i = sum_c |dO_ic| max_j |v_jc|`` bounds ``|g_ij|`` and
``|D_i|``, ``L_i = l_i 2^-G >= 1``, ``n_i`` visible keys, ``P~`` the computed probabilities)::

    eps_P_ij = delta (1 + n_i P~_ij) / (L_i - n_i delta)        >= |P~_ij - P_ij|
    eps_D_i  = 2 n_i delta A_i / (L_i - n_i delta)              >= |D~_i - D_i|
    E_ij     = eps_P_ij (2 A_i + |dlse_i|) + (P~_ij + eps_P_ij) eps_D_i + rho_dS
    |dq~ - dq| <= c sum_j E_ij |k_j|,  |dk~ - dk| <= c sum_i E_ij |q_i|,
    |dv~ - dv| <= sum_i (eps_P_ij + 2^-(G+1)) |dO_i|

plus ``2^-104 |x| + 2^-1074`` for returning ``x + x_lo`` as doubles, evaluated in float64 and
inflated by ``1 + 2^-30``. Like the forward tier it assumes ``exp_fixed``'s error is at most
``EXP_FIXED_ERROR_BOUND`` units (here at ``G + 32`` bits, so it costs under 2^-32 of a unit).
Masked pairs are exactly 0 and padding is never read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from mpmath.libmp import from_float, from_man_exp, mpf_div, mpf_sub, round_nearest, to_float
from mpmath.libmp.libelefun import exp_fixed, ln2_fixed

from attention_crossval.reference.exact import (
    _BOUND_SLACK,
    _P_LIMB_BITS,
    _bit_width,
    _check_rows,
    _combine,
    _dyadic,
    _exponent_range,
    _IntMatrix,
    _limb_budget,
    _plan_limbs,
    _to_limbs,
    _Weights,
    certified_lse,
    dyadic_matmul,
    int_limbs,
    sample_grid,
)
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.masks import visible

_W_BITS = 28  # weight limb width: L products of two limbs (<= 2^28 each) sum below 2^63
_MAX_CHUNK_BITS = 12  # table size 2^12 per chunk of the score gap
_GUARD_BITS = 32  # tables are evaluated at G + 32 bits, then rounded to G
_ROW_CHUNK_ENTRIES = 1 << 17  # rows x keys per vectorized block (~10 int64 arrays of it live)
_MAX_PREC_BITS = 1000  # delta = 2 K 2^-G stays a normal double
_WORD_BITS = 30  # exact scores and gaps as int64 words: a word's sum of shifted parts < 2^63
_WORD_MASK = (1 << _WORD_BITS) - 1


@dataclass(frozen=True, eq=False)
class ExactGradients:
    """Certified tier-1 gradients; NaN where an element was not evaluated.

    ``dq + dq_lo`` is within ``dq_err_bound`` of the exact dq (per element), likewise dk and dv.
    ``rows`` (bool ``[B, Hq, Sq]``) selects the evaluated dq rows, ``keys`` (bool
    ``[B, Hkv, Sk]``) the evaluated dk/dv columns. ``d`` (``D_i - dlse_i``) and ``lse``
    (natural log) with their radii are given for every row whose statistics were needed.
    """

    dq: np.ndarray
    dq_lo: np.ndarray
    dq_err_bound: np.ndarray
    dk: np.ndarray
    dk_lo: np.ndarray
    dk_err_bound: np.ndarray
    dv: np.ndarray
    dv_lo: np.ndarray
    dv_err_bound: np.ndarray
    d: np.ndarray
    d_err_bound: np.ndarray
    lse: np.ndarray
    lse_err_bound: np.ndarray
    rows: np.ndarray
    keys: np.ndarray
    prec_bits: int

    def as_gradients(self) -> Gradients:
        """The (dq, dk, dv) triple as any tier returns it (NaN where not evaluated)."""
        return Gradients(dq=self.dq, dk=self.dk, dv=self.dv)


def sample_keys(case: BackwardCase, n: int, seed: int = 0) -> np.ndarray:
    """Bool ``[B, Hkv, Sk]`` with ``min(n, B*Hkv*Sk)`` key columns set, as ``sample_rows``
    (first and last always included; padded keys may be drawn and get zero gradient)."""
    fwd = case.forward
    return sample_grid((fwd.B, fwd.Hkv, fwd.Sk), n, seed, "keys")


def exact_backward(
    case: BackwardCase,
    *,
    rows: np.ndarray | None = None,
    keys: np.ndarray | None = None,
    prec_bits: int = 128,
) -> ExactGradients:
    """Certified dq for ``rows`` (bool ``[B, Hq, Sq]``) and dk/dv for ``keys`` (bool
    ``[B, Hkv, Sk]``); None selects all. Weights carry at least ``prec_bits`` fraction bits.
    See the module docstring for the algorithm and the radius."""
    if not isinstance(case, BackwardCase):
        raise ValueError(f"case must be a BackwardCase, got {type(case).__name__}")
    if case.forward.softcap is not None or case.forward.sink is not None:
        raise NotImplementedError("the backward of softcap or sink cases is not modelled yet")
    if isinstance(prec_bits, bool) or not isinstance(prec_bits, int):
        raise ValueError(f"prec_bits={prec_bits!r} must be an int in [64, {_MAX_PREC_BITS}]")
    if not 64 <= prec_bits <= _MAX_PREC_BITS:
        raise ValueError(f"prec_bits={prec_bits!r} must be an int in [64, {_MAX_PREC_BITS}]")
    fwd = case.forward
    rows = _check_rows(fwd, rows)
    key_shape = (fwd.B, fwd.Hkv, fwd.Sk)
    if keys is None:
        keys = np.ones(key_shape, dtype=bool)
    keys = np.asarray(keys)
    if keys.dtype != np.bool_ or keys.shape != key_shape:
        raise ValueError(
            f"keys must be a bool array of shape [B, Hkv, Sk]={key_shape}, "
            f"got dtype={keys.dtype} shape={keys.shape}"
        )
    keys = keys.copy()
    out = {
        name: np.full(shape, np.nan)
        for names, shape in (
            (("dq", "dq_lo", "dq_err_bound"), (fwd.B, fwd.Sq, fwd.Hq, fwd.D)),
            (("dk", "dk_lo", "dk_err_bound"), (fwd.B, fwd.Sk, fwd.Hkv, fwd.D)),
            (("dv", "dv_lo", "dv_err_bound"), (fwd.B, fwd.Sk, fwd.Hkv, fwd.Dv)),
            (("d", "d_err_bound", "lse", "lse_err_bound"), (fwd.B, fwd.Hq, fwd.Sq)),
        )
        for name in names
    }
    for b in range(fwd.B):
        for kv_head in range(fwd.Hkv):
            _evaluate_group(case, b, kv_head, rows, keys, prec_bits, out)
    return ExactGradients(**out, rows=rows, keys=keys, prec_bits=prec_bits)


class _FixedExp:
    """``exp(-c x 2^e_s)`` for integer gaps ``x >= 0`` as ``[L, ...]`` int64 limbs of ``_W_BITS``
    bits, ``G = _W_BITS L`` fraction bits, by a product of per-chunk table entries."""

    def __init__(self, softmax_scale: float, score_exponent: int, prec_bits: int, max_gap: int):
        self.limbs = -(-prec_bits // _W_BITS)
        self.fraction_bits = G = _W_BITS * self.limbs
        self.scale_man, scale_exp = _dyadic(softmax_scale)
        self.arg_exp = scale_exp + score_exponent  # c x 2^e_s = scale_man x 2^arg_exp
        self.guard = G + _GUARD_BITS
        self.ln2 = ln2_fixed(self.guard)
        self.cutoff = (G + 2) * (self.ln2 + 1)  # exp(-cutoff 2^-guard) < 2^-(G+2)
        shift = self.arg_exp + self.guard  # x >= cap  =>  c x 2^e_s >= the cutoff: weight 0
        numerator, denominator = self.cutoff << max(-shift, 0), self.scale_man << max(shift, 0)
        self.cap = -(-numerator // denominator)
        bits = max(min(self.cap - 1, max_gap).bit_length(), 1)
        self.chunks = -(-bits // _MAX_CHUNK_BITS)
        self.chunk_bits = -(-bits // self.chunks)
        tables = [
            _exp_table(self.scale_man, self.arg_exp + k * self.chunk_bits, G, self.chunk_bits)
            for k in range(self.chunks)
        ]
        self.tables = [values for values, _ in tables]  # [L, 2^b] per chunk
        self.known = [known for _, known in tables]  # [2^b] per chunk: entries filled

    @property
    def delta(self) -> float:
        """Bound on ``|W~ - p|`` (units of 1): ``K`` table roundings of at most one unit of
        ``2^-G`` each, ``K - 1`` truncated products of ``1 + L^2 2^-28`` units (``L <= 36``),
        and a quarter unit for gaps past the cap: below ``2K`` units."""
        return 2 * self.chunks * 2.0**-self.fraction_bits

    def weights(self, gaps: np.ndarray, seen: np.ndarray) -> np.ndarray:
        """``[L, r, n]`` limbs of the weights of ``gaps`` (``[words, r, n]`` int64 words of
        :func:`_words`, >= 0 where ``seen``), 0 off ``seen``."""
        live = seen & _less(gaps, self.cap)
        gaps = np.where(live, gaps, 0)
        product = None
        for k in range(self.chunks):
            index = _bit_field(gaps, k * self.chunk_bits, self.chunk_bits)
            wanted = np.zeros(1 << self.chunk_bits, dtype=bool)
            wanted[index[live]] = True
            self._fill(k, np.flatnonzero(wanted & ~self.known[k]))
            factor = self.tables[k][:, index]
            product = factor if product is None else _multiply_fixed(product, factor)
        return np.where(live, product, 0)

    def _fill(self, k: int, entries: np.ndarray) -> None:
        """Table ``k`` at ``entries``: ``round(exp(-c t 2^(e_s + b k)) 2^G)``, from ``exp_fixed``
        at ``G + 32`` bits (0 when below ``2^-(G+2)``)."""
        G, shift = self.fraction_bits, self.arg_exp + k * self.chunk_bits + self.guard
        for t in entries:
            arg = self.scale_man * int(t)
            arg = arg << shift if shift >= 0 else arg >> -shift
            if not t:
                value = 1 << G
            elif arg > self.cutoff:
                value = 0
            else:
                value = (exp_fixed(-arg, self.guard, self.ln2) + (1 << (_GUARD_BITS - 1))) >> (
                    _GUARD_BITS
                )
            self.tables[k][:, t] = _split_int(value, self.limbs)
            self.known[k][t] = True


@functools.lru_cache(maxsize=64)
def _exp_table(
    scale_man: int, exponent: int, fraction_bits: int, chunk_bits: int
) -> tuple[np.ndarray, np.ndarray]:
    """One chunk's table, empty until :meth:`_FixedExp._fill` fills the entries a gap needs:
    its values (``round(exp(-scale_man t 2^exponent) 2^G)`` as ``[L, 2^b]`` limbs) depend on
    these arguments only, so the groups of a case and the cases after it share them instead of
    each paying ``exp_fixed`` for every entry again (64 tables: at most 10 MiB at 128 bits)."""
    limbs = fraction_bits // _W_BITS
    return np.zeros((limbs, 1 << chunk_bits), np.int64), np.zeros(1 << chunk_bits, dtype=bool)


def _split_int(value: int, limbs: int) -> list[int]:
    """``_W_BITS``-bit limbs of ``0 <= value <= 2^(_W_BITS limbs)``; the top limb takes the rest."""
    mask = (1 << _W_BITS) - 1
    return [(value >> (_W_BITS * i)) & mask for i in range(limbs - 1)] + [
        value >> (_W_BITS * (limbs - 1))
    ]


def _multiply_fixed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a b`` truncated to ``G`` fraction bits, for ``[L, ...]`` limb arrays of values in
    ``[0, 1]``: at most ``1 + L^2 2^-28`` units of ``2^-G`` below the exact product, as the
    limb products under ``2^(_W_BITS (L - 2))`` (each below ``2^-28`` units) are dropped."""
    L = a.shape[0]
    columns = np.zeros((L + 1, *a.shape[1:]), np.int64)  # columns L-2 .. 2L-2 of the product
    for i in range(L):
        for j in range(max(0, L - 2 - i), L):
            columns[i + j - (L - 2)] += a[i] * b[j]
    out = np.empty_like(a)
    carry = np.zeros(a.shape[1:], np.int64)
    for k in range(L + 1):  # propagate carries; keep the digits at and above 2^G
        total = columns[k] + carry
        if k >= 2:
            out[k - 2] = total & ((1 << _W_BITS) - 1)
        carry = total >> _W_BITS
    out[L - 1] = carry
    return out


def _limbs_to_ints(limbs: np.ndarray) -> np.ndarray:
    """Python-int array ``sum_l limbs[l] 2^(_W_BITS l)``."""
    total = np.zeros(limbs.shape[1:], dtype=object)
    for i in range(limbs.shape[0]):
        total += limbs[i].astype(object) << (_W_BITS * i)
    return total


def _split(b: np.ndarray, terms: int, a_bits: int) -> _IntMatrix:
    """Limbs of the dyadic float64 ``b`` narrow enough for an exact GEMM against ``a_bits``-bit
    limbs over ``terms`` terms."""
    width = _bit_width(b)
    count = -(-width // (_limb_budget(terms) - a_bits))
    return _to_limbs(b, -(-width // count), count)


def _int_matmul(a_limbs: np.ndarray, a_shift: int, b_int: _IntMatrix) -> np.ndarray:
    """Exact ``A @ B.T`` as Python ints ``[r, m]``: ``A = sum_l a_limbs[l] 2^(a_shift l)``
    (``[na, r, n]``), ``B`` the integer form of a matrix split by :func:`_split` for these
    limbs (its exponent is the caller's)."""
    na, r, n = a_limbs.shape
    nb, m = b_int.limbs.shape[:2]
    products = a_limbs.reshape(na * r, n) @ b_int.limbs.reshape(nb * m, n).T
    return _combine(products.reshape(na, r, nb, m), a_shift, b_int.width)


def _signed_matmul(ints: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    """Exact ``ints @ b.T`` for a Python-int matrix ``ints`` ``[r, n]`` and dyadic ``b``:
    (Python ints ``[r, m]``, the exponent of b's integer form)."""
    bits = max((int(x).bit_length() for x in ints.flat), default=0)
    limbs = int_limbs([int(x) for x in ints.flat], ints.shape, bits, signed=True)
    b_int = _split(b, ints.shape[1], _P_LIMB_BITS)
    return _int_matmul(limbs, _P_LIMB_BITS, b_int), b_int.exponent


def _round_div(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """Nearest integer to ``numerator / denominator`` (Python ints, denominator > 0)."""
    return (2 * numerator + denominator) // (2 * denominator)


def _doubles(ints: np.ndarray, exponent: int, scale: float = 1.0) -> tuple:
    """``(hi, lo)``: ``hi`` the double nearest ``scale ints 2^exponent`` (exact dyadic), ``lo``
    the double nearest the remainder."""
    man, exp = _dyadic(scale)
    hi, lo = np.empty(ints.shape), np.empty(ints.shape)
    for index, x in np.ndenumerate(ints):
        value = from_man_exp(int(x) * man, exponent + exp)
        hi[index] = to_float(value, rnd=round_nearest)
        lo[index] = to_float(mpf_sub(value, from_float(hi[index])), rnd=round_nearest)
    return hi, lo


def _scores(q_int: _IntMatrix, k_int: _IntMatrix, rows: slice) -> np.ndarray:
    """Exact integer scores of ``rows`` as ``[words, r, C]`` words (:func:`_words`)."""
    nq, nk = q_int.limbs.shape[0], k_int.limbs.shape[0]
    q = q_int.limbs[:, rows]
    r, D = q.shape[1:]
    products = (q.reshape(nq * r, D) @ k_int.limbs.reshape(-1, D).T).reshape(nq, r, nk, -1)
    top = q_int.width * (nq - 1) + k_int.width * (nk - 1)  # the highest product's shift
    words = np.zeros((top // _WORD_BITS + 4, r, products.shape[3]), np.int64)
    for a in range(nq):
        for b in range(nk):
            _add_shifted(words, products[a, :, b], q_int.width * a + k_int.width * b)
    return _normalized(words)


def _add_shifted(words: np.ndarray, values: np.ndarray, shift: int) -> None:
    """``words += values 2^shift`` for integer-valued float64 ``values`` below 2^53 in
    magnitude (un-normalized: each word gains less than 2^31 in magnitude)."""
    ints = values.astype(np.int64)
    first, offset = divmod(shift, _WORD_BITS)
    for piece, part in enumerate((ints & _WORD_MASK, ints >> _WORD_BITS)):  # < 2^30, < 2^23
        shifted = part << offset  # below 2^59 in magnitude
        words[first + piece] += shifted & _WORD_MASK
        words[first + piece + 1] += shifted >> _WORD_BITS


def _normalized(words: np.ndarray) -> np.ndarray:
    """The same integers with every word but the top in ``[0, 2^30)`` (carries and borrows
    moved up; the top word keeps the sign): the form :func:`_less`, :func:`_bit_field` and
    :func:`_row_max` read."""
    for i in range(len(words) - 1):
        carry = words[i] >> _WORD_BITS
        words[i] &= _WORD_MASK
        words[i + 1] += carry
    return words


def _words(values: np.ndarray, count: int) -> np.ndarray:
    """Python ints as ``[count, *shape]`` normalized int64 words of ``_WORD_BITS`` bits:
    ``value = sum_w words[w] 2^(30 w)``, the top word signed and taking the rest."""
    words = np.zeros((count, *values.shape), np.int64)
    for index, value in np.ndenumerate(values):
        value = int(value)
        for w in range(count - 1):
            words[(w, *index)] = value & _WORD_MASK
            value >>= _WORD_BITS
        words[(count - 1, *index)] = value
    return words


def _word_ints(words: np.ndarray) -> list[int]:
    """The Python ints of ``[count, n]`` words (one per column)."""
    return [
        sum(int(words[w, i]) << (_WORD_BITS * w) for w in range(len(words)))
        for i in range(words.shape[1])
    ]


def _less(words: np.ndarray, bound: int) -> np.ndarray:
    """Bool: the normalized ``words`` (``[count, ...]``) below the Python int ``bound``."""
    count = len(words)
    if bound >= 1 << (_WORD_BITS * (count - 1) + 62):  # beyond every value the words hold
        return np.ones(words.shape[1:], dtype=bool)
    limit = _words(np.array([bound], dtype=object), count)[:, 0]
    less, equal = np.zeros(words.shape[1:], dtype=bool), np.ones(words.shape[1:], dtype=bool)
    for w in reversed(range(count)):
        less |= equal & (words[w] < limit[w])
        equal &= words[w] == limit[w]
    return less


def _bit_field(words: np.ndarray, start: int, bits: int) -> np.ndarray:
    """int64 ``(x >> start) & (2^bits - 1)`` of the non-negative normalized ``words``
    (``bits <= _WORD_BITS``)."""
    first, offset = divmod(start, _WORD_BITS)
    if first >= len(words):
        return np.zeros(words.shape[1:], np.int64)
    field = words[first] >> offset
    if offset + bits > _WORD_BITS and first + 1 < len(words):
        field = field | (words[first + 1] << (_WORD_BITS - offset))
    return field & ((1 << bits) - 1)


def _row_max(words: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """``[count, r]``: each row's largest value over its ``seen`` columns (``[count, r, C]``
    normalized words; every row sees a column)."""
    candidates = seen.copy()
    top = np.empty(words.shape[:2], np.int64)
    for w in reversed(range(len(words))):
        top[w] = np.where(candidates, words[w], np.iinfo(np.int64).min).max(axis=1)
        candidates &= words[w] == top[w][:, None]
    return top


def _evaluate_group(
    case: BackwardCase,
    b: int,
    kv_head: int,
    rows: np.ndarray,
    keys: np.ndarray,
    prec_bits: int,
    out: dict[str, np.ndarray],
) -> None:
    """Every selected dq row of batch ``b`` reading ``kv_head``, and its selected dk/dv columns."""
    fwd = case.forward
    key_sel = keys[b, kv_head]
    for name in ("dk", "dk_lo", "dk_err_bound", "dv", "dv_lo", "dv_err_bound"):
        out[name][b, key_sel, kv_head] = 0.0  # keys no row sees (padding too) stay exactly 0
    stat, seen_rows = [], []  # rows whose statistics are needed, and their visible keys
    for h in (h for h in range(fwd.Hq) if fwd.kv_head(h) == kv_head):
        seen_h = visible(fwd, b, h)
        nonempty = seen_h.any(axis=1)
        empty = rows[b, h] & ~nonempty  # empty and padded rows: zero gradient, D = 0
        for name in ("dq", "dq_lo", "dq_err_bound"):
            out[name][b, empty, h] = 0.0
        out["d"][b, h, empty] = out["d_err_bound"][b, h, empty] = 0.0
        out["lse"][b, h, empty], out["lse_err_bound"][b, h, empty] = -np.inf, 0.0
        need = nonempty & (rows[b, h] | seen_h[:, key_sel].any(axis=1))
        stat += [(h, int(i)) for i in np.flatnonzero(need)]
        seen_rows.append(seen_h[need])
    if not stat:
        return
    seen = np.concatenate(seen_rows)
    cols = np.flatnonzero(seen.any(axis=0))  # only keys some needed row sees are read
    seen = seen[:, cols]
    heads, index = np.array([h for h, _ in stat]), np.array([i for _, i in stat])
    group = _Group(
        q=fwd.q[b, index, heads].astype(np.float64),
        k=fwd.k[b, cols, kv_head].astype(np.float64),
        v=fwd.v[b, cols, kv_head].astype(np.float64),
        do=case.do[b, index, heads].astype(np.float64),
        dlse=np.zeros(len(stat)) if case.dlse is None else case.dlse[b, heads, index],
        seen=seen,
        sel_rows=rows[b, heads, index],
        sel_cols=key_sel[cols],
        scale=fwd.softmax_scale,
    )
    stats = _row_statistics(group, prec_bits)
    grads = _gradients(group, stats)
    rs, ks = (index[group.sel_rows], heads[group.sel_rows]), cols[group.sel_cols]
    out["dq"][b, rs[0], rs[1]], out["dq_lo"][b, rs[0], rs[1]] = grads["dq"][:2]
    out["dq_err_bound"][b, rs[0], rs[1]] = grads["dq"][2]
    for name in ("dk", "dv"):
        out[name][b, ks, kv_head], out[name + "_lo"][b, ks, kv_head] = grads[name][:2]
        out[name + "_err_bound"][b, ks, kv_head] = grads[name][2]
    out["d"][b, heads, index], out["d_err_bound"][b, heads, index] = grads["d"]
    lse = [
        certified_lse(stats.lse_weights, m, l, n * stats.delta)
        for m, l, n in zip(stats.row_max, stats.row_sum, group.seen.sum(axis=1), strict=True)
    ]
    out["lse"][b, heads, index] = [x for x, _ in lse]
    out["lse_err_bound"][b, heads, index] = [e for _, e in lse]


@dataclass(frozen=True)
class _Group:
    """The float64 inputs of one (batch, kv head): needed rows (q, dO, dlse) over the keys they
    see (k, v), their visibility, and which rows/keys are the sampled ones."""

    q: np.ndarray  # [R, D]
    k: np.ndarray  # [C, D]
    v: np.ndarray  # [C, Dv]
    do: np.ndarray  # [R, Dv]
    dlse: np.ndarray  # [R]
    seen: np.ndarray  # [R, C]
    sel_rows: np.ndarray  # [R] sampled dq rows
    sel_cols: np.ndarray  # [C] sampled dk/dv keys
    scale: float


@dataclass(frozen=True)
class _RowStats:
    """Shared row statistics of a group (module docstring): exact integers of the weights."""

    row_max: list[int]  # exact row maximum of the integer scores
    row_sum: np.ndarray  # l_i, Python ints in units 2^-G
    numerator: np.ndarray  # N_i = dO_i . sum_j W_ij v_j, Python ints in units 2^numerator_exp
    numerator_exp: int
    w_rows: np.ndarray  # W_ij of the sampled rows, Python ints [R_sel, C]
    w_cols: np.ndarray  # W_ij of the sampled keys, Python ints [R, C_sel]
    delta: float
    fraction_bits: int
    lse_weights: _Weights


def _row_statistics(group: _Group, prec_bits: int) -> _RowStats:
    """Weights, row sums, row maxima and ``N_i`` of every needed row, in row blocks."""
    q, k, seen = group.q, group.k, group.seen
    R, C = seen.shape
    wq, nq, wk, nk = _plan_limbs(_bit_width(q), _bit_width(k), q.shape[1])
    q_int, k_int = _to_limbs(q, wq, nq), _to_limbs(k, wk, nk)
    score_exponent = q_int.exponent + k_int.exponent
    score_bits = _bit_width(q) + _bit_width(k) + q.shape[1].bit_length()  # |s| < 2^score_bits
    exp = _FixedExp(group.scale, score_exponent, prec_bits, 1 << (score_bits + 1))
    do_int = _to_limbs(group.do, _bit_width(group.do), 1)  # dO as exact integers, one limb
    do_ints = np.frompyfunc(int, 1, 1)(do_int.limbs[0])
    row_max, row_sum, numerator, w_rows, w_cols = [], [], [], [], []
    v_int = _split(group.v.T, C, _W_BITS + 1)  # a weight limb is at most 2^28: 29 bits
    block = max(1, _ROW_CHUNK_ENTRIES // max(C, 1))
    for r0 in range(0, R, block):
        rs = slice(r0, min(r0 + block, R))
        scores = _scores(q_int, k_int, rs)
        m = _row_max(scores, seen[rs])
        w = exp.weights(_normalized(m[:, :, None] - scores), seen[rs])
        row_max += _word_ints(m)
        row_sum += list(_limbs_to_ints(w.sum(axis=2)))
        wv = _int_matmul(w.astype(np.float64), _W_BITS, v_int)
        numerator += list((wv * do_ints[rs]).sum(axis=1))
        w_rows.append(_limbs_to_ints(w[:, group.sel_rows[rs]]))
        w_cols.append(_limbs_to_ints(w[:, :, group.sel_cols]))
    return _RowStats(
        row_max=row_max,
        row_sum=_object_array(row_sum),
        numerator=_object_array(numerator),
        numerator_exp=do_int.exponent + v_int.exponent - exp.fraction_bits,
        w_rows=np.concatenate(w_rows),
        w_cols=np.concatenate(w_cols),
        delta=exp.delta,
        fraction_bits=exp.fraction_bits,
        lse_weights=_Weights(group.scale, score_exponent, exp.fraction_bits),
    )


def _object_array(values: list[int]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _exact_ints(x: np.ndarray) -> tuple[np.ndarray, int]:
    """``(ints, exponent)`` with ``x = ints 2^exponent`` exactly, Python ints, any shape.

    Built from each value's integer ratio, not from float64 limbs: a dlse whose values span
    more than the float64 exponent range (1e-300 next to 1e300) overflowed the limbs' scaling
    to inf and then NaN ("cannot convert float NaN to integer")."""
    exponent, _ = _exponent_range(x)

    def to_int(value: float) -> int:
        numerator, denominator = float(value).as_integer_ratio()
        shift = -exponent - (denominator.bit_length() - 1)  # value is a multiple of 2^exponent
        return numerator << shift if shift >= 0 else numerator >> -shift

    return np.frompyfunc(to_int, 1, 1)(x).reshape(x.shape), exponent


def _gradients(group: _Group, stats: _RowStats) -> dict[str, tuple]:
    """dq of the sampled rows, dk/dv of the sampled keys, D of every row: (value, lo, radius)
    each (``d``: value and radius), from the shared statistics (module docstring)."""
    G, l_int = stats.fraction_bits, stats.row_sum
    g_rows, e_rows = dyadic_matmul(group.do[group.sel_rows], group.v)  # exact dO_i . v_j
    g_cols, e_cols = dyadic_matmul(group.do, group.v[group.sel_cols])
    dlse, e_dlse = _exact_ints(group.dlse)
    e = min(e_rows, e_cols, stats.numerator_exp + G, e_dlse)  # one grid for g, D and dlse
    # D'_i = D~_i - dlse_i = (n_i / l_i) 2^e with the integers n_i below.
    n_int = (
        stats.numerator * (1 << (stats.numerator_exp + G - e)) - dlse * (1 << (e_dlse - e)) * l_int
    )

    def ds(w: np.ndarray, g: np.ndarray, e_g: int, rows: np.ndarray) -> np.ndarray:
        """dS~ = round(W (g l - n) 2^G / l^2), units 2^(e - G)."""
        li, ni = l_int[rows][:, None], n_int[rows][:, None]
        return _round_div(w * (g * (1 << (e_g - e)) * li - ni) * (1 << G), li * li)

    all_rows = np.ones(len(l_int), dtype=bool)
    ds_rows = ds(stats.w_rows, g_rows, e_rows, group.sel_rows)
    ds_cols = ds(stats.w_cols, g_cols, e_cols, all_rows)
    p_cols = _round_div(stats.w_cols * (1 << G), l_int[:, None])  # P~, units 2^-G
    dq, e_k = _signed_matmul(ds_rows, group.k.T)
    dk, e_q = _signed_matmul(ds_cols.T, group.q.T)
    dv, e_do = _signed_matmul(p_cols.T, group.do.T)
    values = {
        "dq": _doubles(dq, e - G + e_k, group.scale),
        "dk": _doubles(dk, e - G + e_q, group.scale),
        "dv": _doubles(dv, e_do - G),
    }
    radii = _radii(group, stats, e - G - 1)
    out = {
        name: (hi, lo, (radii[name] + np.abs(hi) * 2.0**-104 + 2.0**-1074) * _BOUND_SLACK)
        for name, (hi, lo) in values.items()
    }
    d = np.array(
        [
            to_float(mpf_div(from_man_exp(int(n), e), from_man_exp(int(li), 0), 53, round_nearest))
            for n, li in zip(n_int, l_int, strict=True)
        ]
    )
    d_radius = (radii["d"] + np.abs(d) * 2.0**-53 + 2.0**-1074) * _BOUND_SLACK
    out["d"] = (d, d_radius)
    return out


def _radii(group: _Group, stats: _RowStats, ds_rounding_exp: int) -> dict[str, np.ndarray]:
    """Float64 certified radii before the double-double term (module docstring)."""
    G, delta, seen = stats.fraction_bits, stats.delta, group.seen
    l_float = np.array([x / (1 << G) for x in stats.row_sum])  # L_i = l_i 2^-G >= 1
    n = seen.sum(axis=1)
    denominator = np.where(l_float > n * delta, l_float - n * delta, 0)
    a = np.abs(group.do) @ np.abs(group.v).max(axis=0)  # A_i >= |g_ij|, |D_i|
    with np.errstate(divide="ignore"):
        eps_d = 2 * n * delta * a / denominator  # >= |D~_i - D_i|

    def pair_error(w: np.ndarray, rows: np.ndarray, seen_part: np.ndarray) -> tuple:
        """(eps_P, E) of the pairs ``w`` of ``rows``: probability and dS errors."""
        p = np.array([[x / (1 << G) for x in row] for row in w]).reshape(w.shape)
        p /= l_float[rows][:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            eps_p = delta * (1 + n[rows][:, None] * p) / denominator[rows][:, None]
        gap = (2 * a + np.abs(group.dlse))[rows][:, None]
        err = eps_p * gap + (p + eps_p) * eps_d[rows][:, None]
        return np.where(seen_part, eps_p, 0), np.where(seen_part, err, 0)

    all_rows = np.ones(len(n), dtype=bool)
    _, e_rows = pair_error(stats.w_rows, group.sel_rows, seen[group.sel_rows])
    eps_p_cols, e_cols = pair_error(stats.w_cols, all_rows, seen[:, group.sel_cols])
    abs_k, abs_q, abs_do = np.abs(group.k), np.abs(group.q), np.abs(group.do)
    seen_rows, seen_cols = seen[group.sel_rows].astype(float), seen[:, group.sel_cols].astype(float)
    return {  # rounding of dS~ (half a unit of 2^ds_rounding_exp + 1) and of P~ (2^-(G+1))
        "dq": group.scale * (e_rows @ abs_k + _tiny(seen_rows @ abs_k, ds_rounding_exp)),
        "dk": group.scale * (e_cols.T @ abs_q + _tiny(seen_cols.T @ abs_q, ds_rounding_exp)),
        "dv": eps_p_cols.T @ abs_do + _tiny(seen_cols.T @ abs_do, -G - 1),
        "d": np.where(np.isnan(eps_d), np.inf, eps_d),
    }


def _tiny(x: np.ndarray, exponent: int) -> np.ndarray:
    """``x 2^exponent`` rounded up (the scaling may underflow)."""
    return np.nextafter(np.ldexp(x, exponent), np.inf)
