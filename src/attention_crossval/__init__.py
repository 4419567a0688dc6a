"""attention-crossval: prove attention kernels correct against exact references.

This is the public surface for adapter authors; everything else is internal. The project's
packages live under this one namespace (``attention_crossval.reference``, ``.kernel``,
``.properties``, ``.report``), so a user's own folders named ``kernel/`` or ``report/`` never
shadow them.

>>> from attention_crossval import KernelSpec
>>> KernelSpec(name="mine", device="cpu").device
'cpu'
"""

from __future__ import annotations

from attention_crossval.kernel.contract.declined import Declined
from attention_crossval.kernel.contract.known_findings import KnownFinding
from attention_crossval.kernel.contract.public_call import PublicCall
from attention_crossval.kernel.contract.spec import (
    BackwardKernelAdapter,
    KernelAdapter,
    KernelSpec,
)
from attention_crossval.reference.case import (
    AttentionCase,
    AttentionResult,
    CausalAlignment,
    Mask,
)
from attention_crossval.reference.gradients import BackwardCase, Gradients
from attention_crossval.reference.precision import (
    BackwardPrecision,
    StreamingPrecision,
)

__all__ = [
    "AttentionCase",
    "AttentionResult",
    "BackwardCase",
    "BackwardKernelAdapter",
    "BackwardPrecision",
    "CausalAlignment",
    "Declined",
    "Gradients",
    "KernelAdapter",
    "KernelSpec",
    "KnownFinding",
    "Mask",
    "PublicCall",
    "StreamingPrecision",
]
