"""Integrations with model libraries. Each is imported on its own (``torchdist_ext.integrations.hf``), so
that the package never requires them."""
