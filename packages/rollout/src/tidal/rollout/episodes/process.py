"""An environment process: the episodes of a rollout worker's samples, stepped outside the worker.

    python -m tidal.rollout.episodes.process --config envproc.json --name env-0 --identity env-0/1

Started by `tidal.rollout.episodes.pool.EnvPool`, never by hand in a run. It builds the environment of every
domain first (through the plugin registry; a single-turn `Environment` is served through
`SingleTurnEpisodes`), so that no request waits on a build: the pool bounds the time until Hello by its
``start_timeout_s``, and every request after it by ``step_timeout_s``. Then it connects a DEALER (identity
``--identity``) to the pool's ROUTER at `endpoint`, says Hello, and serves one message at a time:

- `EpisodeOpen` -> ``env.episode(Task(...))`` and ``reset()``; the reply (seq 0) carries the first
  observation, the episode's tools and the environment's `max_turns`.
- `EpisodeStep` -> ``step(action)``; the reply carries the step's reward, info and next observation.
  When the episode is done, or this was its `max_turns`-th action (info ``max_turns_reached``), the
  reply has ``done`` and ``outcome()``. A step that raises ends the episode with ``env_error``; an
  outcome that raises, or a reward (step or outcome) that is not a real finite number, with
  ``verifier_error`` naming the author's file and line (`tidal.rollout.episodes.checks`): never a silent
  zero, never a substitute reward.
- `EpisodeClose` forgets an episode (no reply); a finished or failed one is already forgotten.
- `Control(command="stop")`, SIGTERM, or the death of the process that started it end it.

Observations (reset's and each step's, tool results included) are capped at `max_observation_chars`
characters, marked and counted in the reply's info. ``kill -USR1`` writes every thread's Python stack to
the log (`setup_role_process` registers it): the pool does that before it kills a stuck process.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tidal.core.channels import dealer, make_hello
from tidal.core.config import ConfigStruct, Domain, domains_by_key, load_config
from tidal.core.episodes import AGENT, Episode, NotAReward, Observation, SingleTurnEpisodes, is_episodic
from tidal.core.errors import ChannelTimeout, ConfigError, ProtocolError
from tidal.core.interfaces import Task
from tidal.core.plugin_failure import PluginBuildError
from tidal.core.plugins import registry
from tidal.core.process import role_main, setup_role_process
from tidal.core.protocol import (
    ChatMessage,
    Control,
    EpisodeClose,
    EpisodeOpen,
    EpisodeReply,
    EpisodeStep,
    Hello,
)
from tidal.core.security import ChannelSecurity
from tidal.rollout.episodes.checks import BadReward, RewardCheck, cap_messages, observation_info

log = logging.getLogger("tidal.rollout.envproc")

MAX_TURNS_REACHED = "max_turns_reached"  # EpisodeReply.info key: the process ended the episode at max_turns
MAX_OBSERVATION_CHARS = 16384  # the default cap (EpisodesConfig.max_observation_chars)


class EnvProcConfig(ConfigStruct):
    endpoint: str  # the pool's ROUTER, e.g. tcp://127.0.0.1:40123
    # the domains it serves (by key, each once): their env plugins, episodic or single-turn (adapted)
    domains: list[Domain]
    plugins: list[str] = []  # importable modules registered as plugins first (tests, users' local envs)
    name: str = "env-0"  # for logs and the pool's messages
    identity: str = ""  # the DEALER identity the pool routes by ("" = name); new for every restart
    connect_timeout_s: float = 60.0  # how long to wait for the pool's answer to our Hello
    parent_check_s: float = 0.5  # how often the parent's liveness is checked
    max_observation_chars: int = MAX_OBSERVATION_CHARS  # an observation's characters beyond this are dropped
    # CURVE: this process's key (the pool's own, made per pool in an owner-only folder) and the pool's
    # public key as server "envpool"; unset = plaintext
    security: ChannelSecurity = msgspec.field(default_factory=ChannelSecurity)


def register_plugins(modules: list[str]) -> None:
    """Import each module and add it to the registry (its ``@hookimpl`` functions become plugins)."""
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"plugin module {name!r} cannot be imported: {e}; put it on PYTHONPATH or install "
                              f"its distribution", field="plugins") from e
        registry.register(module, name=f"envproc:{name}")


@dataclass
class _Open:
    episode: Episode
    max_turns: int
    domain: str
    turns: int = 0
    roles: tuple[str, ...] = ()  # a multi-role episode's (self-play); () = one role
    role_turns: dict[str, int] = field(default_factory=dict)  # multi-role: max_turns counts each role's own


class _Failed(Exception):
    """Ends the message being served with an error reply of `kind` (`logged`: its log line was written)."""

    def __init__(self, kind: str, text: str, reward: float = 0.0, logged: bool = False) -> None:
        super().__init__(text)
        self.kind, self.reward, self.logged = kind, reward, logged


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class EpisodeHost:
    """The episodes of a set of domains, served message by message, with no socket: the environment
    process wraps one around its channel, and `LocalEpisodes` runs one in the caller's process (offline
    evaluation, where no fault isolation is wanted)."""

    def __init__(self, domains: list[Domain], name: str = "env",
                 max_observation_chars: int = MAX_OBSERVATION_CHARS) -> None:
        if max_observation_chars < 1:
            raise ConfigError(f"max_observation_chars must be >= 1, got {max_observation_chars}",
                              field="max_observation_chars")
        self.domains = domains_by_key(domains)
        self.name, self.max_observation_chars = name, max_observation_chars
        self.envs: dict[str, Any] = {}
        self.episodes: dict[str, _Open] = {}
        self.rewards = RewardCheck(name)
        self._logged: set[tuple[str, str]] = set()  # (error kind, exception type) logged with a traceback
        for key, d in self.domains.items():  # a misspelt name or option fails at start, not per episode
            registry.check("env", d.env.name, d.env.options, field=f"domains[{key}].env")

    def build_all(self) -> None:
        """Build every domain's environment now (an environment process does, before it says Hello).
        A factory that raises is a ConfigError naming the domain: the pool stops with it instead of
        failing every episode."""
        for domain, d in self.domains.items():
            try:
                self.env(domain)
            except _Failed as f:
                log.error("%s: %s", self.name, f, exc_info=f.__cause__)
                raise ConfigError(f"{f}; fix the environment's options or its factory (the traceback is in "
                                  f"this process's log)", field=f"domains[{domain}].env") from None
            log.info("%s: built environment %r of domain %r", self.name, d.env.name, domain)

    def env(self, domain: str) -> Any:
        if domain not in self.envs:
            d = self.domains.get(domain)
            if d is None:
                raise _Failed("bad_request", f"{self.name} serves domains {sorted(self.domains)}, not {domain!r}")
            try:
                env = registry.build("env", d.env.name, d.env.options, field=f"domains[{domain}].env")
            except PluginBuildError as e:  # already names the field, the plugin, the error and the author's line
                raise _Failed("env_error", str(e)) from e
            except Exception as e:
                raise _Failed("env_error", f"building environment {d.env.name!r} of domain {domain!r} failed: "
                                           f"{_describe(e)}") from e
            if not is_episodic(env):
                env = SingleTurnEpisodes(env)
            if not isinstance(getattr(env, "max_turns", None), int) or env.max_turns < 1:
                raise _Failed("env_error", f"environment {d.env.name!r} hands out episodes but its max_turns is "
                                           f"{getattr(env, 'max_turns', None)!r}; it must be an int >= 1")
            self.envs[domain] = env
        return self.envs[domain]

    def handle(self, msg: Any) -> EpisodeReply | None:
        """The reply to an `EpisodeOpen` or `EpisodeStep` (an error reply when it failed); None for the
        messages that get none (`EpisodeClose`)."""
        if isinstance(msg, EpisodeOpen):
            return self._answer(msg.episode_id, 0, self._open, msg)
        if isinstance(msg, EpisodeStep):
            return self._answer(msg.episode_id, msg.seq, self._step, msg)
        if isinstance(msg, EpisodeClose):
            self.forget(msg.episode_id)
        return None

    def forget(self, episode_id: str) -> None:
        """Drop an episode, closing it when it has `close()` (an agent's process, a socket)."""
        op = self.episodes.pop(episode_id, None)
        if op is not None:
            self._close(op.episode, episode_id)

    def _close(self, episode: Any, episode_id: str) -> None:
        close = getattr(episode, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception as e:  # a failing close costs nothing else: the episode is gone either way
            log.warning("%s: closing episode %s failed: %s", self.name, episode_id, _describe(e))

    def forget_all(self) -> None:
        for episode_id in list(self.episodes):
            self.forget(episode_id)

    def _answer(self, episode_id: str, seq: int, handler: Callable[[Any], EpisodeReply], msg: Any) -> EpisodeReply:
        try:
            return handler(msg)
        except _Failed as f:
            self.forget(episode_id)
            return self.error(episode_id, seq, f.kind, str(f), f.__cause__, f.reward, logged=f.logged)

    def error(self, episode_id: str, seq: int, kind: str, text: str, cause: BaseException | None,
              reward: float = 0.0, logged: bool = False) -> EpisodeReply:
        self.forget(episode_id)
        key = (kind, type(cause).__name__)
        if key not in self._logged and not logged:  # the traceback once per kind; later ones are counted by the pool
            self._logged.add(key)
            log.error("%s: episode %s, seq %d: %s: %s (later %s of this type are not logged here)", self.name,
                      episode_id, seq, kind, text, kind, exc_info=cause)
        return EpisodeReply(episode_id=episode_id, seq=seq, done=True, reward=reward, error=text, error_kind=kind)

    def _open(self, msg: EpisodeOpen) -> EpisodeReply:
        if msg.episode_id in self.episodes:
            raise _Failed("bad_request", f"episode {msg.episode_id!r} is already open on {self.name}")
        env = self.env(msg.domain)
        task = Task(prompt=msg.prompt, answer=msg.answer, domain=msg.domain, metadata=dict(msg.metadata))
        episode = None
        try:
            episode = env.episode(task)
            obs = episode.reset()
            tools, stop = list(episode.tools), [str(x) for x in episode.stop]
        except Exception as e:
            if episode is not None:  # it may have started something before it failed
                self._close(episode, msg.episode_id)
            raise _Failed("env_error", f"starting the episode failed: {_describe(e)}") from e
        roles = tuple(str(r) for r in getattr(episode, "roles", ()))
        roles = roles if len(roles) > 1 else ()
        if roles and obs.role not in roles:
            self._close(episode, msg.episode_id)
            raise _Failed("env_error", _no_role(obs.role, roles, "reset()"))
        self.episodes[msg.episode_id] = _Open(episode, env.max_turns, msg.domain, roles=roles)
        messages, text, dropped = self._capped(obs)
        return EpisodeReply(episode_id=msg.episode_id, seq=0, messages=messages, token_ids=obs.token_ids, text=text,
                            tools=tools, max_turns=env.max_turns, stop=stop, info=observation_info(dropped),
                            roles=list(roles), role=obs.role if roles else "")

    def _capped(self, obs: Observation | None) -> tuple[list[ChatMessage], str | None, int]:
        """An observation's messages and text within max_observation_chars (and the characters dropped)."""
        if obs is None:
            return [], None, 0
        if obs.text is None:
            messages, dropped = cap_messages(obs.messages, self.max_observation_chars)
            return messages, None, dropped
        (m,), dropped = cap_messages([ChatMessage(role="user", content=obs.text)], self.max_observation_chars)
        return [], m.content, dropped

    def _step(self, msg: EpisodeStep) -> EpisodeReply:
        op = self.episodes.get(msg.episode_id)
        if op is None:
            raise _Failed("unknown_episode", f"episode {msg.episode_id!r} is not open on {self.name} (never "
                                             f"opened, finished, failed or closed)")
        if msg.seq != op.turns + 1:
            raise _Failed("bad_request", f"episode {msg.episode_id!r} expects step {op.turns + 1}, got {msg.seq}")
        try:
            result = op.episode.step(msg.action, msg.role or AGENT)
            info = {k: float(v) for k, v in result.info.items()}
        except Exception as e:
            raise _Failed("env_error", f"step {msg.seq} failed: {_describe(e)}") from e
        reward = self._reward(result.reward, "step()", op.episode.step, op, msg.episode_id)
        op.turns += 1
        done = bool(result.done)
        obs = result.observation
        if op.roles:  # each role's own actions count against max_turns
            if not done and (obs is None or obs.role not in op.roles):
                raise _Failed("env_error", _no_role(obs.role if obs else None, op.roles, f"step {msg.seq}"))
            op.role_turns[msg.role] = op.role_turns.get(msg.role, 0) + 1
            if not done and obs is not None and op.role_turns.get(obs.role, 0) >= op.max_turns:
                done, info[MAX_TURNS_REACHED] = True, 1.0
        elif not done and op.turns >= op.max_turns:
            done, info[MAX_TURNS_REACHED] = True, 1.0
        if not done:
            messages, text, dropped = self._capped(obs)
            info.update(observation_info(dropped))
            return EpisodeReply(episode_id=msg.episode_id, seq=msg.seq, reward=reward, info=info,
                                messages=messages, token_ids=obs.token_ids if obs else None, text=text,
                                restart=bool(obs.restart) if obs else False,
                                role=obs.role if obs is not None and op.roles else "")
        env = self.envs[op.domain]  # a single-turn env's reward is its score(): name that in an error
        scorer = env.env.score if isinstance(env, SingleTurnEpisodes) else op.episode.outcome
        try:
            value = op.episode.outcome()
        except NotAReward as e:  # refused by the single-turn adapter
            raise self._bad_reward(self.rewards.refused(e, scorer, op.domain, self._env_name(op), msg.episode_id),
                                   reward) from None
        except Exception as e:
            raise _Failed("verifier_error", f"outcome() failed: {_describe(e)}", reward) from e
        if op.roles:  # a multi-role episode: every role's reward
            if not isinstance(value, Mapping) or set(map(str, value)) != set(op.roles):
                raise _Failed("verifier_error", f"outcome() of a multi-role episode must map each of its roles "
                                                f"{list(op.roles)} to a reward; got {value!r:.120}", reward)
            outcomes = {str(k): self._reward(v, f"outcome()[{k!r}]", scorer, op, msg.episode_id, reward)
                        for k, v in value.items()}
            self.forget(msg.episode_id)
            return EpisodeReply(episode_id=msg.episode_id, seq=msg.seq, reward=reward, info=info, done=True,
                                outcomes=outcomes)
        outcome = self._reward(value, "outcome()", scorer, op, msg.episode_id, reward)
        self.forget(msg.episode_id)
        return EpisodeReply(episode_id=msg.episode_id, seq=msg.seq, reward=reward, info=info, done=True,
                            outcome=outcome)

    def _env_name(self, op: _Open) -> str:
        d = self.domains.get(op.domain)
        return d.env.name if d is not None else op.domain

    def _reward(self, value: Any, what: str, func: Any, op: _Open, episode_id: str, step_reward: float = 0.0) -> float:
        """`value` as a reward, or the episode's verifier_error (logged by RewardCheck, once per value)."""
        try:
            return self.rewards.reward(value, what, func, op.domain, self._env_name(op), episode_id)
        except BadReward as e:
            raise self._bad_reward(e, step_reward) from None

    @staticmethod
    def _bad_reward(e: BadReward, step_reward: float) -> _Failed:
        return _Failed("verifier_error", str(e), step_reward, logged=True)


def _no_role(role: str | None, roles: tuple[str, ...], where: str) -> str:
    return (f"{where} of a multi-role episode returned an observation for role {role!r}: set Observation.role "
            f"to the role whose turn it is, one of {list(roles)}")


class EnvProcess:
    """An `EpisodeHost` behind a DEALER to the pool's ROUTER."""

    def __init__(self, cfg: EnvProcConfig) -> None:
        self.cfg = cfg
        self.host = EpisodeHost(cfg.domains, cfg.name, cfg.max_observation_chars)
        self.host.build_all()  # before Hello: the pool's start_timeout_s bounds it, and no open waits on it
        self._stop = False
        self.ch = dealer(cfg.endpoint, identity=(cfg.identity or cfg.name).encode(), linger=0,
                         curve=cfg.security.client("envpool"))
        self.protocol_errors: dict[str, int] = {}  # bad messages dropped, by ProtocolError.reason

    def run(self) -> int:
        hello = make_hello("env", self.cfg.name)
        self.ch.handshake(hello, timeout=self.cfg.connect_timeout_s)
        log.info("%s: serving domains %s for the pool at %s", self.cfg.name, sorted(self.host.domains),
                 self.cfg.endpoint)
        try:
            while not self._stop:
                try:
                    msg = self.ch.recv(timeout=self.cfg.parent_check_s)
                except ChannelTimeout:
                    continue
                except ProtocolError as e:  # any decode failure comes as this; the process goes on
                    self.protocol_errors[e.reason] = self.protocol_errors.get(e.reason, 0) + 1
                    log.error("%s: dropped a bad message (%d so far): %s", self.cfg.name,
                              sum(self.protocol_errors.values()), e)
                    continue
                self.serve(msg)
        finally:
            self.host.forget_all()
            self.ch.close(linger=0)
        return 0

    def serve(self, msg: Any) -> None:
        if isinstance(msg, Control) and msg.command == "stop":
            log.info("%s: stop requested (%s)", self.cfg.name, msg.reason or "no reason given")
            self._stop = True
            return
        if not isinstance(msg, (EpisodeOpen, EpisodeStep, EpisodeClose, Hello)):
            log.warning("%s: unexpected %s ignored", self.cfg.name, type(msg).__name__)
            return
        reply = self.host.handle(msg)
        if reply is None:
            return
        try:
            self.ch.send(reply, timeout=10)
        except (TypeError, ValueError, msgspec.EncodeError) as e:  # what the environment returned does not encode
            self.ch.send(self.host.error(reply.episode_id, reply.seq, "env_error",
                                         f"the environment's answer cannot be sent: {_describe(e)}", e), timeout=10)

    def stop(self) -> None:
        self._stop = True


def _watch_parent(parent: int, every: float, name: str) -> None:
    """Ends the process once its parent is gone, even while a step runs (or hangs) in the main thread."""
    while True:
        time.sleep(every)
        if os.getppid() != parent:
            log.warning("%s: the process that started it (pid %d) is gone; exiting", name, parent)
            logging.shutdown()
            os._exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tidal.rollout.episodes.process",
                                 description="Serve the episodes of a rollout worker's environment pool.")
    ap.add_argument("--config", required=True, help="JSON (or TOML) file of EnvProcConfig")
    ap.add_argument("--name", help="override `name`")
    ap.add_argument("--identity", help="override `identity`")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value settings applied on top")
    ap.add_argument("--log-level", default=os.environ.get("TIDAL_LOG_LEVEL", "INFO"))
    args = ap.parse_args(argv)
    setup_role_process(args.log_level)
    parent = os.getppid()
    cfg = load_config(args.config, EnvProcConfig, args.overrides)
    if args.name:
        cfg.name = args.name
    if args.identity:
        cfg.identity = args.identity
    threading.Thread(target=_watch_parent, args=(parent, cfg.parent_check_s, cfg.name), daemon=True,
                     name="tidal-parent-watch").start()
    register_plugins(cfg.plugins)
    proc = EnvProcess(cfg)

    def on_term(*_: object) -> None:  # raised where the main thread is, a hanging step included
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    return proc.run()


if __name__ == "__main__":
    sys.exit(role_main(main, "environment process"))
