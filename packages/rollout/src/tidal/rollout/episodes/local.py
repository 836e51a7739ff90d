"""LocalEpisodes: the environment pool's interface over episodes served in the caller's own process."""

from __future__ import annotations

from collections.abc import Sequence

from tidal.core.config import Domain
from tidal.core.episodes import AGENT
from tidal.core.interfaces import Task
from tidal.core.protocol import EpisodeClose, EpisodeOpen, EpisodeReply, EpisodeStep, Message
from tidal.rollout.episodes.pool import _ERROR_COUNTER, COUNTERS
from tidal.rollout.episodes.process import MAX_OBSERVATION_CHARS, EpisodeHost, register_plugins


class LocalEpisodes:
    """The pool's interface over an `EpisodeHost` in this process: no isolation, no timeouts. For offline
    evaluation (the demo's warm-start accuracy) where a crash should just raise; runs use `EnvPool`."""

    def __init__(self, domains: Sequence[Domain], plugins: Sequence[str] = (),
                 max_observation_chars: int = MAX_OBSERVATION_CHARS) -> None:
        register_plugins(list(plugins))
        self.host = EpisodeHost(list(domains), name="local", max_observation_chars=max_observation_chars)
        self._out: list[EpisodeReply] = []
        self.counters: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)

    def start(self) -> None:
        pass  # nothing to spawn

    def _serve(self, msg: Message) -> None:
        reply = self.host.handle(msg)
        if reply is not None:
            if reply.error_kind in _ERROR_COUNTER:
                self.counters[_ERROR_COUNTER[reply.error_kind]] += 1
            self._out.append(reply)

    def open(self, episode_id: str, domain: str, task: Task) -> None:
        self.counters["episodes_opened"] += 1
        self._serve(EpisodeOpen(episode_id=episode_id, domain=domain, prompt=task.prompt, answer=task.answer,
                                metadata=dict(task.metadata)))

    def step(self, episode_id: str, seq: int, action: str, role: str = AGENT) -> None:
        self._serve(EpisodeStep(episode_id=episode_id, seq=seq, action=action, role=role))

    def close_episode(self, episode_id: str) -> None:
        self._serve(EpisodeClose(episode_id=episode_id))

    def poll(self, timeout: float = 0.0) -> list[EpisodeReply]:
        out, self._out = self._out, []
        return out

    def close(self) -> None:
        self.host.forget_all()  # closing each (an agent episode's process)
