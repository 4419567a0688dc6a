"""Fixes for Triton's interpreter (``TRITON_INTERPRET=1``, NumPy on the CPU) that the tests
running the Triton kernels on the CPU apply before importing a kernel module.

* Triton 3.6 turns a loop bound into an int with ``int()`` of a 1-element array, which NumPy
  >= 2.4 refuses: the bound is read as its one element instead.
* Its float -> FP8 conversion truncates the exponent range and rounds ties away from zero,
  unlike the hardware's round-to-nearest-even: conversions to and from e4m3/e5m2 go through
  ml_dtypes instead (a kernel clamps before converting, as satfinite does, so nothing overflows
  here).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

_FP8 = {"fp8e4nv": ml_dtypes.float8_e4m3fn, "fp8e5": ml_dtypes.float8_e5m2}
_WIDE = {"fp16": np.float16, "fp32": np.float32}


def patch_interpreter() -> None:
    """Apply both fixes to ``triton.runtime.interpreter`` (idempotent enough: once per process)."""
    from triton.runtime import interpreter

    patch_tensor, convert = interpreter._patch_lang_tensor, interpreter._convert_float

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def converted(values, input_dtype, output_dtype, rounding_mode):
        source, target = str(input_dtype), str(output_dtype)
        if target in _FP8 and source in _WIDE:
            return values.astype(_WIDE[source]).astype(_FP8[target]).view(np.uint8)
        if source in _FP8 and target in _WIDE:
            return values.view(_FP8[source]).astype(_WIDE[target])
        return convert(values, input_dtype, output_dtype, rounding_mode)

    interpreter._patch_lang_tensor = patched_tensor
    interpreter._convert_float = converted
