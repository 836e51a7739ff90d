"""CURVE: only a client holding the server's public key (and, when configured, an authorized key of
its own) gets through; everyone else gets nothing, and the server keeps running."""

from __future__ import annotations

import pytest
import zmq

from tidal.core import ChannelTimeout, SecurityError
from tidal.core.channels import dealer
from tidal.core.protocol import Ack, Control
from tidal.core.security import CurveClient, CurveServer, generate_keys
from tidal.core.testing import make_trajectory


@pytest.fixture
def keys(tmp_path):
    server_pub, server_sec = generate_keys(tmp_path / "server", "server")
    _client_pub, client_sec = generate_keys(tmp_path / "clients", "client")
    _, stranger_sec = generate_keys(tmp_path / "strangers", "stranger")
    return dict(server_pub=server_pub, server_sec=server_sec, client_sec=client_sec,
                clients=tmp_path / "clients", stranger_sec=stranger_sec)


def _stop(endpoint, curve):
    with dealer(endpoint, curve=curve, linger=0) as c:
        assert c.request(Control(command="stop", reason="bye"), timeout=10).kind == "stats"


def test_client_without_the_server_key_gets_nothing_through(server_process, keys):
    proc, endpoint = server_process("--curve-secret", str(keys["server_sec"]))
    # plain client: the CURVE handshake never completes, so nothing is delivered either way
    with dealer(endpoint, linger=0) as plain:
        plain.send(make_trajectory(0), timeout=1)
        with pytest.raises(ChannelTimeout):
            plain.recv(timeout=1.0)
    # a client that trusts the wrong server key is refused as well
    public, secret = zmq.curve_keypair()
    wrong = CurveClient(server_key=zmq.curve_keypair()[0], public_key=public, secret_key=secret)
    with dealer(endpoint, curve=wrong, linger=0) as impostor:
        impostor.send(make_trajectory(0), timeout=1)
        with pytest.raises(ChannelTimeout):
            impostor.recv(timeout=1.0)
    assert proc.poll() is None
    # the right key works, and the server counted only this client's messages
    good = CurveClient.from_files(keys["server_pub"])
    with dealer(endpoint, curve=good, linger=0) as client:
        assert client.request(make_trajectory(1), timeout=10) == Ack(kind="echo", ids=["Trajectory"])
        stats = client.request(Control(command="stop", reason="bye"), timeout=10)
    assert stats.ids == ["2", "0"]
    assert proc.wait(timeout=10) == 0


def test_authorized_keys_keep_out_unknown_clients(server_process, keys):
    proc, endpoint = server_process("--curve-secret", str(keys["server_sec"]), "--authorized", str(keys["clients"]))
    stranger = CurveClient.from_files(keys["server_pub"], keys["stranger_sec"])
    with dealer(endpoint, curve=stranger, linger=0) as c:
        c.send(make_trajectory(0), timeout=1)
        with pytest.raises(ChannelTimeout):
            c.recv(timeout=1.0)
    member = CurveClient.from_files(keys["server_pub"], keys["client_sec"])
    with dealer(endpoint, curve=member, linger=0) as c:
        assert c.request(make_trajectory(0), timeout=10).ids == ["Trajectory"]
    _stop(endpoint, member)
    assert proc.wait(timeout=10) == 0


def test_curve_allows_non_loopback_endpoints_and_reports_bad_key_files(tmp_path, keys):
    server = CurveServer.from_files(keys["server_sec"])
    from tidal.core.channels import router

    with router("tcp://0.0.0.0:*", curve=server, linger=0) as r:
        assert r.endpoint.startswith("tcp://0.0.0.0:")
    with pytest.raises(SecurityError, match="does not exist"):
        CurveServer.from_files(tmp_path / "missing.key_secret")
    with pytest.raises(SecurityError, match="no secret key"):
        CurveServer.from_files(keys["server_pub"])
    (tmp_path / "junk.key").write_text("hello")
    with pytest.raises(SecurityError, match="not a ZeroMQ certificate"):
        CurveClient.from_files(tmp_path / "junk.key")
