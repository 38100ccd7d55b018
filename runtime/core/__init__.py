"""The engine core's process side: the plain loop that steps an engine on what its socket brings, the
typed messages it takes and sends, and the one client that talks to it, in this process (AsyncEngine) or
over a socket to a process of its own (each of a server's replicas)."""
