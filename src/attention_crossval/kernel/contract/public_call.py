"""How a standalone reproducer (report/repro.py) calls a kernel through its own public API.

An adapter may spell its public call with an optional method ``repro_call(case) ->
PublicCall``; nothing else of the contract changes, and an adapter without it gets
:func:`fallback_call`: the script imports the adapter's module by its dotted path and calls the
adapter on a small case container defined in the script itself. The project's own kernels (the
CPU streaming tier and its mutants, the own CuTe DSL kernels) are this package's code, so their
call imports it (:func:`project_call`); every other script imports numpy, torch and the kernel.

A :class:`PublicCall`'s ``lines`` run inside the script's ``run_kernel(q, k, v, pad)``, where

* ``q``, ``k``, ``v`` are float32 NumPy arrays ``[B, S, H, X]`` holding the case's exact input
  values (NaN where the check poisons padding or hidden keys), ``pad`` the value for a layout's
  padding (the unused tail of K/V pages);
* ``as_dtype(x)`` gives a NumPy array in the input dtype (bfloat16 through ml_dtypes, imported
  only then) and, when ``torch`` is set, ``to_torch(x)`` a CUDA tensor in the input dtype;
* ``visible`` is the bool mask ``[B, Hq or 1, Sq, Sk]`` of the keys each query may see, and the
  case's constants are ``DTYPE``, ``SCALE``, ``CAUSAL``, ``ALIGNMENT``, ``WINDOW`` (left,
  right; None unbounded), ``Q_LENGTHS``, ``K_LENGTHS`` (lists or None), ``EXPLICIT`` (the
  explicit bool mask or None), ``SOFTCAP``, ``SINK`` (a list or None), ``PAGE_SIZE``,
  ``NUM_SPLITS``;

and must set ``o`` (``[B, Sq, Hq, Dv]``) and ``lse`` (``[B, Hq, Sq]`` natural log, or None),
anything ``np.asarray`` turns into float64.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from attention_crossval.reference.case import AttentionCase


@dataclass(frozen=True)
class PublicCall:
    """One kernel call in a reproducer: ``api`` names the public function it calls (the
    report's one line), ``imports`` are the script's import lines for it, ``lines`` the code
    (module docstring), ``torch`` whether it needs torch and a CUDA device."""

    api: str
    imports: tuple[str, ...]
    lines: tuple[str, ...]
    torch: bool = False

    def __post_init__(self) -> None:
        for name in ("imports", "lines"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or not all(isinstance(x, str) for x in value):
                raise ValueError(f"PublicCall.{name}={value!r} must be a tuple of str")
        if not isinstance(self.api, str) or not self.api:
            raise ValueError(f"PublicCall.api={self.api!r} must be a non-empty str")


# What a torch call hands back: ``o`` from a ``[B, Sq, Hq, Dv]`` tensor ``out``, after the GPU
# finished (a reproducer's last lines for every torch kernel).
TORCH_RESULT = ("torch.cuda.synchronize()", "o = out.double().cpu().numpy()")


def dense_visible_tensor(name: str) -> str:
    """A script line setting ``name`` to ``visible`` as a CUDA bool tensor ``[B, Hq, Sq, Sk]``."""
    return (
        f"{name} = torch.from_numpy(np.ascontiguousarray(np.broadcast_to(visible, "
        "(q.shape[0], q.shape[2], q.shape[1], k.shape[1])))).cuda()"
    )


def project_call(path: str, *, factory: bool) -> PublicCall:
    """The call of one of this package's own kernels (``package.module:attr``, a zero-argument
    ``factory`` or the adapter): its adapter on the package's own case type, which is that
    kernel's only public API."""
    module, _, attr = path.partition(":")
    return PublicCall(
        api=path,
        imports=(
            f"import {module}",
            "from attention_crossval.reference.case import AttentionCase, CausalAlignment, Mask",
        ),
        lines=(
            f"kernel = {module}.{attr}{'()' if factory else ''}",
            "mask = Mask(causal=CAUSAL, window_left=WINDOW[0], window_right=WINDOW[1],",
            "            alignment=CausalAlignment(ALIGNMENT), q_lengths=Q_LENGTHS,",
            "            k_lengths=K_LENGTHS, explicit=EXPLICIT)",
            "case = AttentionCase(as_dtype(q), as_dtype(k), as_dtype(v), SCALE, mask,",
            "                     softcap=SOFTCAP, page_size=PAGE_SIZE, num_splits=NUM_SPLITS,",
            "                     sink=None if SINK is None else np.asarray(SINK, np.float32),",
            "                     page_fill=pad)",
            "result = kernel(case)",
            "o, lse = result.o, result.lse",
        ),
    )


def fallback_call(path: str, *, factory: bool) -> PublicCall:
    """The generic call of a user's adapter ``package.module:attr`` (a zero-argument
    ``factory`` or the adapter) that spells none: the script imports the module (never this
    package) and calls the adapter on the small case container it defines (``make_case``)."""
    module, _, attr = path.partition(":")
    return PublicCall(
        api=f"{path} (the adapter itself)",
        imports=(f"import {module}",),
        lines=(
            f"kernel = {module}.{attr}{'()' if factory else ''}",
            "result = kernel(make_case(q, k, v, pad))",
            "o, lse = result.o, result.lse",
        ),
    )


def public_call(adapter: Any, case: AttentionCase, kernel: str | None) -> PublicCall:
    """``adapter.repro_call(case)`` when the adapter spells its call; else the project's call
    of one of this package's kernels, else :func:`fallback_call` of the ``--kernel`` path.
    ValueError when neither applies (an in-process adapter without a dotted path)."""
    spell = getattr(adapter, "repro_call", None)
    if spell is not None:
        call = spell(case)
        if not isinstance(call, PublicCall):
            raise ValueError(
                f"{type(adapter).__name__}.repro_call must return a PublicCall, "
                f"got {type(call).__name__}"
            )
        return call
    from attention_crossval.kernel.harness.registry import factory_path

    if kernel is None:
        raise ValueError(
            "kernel=None: a reproducer needs the kernel's --kernel spelling (built-in name or "
            "package.module:attr) when its adapter has no repro_call"
        )
    path = factory_path(kernel)
    spell = project_call if path.startswith("attention_crossval.") else fallback_call
    return spell(path, factory=_is_factory(path))


def _is_factory(path: str) -> bool:
    """Whether ``package.module:attr`` names a factory rather than an adapter (as
    :func:`kernel.registry.resolve` tells them apart)."""
    from attention_crossval.kernel.contract.spec import KernelAdapter

    module, _, attr = path.partition(":")
    target = getattr(importlib.import_module(module), attr)
    return callable(target) and not isinstance(target, KernelAdapter)
