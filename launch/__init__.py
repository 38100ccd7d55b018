"""Command line and server: joins the planner and the runtime."""

__version__ = "0.1.0"
