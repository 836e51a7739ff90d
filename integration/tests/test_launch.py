"""The launchers' checks that need no cluster: where a Ray run's endpoints are, what the driver's node must
hold, and a node that cannot see the run folder (the two-node run itself: test_system.py)."""

import json

import msgspec
import pytest

from tidal.core.errors import ConfigError
from tidal.core.net import PortReservation
from tidal.integration.launch import RayLauncher, RunFolderNotShared, _RoleHost, check_home
from tidal.integration.recipe import load_recipe
from tidal.integration.run import plan


def test_a_run_on_another_address_puts_every_endpoint_and_the_weight_server_there(tmp_path):
    """With the Ray launcher the driver reserves the run's ports on its node's address (what other nodes
    connect to); the learner's zmq weight server binds a port of its own on it too."""
    host = "127.0.0.2"  # an address other than the local launcher's 127.0.0.1 (Linux routes all of 127/8 here)
    cfg = load_recipe(None, [f'model="{tmp_path}"', "workers=2"])
    with PortReservation(host) as ports:
        roles, ep = plan(cfg, tmp_path / "run", ports=ports)
    assert all(e.startswith(f"tcp://{host}:") for e in ep.values()), ep
    by = {r.name: json.loads(r.config.read_text()) for r in roles}
    assert by["learner"]["weights"]["transport"]["options"]["endpoint"] == f"tcp://{host}:*"
    assert by["rollout-1"]["controller"] == ep["controller"] and by["buffer"]["ingest"] == ep["ingest"]


def test_the_drivers_node_must_hold_the_buffer_and_learner_rank_0():
    node = {"NodeManagerAddress": "10.0.0.5", "Resources": {"CPU": 8.0}}
    check_home(node, {"buffer": {}, "learner": {"num_cpus": 2}})
    with pytest.raises(RuntimeError, match=r"driver's node \(10\.0\.0\.5\), which has 0 GPU and the recipe asks for 1 "
                                            r"\(launcher\.options\.resources\.learner\.num_gpus\): start `tidal run` on a node"):
        check_home(node, {"learner": {"num_gpus": 1}})


def test_a_node_that_cannot_see_the_run_folder_is_named_with_the_fix(tmp_path):
    pytest.importorskip("ray")
    host = _RoleHost(["-m", "tidal.buffer", "--config", str(tmp_path / "gone" / "buffer.json")],
                     str(tmp_path / "buffer.log"), {})
    with pytest.raises(RunFolderNotShared, match=r"cannot see .*gone/buffer\.json: every node of the Ray cluster must "
                                                 r"see the run folder at the same path.*filesystem every node mounts"):
        host.start()
    assert host.proc is None


def test_an_unknown_placement_is_refused_with_the_choices():
    pytest.importorskip("ray")
    with pytest.raises(ValueError, match=r"launcher.options.placement = 'wide': one of pack, spread"):
        RayLauncher(placement="wide")


def test_with_weights_relay_each_worker_takes_weights_from_its_nodes_relay(tmp_path):
    """launcher.options.weights_relay: the plan has a `relay` role (tidal.weight_sync.relay) fetching from the
    learner's publisher; each worker subscribes to and fetches from its node's relay (an ipc folder named
    after the node), trusting the relay's key; the learner lets the relay in."""
    from tidal.integration.run import relay_folder
    from tidal.weight_sync.relay import RelayConfig

    cfg = load_recipe(None, [f'model="{tmp_path}"', "workers=2"])
    run_dir = tmp_path / "run"
    with PortReservation("127.0.0.2") as ports:
        roles, ep = plan(cfg, run_dir, ports=ports, relay_dir=relay_folder(run_dir))
    by = {r.name: r for r in roles}
    assert by["relay"].kind == "relay" and by["relay"].module == "tidal.weight_sync.relay"
    relay = msgspec.json.decode(by["relay"].config.read_bytes(), type=RelayConfig)
    assert relay.upstream == ep["learner_pub"]
    assert relay.serve.startswith("ipc:///tmp/tidal-relay-") and relay.serve.endswith("-{node}/weights")
    worker = json.loads(by["rollout-1"].config.read_text())
    assert worker["weights"] == relay.publish and worker["weights_server"] == "relay"
    zmq, = (t for t in worker["weight_transport"] if t["name"] == "zmq")
    assert zmq["options"]["server"] == "relay"
    assert "relay" in worker["security"]["servers"] and relay.security.name == "relay"
    learner = json.loads(by["learner"].config.read_text())
    assert "relay" in learner["security"]["clients"]

    shm = load_recipe(None, [f'model="{tmp_path}"', 'learner.weights.transport.name="shm"'])
    with pytest.raises(ConfigError, match="weights_relay relays zmq weights; learner.weights.transport is 'shm'"):
        plan(shm, tmp_path / "run2", ports=PortReservation("127.0.0.2"), relay_dir="/tmp/x-{node}")
