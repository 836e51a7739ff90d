"""The run driver behind `tidal run` and `tidal demo`: lays out the roles, starts them through the
configured launcher, plays the controller, restarts what dies, and stops everything at the end.

Role layout (endpoints: ipc:// sockets in an owner-only folder with the local launcher; with the Ray
launcher, tcp ports held per run on the driver's node address, where the buffer, learner rank 0 and the
controller run, so that roles on other nodes reach them):

    rollout-i --Trajectory--> buffer (ingest) --Batch--> learner --WeightsAvailable/Metrics (PUB)--> workers, driver
        ^  WorkRequest/Ack/Heartbeat/Metrics       buffer (publish): acks to workers, Metrics to the driver
        +--------------------- controller (ROUTER, in the driver) ---------------------+

Restart rules: a rollout worker that dies (or stops heartbeating) is restarted and its groups go to the
others; the buffer restarts from its write-ahead log; the learner restarts from its last checkpoint
(the buffer serves the batch it had not acknowledged again). Each role restarts at most
`launch.max_restarts` times; past that the run stops with an error.

Authentication (`launch.auth`, on by default): the driver makes one CURVE key pair per role in
RUN_DIR/keys (0700; a restarted role and a resumed run reuse them) and gives each role's config its
`security` (tidal.core.security.ChannelSecurity): its own secret key file, the public keys of the servers
it connects to, and for a server the roles it lets in. Every channel is then CURVE: a process without the
run's keys gets nothing in or out, and the buffer checks which role sends what (stop: the driver's).

Why ipc with the local launcher: a loopback tcp port, even one `PortReservation` holds, can be taken by
another local user binding it before our role does (a bound, not listening socket does not keep a
listener of another user out); a socket file in a folder only we can enter cannot. CURVE stays on
anyway. The Ray launcher keeps tcp with CURVE: an ipc folder is one host's, and Ray may place roles on
other nodes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from tidal.buffer.client import BatchClient
from tidal.core.config import PluginRef
from tidal.core.errors import ChannelTimeout, ConfigError
from tidal.core.net import PortReservation
from tidal.core.plugins import registry
from tidal.core.process import ERROR_FILE_ENV
from tidal.core.protocol import Metrics
from tidal.core.security import ChannelSecurity, make_role_keys
from tidal.integration.controller import Controller
from tidal.integration.launch import Role, one_line
from tidal.integration.learner.checks import check_lora
from tidal.integration.learner.parallel import check_parallel, model_config
from tidal.integration.monitor import Display, MetricsSink
from tidal.integration.recipe import RunConfig, default_run_dir
from tidal.integration.resume import ResumePoint, hold_lock, resume_point, wait_roles_gone
from tidal.integration.samples import to_tensorboard
from tidal.integration.selfplay import SNAPSHOTS, roles_of, snapshot_every
from tidal.integration.supervisor import Supervisor, error_file, write_final
from tidal.learner.config import ParallelConfig
from tidal.rollout.tiny import load_tokenizer

log = logging.getLogger("tidal.run")


@dataclass
class RunResult:
    run_dir: Path
    status: str  # "completed", "interrupted", "stalled: ...", "failed: ..."
    versions: int
    eval: list[tuple[int, float, dict[str, float]]]
    restarts: dict[str, int]
    wall_s: float
    samples: int = 0  # trajectories the learner trained on
    rl_s: float = 0.0  # the RL phase: every role up -> the learner's last step (wall clock)
    rl_start: float = 0.0  # its start (time.time()): the first rollout worker connected and the learner
    # began its first step, whichever came last (the learner loads its model beside the other roles)
    worker_up: float = 0.0  # time.time() when the first rollout worker connected
    first_step_s: float | None = None  # the roles' launch -> the learner's first step ended (None: no step)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.rl_s if self.rl_s > 0 else 0.0


ENDPOINTS = ("controller", "ingest", "serve", "buffer_pub", "learner_pub")


def plan(cfg: RunConfig, run_dir: Path, nproc_learner: int = 1, ports: PortReservation | None = None,
         ipc_dir: Path | None = None, relay_dir: str = "") -> tuple[list[Role], dict[str, str]]:
    """The roles of a run and the endpoints they share; each role's config lands in <run_dir>/roles.
    With `ipc_dir` (an owner-only folder, `ipc_folder`) the endpoints are ipc sockets in it (and the zmq
    weight transport's too); else tcp ports on `ports.host` held by `ports` (tidal.core.net) until the run
    ends, so that no other process takes one between this plan and the role that binds it (or binds it
    again). With `relay_dir` (a folder path that is the same on every node, `relay_folder`) the plan has
    one more role, ``relay`` (tidal.weight_sync.relay), which the launcher runs once on each node that
    hosts rollout workers; the workers take their weights from their node's relay through ipc sockets in
    that folder, and the relay from the learner."""
    if ipc_dir is not None:
        ep = {k: f"ipc://{ipc_dir}/{k}" for k in ENDPOINTS}
    else:
        ports = ports or PortReservation()
        ep = {k: ports.endpoint() for k in ENDPOINTS}
    if relay_dir and cfg.learner.weights.transport.name != "zmq":
        raise ConfigError(f"launcher.options.weights_relay relays zmq weights; learner.weights.transport is "
                          f"{cfg.learner.weights.transport.name!r}: set it to zmq, or turn the relay off",
                          field="launcher.options.weights_relay")
    sec = role_security(cfg, run_dir, relay=bool(relay_dir))
    roles_dir = run_dir / "roles"
    roles_dir.mkdir(parents=True, exist_ok=True)
    sync = cfg.mode == "sync"
    # what the roles must agree on is filled in here; recipe.check refused any other value for these
    buffer = msgspec.structs.replace(
        cfg.buffer, ingest=ep["ingest"], serve=ep["serve"], publish=ep["buffer_pub"],
        wal_dir=str(run_dir / cfg.buffer.wal_dir),  # relative to the run folder (an absolute path stays)
        group_size=cfg.group_size, batch_samples=cfg.batch_samples, security=sec["buffer"], admission=_admission(cfg),
        # the buffer refuses token ids the model cannot embed (0 = unchecked: no config.json to read it from)
        vocab_size=cfg.buffer.vocab_size or vocab_size(cfg.learner.model or cfg.model),
        # its ingest socket takes the largest group this run can produce (a larger frame is dropped unread)
        max_message_bytes=max(cfg.buffer.max_message_bytes, group_bytes(cfg)))
    learner = msgspec.structs.replace(
        cfg.learner, model=cfg.learner.model or cfg.model, buffer=ep["serve"], publish=ep["learner_pub"],
        max_steps=cfg.budget.versions, seed=cfg.seed,
        train=msgspec.structs.replace(cfg.learner.train, temperature=cfg.sampling.temperature),
        wait_for_subscriber_s=cfg.learner.wait_for_subscriber_s or 30.0,  # this driver's controller
        # a learner restarted by this driver resumes from a checkpoint; with checkpoint_every = 0 there is
        # none during the run, so a learner that fails ends the run instead of starting over at version 0
        checkpoint_dir=cfg.learner.checkpoint_dir or str(run_dir / "checkpoints"),
        export_dir=cfg.learner.export_dir or str(run_dir / "model"),  # the policy, when the learner stops
        security=sec["learner"],
        weights=_weights(msgspec.structs.replace(cfg.learner.weights, every=1) if sync else cfg.learner.weights,
                         sec["learner"], ipc_dir, ports.host if ports is not None else ""))
    if snapshots := _selfplay(cfg, run_dir):  # self-play: the learner writes the opponents' snapshots there
        learner = msgspec.structs.replace(learner, snapshot_dir=snapshots[0], snapshot_every=snapshots[1])
    check_lora(learner, nproc_learner)  # as the learner would at start, before any role starts
    if learner.parallel != ParallelConfig():  # the learner would refuse it at start: say so before any role starts
        check_parallel(learner.parallel, world=nproc_learner, config=model_config(learner.model),
                       backend=learner.backend.name, attn=learner.backend.options.attn)
    learner_threads, worker_threads = share_threads(os.cpu_count() or 1, cfg.workers, nproc_learner, cfg.launch.threads)
    log.info("torch threads: %d per learner rank, %d per rollout worker", learner_threads, worker_threads)
    roles = [_role("buffer", "buffer", "tidal.buffer", buffer, roles_dir),
             _role("learner", "learner", "tidal.integration.learner", learner, roles_dir, learner_threads)]
    relay = {"serve": f"ipc://{relay_dir}/weights", "publish": f"ipc://{relay_dir}/announce"} if relay_dir else {}
    roles += [_role(w.name, "rollout", "tidal.rollout.worker.process", w, roles_dir, worker_threads)
              for w in _workers(cfg, run_dir, ep, sec, relay, snapshots[0] if snapshots else "")]
    if relay:
        roles.append(_relay_role(cfg, ep, sec["relay"], relay, roles_dir))
    return roles, ep


def _selfplay(cfg: RunConfig, run_dir: Path) -> tuple[str, int] | None:
    """With `selfplay.opponent`: (the snapshot folder, every how many versions the learner writes one);
    refused when no domain is a game (an environment with `roles`) or the eval opponent is no opponent."""
    sp = cfg.selfplay
    if sp.opponent is None:
        return None
    sampler = registry.build("opponent", sp.opponent.name, sp.opponent.options, field="selfplay.opponent")
    games = {d.key: roles_of(registry.build("env", d.env.name, d.env.options, field=f"domains[{i}].env"))
             for i, d in enumerate(cfg.domains)}
    games = {k: roles for k, roles in games.items() if roles}
    if not games:
        raise ConfigError(f"selfplay.opponent = {sp.opponent.name!r} but no domain is a game of several roles "
                          f"(an environment with `roles`, e.g. nim): remove [selfplay] or add such a domain",
                          field="selfplay.opponent")
    for name, roles in games.items():  # a mirror game's episode is a sample per seat: whole episodes fill a group
        if cfg.group_size % len(roles):
            raise ConfigError(f"group_size = {cfg.group_size} with self-play on {name!r}: a mirror game makes a sample "
                              f"for each of its {len(roles)} seats, so group_size must be a multiple of "
                              f"{len(roles)}", field="group_size")
    if not (sp.eval_opponent in ("scripted", "live") or re.fullmatch(r"v\d+", sp.eval_opponent)):
        raise ConfigError(f"selfplay.eval_opponent = {sp.eval_opponent!r}: give \"scripted\", \"live\" or "
                          f"\"v<version>\"", field="selfplay.eval_opponent")
    if cfg.rollout.episodes.snapshots_held < 1:
        raise ConfigError(f"rollout.episodes.snapshots_held must be >= 1 (snapshots a worker keeps loaded), got "
                          f"{cfg.rollout.episodes.snapshots_held}", field="rollout.episodes.snapshots_held")
    return str(run_dir / SNAPSHOTS), snapshot_every(sampler)


def _workers(cfg: RunConfig, run_dir: Path, ep: dict[str, str], sec: dict[str, ChannelSecurity],
             relay: dict[str, str], snapshot_dir: str = "") -> list[Any]:
    """The rollout workers' configs; with `relay` (its endpoints) each takes weights from its node's relay;
    with `snapshot_dir` (self-play) each serves the opponents' snapshots from there."""
    out = []
    for i in range(cfg.workers):
        out.append(msgspec.structs.replace(
            cfg.rollout, name=f"rollout-{i}", controller=ep["controller"], buffer_ingest=ep["ingest"],
            buffer_acks=ep["buffer_pub"], weights=relay.get("publish", ep["learner_pub"]),
            weights_server="relay" if relay else "learner", model=cfg.rollout.model or cfg.model,
            domains=cfg.domains, security=sec[f"rollout-{i}"],
            weight_transport=_receiver_security(cfg.rollout.weight_transport, sec[f"rollout-{i}"],
                                                "relay" if relay else "learner"),
            # its environment processes (multi-turn domains) log beside the roles
            episodes=msgspec.structs.replace(cfg.rollout.episodes, snapshot_dir=snapshot_dir,
                                             log_dir=cfg.rollout.episodes.log_dir or str(run_dir / "logs")),
            # what the model wrote: RUN_DIR/samples/rollout-<i>.jsonl (`tidal samples RUN_DIR`)
            transcripts=msgspec.structs.replace(cfg.rollout.transcripts,
                                                dir=cfg.rollout.transcripts.dir or str(run_dir / "samples")),
            engine=msgspec.structs.replace(cfg.rollout.engine, options=_engine_options(cfg, i))))
    return out


def _engine_options(cfg: RunConfig, i: int) -> dict[str, Any]:
    """Worker `i`'s engine options: its seed, and with `learner.lora` on vLLM the adapters' rank (vLLM
    serves adapters only when it starts with LoRA support; the embedded engine merges them as they come)."""
    options = {"seed": cfg.seed + 1000 * (i + 1), **cfg.rollout.engine.options}
    lora = cfg.learner.lora
    if lora is not None and cfg.rollout.engine.name == "vllm":
        if options.setdefault("lora_rank", lora.rank) < lora.rank:
            raise ConfigError(f"rollout.engine.options.lora_rank = {options['lora_rank']} is below learner.lora.rank "
                              f"= {lora.rank}: vLLM could not load the adapters; leave it out (the run sets it)",
                              field="rollout.engine.options.lora_rank")
    return options


def _relay_role(cfg: RunConfig, ep: dict[str, str], sec: ChannelSecurity, relay: dict[str, str], roles_dir: Path) -> Role:
    """The weight relay's role (one config for every node's relay: its sockets' paths name the node)."""
    options = cfg.learner.weights.transport.options
    # tidal.weight_sync.relay.RelayConfig's fields (the relay decodes them typed; importing it here would
    # load torch into the driver)
    r = {"upstream": ep["learner_pub"], "serve": relay["serve"], "publish": relay["publish"], "security": sec,
         "delta_updates": bool(options.get("delta", False)), "reannounce_s": cfg.learner.weights.reannounce_s or 2.0}
    return _role("relay", "relay", "tidal.weight_sync.relay", r, roles_dir)


def relay_folder(run_dir: Path) -> str:
    """The folder of a run's weight relay sockets on each node: under /tmp, named after the run folder and
    the node (``{node}``, filled in by each process: tidal.core.net.on_this_node; nodes may share a
    filesystem), short enough for a socket path; the relay makes it owner-only."""
    return f"/tmp/tidal-relay-{hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]}-{{node}}"


def role_security(cfg: RunConfig, run_dir: Path, relay: bool = False) -> dict[str, ChannelSecurity]:
    """Each role's CURVE setup (tidal.core.security), its keys made once in RUN_DIR/keys and reused; all
    empty (plaintext) when `launch.auth` is off. With `relay`, the weight relays (one key pair, "relay",
    for all of them) are clients of the learner and servers of the workers."""
    workers = [f"rollout-{i}" for i in range(cfg.workers)]
    relays = ["relay"] if relay else []
    names = ["buffer", "learner", "driver", *workers, *relays]
    if not cfg.launch.auth:
        return dict.fromkeys(names, ChannelSecurity())
    keys = make_role_keys(run_dir / "keys", names)
    sec = {"buffer": ChannelSecurity.from_role_keys(keys, "buffer", clients=["learner", "driver", *workers]),
           "learner": ChannelSecurity.from_role_keys(keys, "learner", servers=["buffer"],
                                                     clients=["driver", *workers, *relays]),
           "driver": ChannelSecurity.from_role_keys(keys, "driver", servers=["buffer", "learner"], clients=workers)}
    for w in workers:
        sec[w] = ChannelSecurity.from_role_keys(keys, w, servers=["driver", "buffer", "learner", *relays])
    if relay:
        sec["relay"] = ChannelSecurity.from_role_keys(keys, "relay", servers=["learner"], clients=workers)
    return sec


def _weights(weights, sec: ChannelSecurity, ipc_dir: Path | None, host: str = ""):
    """The learner's weight sender options: the zmq transport's server gets the learner's keys, and unless
    the recipe names an endpoint, an ipc socket beside the run's others (`ipc_dir`) or a port of its own
    on `host`, the address the run's other endpoints are on (another node's workers fetch from it)."""
    if weights.transport.name != "zmq":
        return weights
    options = dict(weights.transport.options)
    if sec.enabled:
        options.setdefault("security", msgspec.to_builtins(sec))
    if ipc_dir is not None:
        options.setdefault("endpoint", f"ipc://{ipc_dir}/weights")
    elif host and host != "127.0.0.1":  # (on loopback the transport's own default is that already)
        options.setdefault("endpoint", f"tcp://{host}:*")
    return msgspec.structs.replace(weights, transport=msgspec.structs.replace(weights.transport, options=options))


def _admission(cfg: RunConfig) -> PluginRef | None:
    """The buffer's admission policy; `version_rejection` with no `max_lag` of the recipe's own bounds lag
    by the run's `max_staleness`, the depth gate's bound (its own default, 4, would be another number)."""
    a = cfg.buffer.admission
    if a is None or a.name != "version_rejection" or "max_lag" in a.options:
        return a
    return msgspec.structs.replace(a, options={**a.options, "max_lag": cfg.max_staleness})


def _receiver_security(transports: list[PluginRef], sec: ChannelSecurity, server: str = "learner") -> list[PluginRef]:
    """A worker's weight receiver options: the zmq receiver (listed or not) trusts the public key of
    `server` (the learner, or its node's relay)."""
    if not sec.enabled and server == "learner":
        return transports
    keys = {"security": msgspec.to_builtins(sec)} if sec.enabled else {}
    if server != "learner":
        keys["server"] = server
    listed = [msgspec.structs.replace(t, options={**keys, **t.options}) if t.name == "zmq" else t
              for t in transports]
    return listed if any(t.name == "zmq" for t in transports) else [*listed, PluginRef(name="zmq", options=keys)]


@contextmanager
def ipc_folder(run_dir: Path) -> Iterator[Path]:
    """An owner-only (0700) folder for the run's ipc sockets, short enough for the ~107-byte limit on a
    socket path (so under /tmp, not in the run folder); its path is recorded in RUN_DIR/ipc_dir. Removed
    when the run ends."""
    path = Path(tempfile.mkdtemp(prefix="tidal-"))  # mkdtemp makes it 0700
    (run_dir / "ipc_dir").write_text(f"{path}\n")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def vocab_size(model: str | Path) -> int:
    """The model's vocabulary size (embedding rows) from its folder's config.json; 0 when there is none to
    read (a hub name, a folder without one): the buffer then leaves token ids unchecked."""
    try:
        conf = model_config(model)
    except ConfigError as e:
        log.info("token ids at the buffer unchecked: %s", e)
        return 0
    size = conf.get("vocab_size") or conf.get("text_config", {}).get("vocab_size") or 0
    return int(size) if isinstance(size, int) and size > 0 else 0


def group_bytes(cfg: RunConfig) -> int:
    """The largest TrajectoryGroup message the run's workers can send: a group of sequences as long as the
    model's context, each token with its id, logprob, version and loss mask, plus the sampling mask and MoE
    routing when the recipe asks for them; 0 when the model has no config.json to read."""
    try:
        conf = model_config(cfg.learner.model or cfg.model)
    except ConfigError:
        return 0
    text = conf.get("text_config", conf)
    tokens = int(text.get("max_position_embeddings") or 0) or 32_768
    per_token = 4 + 4 + 4 + 1
    if cfg.sampling.return_sampling_mask:
        per_token += (int(text.get("vocab_size") or 0) + 7) // 8
    if cfg.sampling.return_routing:
        per_token += 2 * int(text.get("num_hidden_layers") or 0) * int(text.get("num_experts_per_tok") or 0)
    return cfg.group_size * (tokens * per_token + 64 * 1024)  # 64 KiB a sample: text fields, msgpack framing


def share_threads(cores: int, workers: int, learner_ranks: int = 1, fixed: int = 0) -> tuple[int, int]:
    """(threads per learner rank, threads per rollout worker). `fixed` > 0 gives every role that many.
    Otherwise half the cores go to the learner's ranks and the rest to the workers, at least one each:
    more threads than cores (or than a role's share) makes OpenMP spin against itself."""
    if fixed > 0:
        return fixed, fixed
    learner = max(1, cores // 2 // max(1, learner_ranks))
    worker = max(1, (cores - learner * learner_ranks) // max(1, workers))
    return learner, worker


def _role(name: str, kind: str, module: str, config, roles_dir: Path, threads: int = 1) -> Role:
    path = roles_dir / f"{name}.json"
    path.write_bytes(msgspec.json.encode(config))
    t = "1" if kind == "buffer" else str(threads)  # torch reads these at start: no oversubscribed cores
    return Role(name=name, kind=kind, module=module, config=path,
                env={"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, ERROR_FILE_ENV: str(error_file(roles_dir, name))})


CONSOLE_QUIET = ("tidal.controller",)  # their INFO lines (every evaluation, every worker) go to driver.log only


class _NotDetail(logging.Filter):
    """On the console: warnings and errors of every logger, INFO of all but `CONSOLE_QUIET`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not record.name.startswith(CONSOLE_QUIET)


@contextmanager
def driver_log(run_dir: Path) -> Iterator[Path]:
    """RUN_DIR/logs/driver.log: every line the driver logs at INFO and above (the evaluations, workers
    connecting, ...). The console's handlers (whatever the caller configured) keep the progress line,
    warnings, errors and the run's own milestones; the per-evaluation INFO lines go to the file only."""
    path = run_dir / "logs" / "driver.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    root, tidal = logging.getLogger(), logging.getLogger("tidal")
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    quiet = _NotDetail()
    console = [h for h in root.handlers if not isinstance(h, logging.FileHandler)]
    for h in console:
        h.addFilter(quiet)
    old_level, old_console = tidal.level, [h.level for h in console]
    if tidal.getEffectiveLevel() > logging.INFO:  # the file has INFO whatever the console shows
        tidal.setLevel(logging.INFO)
        for h in console:  # the console keeps the level it had
            h.setLevel(max(h.level, root.getEffectiveLevel()))
    tidal.addHandler(handler)
    try:
        yield path
    finally:
        tidal.removeHandler(handler)
        tidal.setLevel(old_level)
        handler.close()
        for h, level in zip(console, old_console, strict=True):
            h.removeFilter(quiet)
            h.setLevel(level)


def run(cfg: RunConfig, *, run_dir: Path | None = None, nproc_learner: int = 1, resume: bool = False,
        overrides: list[str] | None = None) -> RunResult:
    """Run `cfg` in `run_dir`; with `resume`, continue the run that folder holds (tidal.integration.resume)
    with `overrides` (recorded in its resumes.jsonl) applied to its recipe."""
    run_dir = Path(run_dir or default_run_dir(cfg))
    lock = hold_lock(run_dir)  # raises RunFolderBusy while another driver runs this folder
    try:
        with driver_log(run_dir):
            return _locked(cfg, run_dir, nproc_learner, resume, overrides or [])
    finally:
        lock.close()


def _locked(cfg: RunConfig, run_dir: Path, nproc_learner: int, resume: bool, overrides: list[str]) -> RunResult:
    point = None
    if resume:
        wait_roles_gone(run_dir, cfg.launch.shutdown_timeout_s + 30)  # a killed driver's roles stop by themselves
        point = resume_point(run_dir, cfg.group_size, run_dir / cfg.buffer.wal_dir,
                             Path(cfg.learner.checkpoint_dir or run_dir / "checkpoints"))
        log.info("resuming %s: %s", run_dir, point.describe())
        with open(run_dir / "resumes.jsonl", "ab") as f:
            f.write(msgspec.json.encode({"time": time.time(), "version": point.version, "overrides": overrides,
                                         "next_group": point.next_group, "accepted": point.accepted}) + b"\n")
    if not cfg.launch.auth:
        log.warning("launch.auth = false: the run's channels are plaintext; any local process can push data "
                    "into the buffer, take or acknowledge batches, stop it, and talk to the controller")
    launcher = _launcher(cfg, run_dir)
    if cfg.launcher.name == "local":
        with ipc_folder(run_dir) as ipc_dir:
            return _run(cfg, run_dir, nproc_learner, launcher, None, ipc_dir, point)
    # a launcher that places roles on other machines names the address of the driver's node, where the roles
    # that others connect to bind (tidal.integration.launch); a launcher without one binds loopback
    try:
        host = launcher.host(cfg.workers + 2) if hasattr(launcher, "host") else "127.0.0.1"
    except Exception as e:  # e.g. no Ray cluster at launcher.options.address
        status = f"failed: the {cfg.launcher.name} launcher could not start: {one_line(e)}"
        log.error("%s", status)
        write_final(run_dir, {"status": status, "versions": 0, "budget_versions": cfg.budget.versions})
        return RunResult(run_dir=run_dir, status=status, versions=0, eval=[], restarts={}, wall_s=0.0)
    with PortReservation(host) as ports:
        return _run(cfg, run_dir, nproc_learner, launcher, ports, None, point)


def _run(cfg: RunConfig, run_dir: Path, nproc_learner: int, launcher: Any, ports: PortReservation | None,
         ipc_dir: Path | None, point: ResumePoint | None = None) -> RunResult:
    (run_dir / "config.json").write_bytes(msgspec.json.format(msgspec.json.encode(cfg)))
    relay_dir = relay_folder(run_dir) if getattr(launcher, "weights_relay", False) else ""
    roles, ep = plan(cfg, run_dir, nproc_learner, ports, ipc_dir, relay_dir)
    driver_sec = role_security(cfg, run_dir)["driver"]
    for r in roles:
        if r.kind == "learner":
            r.nproc = nproc_learner
    sink = _metrics_sink(cfg, run_dir, point)
    display = Display(cfg.monitor.progress, cfg.budget.versions, cfg.monitor.log_every_s)
    try:  # builds every domain's env (and reward) here, in the driver: bad options fail before any role starts
        controller = Controller(cfg, endpoint=ep["controller"], learner_pub=ep["learner_pub"],
                                buffer_pub=ep["buffer_pub"], run_dir=run_dir, tokenizer=load_tokenizer(cfg.model),
                                emit=sink, security=driver_sec, resume=point)
    except Exception as e:
        sink.close()
        write_final(run_dir, {"status": f"failed: {e}", "versions": 0, "budget_versions": cfg.budget.versions})
        raise
    sup = Supervisor(cfg, run_dir, {r.name: r.kind for r in roles}, controller, None, sink, display)
    for r in roles:
        error_file(sup.roles_dir, r.name).unlink(missing_ok=True)

    def on_signal(sig, _frame):
        sup.interrupted = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    log.info("run folder %s (%s mode, %d workers, launcher %s)", run_dir, cfg.mode, cfg.workers, cfg.launcher.name)
    try:
        try:
            sup.launched_at = time.time()
            sup.handle = launcher.launch(roles, run_dir)
        except Exception as e:  # no role runs: say why in final.json, in one line
            sup.status = f"failed: the {cfg.launcher.name} launcher could not start the roles: {one_line(e)}"
            log.error("%s (role logs: %s)", sup.status, run_dir / "logs")
            write_final(run_dir, {"status": sup.status, "versions": 0, "budget_versions": cfg.budget.versions})
            return RunResult(run_dir=run_dir, status=sup.status, versions=0, eval=[], restarts={},
                             wall_s=time.monotonic() - sup.t0)
        sup.loop()
    finally:
        if sup.handle is not None:
            sup.finish(lambda: _buffer_status(ep["serve"], driver_sec))
        controller.close()
        _samples_to_tensorboard(sink, run_dir, controller.learner_version)
        sink.close()
        for s, h in old.items():
            signal.signal(s, h)
    return _run_result(run_dir, sup, controller)


def _launcher(cfg: RunConfig, run_dir: Path) -> Any:
    """The recipe's launcher; one that cannot be made is recorded in final.json."""
    try:
        launcher = registry.create("launcher", cfg.launcher.name, **cfg.launcher.options)
    except Exception as e:
        write_final(run_dir, {"status": f"failed: launcher {cfg.launcher.name}: {one_line(e)}", "versions": 0,
                              "budget_versions": cfg.budget.versions})
        raise
    return launcher


def _metrics_sink(cfg: RunConfig, run_dir: Path, point: ResumePoint | None) -> MetricsSink:
    sink = MetricsSink(run_dir, cfg.monitor.tensorboard)
    if point is not None:  # elapsed time and versions carry on; the resume is marked on the time axis
        sink.t0 -= point.elapsed_s
        sink.version = point.version
        sink(Metrics(source="driver", step=point.version, time=time.time(),
                     scalars={"event/resume": 1.0, "resume/version": float(point.version), "resume/elapsed_s": point.elapsed_s,
                              "resume/next_group": float(point.next_group),
                              "resume/gate_accepted": float(point.accepted)}))
    return sink


def _run_result(run_dir: Path, sup: Supervisor, controller: Controller) -> RunResult:
    samples = int(controller.last.get("learner-0", {}).get("train/samples_total", 0))
    worker_up = sup.rl_start or 0.0
    rl_start = max(worker_up, controller.learner_up_at) if worker_up else 0.0
    rl_s = controller.learner_step_at - rl_start if rl_start and controller.learner_step_at else 0.0
    return RunResult(run_dir=run_dir, status=sup.status, versions=controller.learner_version,
                     eval=controller.eval_results, restarts={k: v for k, v in sup.restarts.items() if v},
                     wall_s=time.monotonic() - sup.t0, samples=samples, rl_s=rl_s, rl_start=rl_start,
                     worker_up=worker_up, first_step_s=sup.launch_to_first_step())


def _samples_to_tensorboard(sink: MetricsSink, run_dir: Path, version: int) -> None:
    """A few of the workers' transcripts as TensorBoard text (`samples/<domain>`), once the run ended."""
    if sink.tb is None:
        return

    try:
        to_tensorboard(sink.tb, run_dir, version)
    except (OSError, ValueError) as e:  # a transcript file that cannot be read costs the text, not the run
        log.warning("transcripts not added to TensorBoard: %s", e)


def _buffer_status(endpoint: str, sec: ChannelSecurity | None = None) -> dict[str, float]:
    """The buffer's counters at the end (what it acknowledged and still holds), or {} if it is gone."""
    client = BatchClient(endpoint, name="run-end", curve=sec.client("buffer") if sec else None)
    try:
        return dict(client.status(timeout=10).scalars)
    except (ChannelTimeout, OSError) as e:
        log.warning("could not read the buffer's final status: %s", e)
        return {}
    finally:
        client.close()
