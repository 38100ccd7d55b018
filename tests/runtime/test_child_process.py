"""The framing every child process of ours (ranks, replicas) shares: whole messages only, in order, the
ones sent before the other side closed still read."""

import socket

from shardserve.runtime.distributed.child_process import FrameReader, frame, recv_blocking, send_blocking


def test_a_frame_cut_anywhere_is_read_whole_once_it_has_all_arrived():
    parent, child = socket.socketpair()
    with parent, child:
        data = frame({"call": "step", "ids": list(range(1000))}) + frame("second")
        reader = FrameReader(child)
        for cut in (3, 8, 9, len(data) // 2):
            parent.sendall(data[:cut])
            assert reader.read(0.0) == []  # nothing whole yet
            parent.sendall(data[cut:])
            assert reader.read(1.0) == [{"call": "step", "ids": list(range(1000))}, "second"]
        assert reader.read(0.0) == [] and not reader.closed


def test_what_came_before_the_close_is_read_then_the_reader_says_closed():
    parent, child = socket.socketpair()
    with child:
        send_blocking(parent, 1)
        send_blocking(parent, [2])
        parent.close()
        reader = FrameReader(child)
        assert reader.read(1.0) == [1, [2]]
        assert reader.closed and reader.read(5.0) == []  # closed: no wait


def test_blocking_reads_take_what_the_reader_side_sends():
    parent, child = socket.socketpair()
    with parent, child:
        send_blocking(child, ("ready", 0))
        assert recv_blocking(parent) == ("ready", 0)
