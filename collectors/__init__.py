"""Collectors: they run inside the training process and write the run directory.

Nothing here imports `diag.analyzers`; everything that can fail switches itself off.
"""
