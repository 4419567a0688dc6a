"""flash_attn.cute's backward (SM90 on Hopper): dq, dk, dv with and without ``deterministic``.

A mixin of :class:`kernel.adapters.flash_attn_cute.FlashAttnCuteAdapter`, so ``flash-attn-cute``
has a backward; :func:`deterministic` is the same kernel with ``deterministic=True`` (dQ
partials added under a semaphore in a fixed order, declared ``backward_deterministic``).

The call goes through ``flash_attn.cute.interface._flash_attn_bwd`` (private) because only it
takes ``dq=`` / ``dk=`` / ``dv=``: the harness prefills them (NaN or zero) inside guard bands.
Its O and LSE come from the adapter's own forward (``_flash_attn_fwd``) on the case with its
padding zeroed: that forward reads padded keys (the known forward ``padding-read`` finding), and
the backward must be judged on its own reads, which NaN in the padding of q, k, v and dO shows.
Varlen is ``seqused_q`` / ``seqused_k`` as in the forward; rows past them are not written
(``padded_rows="unwritten"``, which the backward harness applies to dq, dk and dv).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attention_crossval.kernel.adapters import _torch
from attention_crossval.kernel.contract.spec import KernelSpec
from attention_crossval.kernel.harness.forward import fill_padding
from attention_crossval.kernel.harness.phases import compiles
from attention_crossval.reference.gradients import BackwardCase, Gradients

# What one backward call may compile: the backward kernel and its pre- and postprocessing.
_BACKWARD_FUNCTIONS = ("_flash_attn_bwd", "_bwd_preprocess", "_bwd_postprocess_convert")


def seqused(values: tuple[int, ...] | None, device: Any) -> Any:
    """Per-batch valid lengths as the int32 tensor flash_attn.cute takes (None: no varlen)."""
    import torch

    return None if values is None else torch.tensor(values, dtype=torch.int32, device=device)


def compile_cache_entries(*names: str) -> Callable[[], int]:
    """How many configurations the compile caches (``compile_cache``, a dict per function) of
    ``flash_attn.cute.interface``'s functions ``names`` hold: what :func:`kernel.phases.compiles`
    watches to time a call that compiled as ``compile``."""
    from flash_attn.cute import interface

    caches = [getattr(getattr(interface, name), "compile_cache", None) for name in names]
    return lambda: sum(len(getattr(cache, "cache", ())) for cache in caches)


class CuteBackward:
    """The backward of a flash_attn.cute adapter: uses its ``spec`` and its forward
    ``launch(case, q, k, v, out, lse)``."""

    spec: KernelSpec
    backward_checks: frozenset[str] = _torch.GUARDED_CHECKS

    def backward(self, case: BackwardCase) -> Gradients:
        return self.run_backward_guarded(case, prefill="zero")[0]

    def run_backward_guarded(
        self, case: BackwardCase, *, prefill: str
    ) -> tuple[Gradients, tuple[str, ...]]:
        """Forward on the zero-padded case, then one backward launch into ``prefill``ed,
        guard-banded dq/dk/dv; returns the gradients and any guard writes."""
        import torch
        from flash_attn.cute.interface import _flash_attn_bwd

        fwd = case.forward
        clean = fill_padding(fwd, 0.0)
        q, k, v = (_torch.to_device(getattr(clean, n)) for n in "qkv")
        out = torch.zeros((fwd.B, fwd.Sq, fwd.Hq, fwd.Dv), dtype=q.dtype, device=q.device)
        lse = torch.zeros((fwd.B, fwd.Hq, fwd.Sq), dtype=torch.float32, device=q.device)
        self.launch(clean, q, k, v, out, lse)
        q, k, v = (_torch.to_device(getattr(fwd, n)) for n in "qkv")
        shapes = {"dq": q.shape, "dk": k.shape, "dv": v.shape}
        grads = {
            name: _torch.GuardedOutput.allocate(tuple(shape), fwd.dtype, axis=1, prefill=prefill)
            for name, shape in shapes.items()
        }
        mask = fwd.mask
        entries = compile_cache_entries(*_BACKWARD_FUNCTIONS)
        with compiles(entries):
            _flash_attn_bwd(
                q,
                k,
                v,
                out,
                _torch.to_device(case.do),
                lse,
                softmax_scale=fwd.softmax_scale,
                causal=mask.causal,
                window_size_left=mask.window_left,
                window_size_right=mask.window_right,
                seqused_q=seqused(mask.q_lengths, q.device),
                seqused_k=seqused(mask.k_lengths, q.device),
                deterministic=bool(self.spec.backward_deterministic),
                dq=grads["dq"].view,
                dk=grads["dk"].view,
                dv=grads["dv"].view,
            )
        torch.cuda.synchronize()
        writes = tuple(w for name, grad in grads.items() for w in grad.guard_writes(name))
        return Gradients(**{n: _torch.to_host(g.view) for n, g in grads.items()}), writes
