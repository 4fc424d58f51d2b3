"""A worker's last lines tell the agent whether it failed because a peer was gone (its report says so, and the
master waits a moment for news of a lost node before it spends a restart)."""

from __future__ import annotations

from convoy.agent.log_pump import peer_lost


def test_a_closed_or_reset_connection_reads_as_a_lost_peer_and_an_error_of_its_own_does_not() -> None:
    assert peer_lost(["Traceback (most recent call last):", "RuntimeError: [../gloo/transport/tcp/pair.cc:553] "
                      "Connection closed by peer [127.0.0.1]:31961"])
    assert peer_lost(["torch.distributed.DistBackendError: ... Connection reset by peer"])
    assert not peer_lost(["Traceback (most recent call last):", "ValueError: bad batch size"])
    assert not peer_lost([])
