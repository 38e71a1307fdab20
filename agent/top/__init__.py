"""`diag top`: a live view of a running job (sources, screen, keys, loop)."""
