"""The kernel tier: the plug-in contract (``spec``), built-in adapters, own kernels."""
