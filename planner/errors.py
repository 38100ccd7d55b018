"""Errors the planner raises: each message says what to change."""


class PlanError(Exception):
    """Bad input (model, hardware or options). The CLI prints the message and exits 1."""

    exit_code = 1


class InfeasibleError(PlanError):
    """The model cannot be served on this hardware with these options. Exit code 2."""

    exit_code = 2
