"""One module per `diag` subcommand.

Each module defines `HELP`, `add_arguments(parser)` and `run(args) -> int`.
`diag.cli` imports a module only when its subcommand runs, so `diag --help` stays fast.
"""
