"""What learner rank 0 publishes: policy versions (`WeightsAvailable`, topic ``weights``) and step
`Metrics` (topic ``metrics``), on one PUB socket.

Weights go through the configured tidal-weight-sync transport (found by name in the plugin registry).
With a background executor (one process) a version is packed and staged on it while the next step's
forward and backward run; `wait` (the optimizer calls it before it changes the weights) blocks until that
send has packed and announced them. The latest announcement is published again every
``weights.reannounce_s``, for a generator that subscribed after it (late start, restart, slow joiner);
receivers ignore versions they already hold. At a finished run's end, transports that serve from this
process (zmq, shm) keep serving the last version until a generator reports it, up to
``weights.final_wait_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tidal.core.channels import pub
from tidal.core.plugins import registry
from tidal.core.protocol import TOPIC_METRICS, TOPIC_WEIGHTS, Metrics, WeightsAvailable
from tidal.core.security import AuthGuard, ChannelSecurity
from tidal.learner.config import WeightsConfig

log = logging.getLogger("tidal.learner")


class Publisher:
    def __init__(self, endpoint: str, weights: WeightsConfig, *, wait_for_subscriber_s: float = 0.0,
                 security: ChannelSecurity | None = None, lora_scale: float = 0.0) -> None:
        """`lora_scale` > 0: the backend's weights are LoRA adapters (`learner.lora`), sent alone and
        announced with that scale (alpha / rank)."""
        self.cfg = weights
        # with a run's keys: only its workers, weight relays and driver subscribe (refusals: auth/refused in our metrics),
        # and they trust only this key, so no one else can announce weights
        self.auth = AuthGuard()
        curve = (security or ChannelSecurity()).server(["rollout", "driver", "relay"], self.auth, "learner publish")
        self.pub = pub(endpoint, linger=1.0, watch_subscriptions=True, curve=curve)
        # PUB/SUB drops what is published before a subscription arrives: a step that comes at once (the
        # buffer already holds a batch) would lose its metrics
        if wait_for_subscriber_s > 0 and not self.pub.wait_for_subscriber(TOPIC_METRICS, wait_for_subscriber_s):
            log.warning("no metrics subscriber on %s within %.0f s; publishing anyway", endpoint, wait_for_subscriber_s)
        self._lock = threading.Lock()  # the PUB socket is shared with the re-announcer thread
        options = dict(weights.transport.options)
        if lora_scale > 0:
            options.update(lora_only=True, lora_scale=lora_scale)
        self.sender = registry.create("weight_transport", weights.transport.name).sender(options) \
            if weights.every > 0 else None
        self._announced: WeightsAvailable | None = None  # the latest, re-published every reannounce_s
        self._sending: Future | None = None
        self._stop = threading.Event()
        self._announcer: threading.Thread | None = None
        if self.sender is not None and weights.reannounce_s > 0:
            self._announcer = threading.Thread(target=self._reannounce_loop, name="tidal-reannounce", daemon=True)
            self._announcer.start()

    @property
    def send_stats(self) -> dict[str, float]:
        """The latest completed send's stats (empty without weights)."""
        return self.sender.last_stats if self.sender is not None else {}

    def publish(self, topic: str, msg: Metrics | WeightsAvailable) -> None:
        with self._lock:
            self.pub.publish(topic, msg)

    def send_weights(self, weights: Iterable[tuple[str, Any]], version: int, background: ThreadPoolExecutor | None) -> None:
        """Send and announce `version`: on `background` when given (after the previous send), else now."""
        if background is None:
            self._send(weights, version)
            return
        self.wait()
        self._sending = background.submit(self._send, weights, version)

    def _send(self, weights: Iterable[tuple[str, Any]], version: int) -> None:
        assert self.sender is not None  # only called with weights to publish
        ann = self.sender.send(weights, version)
        self._announced = ann
        self.publish(TOPIC_WEIGHTS, ann)

    def wait(self) -> None:
        """Block until the version being sent in the background is packed and announced; raises what
        the send raised."""
        fut, self._sending = self._sending, None
        if fut is not None:
            fut.result()

    def _reannounce_loop(self) -> None:
        while not self._stop.wait(self.cfg.reannounce_s):
            ann = self._announced
            if ann is not None:
                try:
                    self.publish(TOPIC_WEIGHTS, ann)
                except Exception as e:  # never take the learner down for a repeat
                    log.debug("re-announcing version %d failed: %s", ann.version, e)

    def _wait_for_last_version(self) -> None:
        """Give the generators `final_wait_s` to fetch the last version, ending early once one reports it."""
        sender = self.sender
        if sender is None or self.cfg.transport.name not in ("zmq", "shm") or sender.version < 0:
            return
        deadline = time.monotonic() + self.cfg.final_wait_s
        while time.monotonic() < deadline and not sender.reports(sender.version):
            time.sleep(0.05)
        if not sender.reports(sender.version):
            log.warning("no generator reported version %d within %.0f s of the end", sender.version,
                        self.cfg.final_wait_s)

    def close(self, finished: bool) -> None:
        """`finished`: the run completed its steps, so the generators should get the last version."""
        self.wait()
        if self.sender is not None:
            if finished:
                self._wait_for_last_version()
            self._stop.set()
            if self._announcer is not None:
                self._announcer.join(timeout=10)
            self.sender.close()
        self.auth.close()
        self.pub.close()
