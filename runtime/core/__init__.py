"""The engine core: the engine's step loop (schedule, execute, update) and what it steps (the scheduler, the
KV block pool, requests, structured outputs, output processing); the core's plain loop over a socket, its
messages, and the one client that talks to it, in this process (AsyncEngine) or in one of its own (each of
a server's replicas)."""
