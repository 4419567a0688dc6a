"""torch ``scaled_dot_product_attention`` with one backend forced: math, flash, efficient, cuDNN.

Conventions, declared rather than failed on:

* ``is_causal`` is top-left (key j visible iff j <= i), so ``causal_alignment=TOP_LEFT``; the
  framework only gives bottom-right causal cases where both diagonals agree (Sq == Sk).
* Windows, explicit masks and varlen go in as a boolean ``attn_mask`` built from
  :func:`reference.masks.visible_all`, on the backends that take a mask (math, efficient,
  cuDNN). SDPA has no per-batch lengths, so varlen is only that mask.
* SDPA returns no LSE through its public API, so ``returns_lse=False``.
* Measured on torch 2.11 / H200 (docs/results-h200.md): the flash backend refuses ``is_causal`` when
  Sq != Sk and takes no mask, so it declares no mask kinds; the efficient backend has no GQA;
  cuDNN refuses Sk == 1. A backend's "No available kernel" is raised as
  :class:`kernel.contract.declined.Declined` (the case is skipped with torch's reasons, and
  counted).
* Known findings (``KernelSpec.known_findings``), kept in scope rather than declared away.
  Measured on torch 2.11 / H200, bf16 and fp16: math, efficient and cuDNN let NaN
  in masked-out K/V reach every row of the batch (a mask adds -inf to a NaN score, which stays
  NaN; 1e4 there is harmless), so varlen padding is read (``padding-read``); cuDNN gives a
  nonzero output (up to 0.5) for a row that a boolean mask hides entirely, where math and
  efficient give 0 (``empty-rows``). Its backward gives such a row the gradient of that
  output (``zero-grad``), and NaN everywhere when dO is 0 on the row (``nonfinite``).
* The forward surface: SDPA has no softcap, no learnable sink, no paged KV, no split-KV and no
  packed layout (nested tensors aside), so the specs declare none of them (the defaults): such
  cases are never generated for these backends.
* Outputs cannot be preallocated (no ``out=``), so the NaN-prefill and output guard-band checks
  do not apply; NaN padding, poisoned input guard bands, determinism and finiteness do.
* Backward: autograd through the same call (``backward``); dk/dv of a GQA group are summed by
  ``enable_gqa``'s autograd. Only math (one fp32 graph) is declared bitwise deterministic: the
  fused backends' backward adds dQ partials atomically. The efficient backend forms
  ``dS = P (dP - D)`` from the P it rounded to 16 bits for ``dV += P^T dO``, not from the fp32
  P: measured on the H200 (fp16, 6 saved cases), its dk error was 2.7-6.5x
  FlashAttention's bound and 0.4-0.92x of that chain's bound (``ds_from_rounded_p``), while
  dq and dv fit both. The flash backend rounds each query head's dk/dv to the input dtype
  before summing a GQA group (``dkv_rounded_per_head``): measured on the H200, its
  GQA cases exceeded FlashAttention's dk/dv bound by 1.01-1.95x, and the emulation of that
  chain reproduces those ratios to three digits within its own bound; cuDNN does the same
  (1.71x / 1.19x on dk / dv, 0.64x / 0.54x of the per-head chain's bound). The efficient and
  cuDNN backends multiply dS by the scale before rounding it to 16 bits (``ds_scaled``): on a
  decode whose dS is a 16-bit subnormal both exceeded FlashAttention's dk bound (1.25x, 1.46x)
  exactly as that chain's emulation does. cuDNN also flushes a dS below the 16-bit format's
  smallest normal to zero (``ds_flushes_subnormals``): on a bf16 case with max |dO| 5.7e-6
  (254 x 255, D 64, an explicit mask hiding rows, their dO zeroed) it returned dk = 0 where
  the float64 dk is 1.42e-37, 9.3x the bound without the flag; with it every element fits
  (dq / dk / dv at 0.21x / 0.21x / 0.91x) and the emulation returns 0 there as well. With dO
  times 2^16, where no dS is subnormal, both chains hold and the flushing emulation has
  exactly cuDNN's count of zeros where the float64 dk is not (1408; 1098 without the flush).
  The efficient backend passed that case at every scale, so it declares no flush; the flash
  backend takes no mask and has no such measurement. The gradients come back from autograd
  (no caller buffers), so again only input guards, determinism and finiteness apply.
* ``spec.device`` is where the tensors go: "cuda" for every registered backend; a "cpu" copy of
  the math backend exercises the adapter logic on a machine without a GPU.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

from attention_crossval.kernel.adapters import _torch
from attention_crossval.kernel.contract.declined import Declined
from attention_crossval.kernel.contract.known_findings import KnownFinding
from attention_crossval.kernel.contract.public_call import (
    TORCH_RESULT,
    PublicCall,
    dense_visible_tensor,
)
from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.reference.case import AttentionCase, AttentionResult, CausalAlignment
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.precision import BackwardPrecision, StreamingPrecision

_FLOATS = frozenset({"float16", "bfloat16", "float32"})
_HALVES = frozenset({"float16", "bfloat16"})
_MASKS = frozenset({"causal", "window", "explicit", "varlen"})
_PYTORCH = "https://github.com/pytorch/pytorch"
_NAN_THROUGH_MASK = KnownFinding(
    check="padding-read",
    mask_kinds=frozenset({"varlen"}),
    reason="NaN in masked-out K/V padding reaches every row that shares the batch: the mask "
    "adds -inf to a NaN score, which stays NaN (large finite padding is harmless). Not yet "
    "reported upstream.",
    link=_PYTORCH,
)
_CUDNN_EMPTY_ROWS = KnownFinding(
    check="empty-rows",
    mask_kinds=frozenset({"explicit", "window", "varlen"}),
    reason="a query row that the boolean mask hides entirely gets a nonzero output (neither "
    "O = 0 nor NaN; up to 0.5 on N(0,1) inputs). Not yet reported upstream.",
    link=_PYTORCH,
)

# Measured on the H200 (torch 2.11, properties/test_kernels_backward.py -m gpu): the
# same NaN reaches the gradients, and cuDNN's hidden rows get nonzero gradients.
_NAN_THROUGH_MASK_BACKWARD = dataclasses.replace(
    _NAN_THROUGH_MASK,
    reason="NaN in masked-out K/V padding reaches dq (as in the forward: the mask adds -inf to "
    "a NaN score). Not yet reported upstream.",
    backward=True,
)
_CUDNN_HIDDEN_ROW_GRADIENTS = KnownFinding(
    check="zero-grad",
    mask_kinds=frozenset({"explicit", "window", "varlen"}),
    reason="a query row that the boolean mask hides entirely gets nonzero dq, and its keys "
    "nonzero dk/dv (the forward's nonzero output on such rows, differentiated). Not yet "
    "reported upstream.",
    link=_PYTORCH,
    backward=True,
)
_CUDNN_ZERO_DO_NAN = KnownFinding(
    check="nonfinite",
    mask_kinds=frozenset({"explicit", "window", "varlen"}),
    reason="with dO = 0 on a query row that the boolean mask hides entirely (as a loss mask "
    "gives), dq, dk and dv came back NaN in every element, measured with one query row (Sq = 1) "
    "over 64 keys; 128 query rows with 32 hidden gave no NaN. Not yet reported upstream.",
    link=_PYTORCH,
    backward=True,
)


class _Backend(NamedTuple):
    member: str  # torch.nn.attention.SDPBackend member
    dtypes: frozenset[str]
    mask_kinds: frozenset[str]
    gqa: bool
    tile_m: int
    tile_n: int
    fp32_p: bool  # P kept in fp32 (math upcasts); else FlashAttention's chain
    known: tuple[KnownFinding, ...]
    # BackwardPrecision flags its backward sets over FlashAttention's atomic chain (see module)
    backward_changes: tuple[str, ...] = ()


# torch warns about every backend it skipped; only the chosen backend's reasons explain a refusal.
_NOISE = (
    "Flash attention has been runtime disabled.",
    "Memory Efficient attention has been runtime disabled.",
    "cuDNN attention has been runtime disabled.",
    "Flash attention kernel not used because:",
    "Memory efficient kernel not used because:",
    "cuDNN attention kernel not used because:",
)

_BACKENDS = {
    "math": _Backend(
        "MATH",
        _FLOATS,
        _MASKS,
        True,
        128,
        128,
        True,
        (_NAN_THROUGH_MASK, _NAN_THROUGH_MASK_BACKWARD),
    ),
    "flash": _Backend(
        "FLASH_ATTENTION",
        _HALVES,
        frozenset(),
        True,
        128,
        64,
        False,
        (),
        backward_changes=("dkv_rounded_per_head",),
    ),
    "efficient": _Backend(
        "EFFICIENT_ATTENTION",
        _FLOATS,
        _MASKS,
        False,
        64,
        64,
        False,
        (_NAN_THROUGH_MASK, _NAN_THROUGH_MASK_BACKWARD),
        backward_changes=("ds_from_rounded_p", "ds_scaled"),
    ),
    "cudnn": _Backend(
        "CUDNN_ATTENTION",
        _HALVES,
        _MASKS,
        True,
        128,
        128,
        False,
        (
            _CUDNN_EMPTY_ROWS,
            _NAN_THROUGH_MASK,
            _CUDNN_HIDDEN_ROW_GRADIENTS,
            _CUDNN_ZERO_DO_NAN,
            _NAN_THROUGH_MASK_BACKWARD,
        ),
        backward_changes=("ds_scaled", "ds_flushes_subnormals", "dkv_rounded_per_head"),
    ),
}


def _math_precision(dtype: str) -> StreamingPrecision:
    """The math backend upcasts 16-bit inputs to fp32 and never rounds P (one dense softmax)."""
    return StreamingPrecision(score_dtype="float32", accum_dtype="float32", output_dtype=dtype)


def _math_backward_precision(dtype: str) -> BackwardPrecision:
    """Autograd through the math backend's fp32 graph: P and dS never rounded, one fixed
    order, the gradients rounded to the input dtype at the end."""
    return BackwardPrecision(forward=_math_precision(dtype), output_dtype=dtype)


def _changed_backward_precision(dtype: str, changes: tuple[str, ...]) -> BackwardPrecision:
    """FlashAttention's atomic-add chain with the flags ``changes`` set."""
    chain = BackwardPrecision.flash_attention(dtype, deterministic=False)
    return dataclasses.replace(chain, **dict.fromkeys(changes, True))


@dataclass
class SdpaAdapter:
    """One SDPA backend as a kernel adapter (``backend`` in math, flash, efficient, cudnn)."""

    backend: str
    spec: KernelSpec
    checks: frozenset[str] = frozenset({"padding-read", "determinism", "nonfinite"})
    backward_checks: frozenset[str] = checks

    @classmethod
    def create(cls, backend: str) -> SdpaAdapter:
        if backend not in _BACKENDS:
            raise ValueError(f"backend={backend!r} must be one of {sorted(_BACKENDS)}")
        info = _BACKENDS[backend]
        precision = {d: _math_precision(d) for d in info.dtypes} if info.fp32_p else {}
        backward = {d: _math_backward_precision(d) for d in info.dtypes} if info.fp32_p else {}
        if info.backward_changes:
            changes = info.backward_changes
            backward = {d: _changed_backward_precision(d, changes) for d in info.dtypes}
        spec = KernelSpec(
            name=f"sdpa-{backend}",
            dtypes=info.dtypes,
            head_dims=frozenset({64, 128}),
            mask_kinds=info.mask_kinds,
            causal_alignment=CausalAlignment.TOP_LEFT,
            gqa=info.gqa,
            tile_m=info.tile_m,
            tile_n=info.tile_n,
            precision=precision,
            returns_lse=False,
            deterministic=True,
            known_findings=info.known,
            backward=True,
            backward_deterministic=info.fp32_p,  # the fused backends add dQ atomically
            backward_precision=backward,
        )
        return cls(backend, spec)

    def __call__(self, case: AttentionCase) -> AttentionResult:
        q, k, v = (
            _torch.to_device(getattr(case, n), self.spec.device).transpose(1, 2) for n in "qkv"
        )
        o = self._attend(case, q, k, v)
        self._synchronize()
        return AttentionResult(o=_torch.to_host(o.transpose(1, 2)), lse=None)

    def repro_call(self, case: AttentionCase) -> PublicCall:
        """The public call a reproducer script makes (kernel/contract/public_call.py): SDPA with
        this backend forced, the mask as :meth:`_attend` passes it."""
        options = "scale=SCALE" + (", enable_gqa=True" if case.group_size > 1 else "")
        mask = []
        if self._is_causal(case):
            options += ", is_causal=True"
        elif case.mask.kinds:
            mask = [dense_visible_tensor("mask")]
            options += ", attn_mask=mask"
        member = _BACKENDS[self.backend].member
        return PublicCall(
            api=f"torch.nn.functional.scaled_dot_product_attention (SDPBackend.{member})",
            imports=("import torch", "from torch.nn.attention import SDPBackend, sdpa_kernel"),
            lines=(
                "qt, kt, vt = (to_torch(x).transpose(1, 2) for x in (q, k, v))",
                *mask,
                f"with sdpa_kernel([SDPBackend.{member}]):",
                "    out = torch.nn.functional.scaled_dot_product_attention(",
                f"        qt, kt, vt, {options}",
                "    ).transpose(1, 2)",
                *TORCH_RESULT,
                "lse = None  # SDPA returns no LSE",
            ),
            torch=True,
        )

    @staticmethod
    def _is_causal(case: AttentionCase) -> bool:
        """SDPA's ``is_causal`` (top-left) says the case's mask: causal alone, aligned alike."""
        return case.mask.kinds == {"causal"} and (
            case.mask.alignment is CausalAlignment.TOP_LEFT or case.Sq == case.Sk
        )

    def backward(self, case: BackwardCase) -> Gradients:
        """Forward, then backward through autograd. The leaves are detached views of the
        NaN-guarded inputs, so a read past a sequence's end still shows as non-finite."""
        q, k, v = (
            _torch.to_device(getattr(case.forward, n), self.spec.device)
            .transpose(1, 2)
            .detach()
            .requires_grad_()
            for n in "qkv"
        )
        o = self._attend(case.forward, q, k, v)
        o.backward(_torch.to_device(case.do, self.spec.device).transpose(1, 2))
        self._synchronize()
        return Gradients(*(_torch.to_host(x.grad.transpose(1, 2)) for x in (q, k, v)))

    def _attend(self, case: AttentionCase, q: Any, k: Any, v: Any) -> Any:
        """SDPA on ``[B, H, S, X]`` views with this backend forced; a refusal is Declined."""
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kwargs: dict[str, Any] = {"scale": case.softmax_scale}
        if case.group_size > 1:
            kwargs["enable_gqa"] = True
        if self._is_causal(case):
            kwargs["is_causal"] = True
        elif case.mask.kinds:
            from attention_crossval.reference.masks import visible_all

            kwargs["attn_mask"] = torch.from_numpy(visible_all(case)).to(q.device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with sdpa_kernel([getattr(SDPBackend, _BACKENDS[self.backend].member)]):
                try:
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
                except RuntimeError as error:
                    if "No available kernel" not in str(error):
                        raise
                    reasons = sorted(
                        {str(w.message).split("(Triggered")[0].strip() for w in caught}
                    )
                    raise Declined(f"sdpa-{self.backend}: {'; '.join(reasons)}") from None

    def _synchronize(self) -> None:
        import torch

        if self.spec.device == "cuda":
            torch.cuda.synchronize()


def math() -> SdpaAdapter:
    return SdpaAdapter.create("math")


def flash() -> SdpaAdapter:
    return SdpaAdapter.create("flash")


def efficient() -> SdpaAdapter:
    return SdpaAdapter.create("efficient")


def cudnn() -> SdpaAdapter:
    return SdpaAdapter.create("cudnn")
