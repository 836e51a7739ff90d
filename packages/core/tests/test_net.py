"""tidal.core.net: a node-local endpoint names the node it runs on."""

from tidal.core.net import NODE_ENV, on_this_node


def test_a_node_local_endpoint_names_this_node(monkeypatch):
    monkeypatch.delenv(NODE_ENV, raising=False)
    assert on_this_node("ipc:///tmp/relay-{node}/pub") == "ipc:///tmp/relay-local/pub"
    monkeypatch.setenv(NODE_ENV, "10.0.0.7")
    assert on_this_node("ipc:///tmp/relay-{node}/pub") == "ipc:///tmp/relay-10.0.0.7/pub"
    assert on_this_node("tcp://10.0.0.5:5555") == "tcp://10.0.0.5:5555"
