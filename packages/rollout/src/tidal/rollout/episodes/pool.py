"""EnvPool: the rollout worker's environment processes, driven without blocking from its event loop.

    pool = EnvPool([Domain(name="tools", env=PluginRef(name="multiply"))], processes=2, step_timeout_s=30.0)
    pool.start()                                  # spawns them, waits for each one's Hello
    pool.open("g-0000001:0", "tools", task)       # the reply (seq 0) carries the first observation
    for reply in pool.poll(timeout=0.0): ...      # EpisodeReply: real answers and synthesized failures
    pool.step("g-0000001:0", 1, action_text)
    pool.close_episode("g-0000001:0")
    pool.close()

The pool binds one ROUTER (loopback, a port of its own); each environment process
(`tidal.rollout.episodes.process`) connects a DEALER whose identity is ``<name>/<start number>``, so a restarted
process is a new peer and a late answer of its predecessor is recognised and dropped. An episode lives on
the process that had the fewest when it was opened, and stays there.

Every request gets exactly one answer from `poll`, and an answer with ``error_kind`` or ``done`` ends the
episode (later messages about it are ignored; `close_episode` is then a no-op). The kinds:

- from the process's `EpisodeReply`: ``env_error`` (the environment raised), ``verifier_error``
  (`outcome()` raised, or a reward is not a real finite number), ``bad_request``;
- ``timeout``: the episode whose request (an open or a step: the process builds its environments
  before it says Hello, so both are bounded alike) got no answer for `step_timeout_s`. A process that
  has requests waiting and has answered none of them for that long is stuck on the oldest (it serves
  one message at a time, in order, so time queued behind other episodes' steps does not count; a request
  of an episode closed while in flight still counts as the one it serves). Its
  Python stack is written to its log (SIGUSR1), and it is killed `KILL_GRACE_S` later without the
  caller waiting, and restarted at once (counted in ``timeouts`` and ``restarts``);
- ``env_restarted``: an episode of a process the pool killed (stuck on another episode, or silent for
  `start_timeout_s` at its start): not at fault, so it may be retried (counted in ``episodes_interrupted``);
- ``env_died``: an episode of a process that died by itself (kill -9 from outside, a crash); every
  episode it held is answered so, then it is restarted (counted in ``env_died`` and ``restarts``);
- ``unknown_episode``: `step` of an episode the pool does not hold (already ended or never opened).

Every limit an episode can meet is a parameter here, set from the recipe's `rollout.episodes`
(`EpisodesConfig`): `step_timeout_s`, `start_timeout_s`, `max_observation_chars`.

A process that fails `max_failures_in_a_row` times (died, timed out, never said Hello) with no answer in
between makes `start` / `poll` raise `EnvPoolError` naming it and its log: a broken environment ends the
worker with its message instead of restarting forever.

Starting, signalling and killing the processes is `tidal.rollout.episodes.slots`; `LocalEpisodes`
(the same interface over episodes in the caller's own process) is `tidal.rollout.episodes.local`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from tidal.core.channels import RouterChannel, make_hello, poll, router
from tidal.core.config import Domain, domains_by_key
from tidal.core.episodes import AGENT
from tidal.core.errors import ChannelTimeout, PeerUnreachable, ProtocolError, TidalError
from tidal.core.interfaces import Task
from tidal.core.process import EXIT_CONFIG
from tidal.core.protocol import EpisodeClose, EpisodeOpen, EpisodeReply, EpisodeStep, Message
from tidal.core.security import AuthGuard, ChannelSecurity, make_role_keys
from tidal.rollout.episodes.process import MAX_OBSERVATION_CHARS, EnvProcConfig
from tidal.rollout.episodes.slots import SlotProcesses, _Dying, _Episode, _exit_text, _Slot, _tail

log = logging.getLogger("tidal.rollout.envpool")

COUNTERS = ("restarts", "timeouts", "env_died", "episodes_interrupted", "env_errors", "verifier_errors",
            "bad_requests", "late_replies", "episodes_opened")
_ERROR_COUNTER = {"env_error": "env_errors", "verifier_error": "verifier_errors", "bad_request": "bad_requests",
                  "unknown_episode": "bad_requests"}


class EnvPoolError(TidalError):
    """The pool cannot keep an environment process running (see the message for which, and its log)."""


class EnvPool(SlotProcesses):
    """Environment processes serving episodes of `domains` (each by its key, once)."""

    def __init__(
        self,
        domains: Sequence[Domain],
        processes: int = 1,
        step_timeout_s: float = 30.0,
        plugins: Sequence[str] = (),
        *,
        name: str = "env",  # processes are <name>-0, <name>-1, ... (logs <log_dir>/<name>-<i>.log)
        log_dir: str | os.PathLike[str] | None = None,  # None: a temporary folder, removed by close()
        environ: Mapping[str, str] | None = None,  # extra environment variables of the processes (PYTHONPATH, ...)
        start_timeout_s: float = 120.0,  # how long a process may take to say Hello (it builds its environments first)
        max_observation_chars: int = MAX_OBSERVATION_CHARS,  # the processes cut longer observations (marked, counted)
        stop_grace_s: float = 5.0,  # SIGTERM, then SIGKILL after this long
        max_failures_in_a_row: int = 3,
        endpoint: str = "tcp://127.0.0.1:*",  # where the ROUTER binds
        # CURVE between the pool and its processes, with keys made for this pool in an owner-only folder in
        # `log_dir`: no other local process can pose as an environment (observations, rewards) or read episodes
        auth: bool = True,
    ) -> None:
        self.domains = domains_by_key(domains)
        if not self.domains:
            raise ValueError("an environment pool needs at least one domain in `domains`")
        if (processes < 1 or step_timeout_s <= 0 or start_timeout_s <= 0 or max_observation_chars < 1
                or max_failures_in_a_row < 1):
            raise ValueError(f"need processes >= 1, step_timeout_s and start_timeout_s > 0, max_observation_chars and "
                             f"max_failures_in_a_row >= 1, got {processes}, {step_timeout_s}, {start_timeout_s}, "
                             f"{max_observation_chars}, {max_failures_in_a_row}")
        self.processes, self.step_timeout_s, self.plugins = processes, step_timeout_s, list(plugins)
        self.max_observation_chars = max_observation_chars
        self.name, self.environ = name, dict(environ or {})
        self.start_timeout_s, self.stop_grace_s = start_timeout_s, stop_grace_s
        self.max_failures_in_a_row = max_failures_in_a_row
        self._bind = endpoint
        self.auth = auth
        self._keys_dir: Path | None = None
        self._guard = AuthGuard()  # logs (once per address) what a stranger tried
        self._own_dir = log_dir is None
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="tidal-envpool-"))
        self._counts = dict.fromkeys(COUNTERS, 0.0)
        self._logged: set[str] = set()
        self._slots: list[_Slot] = []
        self._dying: list[_Dying] = []
        self._episodes: dict[str, _Episode] = {}
        self._by_identity: dict[bytes, _Slot] = {}
        self._out: list[EpisodeReply] = []
        self._ch: RouterChannel | None = None
        self._closed = False
        self._broken: EnvPoolError | None = None  # raised again by every later call
        self._starting = False  # in start(): a silent process fails it (not restarted)

    # ------------------------------------------------------------------ lifecycle

    def start(self, wait: bool = True) -> None:
        """Spawn the processes and wait until each has said Hello (they build their environments first).
        Raises EnvPoolError when one cannot start (its configuration refused, dead `max_failures_in_a_row`
        times, or silent for `start_timeout_s`), naming its log.

        `wait=False` returns at once: episodes opened meanwhile are queued until their process says Hello
        (their clock starts then), and a failure to start surfaces from `poll` (a process silent for
        `start_timeout_s` is restarted like a stuck one). For a caller with an event loop to keep (the
        rollout worker's heartbeats), whose environments may take longer to build than it may be silent."""
        if self._ch is not None:
            raise RuntimeError("EnvPool.start() called twice")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        server, client = ChannelSecurity(), ChannelSecurity()
        if self.auth:
            # an owner-only folder of its own inside the logs (removed at close; one a killed worker left
            # behind stays owner-only, and its pool's next start reuses the pairs)
            self._keys_dir = make_role_keys(self.log_dir / f".{self.name}-keys", ["envpool", "envproc"])
            server = ChannelSecurity.from_role_keys(self._keys_dir, "envpool", clients=["envproc"])
            client = ChannelSecurity.from_role_keys(self._keys_dir, "envproc", servers=["envpool"])
        self._ch = router(self._bind, hello=make_hello("envpool", self.name), linger=0,
                          curve=server.server(guard=self._guard, where=f"{self.name} environment pool"))
        self._config_path = self.log_dir / f"{self.name}.json"
        cfg = EnvProcConfig(endpoint=self._ch.endpoint, domains=list(self.domains.values()), plugins=self.plugins, security=client,
                            max_observation_chars=self.max_observation_chars)
        self._config_path.write_bytes(msgspec.json.encode(cfg))
        for i in range(self.processes):
            name = f"{self.name}-{i}"
            slot = _Slot(i, name, self.log_dir / f"{name}.log", self.log_dir / f"{name}.error")
            self._slots.append(slot)
            self._spawn(slot)
        if not wait:
            log.info("%s: %d environment processes starting for %s (logs in %s)", self.name, self.processes,
                     sorted(self.domains), self.log_dir)
            return
        self._starting = True
        try:
            while not all(s.ready for s in self._slots):
                for s in self._slots:
                    if not s.ready and time.monotonic() - s.started_at > self.start_timeout_s:
                        why = f"did not say Hello within {self.start_timeout_s:g} s (start_timeout_s)"
                        self._dump_stack(s, why)
                        time.sleep(0.2)  # for the stack to reach the log's tail below (it is being stopped anyway)
                        raise EnvPoolError(f"environment process {s.name} (pid {s.proc.pid if s.proc else '?'}) "
                                           f"{why}; see its log {s.log_path}{_tail(s.log_path, 24)}")
                self._service(0.02)
        except BaseException:
            self.close()
            raise
        finally:
            self._starting = False
        log.info("%s: %d environment processes serving %s (logs in %s)", self.name, self.processes,
                 sorted(self.domains), self.log_dir)

    def close(self) -> None:
        """Stop every process (SIGTERM, SIGKILL after `stop_grace_s`) and the socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        alive = [s for s in self._slots if s.proc is not None and s.proc.poll() is None]
        for s in alive:
            self._signal(s, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for s in alive:  # (a process reaped long ago is left alone: its pid may be another's by now)
            assert s.proc is not None
            try:
                s.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s: %s did not stop within %g s of SIGTERM: killed", self.name, s.name,
                            self.stop_grace_s)
            self._kill(s)  # and whatever it started in its session
        for d in self._dying:
            self._signal_group(d.proc.pid, signal.SIGKILL)
            try:
                d.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("%s: %s (pid %d) survived SIGKILL for 5 s", self.name, d.name, d.proc.pid)
        self._dying.clear()
        self._guard.close()
        if self._ch is not None:
            self._ch.close(linger=0)
        self._episodes.clear()
        if self._own_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        if self._keys_dir is not None:
            shutil.rmtree(self._keys_dir, ignore_errors=True)

    def __enter__(self) -> EnvPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ episodes

    def open(self, episode_id: str, domain: str, task: Task) -> None:
        """Start an episode of `domain`; its first observation comes from `poll` (seq 0)."""
        self._check_running()
        if episode_id in self._episodes:
            raise ValueError(f"episode {episode_id!r} is already open")
        if domain not in self.domains:
            raise ValueError(f"no environment for domain {domain!r}; this pool serves {sorted(self.domains)}")
        slot = min(self._slots, key=lambda s: (len(s.episodes), not s.ready, s.index))
        ep = _Episode(episode_id, slot)
        self._episodes[episode_id] = ep
        slot.episodes.add(episode_id)
        self._counts["episodes_opened"] += 1
        self._send(slot, EpisodeOpen(episode_id=episode_id, domain=domain, prompt=task.prompt, answer=task.answer,
                                     metadata=dict(task.metadata)), ep)

    def step(self, episode_id: str, seq: int, action: str, role: str = AGENT) -> None:
        """Send the action of turn `seq` (1 for the first); its answer comes from `poll`."""
        self._check_running()
        ep = self._episodes.get(episode_id)
        if ep is None:
            self._counts["bad_requests"] += 1
            self._out.append(EpisodeReply(episode_id=episode_id, seq=seq, done=True, error_kind="unknown_episode",
                                          error=f"episode {episode_id!r} is not open in the pool (never opened, "
                                                f"or already ended)"))
            return
        if ep.pending:
            raise ValueError(f"episode {episode_id!r} still awaits the answer to seq {ep.seq}; step it after that")
        if seq != ep.seq + 1:
            raise ValueError(f"episode {episode_id!r}: the next step is seq {ep.seq + 1}, not {seq}")
        ep.seq, ep.pending = seq, True
        self._send(ep.slot, EpisodeStep(episode_id=episode_id, seq=seq, action=action, role=role), ep)

    def close_episode(self, episode_id: str) -> None:
        """Forget an episode (finished, dropped or abandoned); a no-op for one that already ended."""
        ep = self._episodes.pop(episode_id, None)
        if ep is None:
            return
        ep.slot.episodes.discard(episode_id)
        if ep.slot.ready:  # a queued open is skipped when its process says Hello
            if ep.pending and ep.sent_at != float("inf"):
                ep.slot.closed_in_flight.append(ep)
            self._send(ep.slot, EpisodeClose(episode_id=episode_id), None)

    def poll(self, timeout: float = 0.0) -> list[EpisodeReply]:
        """The answers that arrived (or failures found) within `timeout` seconds; returns as soon as there
        is one. Also notices dead and stuck processes and restarts them."""
        self._check_running()
        deadline = time.monotonic() + timeout
        while True:
            self._service(0.0)
            left = deadline - time.monotonic()
            if self._out or left <= 0:
                break
            self._service(min(left, 0.05))  # deaths are checked at least every 50 ms while waiting
            if self._out:
                break
        out, self._out = self._out, []
        return out

    @property
    def counters(self) -> dict[str, float]:
        """restarts, timeouts, env_died (episodes lost with a process that died by itself),
        episodes_interrupted (episodes of a process the pool killed), env_errors, verifier_errors,
        bad_requests, late_replies, episodes_opened, and the gauge episodes_open."""
        return {**self._counts, "episodes_open": float(len(self._episodes))}

    @property
    def pids(self) -> dict[str, int]:
        """Process name -> pid of the processes running now."""
        return {s.name: s.proc.pid for s in self._slots if s.proc is not None and s.proc.poll() is None}

    @property
    def channel(self) -> RouterChannel:
        """The pool's socket, for a caller's own `tidal.core.channels.poll` (then call `poll(0)`)."""
        self._check_running()
        assert self._ch is not None
        return self._ch

    # ------------------------------------------------------------------ inside

    def _check_running(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._ch is None or self._closed:
            raise RuntimeError("the environment pool is not running: call start() first (and not after close())")

    def _send(self, slot: _Slot, msg: Message, ep: _Episode | None) -> None:
        if not slot.ready:
            slot.outbox.append((msg, ep))
            return
        if ep is not None:
            now = time.monotonic()
            if not [e for e in slot.waiting(self._episodes) if e is not ep]:
                slot.progress_at = now  # the clock of a stuck process starts when it has work
            ep.sent_at = now
        assert self._ch is not None
        try:
            self._ch.send(slot.identity, msg, timeout=0)
        except (PeerUnreachable, ChannelTimeout) as e:  # it is going (a death is seen next) or stuck (a timeout)
            log.debug("%s: %s not sent to %s: %s", self.name, type(msg).__name__, slot.name, e)

    def _service(self, wait: float) -> None:
        assert self._ch is not None
        if wait > 0:
            due = min([d for _, d in filter(None, map(self._serving, self._slots))] + [d.kill_at for d in self._dying],
                      default=float("inf"))
            wait = max(0.0, min(wait, due - time.monotonic()))
            if wait > 0:
                poll([self._ch], wait)
        for _ in range(1024):  # bounded: a flood of (bad) messages cannot keep the slots and deadlines waiting
            try:
                peer, msg = self._ch.recv(timeout=0)  # answers Hellos by itself (RouterChannel.peers)
            except ChannelTimeout:
                break
            except ProtocolError as e:  # any decode failure comes as this; the pool goes on serving
                key = f"protocol_errors/{e.reason}"
                self._counts[key] = self._counts.get(key, 0.0) + 1
                log.error("%s: dropped a bad message from %r: %s", self.name, e.peer, e)
                continue
            self._on_message(peer, msg)
        for slot in self._slots:
            self._check_slot(slot)
        self._check_deadlines()
        self._reap()

    def _on_message(self, peer: bytes, msg: Any) -> None:
        slot = self._by_identity.get(peer)
        if not isinstance(msg, EpisodeReply) or slot is None:
            self._counts["late_replies"] += slot is None
            if slot is not None:
                log.warning("%s: unexpected %s from %s ignored", self.name, type(msg).__name__, slot.name)
            return
        slot.failures_in_a_row = 0  # it answers: whatever it did before, it is not crash-looping
        slot.progress_at = time.monotonic()
        ep = self._episodes.get(msg.episode_id)
        if ep is None or ep.slot is not slot or not ep.pending or ep.seq != msg.seq:
            self._counts["late_replies"] += 1  # an episode that already failed (or was closed meanwhile)
            slot.closed_in_flight = [e for e in slot.closed_in_flight if (e.id, e.seq) != (msg.episode_id, msg.seq)]
            return
        ep.pending = False
        if msg.error_kind:
            counter = _ERROR_COUNTER.get(msg.error_kind, "env_errors")
            self._counts[counter] += 1
            self._note(msg.error_kind, f"episode {msg.episode_id} (seq {msg.seq}) on {slot.name}: {msg.error_kind}: "
                                       f"{msg.error}", f"{counter} {self._counts[counter]:g}")
        if msg.error_kind or msg.done:
            self._forget(ep)
        self._out.append(msg)

    def _check_slot(self, slot: _Slot) -> None:
        assert self._ch is not None
        if slot.proc is None:  # being killed, its replacement not started (the pool is broken)
            return
        rc = slot.proc.poll()
        if rc is not None:
            self._failed(slot, f"died with {_exit_text(rc)}", rc=rc)
        elif not slot.ready:
            if slot.identity in self._ch.peers:
                slot.ready = True
                queued, slot.outbox = slot.outbox, []
                for msg, ep in queued:
                    if ep is None or self._episodes.get(ep.id) is ep:
                        self._send(slot, msg, ep)
            elif time.monotonic() - slot.started_at > self.start_timeout_s and not self._starting:
                # (during start() its own check raises at once: a first start is not retried)
                self._failed(slot, f"did not say Hello within {self.start_timeout_s:g} s (start_timeout_s)", kill=True)

    def _serving(self, slot: _Slot) -> tuple[_Episode, float] | None:
        """The request `slot` is serving (the oldest waiting: it serves one at a time, in order) and when
        it is late; None when it has none."""
        waiting = slot.waiting(self._episodes)
        if not waiting:
            return None
        return min(waiting, key=lambda e: e.sent_at), slot.progress_at + self.step_timeout_s

    def _check_deadlines(self) -> None:
        """A process that answered nothing for `step_timeout_s` is stuck on the request it serves: that
        request times out, the process is killed (and its other episodes are answered env_restarted)."""
        now = time.monotonic()
        for slot in self._slots:
            serving = self._serving(slot)
            if serving is None or now <= serving[1]:
                continue
            ep, limit = serving[0], self.step_timeout_s
            pid = slot.proc.pid if slot.proc else 0
            what = "the open" if ep.seq == 0 else f"step {ep.seq}"
            closed = ep in slot.closed_in_flight  # (no one awaits its answer: only counted)
            text = (f"environment process {slot.name} (pid {pid}) gave no answer to {what} of episode {ep.id}"
                    f"{' (closed meanwhile)' if closed else ''} within {limit:g} s (step_timeout_s); the process "
                    f"was killed and restarted (its Python stack is in its log: {slot.log_path})")
            self._counts["timeouts"] += 1
            self._note("timeout", text, f"timeouts {self._counts['timeouts']:g}")
            if not closed:
                self._forget(ep)
                self._out.append(EpisodeReply(episode_id=ep.id, seq=ep.seq, done=True, error=text, error_kind="timeout"))
            self._failed(slot, f"was killed: stuck on episode {ep.id} for more than {limit:g} s", kill=True)

    def _failed(self, slot: _Slot, why: str, *, rc: int | None = None, kill: bool = False) -> None:
        """`slot`'s process is gone (`rc`), or is to go (`kill`: the pool stops it, its stack to its log):
        answer its episodes (env_died, or env_restarted when the pool killed it), restart it (or give up)."""
        pid = slot.proc.pid if slot.proc else 0
        if kill:
            self._stop_stuck(slot, why)
        elif rc is not None:
            self._kill(slot)  # reaps it, and ends whatever it left in its session
        kind, counter = ("env_restarted", "episodes_interrupted") if kill else ("env_died", "env_died")
        fate = "episode interrupted, not at fault" if kill else "episode dropped"
        for eid in sorted(slot.episodes):
            ep = self._episodes.pop(eid)
            self._counts[counter] += 1
            self._out.append(EpisodeReply(episode_id=eid, seq=ep.seq, done=True, error_kind=kind,
                                          error=f"environment process {slot.name} (pid {pid}) {why}; {fate} "
                                                f"(log: {slot.log_path})"))
        slot.episodes.clear()
        slot.outbox.clear()
        slot.closed_in_flight.clear()
        self._by_identity.pop(slot.identity, None)
        assert self._ch is not None
        self._ch.peers.pop(slot.identity, None)
        slot.failures_in_a_row += 1
        refused = slot.error_path.read_text().strip() if slot.error_path.is_file() else ""
        detail = f"environment process {slot.name} (pid {pid}) {why}"
        if rc == EXIT_CONFIG or slot.failures_in_a_row >= self.max_failures_in_a_row:
            reason = (refused or "its configuration was refused") if rc == EXIT_CONFIG else (
                f"{slot.failures_in_a_row} failures in a row with no answer in between" + (f"; {refused}" if refused else ""))
            self._broken = EnvPoolError(f"{detail}: {reason}; domains {sorted(self.domains)}; see its log "
                                        f"{slot.log_path}{_tail(slot.log_path)}")
            raise self._broken
        self._note("env_restarted" if kill else "env_died",
                   f"{detail}; restarting it{f' ({refused})' if refused else ''}; log {slot.log_path}",
                   f"restarts {self._counts['restarts'] + 1:g}", _tail(slot.log_path))
        self._counts["restarts"] += 1
        self._spawn(slot)

    def _forget(self, ep: _Episode) -> None:
        self._episodes.pop(ep.id, None)
        ep.slot.episodes.discard(ep.id)

    def _note(self, kind: str, detail: str, count: str, tail: str = "") -> None:
        """The first failure of each kind with its detail (and the process's last log lines); later ones
        in one line with the count."""
        if kind not in self._logged:
            self._logged.add(kind)
            log.error("%s: %s (later %s failures: one line each)%s", self.name, detail, kind,
                      f"; its log ends with:{tail}" if tail else "")
        else:
            log.warning("%s: %s (%s)", self.name, detail, count)


__all__ = ["COUNTERS", "EnvPool", "EnvPoolError"]
