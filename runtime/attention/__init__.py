"""Paged attention: the layer models use, a torch reference backend and a Triton backend."""
