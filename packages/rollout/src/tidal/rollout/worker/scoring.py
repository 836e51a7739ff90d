"""What a rollout worker builds per domain (its environment, its scorer) and how one sample is scored.

A domain (one of the worker's ``domains``, or an env plugin that a task names directly) gets one
environment instance, so one env plugin can serve two domains with different options, and one scorer:
the domain's reward plugin when it names one, else its environment's ``score``. Whatever a plugin
raises while scoring costs the sample's group (`SampleError`, with the reason the worker counts), never
the worker.
"""

from __future__ import annotations

from typing import Any

from tidal.core.config import domains_by_key
from tidal.core.episodes import NotAReward, real_reward
from tidal.core.interfaces import GenerationResult, Task
from tidal.core.plugins import registry
from tidal.rollout.worker.config import WorkerConfig


class SampleError(Exception):
    """Scoring or decoding one sample failed: its group is dropped (`reason`), the worker goes on."""

    def __init__(self, reason: str, cause: BaseException) -> None:
        super().__init__(f"{reason}: {type(cause).__name__}: {cause}")
        self.reason, self.cause = reason, cause


class Domains:
    def __init__(self, cfg: WorkerConfig, tokenizer: Any | None) -> None:
        domains_by_key(cfg.domains)  # a domain listed twice is refused at the worker's start
        self.cfg, self.tokenizer = cfg, tokenizer
        self._envs: dict[str, Any] = {}
        self._scorers: dict[str, Any] = {}

    def env(self, name: str) -> Any:
        """The environment instance of domain `name`, built on first use."""
        if name not in self._envs:
            env = self.cfg.domain(name).env
            self._envs[name] = registry.build("env", env.name, env.options, field=f"domains[{name}].env")
        return self._envs[name]

    def scorer(self, name: str) -> Any:
        """What scores domain `name`: its reward plugin when it names one, else its env's `score`."""
        if name not in self._scorers:
            reward = self.cfg.domain(name).reward
            if reward is not None:
                self._scorers[name] = registry.build("reward", reward.name, reward.options,
                                                     field=f"domains[{name}].reward")
            else:
                self._scorers[name] = self.env(name).score
        return self._scorers[name]

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def score(self, domain: str, task: Task, res: GenerationResult) -> float:
        """The reward of one sample of `domain`; SampleError (decode_error, reward_error or score_error)
        when decoding or the plugin fails, or the reward is not a real finite number (`real_reward`)."""
        try:
            text = self.decode(res.completion_ids)
        except Exception as e:
            raise SampleError("decode_error", e) from e
        reason = "reward_error" if self.cfg.domain(domain).reward is not None else "score_error"
        try:
            value = self.scorer(domain)(task, text)
        except Exception as e:
            raise SampleError(reason, e) from e
        try:  # NaN would poison its group's advantages; a string ("1.0") is a verifier's bug, not a reward
            return real_reward(value, "score()" if reason == "score_error" else "the reward plugin")
        except NotAReward as e:
            raise SampleError(reason, ValueError(f"{e}, for completion {text[:80]!r}")) from None
