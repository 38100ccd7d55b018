"""The rendezvous store listens on the address it is given alone, keeps its keys under the engine's
secret, refuses a rank without it, and (gloo) stops listening once every rank has joined."""

from __future__ import annotations

import ipaddress
import os
import socket
import threading

import pytest

from shardserve.launch.cluster.node_facts import interface_addresses
from shardserve.runtime import LLM, SamplingParams
from shardserve.runtime.distributed.process_group import CHECK_KEY, Rendezvous, join_rendezvous, start_rendezvous
from test_parallel_generate import MAX_TOKENS, PROMPTS, rank_pids
from test_runtime_matches_transformers import token_outputs


def listening(pid: int | str = "self") -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (its fds matched to /proc/net)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    address, port = fields[1].split(":")
                    found.add((_address(address), int(port, 16)))
    return found


def _address(hex_address: str) -> str:
    """/proc/net/tcp{,6}'s address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def other_address() -> str:
    """An IPv4 address of this machine that is not loopback; skips when there is none."""
    addresses = [a for a in interface_addresses().values() if a and not ipaddress.ip_address(a).is_loopback]
    if not addresses:
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    return addresses[0]


def refuses(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_one_node_store_listens_on_loopback_alone():
    """The mp executor's store (TCPStore alone would listen on every interface, 0.0.0.0 or ::)."""
    store, rendezvous = start_rendezvous("127.0.0.1", 2)
    assert [a for a, port in listening() if port == rendezvous.port] == ["127.0.0.1"]
    del store
    assert all(port != rendezvous.port for _, port in listening())  # dropping the store closes it


def test_one_node_store_refuses_another_interface():
    store, rendezvous = start_rendezvous("127.0.0.1", 2)
    assert refuses(other_address(), rendezvous.port)  # the same port at this machine's other address


def test_cluster_store_listens_on_the_cluster_interface_alone():
    """What the Ray executor does with its node IP: that address only, not loopback, not all."""
    node_ip = other_address()
    store, rendezvous = start_rendezvous(node_ip, 2)
    assert [a for a, port in listening() if port == rendezvous.port] == [node_ip]
    assert refuses("127.0.0.1", rendezvous.port)
    joined = join_rendezvous(rendezvous, 2)
    joined.set("rank0", "here")
    assert store.get(f"{rendezvous.secret}/rank0") == b"here"


def test_ranks_keys_live_under_the_secret_and_a_wrong_secret_is_refused():
    store, rendezvous = start_rendezvous("127.0.0.1", 2)
    assert len(rendezvous.secret) >= 32 and rendezvous.secret not in repr(rendezvous)
    assert start_rendezvous("127.0.0.1", 2)[1].secret != rendezvous.secret  # one per engine
    with pytest.raises(RuntimeError, match="not this engine's"):
        join_rendezvous(Rendezvous(rendezvous.host, rendezvous.port, "a-guess"), 2)
    joined = join_rendezvous(rendezvous, 2)
    joined.set("rank1", "here")
    keys = [k for k in store.list_keys() if not k.startswith("init/")]  # init/: TCPStore's client count
    assert sorted(keys) == sorted(f"{rendezvous.secret}/{k}" for k in (CHECK_KEY, "rank1"))


class ListenerWatch:
    """Every TCP socket this process listens on, sampled every few ms while it runs."""

    def __init__(self):
        self.seen: set[tuple[str, int]] = set()
        self.is_running = True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while self.is_running:
            self.seen |= listening()
            threading.Event().wait(0.005)

    def stop(self) -> set[tuple[str, int]]:
        self.is_running = False
        self.thread.join()
        return self.seen


@pytest.mark.slow
def test_tensor_parallel_store_is_loopback_and_closes_once_ranks_join(checkpoint_factory, monkeypatch):
    monkeypatch.delenv("TORCH_GLOO_LAZY_INIT", raising=False)
    folder, _ = checkpoint_factory("llama3")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, block_size=4) as llm:
        expected = token_outputs(llm, PROMPTS, params)
    before = listening()
    watch = ListenerWatch()
    with LLM(folder, device="cpu", kv_cache_memory_bytes=2**22, block_size=4, tensor_parallel_size=2,
             distributed_executor_backend="mp") as llm:
        during = watch.stop() - before
        assert during, "the store was never seen listening"  # the watch is fast enough to see it
        assert {address for address, _ in during} == {"127.0.0.1"}
        assert llm.engine.executor.store is None and listening() - before == set()
        assert token_outputs(llm, PROMPTS, params) == expected  # gloo needs no store once joined
    assert rank_pids() == []
