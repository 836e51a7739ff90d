"""The buffer service process: rollout workers push trajectories in, learner ranks pull batches out.

    tidal-buffer [--config buffer.toml] [dotted.overrides ...]
    python -m tidal.buffer ...

Sockets (from config): PULL `ingest` for trajectories and trajectory groups; ROUTER `serve` for
BatchRequest / batch Acks / Control("status" | "stop"); PUB `publish` for acks (topic ``ack/<source>/``)
and Metrics (topic ``metrics``). With a run's keys (`security`) every socket is CURVE and lets in only
the run's roles that use it (ingest: rollout workers; serve: learner and driver; publish: workers and
driver); on serve, BatchRequest and batch Acks come from the learner only, stop from the driver only,
status from either. Refusals count as ``auth/refused`` (key not let in) and ``auth/role_refused``. A trajectory is acknowledged only once its WAL record is durable (group
commit: one fsync per drained batch of records); a batch is forgotten only when its learner acknowledges it.

What comes in on ingest is admitted by `tidal.buffer.ingest.Ingest`, a base class of the service.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import time
from typing import Any

import msgspec
import zmq

from tidal.buffer import wal
from tidal.buffer.batching import position_after, split_groups
from tidal.buffer.commit import Effects, GroupCommit
from tidal.buffer.config import BufferConfig
from tidal.buffer.ingest import LOGGED_ERRORS, Ingest
from tidal.buffer.memory import retain_freed_memory
from tidal.buffer.store import Group, Store, masked
from tidal.core.arrays import Array
from tidal.core.channels import PullChannel, RouterChannel, make_hello, pub, pull, router
from tidal.core.codec import PREAMBLE_BYTES, Codec
from tidal.core.config import load_config
from tidal.core.errors import ChannelTimeout, PeerUnreachable, ProtocolError
from tidal.core.plugins import registry
from tidal.core.process import role_main, setup_role_process
from tidal.core.protocol import (
    ACK_BATCH,
    ACK_CONTROL,
    TOPIC_METRICS,
    Ack,
    Batch,
    BatchRequest,
    Control,
    Error,
    Metrics,
    Trajectory,
    TrajectoryGroup,
)
from tidal.core.reliable import ack_topic
from tidal.core.security import AuthGuard, CurveServer

log = logging.getLogger("tidal.buffer")
GC_GEN0_THRESHOLD = 50_000
# Shares formed ahead of a rank's request (when ready data allows): each is durable (its Serve record
# fsynced) well before the rank asks for it, so a request does not wait for a commit. Bounded mode
# (max_groups > 0) keeps one ahead: its memory bound is ready + assembling + two shares per rank.
SHARES_AHEAD = 3


class BufferService(Ingest):
    def __init__(self, cfg: BufferConfig) -> None:
        self.cfg = cfg
        t0 = time.monotonic()
        self.wal = wal.WriteAheadLog(cfg.wal_dir, cfg.fsync)
        records, report = self.wal.replay()
        self.store = Store(cfg.group_size, cfg.dedupe_window)
        for rec in records:
            self.store.apply(rec)
        self.corrupt_bytes = report.corrupt_bytes
        log.info(
            "replayed %d WAL records in %.2fs: %d live trajectories, %d outstanding batches%s",
            report.records, time.monotonic() - t0, self.store.live_trajectories, len(self.store.outstanding),
            f"; SKIPPED {report.corrupt_bytes} corrupt bytes" if report.corrupt_bytes else "",
        )
        self.admission = (
            registry.build("admission", cfg.admission.name, cfg.admission.options, field="admission") if cfg.admission else None
        )
        self.filters = [(f.name, registry.build("group_filter", f.name, f.options, field=f"filters[{i}]"))
                        for i, f in enumerate(cfg.filters)]
        self.sec, self.guard = cfg.security, AuthGuard()
        curves = self._curves(cfg)
        common: dict[str, Any] = {"hwm": cfg.hwm, "linger": 1.0}
        # ingest decodes its two types only (faster than the whole Message union; others get a clear error);
        # each channel's codec limits also set its socket's MAXMSGSIZE (a larger frame is dropped unread)
        ingest_codec = Codec(message_type=Trajectory | TrajectoryGroup, max_message_bytes=cfg.max_message_bytes,
                             max_header_bytes=cfg.max_message_bytes)
        self.ingest: PullChannel = pull(cfg.ingest, codec=ingest_codec, curve=curves[0], **common)
        self._max_frame = self.ingest.codec.max_header_bytes + PREAMBLE_BYTES
        self.server: RouterChannel = router(cfg.serve, hello=make_hello("buffer", "buffer"), curve=curves[1],
                                            max_bytes=cfg.max_request_bytes, **common)
        self.pub = pub(cfg.publish, curve=curves[2], hwm=100_000, linger=1.0)
        self.learner_version = 0
        self._learner_known = False  # a BatchRequest arrived since this process started
        self.version_jumps = 0  # BatchRequests whose version jumped more than max_version_step (clamped)
        self.parked: dict[int, tuple[bytes, BatchRequest]] = {}
        self.protocol_errors = 0
        self.protocol_errors_by: dict[str, int] = {}  # ProtocolError.reason -> count (ingest and serve)
        self.refused_by: dict[str, int] = {}  # Refusal.reason -> trajectories / groups refused
        # id -> why, of trajectories the admission policy refused (the newest REMEMBER_REFUSED): a producer that
        # resends one (its ack was late or lost) is refused again with the same reason, counted once
        self.admission_refused: dict[str, str] = {}
        self.rejected = 0
        self._stop = False
        self._ingested_since = 0
        self._served_since = 0
        self._last_metrics = time.monotonic()
        # acks, refusals and replies wait for the fsync of their records (group commit)
        syncer = wal.Syncer(self.wal) if cfg.fsync == "batch" else None
        self.commits = GroupCommit(self.wal, cfg.max_batch_records, cfg.commit_interval_s, syncer)

    def _curves(self, cfg: BufferConfig) -> tuple[Any, Any, Any]:
        """CURVE for ingest, serve and publish: the run's keys (each socket its own client list), else
        the standalone key files (every socket the same), else none (plaintext, loopback only)."""
        if self.sec.enabled:
            sec, g = self.sec, self.guard
            return (sec.server(["rollout"], g, "buffer ingest"), sec.server(["learner", "driver"], g, "buffer serve"),
                    sec.server(["rollout", "driver"], g, "buffer publish"))
        curve = CurveServer.from_files(cfg.curve_secret_key, cfg.curve_authorized_keys or None) if cfg.curve_secret_key else None
        return curve, curve, curve

    # ------------------------------------------------------------------ main loop

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        # The live state is many small objects that form no reference cycles, and the cyclic collector's
        # default (a pass every 700 allocations, and full passes over everything held) is costly on a deep
        # buffer: what exists now (imports, the replayed state) is frozen out of its view, and young
        # objects are looked at 70x less often.
        gc.freeze()
        gc.set_threshold(GC_GEN0_THRESHOLD, 50, 100)
        log.info("buffer serving: ingest %s, serve %s, publish %s", self.ingest.endpoint, self.server.endpoint, self.pub.endpoint)
        try:
            # two pollers made once (building one per iteration costs more than the iteration)
            both, serve_only = zmq.Poller(), zmq.Poller()
            for poller, chans in ((both, (self.server, self.ingest)), (serve_only, (self.server,))):
                for ch in chans:
                    poller.register(ch.socket, zmq.POLLIN)
                if self.commits.syncer is not None:
                    poller.register(self.commits.syncer.fd, zmq.POLLIN)
            while not self._stop:
                poller = serve_only if self.backpressured() else both
                ready = dict(poller.poll(int(self.commits.timeout() * 1000)))
                if self.server.socket in ready:  # learners first: a waiting learner is idle compute
                    self.handle_requests()
                if self.ingest.socket in ready:
                    self.drain_ingest()
                self.commit()
                self.release_durable()
                self.tick()
        finally:
            self.commit(force=True)
            self.close()

    def stop(self) -> None:
        self._stop = True

    def backpressured(self) -> bool:
        return self.cfg.max_groups > 0 and len(self.store.ready) >= self.cfg.max_groups

    # ------------------------------------------------------------------ commits and acks

    def _protocol_error(self, e: ProtocolError) -> None:
        self.protocol_errors += 1
        self.protocol_errors_by[e.reason] = self.protocol_errors_by.get(e.reason, 0) + 1

    def commit(self, force: bool = False) -> None:
        """Group commit (`GroupCommit`): one fsync for the appended records, then their effects go out."""
        self._publish(self.commits.commit(force))

    def release_durable(self) -> None:
        """Send what waited for an fsync (on the syncer thread) that has finished, in commit order."""
        self._publish(self.commits.release())

    def _publish(self, released: list[Effects]) -> None:
        for effects in released:
            self.rejected += effects.rejected
            for source, ack in effects.acks_out():
                self.publish_ack(source, ack)
            for peer, batch in effects.replies:
                self._reply(peer, batch)

    def publish_ack(self, source: str, ack: Ack) -> None:
        if not source:
            log.warning("trajectories %s carry no source name; they cannot be acknowledged", ack.ids[:3])
            return
        self.pub.publish(ack_topic(source), ack)

    # ------------------------------------------------------------------ serving

    def handle_requests(self) -> None:
        for _ in range(64):
            try:
                peer, msg = self.server.recv(timeout=0)
            except ChannelTimeout:
                return
            except ProtocolError as e:  # of any kind: the codec turns every decode failure into this
                self._protocol_error(e)
                if self.protocol_errors <= LOGGED_ERRORS or self.protocol_errors % 1000 == 0:
                    log.warning("rejected a malformed request from %r (%d so far): %s", e.peer,
                                self.protocol_errors, e)
                continue
            if not self._permitted(msg):
                self._reply(peer, Error(code="refused", detail=f"{type(msg).__name__} is not accepted from "
                                        f"{self.sec.role_of(self.server.sender) or 'this client'} (role check)"))
                continue
            if type(msg) is BatchRequest:
                if msg.acked:
                    self.consume(msg.acked)
                self._learner_at(msg.version, peer)
                self.parked[msg.rank] = (peer, msg)
                self.try_serve(msg.rank)
            elif type(msg) is Ack and msg.kind == ACK_BATCH:
                self.consume(msg.ids)
                self._reply(peer, Ack(kind=ACK_BATCH, ids=msg.ids))
            elif type(msg) is Control and msg.command == "status":
                self._reply(peer, self.metrics())
            elif type(msg) is Control and msg.command == "stop":
                self._reply(peer, Ack(kind=ACK_CONTROL, ids=["stop"]))
                self.stop()
            else:
                self._reply(peer, Error(code="refused", detail=f"the buffer does not handle {type(msg).__name__} here"))

    def _permitted(self, msg: Any) -> bool:
        """Role check on serve (with a run's keys): batches are the learner's, stop is the driver's."""
        if not self.sec.enabled:
            return True
        kinds = ("learner", "driver") if type(msg) is Control and msg.command == "status" else \
            ("driver",) if type(msg) is Control else ("learner",)
        if self.sec.permits(self.server.sender, kinds):
            return True
        what = f"Control({msg.command!r})" if type(msg) is Control else type(msg).__name__
        self.guard.refuse_role("buffer serve", self.sec.role_of(self.server.sender) or "?", what)
        return False

    def _learner_at(self, version: int, peer: bytes) -> None:
        """Believe a BatchRequest's learner version: the first since start sets it; later ones move it forward
        by at most max_version_step (a larger jump, e.g. a forged 1e9, is clamped and counted)."""
        step = self.cfg.max_version_step
        if self._learner_known and step >= 0 and version > self.learner_version + step:
            self.version_jumps += 1
            log.warning("a BatchRequest from %r claims learner version %d, %d past the known %d (max_version_step "
                        "%d): moved to %d only", peer, version, version - self.learner_version,
                        self.learner_version, step, self.learner_version + step)
            version = self.learner_version + step
        self._learner_known = True
        self.learner_version = max(self.learner_version, version)

    def consume(self, batch_ids: list[str]) -> None:
        for batch_id in batch_ids:
            if self.store.consume(batch_id):
                self.wal.append(wal.Consume(batch_id))
        # Flushed to the OS (survives a crash of this process) but not fsynced: if a power loss drops
        # it, the batch is served again under the same id and the learner, which keeps the ids it
        # trained on, acknowledges it without training twice.
        self.wal.flush()

    def _reply(self, peer: bytes, msg: Any) -> None:
        try:
            self.server.send(peer, msg, timeout=1.0)
        except (PeerUnreachable, ChannelTimeout) as e:
            log.info("could not reply to %r: %s", peer, e)

    def try_serve(self, rank: int) -> None:
        parked = self.parked.get(rank)
        if parked is None:
            return
        peer, req = parked
        q = self.store.pending_shares.get(rank)
        pos = position_after(q, req.after)
        if q is None or pos >= len(q):
            if not self.form_step(req.world_size):
                return  # wait for data; the request stays parked
            q = self.store.pending_shares.get(rank)
            if q is None or pos >= len(q):
                return
        served = self.store.outstanding[q[pos]]
        del self.parked[rank]
        trajs: list[Any]  # Raw encodings (spliced in) or Trajectories: Batch declares what they decode to
        if self.admission is None:  # the stored encodings, spliced into the Batch as they are
            frames, raw = self.store.frames, msgspec.Raw
            trajs = [raw(frames[t.id]) for t in served.trajectories]
        else:
            trajs = [self._prepare(t) for t in served.trajectories]
        batch = Batch(batch_id=served.batch_id, rank=rank, world_size=served.world_size, trajectories=trajs,
                      step=self.learner_version, num_tokens=served.tokens, ready_at=served.formed_at)
        if not self.commits.durable(served.batch_id):
            self.commits.reply(peer, batch)  # sent once its Serve record is durable (commit)
        else:
            self._reply(peer, batch)
        self._served_since += len(trajs)
        # form the next shares now, so they are durable by the time this rank asks for them
        ahead = 1 if self.cfg.max_groups > 0 else SHARES_AHEAD
        while len(q) - pos - 1 < ahead and self.form_step(req.world_size):
            pass

    def _prepare(self, t: Trajectory) -> Trajectory | msgspec.Raw:
        """Apply the admission policy again at serving time (the hard staleness guarantee). An unchanged
        trajectory goes out as its stored encoding, spliced into the Batch without re-encoding."""
        raw = msgspec.Raw(self.store.frames[t.id])
        if self.admission is None:
            return raw
        adm = self.admission.admit(t.versions.numpy(), self.learner_version)
        if adm.admit and adm.token_mask is None:
            return raw
        mask = [False] * (t.completion_ids.shape[0]) if not adm.admit else adm.token_mask
        return masked(t, self.store.frames[t.id], mask)

    def form_step(self, world_size: int) -> bool:
        """Take whole ready groups for one learner step and serve a share to every rank."""
        if self.admission is not None:
            self._drop_stale_ready()
        chosen: list[Group] = []
        samples = tokens = 0
        for g in self.store.ready.values():
            if self._step_full(samples, tokens, len(chosen)):
                break
            chosen.append(g)
            samples += len(g.members)
            tokens += g.tokens
        if not chosen or not self._step_full(samples, tokens, len(chosen)):
            return False
        seq = self.store.next_batch_seq
        for rank, share in enumerate(split_groups(chosen, world_size)):
            ids = [tid for g in share for tid in g.members]
            batch_id = f"b{seq}-r{rank}"
            self.wal.append(wal.Serve(batch_id, rank, world_size, ids))
            self.store.serve(batch_id, rank, world_size, ids)
            self.commits.formed(batch_id)
        self.store.next_batch_seq = seq + 1
        # committed now, not within commit_interval_s: a learner asks for this share about one step from
        # now, and with an fsync of ~3-4 ms plus the interval it would often wait for the record
        self.commits.within(0.0)
        return True  # durable with the next commit, before any share is sent

    def _step_full(self, samples: int, tokens: int, groups: int) -> bool:
        """`batch_tokens`, else `batch_samples`, or as many groups as a step of whole groups of `group_size`
        holds: a group that delivers fewer samples than it was granted (a failed episode left out, a game's
        seat that never moved) makes its step short instead of pulling in one more group, so that a step
        takes what the controller's depth gate granted per version and the gate never waits on a step the
        buffer cannot fill."""
        if self.cfg.batch_tokens > 0:
            return tokens >= self.cfg.batch_tokens
        return samples >= self.cfg.batch_samples or groups >= -(-self.cfg.batch_samples // max(self.cfg.group_size, 1))

    def _drop_stale_ready(self) -> None:
        admission = self.admission
        assert admission is not None  # called only with a policy
        stale = [
            tid
            for g in self.store.ready.values()
            for tid, t in g.members.items()
            if not admission.admit(t.versions.numpy(), self.learner_version).admit
        ]
        if stale:
            self.wal.append(wal.Drop(stale, "stale"))
            self.store.drop(stale, "stale")

    # ------------------------------------------------------------------ housekeeping

    def tick(self) -> None:
        now = time.monotonic()
        expired = [g for g in self.store.assembling.values() if now - g.first_seen > self.cfg.group_timeout_s]
        for g in expired:
            if self.cfg.incomplete == "release":
                self.wal.append(wal.Release(g.group_id))
                self.store.release(g.group_id)
                self.on_group_complete(g)
            else:
                ids = list(g.members)
                self.wal.append(wal.Drop(ids, "timeout"))
                self.store.drop(ids, "timeout")
        if expired:
            self.wal.sync()
        for rank in list(self.parked):
            self.try_serve(rank)
        if now - self._last_metrics >= self.cfg.metrics_interval_s:
            self.pub.publish(TOPIC_METRICS, self.metrics())
        self.maybe_compact()

    def maybe_compact(self) -> None:
        # Compact once the log exceeds the live state twice over plus compact_bytes: a large live state is
        # not rewritten over and over, so the cost stays linear in what is appended.
        if self.wal.bytes_written > self.cfg.compact_bytes + 2 * self.store.live_bytes:
            t0 = time.monotonic()
            self.wal.compact(self.store.snapshot())
            log.info("compacted the WAL to %d bytes in %.2fs", self.wal.bytes_written, time.monotonic() - t0)

    def metrics(self) -> Metrics:
        now = time.monotonic()
        dt = max(now - self._last_metrics, 1e-9)
        s = self.store
        hist = s.lag_histogram(self.learner_version)
        scalars = {
            "depth/ready_groups": float(len(s.ready)),
            "depth/ready_samples": float(s.ready_samples),
            "depth/assembling_groups": float(len(s.assembling)),
            "depth/outstanding_batches": float(len(s.outstanding)),
            "depth/live_trajectories": float(s.live_trajectories),
            "rate/ingest_per_s": self._ingested_since / dt,
            "rate/serve_per_s": self._served_since / dt,
            "total/accepted": float(s.stats["accepted"]),
            "total/consumed": float(s.stats["consumed"]),
            "total/served": float(s.stats["served"]),
            "total/duplicates": float(s.stats["duplicates"]),
            "total/dropped": float(s.stats["dropped"]),
            "total/rejected": float(self.rejected),
            "errors/protocol": float(self.protocol_errors),
            **self.guard.scalars(),
            "errors/version_jump": float(self.version_jumps),
            "wal/bytes": float(self.wal.bytes_written),
            "wal/appended_bytes": float(self.wal.appended_total),
            "wal/corrupt_bytes_skipped": float(self.corrupt_bytes),
            "backpressure": float(self.backpressured()),
            "learner_version": float(self.learner_version),
        }
        scalars.update({f"drops/{k}": float(v) for k, v in s.drops.items()})
        scalars.update({f"errors/protocol/{k}": float(v) for k, v in self.protocol_errors_by.items()})
        scalars.update({f"refused/{k}": float(v) for k, v in self.refused_by.items()})
        self._ingested_since = self._served_since = 0
        self._last_metrics = now
        return Metrics(source="buffer", step=self.learner_version, time=time.time(), scalars=scalars,
                       histograms={"lag": Array.from_numpy(hist)})

    def close(self) -> None:
        self._publish(self.commits.close())  # what is durable still goes out before the sockets close
        self.wal.close()
        self.guard.close()
        for ch in (self.ingest, self.server, self.pub):
            ch.close(linger=0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="tidal-buffer",
        description="Run the Tidal buffer service (trajectories in over PULL, batches out over ROUTER).",
        epilog="Overrides use dotted TOML syntax, e.g. group_size=16 fsync=always admission.name=version_rejection",
    )
    ap.add_argument("--config", help="TOML file with buffer settings (defaults otherwise)")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value settings applied on top")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    setup_role_process(args.log_level)  # `kill -USR1 PID` writes every thread's stack to the log
    cfg = load_config(args.config, BufferConfig, args.overrides)
    retain_freed_memory()
    BufferService(cfg).run()
    return 0


if __name__ == "__main__":
    sys.exit(role_main(main, "buffer"))
