"""The fair share's room follows the live replicas (issue 40): with one of two dead, a client's fan-out sized for
both would fill the survivor, and another client's request would wait a whole generation behind it."""

import asyncio

from shardserve.launch.server.fair_share import FairShare


def test_room_shrinks_with_a_dead_replica_and_a_waiting_prompt_enters_when_it_is_back():
    async def run() -> None:
        share = FairShare(capacity=64, timeout=60)
        share.resize(32)  # one replica of two died
        assert share.per_client == 30
        await share.acquire("fan", 24)
        waiting = asyncio.ensure_future(share.acquire("fan", 8))  # past its 30 of the survivor's 32
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await asyncio.wait_for(share.acquire("probe", 1), 1)  # another client finds room at once
        share.resize(64)  # the replica is back
        await asyncio.wait_for(waiting, 1)
        assert share.held == {"fan": 32, "probe": 1}
    asyncio.run(run())
