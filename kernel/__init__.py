"""The kernel tier: the plug-in contract (``spec``), built-in adapters, and the project's own kernels."""
