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

from pathlib import Path

# In a source checkout the subpackages are the repository's top-level folders (an install maps
# them under this package instead), so a checkout on PYTHONPATH works without installing.
_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "reference" / "case.py").is_file():
    __path__.append(str(_CHECKOUT))

from attention_crossval.kernel.isolation import Declined  # noqa: E402
from attention_crossval.kernel.known_findings import KnownFinding  # noqa: E402
from attention_crossval.kernel.spec import (  # noqa: E402
    BackwardKernelAdapter,
    KernelAdapter,
    KernelSpec,
)
from attention_crossval.reference.case import (  # noqa: E402
    AttentionCase,
    AttentionResult,
    CausalAlignment,
    Mask,
)
from attention_crossval.reference.gradients import BackwardCase, Gradients  # noqa: E402
from attention_crossval.reference.precision import (  # noqa: E402
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
    "StreamingPrecision",
]
