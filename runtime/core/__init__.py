"""The engine core, on token ids only: the engine's step loop (schedule, execute, update) and what it steps (the
scheduler, the KV block pool, requests, structured outputs); the core's plain loop over a socket, its messages,
and the one client that talks to it and makes text of its updates, in this process (AsyncEngine) or in one of
its own (each of a server's replicas)."""
