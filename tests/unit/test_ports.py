"""The rendezvous port a launch is given (toolkit.runtime.ports): free, and outside the kernel's ephemeral range, so
that no outgoing connection on the host can take it before the launcher binds it."""

import socket

from toolkit.runtime.ports import FLOOR, ephemeral_low, free_port


def test_a_port_is_drawn_free_below_the_ephemeral_range(tmp_path):
    low = ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(FLOOR <= p < low for p in ports), (sorted(ports), low)
    assert len(ports) > 15  # drawn at random, not the kernel's next port
    with socket.socket() as sock:  # and free: it binds
        sock.bind(("127.0.0.1", ports.pop()))
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    assert ephemeral_low(str(ranges)) == 40000
    assert ephemeral_low(str(tmp_path / "missing")) == 32768
