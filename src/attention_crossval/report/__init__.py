"""Numerical-error reports for attention kernels: per configuration, each tier pair's error
metrics, the worst element's story, determinism and a verdict, written as JSON (versioned
schema, report/schema.json), Markdown and a self-contained HTML page with plots.

Modules: ``configs`` (what to run), ``runner`` (one config -> records; ``cache`` for the exact
tier, ``subset`` for big cases, ``plotdata``), ``records`` (JSON values, the incremental log),
``session`` (a whole run with resume), ``markdown`` / ``html`` / ``plots`` (outputs), ``diff``
(two reports), ``schema`` (validation), ``cli`` (``attention-report`` and ``python -m report``).
"""
