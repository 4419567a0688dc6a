"""Which kernel a saved case (``.npz``) failed for: the ``--kernel`` spelling stored beside the
arrays, so ``python -m attention_crossval.properties.replay`` can rerun that kernel on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from attention_crossval.kernel.harness.registry import BUILTIN

KERNEL_FIELD = "kernel"  # the .npz field holding the --kernel spelling


def store_kernel(path: Path, kernel: str) -> Path:
    """Add ``kernel`` to the case saved at ``path`` (rewritten in place); returns ``path``."""
    with np.load(path) as data:
        fields = dict(data)
    np.savez_compressed(path, **fields, **{KERNEL_FIELD: np.array(kernel)})
    return path


def kernel_spelling(kernel_name: str | None, spec_name: str) -> str | None:
    """The ``--kernel`` spelling that loads a harness's kernel again: its worker's
    ``kernel_name`` when it runs in one, else the spec's name when that is a built-in's (an
    in-process adapter does not know its dotted path), else None."""
    if kernel_name is not None:
        return kernel_name
    return spec_name if spec_name in BUILTIN else None
