"""A kernel module that fails when imported, as a user's module with a bug at top level does."""

raise ZeroDivisionError("deliberate failure at import of kernel.broken.fails_at_import")
