"""The check vocabulary shared by the contract and the harness: what a finding, a known finding
and an adapter's ``checks`` may name."""

from __future__ import annotations

CHECKS = (
    "error",
    "crash",
    "timeout",
    "shape",
    "input-write",
    "output-guard",
    "unwritten",
    "padding-read",
    "hidden-nan",
    "nonfinite",
    "determinism",
    "empty-rows",
    "bound",
    "lse",
)
# The backward harness's checks (kernel/harness/backward.py), same vocabulary where they overlap.
BACKWARD_CHECKS = (
    "error",
    "crash",
    "timeout",
    "output-guard",
    "unwritten",
    "padding-read",
    "nonfinite",
    "determinism",
    "zero-grad",
    "dq-bound",
    "dk-bound",
    "dv-bound",
)
# What an adapter's ``checks`` (and ``backward_checks``) may name: the checks that need its
# cooperation. ``output-guard`` and ``unwritten`` need caller-allocated, guard-banded, prefilled
# outputs (``run_guarded``); ``padding-read`` needs a kernel that may be handed NaN in padding
# (the harness then poisons it); ``hidden-nan`` one that may be handed NaN in K/V rows no query
# sees (kernel/harness/hidden_nan.py).
ADAPTER_CHECKS = frozenset(
    {"output-guard", "unwritten", "padding-read", "hidden-nan", "determinism", "nonfinite"}
)
# The adapter checks of an adapter that declares none.
BASIC_CHECKS = frozenset({"determinism", "nonfinite"})
