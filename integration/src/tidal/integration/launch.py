"""Runners (plugin kind ``launcher``): start a run's roles, report the ones that died, restart, stop.

A role is one command: ``python -m MODULE --config ROLE.json [ARGS]``. The run driver
(`tidal.integration.run`) decides what to restart; a launcher only knows how to start, watch and stop.

`local` runs each role as a child process of the driver, each in its own session (Ctrl-C reaches the
driver only, which stops the roles in order) and bound to the driver's life (Linux
PR_SET_PDEATHSIG), so a driver killed with SIGKILL leaves no orphans. Logs go to <run_dir>/logs.

`ray` places each role as a Ray actor that starts the role's process on its node with the driver's own
Python (`sys.executable`). On a cluster of several nodes, the roles that the others connect to (the
buffer, learner rank 0, and the controller inside the driver) run on the driver's node and bind its
address, which the driver writes into every role's config; learner ranks >= 1 and rollout workers go
where their resources are free (`placement = "pack"`: Ray's own choice) or round-robin over the live
nodes (`placement = "spread"`). A lost node takes its roles with it; the driver places them again on the
nodes left, where they reconnect to the same endpoints. Every node must see the run folder (role
configs, keys, logs, checkpoints) at the same path: a shared filesystem. Ray's `uv run` hook (on by
default in Ray >= 2.43 when the driver runs under `uv run`) would ship the working folder to a fresh uv
environment on each worker, which does not hold the workspace's packages (`ModuleNotFoundError: No
module named 'tidal'`), so the launcher turns it off (RAY_ENABLE_UV_RUN_RUNTIME_ENV=0, unless set) and
says so in the log.

Both write <run_dir>/pids.json, what is running now: local ``{role: pid}``; ray ``{role: {"node": ip,
"pid": pid}}`` (learner ranks: "pid" is rank 0's, "pids" every rank's). `read_pids` reads both.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.core.net import NODE_ENV

log = logging.getLogger("tidal.launch")


@dataclass
class Role:
    name: str  # unique in the run: "buffer", "learner", "rollout-0", ...
    kind: str  # "buffer" | "learner" | "rollout"
    module: str  # started as python -m MODULE
    config: Path  # the role's JSON config
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    nproc: int = 1  # learner ranks (torch.distributed) for this role

    def argv(self) -> list[str]:
        return ["-m", self.module, "--config", str(self.config), *self.args]


PR_SET_PDEATHSIG = 1


def _bind_to_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the driver's finally-block still stops its children


def start_process(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A child that dies with its parent, in its own session, logging to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_bind_to_parent if sys.platform.startswith("linux") else None,
                                env={**os.environ, **(env or {})})


def read_pids(run_dir: Path) -> dict[str, tuple[str, int]]:
    """pids.json as {role: (node, pid)}: node "" for a local run (this machine); {} if there is none."""
    try:
        raw = json.loads((Path(run_dir) / "pids.json").read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for name, v in raw.items():
        if isinstance(v, int):
            out[name] = ("", v)
        elif isinstance(v, dict) and isinstance(v.get("pid"), int):
            out[name] = (str(v.get("node", "")), v["pid"])
    return out


class LocalRun:
    def __init__(self, roles: list[Role], run_dir: Path) -> None:
        self.roles = {r.name: r for r in roles}
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.starts: dict[str, int] = {}
        for r in roles:
            self._start(r)

    def _start(self, role: Role) -> None:
        self.starts[role.name] = self.starts.get(role.name, 0) + 1
        args = [*role.argv()] + (["--nproc", str(role.nproc)] if role.nproc > 1 else [])
        p = start_process([sys.executable, *args], self.run_dir / "logs" / f"{role.name}.log", role.env)
        self.procs[role.name] = p
        pids = self.run_dir / "pids.json"  # what is running now, for `kill -9` drills and debugging
        pids.write_text(json.dumps({n: q.pid for n, q in self.procs.items() if q.poll() is None}))
        log.info("started %s (pid %d)%s", role.name, p.pid,
                 f", start {self.starts[role.name]}" if self.starts[role.name] > 1 else "")

    def exited(self) -> dict[str, int]:
        out = {}
        for name, p in list(self.procs.items()):
            rc = p.poll()
            if rc is not None:
                out[name] = rc
                del self.procs[name]
        return out

    def running(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def restart(self, name: str) -> None:
        if self.running(name):
            self.kill(name)
        self._start(self.roles[name])

    def kill(self, name: str) -> None:
        p = self.procs.get(name)
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)

    def signal(self, name: str, sig: int) -> None:
        p = self.procs.get(name)
        if p is not None and p.poll() is None:
            p.send_signal(sig)

    def stop(self, order: list[str], timeout: float, only: bool = False) -> dict[str, int]:
        """SIGTERM each role in `order` (then, unless `only`, any left), waiting up to `timeout` for each
        before SIGKILL of its whole process group (learner ranks included)."""
        codes = {}
        for name in [*order, *(n for n in list(self.procs) if n not in order and not only)]:
            p = self.procs.pop(name, None)
            if p is None:
                continue
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                codes[name] = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: killed", name, timeout)
                os.killpg(p.pid, signal.SIGKILL)
                codes[name] = p.wait(timeout=30)
            try:  # anything its children left in the session
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return codes


class LocalLauncher:
    """Every role a local process (plugin ``local``)."""

    def launch(self, roles: list[Role], run_dir: Path) -> LocalRun:
        return LocalRun(roles, run_dir)


def wait_until(pred, timeout: float, every: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    return pred()


class _RoleHost:
    """A Ray actor that owns one role's process on the node Ray placed it on (it inherits the actor's
    environment: CUDA_VISIBLE_DEVICES, the node's address)."""

    def __init__(self, argv: list[str], log_path: str, env: dict[str, str]) -> None:
        self.argv, self.log_path, self.env = argv, Path(log_path), env
        self.proc: subprocess.Popen | None = None

    def rendezvous(self) -> tuple[str, str]:
        """(this node's address, a port free on it) for torch.distributed's store, which rank 0 (this actor's
        process) binds right after. Picked on the node that binds it, not on the driver's; unlike the
        run's loopback endpoints (tidal.core.net) it is not held until then: a process on this node that
        binds a port in that instant can still take it, and the ranks then fail to start (a restart
        picks again)."""
        # optional: the [ray] extra
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), str(s.getsockname()[1])

    def start(self, extra_env: dict[str, str] | None = None) -> tuple[str, int]:
        """Start the role's process; (this node's address, its pid)."""
        # optional: the [ray] extra
        import ray

        node = ray.util.get_node_ip_address()
        config = Path(self.argv[self.argv.index("--config") + 1])
        if not config.is_file():  # the role would fail at start, in a log the driver's node cannot read
            raise RunFolderNotShared(
                f"node {node} cannot see {config}: every node of the Ray cluster must see the run folder at "
                f"the same path (role configs, keys, logs and checkpoints live there); put run_dir on a "
                f"filesystem every node mounts (NFS, a cluster filesystem), e.g. run_dir=\"/shared/runs/x\"")
        self.proc = start_process([sys.executable, *self.argv], self.log_path,
                                  {**self.env, NODE_ENV: node, **(extra_env or {})})
        return node, self.proc.pid

    def node_id(self) -> str:
        # optional: the [ray] extra
        import ray

        return ray.get_runtime_context().get_node_id()

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        return None if self.proc is None else self.proc.wait(timeout=30)

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None


class RunFolderNotShared(RuntimeError):
    """A node Ray placed a role on does not see the run folder."""


START_TIMEOUT_S = 300.0  # placing one role's actors and starting its process (a busy cluster: a queue)
POLL_TIMEOUT_S = 5.0  # a role's host that does not answer this soon (its node is going) counts as running
PLACEMENTS = ("pack", "spread")
PLACE_ATTEMPTS = 3  # a role whose new node dies before it starts (a node going down as it is chosen) is placed again


class RayRun:
    """Each role placed as a Ray actor (`_RoleHost`); learner ranks are one actor each, joined under
    torch.distributed through rank 0's node address."""

    def __init__(self, roles: list[Role], run_dir: Path, resources: dict[str, dict[str, float]],
                 owns_ray: bool = False, placement: str = "pack") -> None:
        # optional: the [ray] extra
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.ray, self.affinity = ray, NodeAffinitySchedulingStrategy
        self.roles = {r.name: r for r in roles}
        self.run_dir = run_dir
        self.resources = resources
        self.placement = placement
        self.home = ray.get_runtime_context().get_node_id()  # the driver's node: the servers' endpoints are on it
        self.hosts: dict[str, list] = {}
        self.done: set[str] = set()
        self.starts: dict[str, int] = {}
        self.pids: dict[str, dict[str, Any]] = {}
        self.owns_ray = owns_ray  # a local head started for this run is shut down with it
        # the weight relay (kind "relay"), if the plan has one: run once per node that hosts rollout workers
        self.relay = next((r for r in roles if r.kind == "relay"), None)
        self.pinned: dict[str, str] = {}  # a relay's name -> its node's id
        try:
            check_home(self._nodes()[0], {k: v for k, v in resources.items() if k in ("buffer", "learner")})
            for r in roles:
                if r.kind != "relay":
                    self._start(r)
        except BaseException:  # nothing placed so far outlives a launch that failed
            self.stop([], 30)
            raise

    def _drop_relay(self, name: str, why: str) -> None:
        """Forget the relay of a node that is gone (the workers placed again elsewhere use their node's)."""
        log.warning("%s went with its node (%s); workers placed again use the relay of their new node", name, why)
        for h in self.hosts.pop(name, []):
            self.ray.kill(h)
        self.pids.pop(name, None)
        self.pinned.pop(name, None)
        self.done.discard(name)
        self._write_pids()

    def _alive(self, node_id: str) -> bool:
        return any(n["NodeID"] == node_id and n.get("Alive") for n in self.ray.nodes())

    def _nodes(self) -> list[dict[str, Any]]:
        """The live nodes, the driver's first, then by address."""
        alive = [n for n in self.ray.nodes() if n.get("Alive")]
        return sorted(alive, key=lambda n: (n["NodeID"] != self.home, n.get("NodeManagerAddress", ""), n["NodeID"]))

    def _where(self, role: Role, rank: int) -> dict[str, Any]:
        """Ray options that place rank `rank` of `role`: the buffer and learner rank 0 on the driver's node
        (they bind the endpoints the driver reserved there); the rest by `placement`."""
        if role.kind == "buffer" or (role.kind == "learner" and rank == 0):
            return {"scheduling_strategy": self.affinity(self.home, soft=False)}
        if role.name in self.pinned:  # a node's relay
            return {"scheduling_strategy": self.affinity(self.pinned[role.name], soft=False)}
        if self.placement != "spread":
            return {}
        nodes = self._nodes()
        i = rank if role.kind == "learner" else int(role.name.rsplit("-", 1)[-1]) + 1  # rollout-0 off the driver's
        # soft, spilling: a node that is full or gone sends the actor wherever Ray finds room
        return {"scheduling_strategy": self.affinity(nodes[i % len(nodes)]["NodeID"], soft=True,
                                                     _spill_on_unavailable=True)}

    def _start(self, role: Role) -> None:
        self.starts[role.name] = self.starts.get(role.name, 0) + 1
        for attempt in range(PLACE_ATTEMPTS):
            try:
                started = self._place(role)
                break
            except self.ray.exceptions.RayError as e:
                for h in self.hosts.pop(role.name, []):
                    self.ray.kill(h)
                if role.name in self.pinned:  # a relay whose node is going: its workers are placed elsewhere
                    self._drop_relay(role.name, one_line(e))
                    return
                if not isinstance(e, self.ray.exceptions.RayActorError) or attempt == PLACE_ATTEMPTS - 1:
                    raise
                # placed on a node that died before it started
                log.warning("%s: its node died while it was being placed; placing it again (%s)", role.name,
                            one_line(e))
                time.sleep(2.0)  # the cluster learns that the node is gone
        self.done.discard(role.name)
        node, pid = started[0]
        self.pids[role.name] = {"node": node, "pid": pid, **({"pids": [p for _, p in started],
                                                              "nodes": [n for n, _ in started]} if len(started) > 1 else {})}
        self._write_pids()
        where = node if len(started) == 1 else ", ".join(f"rank {i} on {n}" for i, (n, _) in enumerate(started))
        log.info("placed %s as %d Ray actor(s): %s (pid %d)%s", role.name, len(started), where, pid,
                 f", start {self.starts[role.name]}" if self.starts[role.name] > 1 else "")
        if role.kind == "rollout" and self.relay is not None:
            self._relay_for(role.name, node)

    def _relay_for(self, worker: str, node: str) -> None:
        """Start the weight relay of `worker`'s node (at `node`) unless one runs there."""
        name = f"relay@{node}"
        if name in self.hosts and name not in self.done:
            return
        assert self.relay is not None
        try:
            self.pinned[name] = self.ray.get(self.hosts[worker][0].node_id.remote(), timeout=START_TIMEOUT_S)
        except self.ray.exceptions.RayError as e:  # the worker's node went: its relay is not needed there
            log.warning("no relay started for %s's node %s: %s", worker, node, one_line(e))
            return
        self.roles[name] = Role(name=name, kind="relay", module=self.relay.module, config=self.relay.config,
                                args=self.relay.args, env=self.relay.env)
        self.hosts.pop(name, None)
        self._start(self.roles[name])

    def _place(self, role: Role) -> list[tuple[str, int]]:
        """Place `role`'s actors and start its process(es): (node address, pid) per rank."""
        opts = {"num_cpus": 0.5, **self.resources.get(role.kind, {})}
        host_cls = self.ray.remote(_RoleHost)
        hosts: list[Any] = []  # ray actor handles (their methods' `.remote` is made at run time)
        for rank in range(role.nproc):
            log_path = self.run_dir / "logs" / (f"{role.name}.log" if role.nproc == 1 else f"{role.name}-{rank}.log")
            hosts.append(host_cls.options(**opts, **self._where(role, rank)).remote(role.argv(), str(log_path), role.env))
        self.hosts[role.name] = hosts  # before any wait: a failed start is still stopped
        if role.nproc > 1:
            master, port = self.ray.get(hosts[0].rendezvous.remote(), timeout=START_TIMEOUT_S)  # picked on rank 0's own node
            pids = [h.start.remote({"RANK": str(i), "WORLD_SIZE": str(role.nproc), "LOCAL_RANK": "0",
                                    "MASTER_ADDR": master, "MASTER_PORT": port}) for i, h in enumerate(hosts)]
        else:
            pids = [hosts[0].start.remote()]
        return self.ray.get(pids, timeout=START_TIMEOUT_S)

    def _write_pids(self) -> None:
        """pids.json: each running role's node and pid (for `kill -USR1`, kill drills, `tidal status`)."""
        live = {n: v for n, v in self.pids.items() if n in self.hosts and n not in self.done}
        (self.run_dir / "pids.json").write_text(json.dumps(live))

    def _codes(self, name: str) -> list[int | None]:
        try:
            return self.ray.get([h.poll.remote() for h in self.hosts[name]], timeout=POLL_TIMEOUT_S)
        except self.ray.exceptions.RayActorError:  # its actor died: its node was lost, or Ray killed it
            return [-9]
        except self.ray.exceptions.GetTimeoutError:  # no answer yet (a node on its way out): ask again later
            return [None]

    def exited(self) -> dict[str, int]:
        out = {}
        for name in list(self.hosts):
            if name in self.done:
                continue
            codes = self._codes(name)
            if name in self.pinned and codes == [-9] and not self._alive(self.pinned[name]):
                self._drop_relay(name, "its node is gone")
                continue
            if any(c not in (None, 0) for c in codes) or all(c == 0 for c in codes):
                rc = next((c for c in codes if c not in (None, 0)), 0)
                for h in self.hosts[name]:  # a failed rank takes its peers with it
                    try:
                        self.ray.get(h.kill.remote(), timeout=60)
                    except self.ray.exceptions.RayError:
                        pass  # its actor is gone, and its process with it
                out[name] = rc
                self.done.add(name)
        if out:
            self._write_pids()
        return out

    def running(self, name: str) -> bool:
        return name in self.hosts and name not in self.done and all(c is None for c in self._codes(name))

    def restart(self, name: str) -> None:
        self.kill(name)
        for h in self.hosts.pop(name, []):
            self.ray.kill(h)
        self._start(self.roles[name])

    def kill(self, name: str) -> None:
        for h in self.hosts.get(name, []):
            try:
                self.ray.get(h.kill.remote(), timeout=60)
            except self.ray.exceptions.RayError:  # its actor is gone (or its node is going): so is its process
                pass

    def signal(self, name: str, sig: int) -> None:
        for h in self.hosts.get(name, []):
            h.signal.remote(sig)

    def stop(self, order: list[str], timeout: float, only: bool = False) -> dict[str, int]:
        codes: dict[str, int] = {}
        for name in [*order, *(n for n in list(self.hosts) if n not in order and not only)]:
            hosts = self.hosts.pop(name, [])
            if not hosts:
                continue
            try:
                for h in hosts:
                    h.signal.remote(signal.SIGTERM)
                got = self.ray.get([h.wait.remote(timeout) for h in hosts], timeout=timeout + 30)
                if any(c is None for c in got):
                    log.warning("%s did not stop within %.0f s: killed", name, timeout)
                    got = self.ray.get([h.kill.remote() for h in hosts], timeout=60)
                codes[name] = next((c for c in got if c), 0) or 0
            except self.ray.exceptions.RayError:  # its actor died (or never started), or did not answer
                codes[name] = -9
            for h in hosts:
                self.ray.kill(h)
        if self.owns_ray and not self.hosts:
            self.ray.shutdown()
        return codes


class RayLauncher:
    """Roles as Ray actors on a Ray cluster (plugin ``ray``; `pip install tidal[ray]`).

    `address`: the cluster to join ("auto" = the one `ray start` made on this node; "" = start a local
    head for this run). `resources`: Ray options per role kind, e.g.
    ``{ learner = { num_gpus = 1 }, rollout = { num_gpus = 1 } }``. `placement`: where learner ranks >= 1
    and rollout workers go: "pack" (Ray's default: where their resources are free, filling a node before
    the next) or "spread" (round-robin over the live nodes, each free to go elsewhere when its node is
    full or gone). The buffer and learner rank 0 always run on the driver's node. `weights_relay`: one
    weight relay (tidal.weight_sync.relay) on each node that hosts rollout workers, so that each version
    crosses the network to a node once, however many workers it holds (zmq weights only)."""

    def __init__(self, address: str = "", resources: dict[str, dict[str, float]] | None = None,
                 num_cpus: int | None = None, placement: str = "pack", weights_relay: bool = False) -> None:
        try:
            # optional: the [ray] extra
            import ray
        except ImportError:
            raise RuntimeError("the ray launcher needs Ray: pip install 'tidal[ray]'") from None
        if placement not in PLACEMENTS:
            raise ValueError(f"launcher.options.placement = {placement!r}: one of {', '.join(PLACEMENTS)}")
        self.ray = ray
        self.address, self.resources, self.num_cpus, self.placement = address, resources or {}, num_cpus, placement
        self.weights_relay = weights_relay  # the driver's plan adds the relay role (tidal.integration.run.plan)
        self.owns = False  # this launcher started Ray (a local head) and shuts it down with the run

    def host(self, roles: int) -> str:
        """The address of the driver's node as the cluster sees it (joining or starting Ray first): the
        buffer, learner rank 0 and the controller bind it, and every other node connects to it."""
        if not self.ray.is_initialized():
            uv_hook_off()
            kw = {"address": self.address} if self.address else {"num_cpus": self.num_cpus or max(4, roles + 2),
                                                                  "include_dashboard": False}
            self.ray.init(log_to_driver=False, **kw)
            self.owns = not self.address
        return self.ray.util.get_node_ip_address()

    def launch(self, roles: list[Role], run_dir: Path) -> RayRun:
        self.host(len(roles))
        try:
            return RayRun(roles, run_dir, self.resources, owns_ray=self.owns, placement=self.placement)
        except BaseException:
            if self.owns:
                self.ray.shutdown()
            raise


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its message that says something (Ray's
    errors wrap the cause's traceback; its last line is the cause)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    cause = next((ln for ln in reversed(lines) if re.match(r"^[A-Za-z_.]*(Error|Exception):", ln)), "")
    text = cause or (lines[0] if lines else "")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


RAY_OPTION_RESOURCE = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}


def check_home(node: dict[str, Any], wanted: dict[str, dict[str, float]]) -> None:
    """Refuse, before anything is placed, a driver's node that cannot hold the buffer and learner rank 0
    with the resources the recipe asks for them (Ray would leave them waiting for room forever)."""
    have = node.get("Resources", {})
    for kind, opts in wanted.items():
        for option, amount in opts.items():
            resource = RAY_OPTION_RESOURCE.get(option, option)
            if have.get(resource, 0.0) < amount:
                raise RuntimeError(
                    f"the {kind} runs on the driver's node ({node.get('NodeManagerAddress', '?')}), which has "
                    f"{have.get(resource, 0.0):g} {resource} and the recipe asks for {amount:g} "
                    f"(launcher.options.resources.{kind}.{option}): start `tidal run` on a node that has it "
                    f"(on a GPU cluster, one of the GPU nodes)")


def uv_hook_off() -> None:
    """Turn off Ray's `uv run` runtime-env hook for this driver, unless RAY_ENABLE_UV_RUN_RUNTIME_ENV is set.

    Under `uv run`, Ray (>= 2.43) otherwise sets every worker's `py_executable` to `uv run ... python` and
    ships the working folder as `working_dir`: each worker builds a fresh environment from the folder's
    pyproject, which for this workspace (a root with `package = false`) does not hold Tidal's packages,
    and every actor fails with `ModuleNotFoundError: No module named 'tidal'`. With the hook off, Ray's
    workers run the driver's interpreter (this environment, where Tidal is installed), as they do when
    the driver is started as `.venv/bin/tidal` or from a pip-installed package. On a multi-node cluster,
    each node's Ray must run an environment with `tidal[ray]` installed (`ray start` from it)."""
    import ray._private.ray_constants as ray_constants  # read by ray.init, each time it is called

    setting = os.environ.get("RAY_ENABLE_UV_RUN_RUNTIME_ENV")
    if setting is not None:
        log.info("Ray's uv run hook left as RAY_ENABLE_UV_RUN_RUNTIME_ENV=%s says", setting)
        return
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"  # for the Ray processes this driver starts
    ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    log.info("Ray workers run this Python (%s): Ray's uv run hook is off (RAY_ENABLE_UV_RUN_RUNTIME_ENV=0), "
             "so workers do not build a uv environment of their own without Tidal's packages", sys.executable)
