"""The plug-in contract a kernel implements: its declaration (KernelSpec, known findings,
call options) and the exceptions it may raise. Imports nothing of the harness."""
