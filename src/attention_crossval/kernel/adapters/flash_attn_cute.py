"""flash_attn.cute (flash-attn-4): the SM90 path on Hopper (H100/H200), SM100 on Blackwell.

Conventions: bottom-right causal and windows (FlashAttention's), LSE natural log in
``[B, Hq, Sq]``, empty rows O = 0 and LSE = -inf (the project's convention). Varlen is passed as
``seqused_q`` / ``seqused_k`` on the padded ``[B, S, H, D]`` layout, which is exactly the case
model's ``q_lengths`` / ``k_lengths``; rows past ``seqused_q`` are not written
(``padded_rows="unwritten"``).

Known finding (``padding-read``, measured on the H200 with flash-attn-4 4.0.0b36): with
``seqused_k`` the kernel reads the K/V rows of the last partial tile past the valid length, even
when that length is 0. Masking gives them weight 0, but ``0 * NaN = NaN``, so NaN there reaches
every row of that batch; large finite values do not. The same read through a page table: with
pages of 128 keys (its K tile) it reads the unused tail of a sequence's last page (a second
known ``padding-read``, of paged cases).

The call goes through ``flash_attn.cute.interface._flash_attn_fwd`` (private) because only it
takes ``out=`` / ``lse=``: that is what lets the harness prefill outputs with NaN and surround
them with guard bands. The public ``flash_attn_varlen_func`` computes the same thing.

The forward surface, as flash-attn-4 4.0.0b36's ``interface.py`` takes it (declared, not yet
run on the H200):

* ``softcap``: turned into a ``score_mod`` (``cap * tanh(scale * s / cap)``, the scale first);
  its tanh is ``tanh.approx.f32`` (relative error about 2^-11), so ``tanh_error_ulp=4096``;
* ``learnable_sink``: float32 ``[Hq]``; empty rows get LSE = sink;
* paged KV: ``page_table`` int32 ``[B, max_pages]`` over K/V pages ``[num_pages, page_size,
  Hkv, D]``, the lengths as ``seqused_k`` (not with ``cu_seqlens_k``: a paged and packed case
  packs q only); a page size other than the K tile takes the cp.async path instead of TMA;
* packed varlen: ``cu_seqlens_q/k`` and ``max_seqlen_q/k``, outputs ``[total_q, Hq, Dv]`` and
  ``lse [Hq, total_q]``;
* ``num_splits``: refused on SM90 ("SplitKV not supported on SM 9.0"), so declared only on SM100;
* head dims: on SM90 the pairs (D, Dv) with D = Dv in 64, 96, 128, 192, 256, and (192, 128)
  (``head_dim_pairs``). Its interface accepts any D and Dv in 8..256 divisible by 8, but
  on the H200 D = 64 with Dv = 256 does not compile ("Insufficient
  registers"), while 192/128 ran; other Dv != D pairs have not been tried. On SM100 8..128
  (and the pairs (192, 128), (256, 256)): declared 64 and 128 with Dv = D, as nothing of it
  has run (no Blackwell GPU). SM90's K tile depends on D (128 for
  D <= 64 and D = 128; 144 or 128 for 96; 128, 112 or 96 for 192; 80 or 64 for 256), so the
  bound counts K blocks of 16, a divisor of every one of them (``kv_blocks``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from attention_crossval.kernel.adapters import _torch
from attention_crossval.kernel.adapters.flash_attn_cute_backward import (
    CuteBackward,
    compile_cache_entries,
    seqused,
)
from attention_crossval.kernel.contract.known_findings import KnownFinding
from attention_crossval.kernel.contract.public_call import TORCH_RESULT, PublicCall
from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.phases import compiles
from attention_crossval.reference.case import AttentionCase, CausalAlignment

# SM90's K tile per D (interface._tile_size_fwd_sm90): a D with several tiles gets 16, which
# divides them all, so every tile edge is a block edge of the bound.
_SM90_HEAD_DIMS = frozenset({64, 96, 128, 192, 256})
# D = Dv, and the one Dv != D pair that ran on the H200 (64/256 did not compile).
_SM90_HEAD_DIM_PAIRS = frozenset({(d, d) for d in _SM90_HEAD_DIMS} | {(192, 128)})
_SM90_KV_BLOCKS = {96: 16, 192: 16, 256: 16}
_SM100_MAX_SPLITS = 16  # an upper end to draw from; the combine takes up to 256
# flash-attn-4's switch for its file cache of compiled kernels (flash_attn/cute/cache_utils.py)
COMPILE_CACHE_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"


def _compute_major() -> int:
    """The GPU's compute capability major (9 = Hopper, 10 = Blackwell); 9 without a GPU,
    where the spec only names the kernel's tests."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_capability()[0]
    except ImportError:
        pass
    return 9


def _spec() -> KernelSpec:
    sm90 = _compute_major() == 9
    return KernelSpec(
        name="flash-attn-cute",
        dtypes=frozenset({"float16", "bfloat16"}),
        head_dims=_SM90_HEAD_DIMS if sm90 else frozenset({64, 128}),
        head_dims_v=_SM90_HEAD_DIMS if sm90 else None,
        head_dim_pairs=_SM90_HEAD_DIM_PAIRS if sm90 else None,
        kv_blocks=_SM90_KV_BLOCKS if sm90 else {},
        softcap=True,
        tanh_error_ulp=4096.0,
        sink=True,
        paged=True,
        max_splits=1 if sm90 else _SM100_MAX_SPLITS,
        layouts=frozenset({"padded", "packed"}),
        mask_kinds=frozenset({"causal", "window", "varlen"}),
        causal_alignment=CausalAlignment.BOTTOM_RIGHT,
        gqa=True,
        tile_m=128,
        tile_n=128,  # SM90 tiles: D=128 -> 128x128; D=64 -> 192x128
        # lengths travel as int32 (seqused_q/k, cu_seqlens) and no smaller limit is documented;
        # checked at 64k prefill and 128k decode by tests/reference/test_long_context.py -m gpu
        max_seqlen=(1 << 31) - 1,
        returns_lse=True,
        deterministic=True,
        padded_rows="unwritten",
        known_findings=(
            KnownFinding(
                check="padding-read",
                mask_kinds=frozenset({"varlen"}),
                reason="with seqused_k it reads K/V past the valid length (the last partial "
                "tile, even for length 0): NaN there reaches every row of that batch, large "
                "finite values do not. Not yet reported upstream.",
                link="https://github.com/Dao-AILab/flash-attention",
            ),
            KnownFinding(  # measured on the H200 (docs/results-h200.md)
                check="padding-read",
                mask_kinds=frozenset(),
                features=frozenset({"paged"}),
                reason="with pages of 128 keys (its K tile, the TMA path) it reads the unused "
                "tail of a sequence's last page: NaN there made 412 of 840 rows of a "
                "three-sequence case non-finite (measured once, as nonfinite, before the "
                "harness read page tails as padding). Page size 16 passed once; other page "
                "sizes are untested, so the finding covers every paged case. Not yet "
                "reported upstream.",
                link="https://github.com/Dao-AILab/flash-attention",
            ),
            *(
                KnownFinding(  # docs/results-h200.md, "Known findings, reproduced"
                    check=check,
                    mask_kinds=frozenset(),
                    features=frozenset({"paged"}),
                    head_dims=frozenset({96}),
                    reason="with paged KV at D = 96 its O is wrong and differs between two runs "
                    "on the same inputs (a decode over 25 keys gave -0.52 and 0.0009 for one "
                    "element), at page sizes 1, 2 and 16, one or two heads, 25 to 320 keys, "
                    "its LSE too; D = 64 and 128 pass the same cases. Not yet reported "
                    "upstream.",
                    link="https://github.com/Dao-AILab/flash-attention",
                )
                for check in ("determinism", "bound", "lse")
            ),
            KnownFinding(  # measured on the H200 (docs/results-h200.md)
                check="hidden-nan",
                mask_kinds=frozenset({"window"}),
                reason="it loads K/V tiles holding keys that a sliding window hides from every "
                "query and weights them 0: NaN there made 768 of 2044 rows non-finite (B=2, "
                "Sq=511, Sk=512, window (0, 282), D=96; the same with pages, packed, softcap), "
                "and 2 rows of a decode at D=256. A KV cache holds anything outside the "
                "window. Not yet reported upstream.",
                link="https://github.com/Dao-AILab/flash-attention",
            ),
            KnownFinding(  # measured on the H200 (docs/results-h200.md)
                check="nonfinite",
                mask_kinds=frozenset(),
                features=frozenset({"sink"}),
                reason="the learnable sink is left out of the running max: where the sink "
                "exceeds every visible score by more than 88 (exp overflows float32) the row "
                "comes back non-finite. Measured: exactly the 3 rows of 2044 with that gap "
                "(115-345) in a case with sinks 21.9 and 4.0 and scores down to -323. Not "
                "yet reported upstream.",
                link="https://github.com/Dao-AILab/flash-attention",
            ),
            KnownFinding(  # measured on the H200 (docs/results-h200.md)
                check="padding-read",
                mask_kinds=frozenset({"varlen"}),
                reason="the backward with seqused_k reads K/V past the valid length as the "
                "forward does: NaN there makes dq non-finite. Not yet reported upstream.",
                link="https://github.com/Dao-AILab/flash-attention",
                backward=True,
            ),
        ),
        backward=True,  # kernel/adapters/flash_attn_cute_backward.py; atomic dQ adds by default
        # What its SM90 backward was run at on the H200; it has tile configs up
        # to 256 (and 192/128), not run here yet.
        backward_head_dims=frozenset({64, 128}),
    )


@dataclass
class FlashAttnCuteAdapter(CuteBackward, _torch.GuardedOutputsAdapter):
    """``flash_attn.cute`` forward with guard-banded, prefilled ``out`` and ``lse`` (and its
    backward, :class:`~kernel.adapters.flash_attn_cute_backward.CuteBackward`)."""

    spec: KernelSpec = field(default_factory=_spec)
    # NaN in K/V that no query sees, too (kernel/harness/hidden_nan.py): one more launch per case
    # with
    # hidden keys, which the GPU suite affords.
    checks: frozenset[str] = _torch.GUARDED_CHECKS | {"hidden-nan"}

    def launch(
        self, case: AttentionCase, q: Any, k: Any, v: Any, out: Any, lse: Any, **layout: Any
    ) -> None:
        """One forward into ``out`` / ``lse``; ``layout`` holds a packed or paged case's
        ``cu_seqlens_q/k``, ``max_seqlen_q/k``, ``page_table`` and ``seqused_k``
        (``_torch.call_tensors``). A padded case passes its valid lengths as ``seqused_q/k``."""
        from flash_attn.cute.interface import _flash_attn_fwd

        mask = case.mask
        lengths = {}  # packed: the offsets are the lengths (paged: seqused_k from the layout)
        if case.layout == "padded":
            lengths = {
                "seqused_q": seqused(mask.q_lengths, q.device),
                "seqused_k": seqused(mask.k_lengths, q.device),
            }
        sink = None if case.sink is None else _torch.float32_tensor(case.sink, q.device)
        with compiles(compile_cache_entries("_flash_attn_fwd")):
            _flash_attn_fwd(
                q,
                k,
                v,
                **(lengths | layout),
                softmax_scale=case.softmax_scale,
                causal=mask.causal,
                softcap=case.softcap,
                window_size_left=mask.window_left,
                window_size_right=mask.window_right,
                learnable_sink=sink,
                num_splits=case.num_splits,
                return_lse=True,
                out=out,
                lse=lse,
            )

    def repro_call(self, case: AttentionCase) -> PublicCall:
        """The public call a reproducer script makes (kernel/contract/public_call.py):
        ``flash_attn.cute.flash_attn_varlen_func`` on the padded layout, the valid lengths as
        ``seqused_q`` / ``seqused_k``, K/V through a page table for a paged case (pages past a
        sequence's keys hold ``pad``), the sink as float32. ValueError for the packed layout,
        which the script does not build."""
        if case.layout != "padded":
            raise ValueError(
                f"layout={case.layout!r}: the flash-attn-cute reproducer builds the padded and "
                "paged layouts only"
            )
        lines = ["qt = to_torch(q)"]
        options = ["softmax_scale=SCALE", "causal=CAUSAL", "window_size=WINDOW"]
        if case.page_size is None:
            lines.append("kt, vt = to_torch(k), to_torch(v)")
        else:
            lines += _PAGED_LINES
            options.append("page_table=page_table")
        if case.page_size is not None or case.mask.k_lengths is not None:
            lines.append(
                "seqused_k = torch.tensor(K_LENGTHS or [k.shape[1]] * k.shape[0], "
                "dtype=torch.int32, device='cuda')"
            )
            options.append("seqused_k=seqused_k")
        if case.mask.q_lengths is not None:
            lines.append("seqused_q = torch.tensor(Q_LENGTHS, dtype=torch.int32, device='cuda')")
            options.append("seqused_q=seqused_q")
        if case.softcap is not None:
            options.append("softcap=SOFTCAP")
        if case.sink is not None:
            lines.append("sink = torch.tensor(SINK, dtype=torch.float32, device='cuda')")
            options.append("learnable_sink=sink")
        if case.num_splits > 1:
            options.append("num_splits=NUM_SPLITS")
        return PublicCall(
            api="flash_attn.cute.flash_attn_varlen_func",
            imports=("import torch", "from flash_attn.cute import flash_attn_varlen_func"),
            lines=(
                *lines,
                "out, lse = flash_attn_varlen_func(",
                "    qt, kt, vt, " + ", ".join(options) + ", return_lse=True",
                ")",
                *TORCH_RESULT,
                "lse = lse.double().cpu().numpy()",
            ),
            torch=True,
        )


# A paged case's K/V in the script: pages of PAGE_SIZE keys, sequence after sequence, a
# sequence's unused slots holding ``pad`` (NaN in the padding check).
_PAGED_LINES = [
    "per_sequence = -(-k.shape[1] // PAGE_SIZE)",
    "lengths = K_LENGTHS or [k.shape[1]] * k.shape[0]",
    "shape = (k.shape[0] * per_sequence, PAGE_SIZE, k.shape[2])",
    "k_pages = np.full((*shape, k.shape[3]), pad, np.float32)",
    "v_pages = np.full((*shape, v.shape[3]), pad, np.float32)",
    "for b in range(k.shape[0]):",
    "    for n in range(per_sequence):",
    "        start = n * PAGE_SIZE",
    "        count = max(0, min(PAGE_SIZE, lengths[b] - start))",
    "        k_pages[b * per_sequence + n, :count] = k[b, start : start + count]",
    "        v_pages[b * per_sequence + n, :count] = v[b, start : start + count]",
    "page_table = torch.arange(k.shape[0] * per_sequence, dtype=torch.int32, device='cuda')",
    "page_table = page_table.reshape(k.shape[0], per_sequence)",
    "kt, vt = to_torch(k_pages), to_torch(v_pages)",
]


def use_persistent_compile_cache() -> None:
    """Turn on flash_attn.cute's own file cache of compiled kernels (off by default in
    flash-attn-4; read when ``flash_attn.cute`` is first imported), so the kernel workers of a
    run, and later runs on the same machine, load a configuration another one compiled instead
    of compiling it again. ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0`` keeps it off;
    ``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR`` moves it (default ``$TMPDIR/$USER/``)."""
    os.environ.setdefault(COMPILE_CACHE_ENV, "1")


def create() -> FlashAttnCuteAdapter:
    use_persistent_compile_cache()
    return FlashAttnCuteAdapter()


def deterministic() -> FlashAttnCuteAdapter:
    """``flash-attn-cute`` with ``deterministic=True`` in the backward, declared bitwise
    repeatable (its forward is the same)."""
    use_persistent_compile_cache()
    spec = replace(_spec(), name="flash-attn-cute-deterministic", backward_deterministic=True)
    return FlashAttnCuteAdapter(spec=spec)
