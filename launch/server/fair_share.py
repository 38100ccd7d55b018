"""The engines' sequences, shared fairly between clients: what one request may cost the others.

A prompt holds its n sequences from the moment it is handed to a replica until its stream ends. The
replicas run `capacity` sequences at once (max_num_seqs each); one client may hold all but a sixteenth
of them (at least one), so another client's request always finds room in the next step instead of
queueing behind a fan-out (8 prompts x n=32, a batch of 1,024 conversations). The price: a client alone
on the server runs at most 15/16 of the batch it could (240 of 256 sequences by default). Waiting prompts are served client by client,
the client holding the fewest first. A prompt waits at most `timeout` seconds while its client holds
nothing (a client's fan-out waiting behind its own earlier prompts is making progress); then its request
is a 503 with Retry-After.

A client is the request's `user` field (OpenAI's end-user id) where it gives one, else its address."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator

from shardserve.launch.server.api_error import APIError

RETRY_AFTER_SECONDS = 1


def client_key(user: object, request) -> str:
    """Whom a request (a Starlette Request) is counted for: its `user` field, else the address it came from."""
    if isinstance(user, str) and user:
        return f"user:{user}"
    return f"address:{request.client.host if request.client else '?'}"


class FairShare:
    def __init__(self, capacity: int, timeout: float):
        self.timeout = timeout
        self.held: dict[str, int] = {}  # client -> sequences its prompts hold
        self.total = 0
        self.waiting: dict[str, deque[tuple[int, asyncio.Future]]] = {}  # client -> its prompts, in order
        self.resize(capacity)

    def resize(self, capacity: int) -> None:
        """The replicas now run `capacity` sequences at once (fewer while one is dead and restarting)."""
        self.capacity = capacity
        self.per_client = max(1, capacity - max(1, capacity // 16))  # the rest stays for other clients
        self._grant()  # (room that grew)

    @contextlib.asynccontextmanager
    async def holding(self, client: str, n: int) -> AsyncIterator[None]:
        """The client's prompt of n sequences holds them inside the block (it waits to enter it)."""
        await self.acquire(client, n)
        try:
            yield
        finally:
            self.release(client, n)

    async def acquire(self, client: str, n: int) -> None:
        """Wait until the client's prompt of n sequences may go to a replica (or a 503 after the timeout)."""
        if not any(self.waiting.values()) and self._fits(client, n):
            self._take(client, n)
            return
        granted = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(client, deque()).append((n, granted))
        self._grant()  # (room another client's waiting prompt cannot use may be this one's)
        try:
            await self._wait(client, granted)
        except BaseException:
            if granted.done() and not granted.cancelled():
                self.release(client, n)  # granted as it was given up
            else:
                granted.cancel()  # (left in the queue: _grant drops it)
            raise

    async def _wait(self, client: str, granted: asyncio.Future) -> None:
        starved_since = time.monotonic()
        while True:
            await asyncio.wait({granted}, timeout=0.25)
            if granted.done():
                return
            if self.held.get(client, 0):
                starved_since = time.monotonic()  # its own earlier prompts run: progress
            elif time.monotonic() - starved_since > self.timeout:
                raise APIError(503, f"server busy: the request waited {self.timeout:g} s for room on the engines "
                               "(--queue-timeout); retry later", error_type="service_unavailable",
                               headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    def release(self, client: str, n: int) -> None:
        self.held[client] -= n
        if not self.held[client]:
            del self.held[client]
        self.total -= n
        self._grant()

    def _fits(self, client: str, n: int) -> bool:
        held = self.held.get(client, 0)
        return (self.total == 0 or self.total + n <= self.capacity) and (held == 0 or held + n <= self.per_client)

    def _take(self, client: str, n: int) -> None:
        self.held[client] = self.held.get(client, 0) + n
        self.total += n

    def _grant(self) -> None:
        """Hand the room there is to waiting prompts, the client holding the fewest first."""
        while True:
            for queue in self.waiting.values():
                while queue and queue[0][1].done():  # given up
                    queue.popleft()
            ready = [c for c, queue in self.waiting.items() if queue and self._fits(c, queue[0][0])]
            if not ready:
                self.waiting = {c: queue for c, queue in self.waiting.items() if queue}
                return
            client = min(ready, key=lambda c: (self.held.get(c, 0), c))
            n, granted = self.waiting[client].popleft()
            self._take(client, n)
            granted.set_result(None)

