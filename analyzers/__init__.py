"""Stateless analyzers: they read traces, run directories and logs and return plain data.

Nothing here imports `diag.collectors`, plots or prints.
"""
