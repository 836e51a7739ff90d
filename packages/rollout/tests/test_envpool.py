"""The environment pool with real environment processes: episodes stepped in order, single-turn envs
through the adapter, and every failure answered once (env_died, timeout, env_error, verifier_error),
with the process restarted and nothing left behind."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidal.core.config import Domain, PluginRef
from tidal.core.errors import ConfigError
from tidal.core.interfaces import Task
from tidal.core.protocol import EpisodeReply
from tidal.rollout.envs.tasks import Arithmetic
from tidal.rollout.episodes.pool import EnvPool, EnvPoolError

pytestmark = pytest.mark.timeout(60)

HERE = Path(__file__).resolve().parent
EXAMPLE_SRC = HERE.parents[2] / "examples" / "tidal-env-guess" / "src"
PYTHONPATH = os.pathsep.join([str(HERE), str(EXAMPLE_SRC)])


def dom(key: str, env: str, options: dict | None = None) -> Domain:
    """Domain `key` served by env plugin `env` with `options`."""
    return Domain(name=key, env=PluginRef(name=env, options=options or {}))


@pytest.fixture
def make_pool(tmp_path):
    pools: list[EnvPool] = []

    def make(domains: list[Domain], wait: bool = True, **kw) -> EnvPool:
        kw.setdefault("plugins", ["envpool_plugins"])
        pool = EnvPool(domains, log_dir=tmp_path / f"logs{len(pools)}", environ={"PYTHONPATH": PYTHONPATH}, **kw)
        pools.append(pool)
        pool.start(wait=wait)
        return pool

    yield make
    for pool in pools:
        pool.close()


def wait_for(pool: EnvPool, n: int, timeout: float = 10.0) -> list[EpisodeReply]:
    """The next `n` answers (fails after `timeout`)."""
    got: list[EpisodeReply] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(got)} of {n} answers within {timeout} s: {got}"
        got += pool.poll(timeout=left)
    assert len(got) == n, got
    return got


def one(pool: EnvPool, timeout: float = 10.0) -> EpisodeReply:
    return wait_for(pool, 1, timeout)[0]


def pid_of(reply: EpisodeReply) -> int:
    return int(re.search(r"served by pid (\d+)", reply.messages[0].content).group(1))  # type: ignore[union-attr]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_an_episodic_env_answers_each_step_in_order_with_rewards_and_its_outcome_when_done(make_pool):
    pool = make_pool([dom("count", "counting", {"turns": 3})], processes=2)
    for i in range(4):
        pool.open(f"e{i}", "count", Task(prompt=f"p{i}"))
    opened = {r.episode_id: r for r in wait_for(pool, 4)}
    assert all(r.seq == 0 and not r.error_kind and r.max_turns == 10 for r in opened.values())
    assert [t.name for t in opened["e0"].tools] == ["say"]
    assert opened["e0"].messages[0].content.startswith("p0: count from 1 to 3")
    assert len({pid_of(r) for r in opened.values()}) == 2, "the least-loaded placement uses both processes"
    actions = {"e0": ["1", "2", "3"], "e1": ["1", "5", "3"], "e2": ["1", "2", "3"], "e3": ["0", "0", "0"]}
    for seq in (1, 2, 3):
        for eid in actions:
            pool.step(eid, seq, actions[eid][seq - 1])
        replies = {r.episode_id: r for r in wait_for(pool, 4)}
        for eid, r in replies.items():
            assert r.seq == seq and not r.error_kind, r
            assert r.reward == float(actions[eid][seq - 1] == str(seq))
            assert r.done == (seq == 3)
            assert (r.outcome is None) == (seq < 3)
            assert bool(r.messages) == (seq < 3)
    assert replies["e0"].outcome == 1.0 and replies["e1"].outcome == pytest.approx(2 / 3)
    assert replies["e3"].outcome == 0.0
    assert pool.counters["episodes_open"] == 0 and pool.counters["episodes_opened"] == 4
    pool.close_episode("e0")  # already ended: a no-op
    pool.step("e0", 4, "4")
    assert one(pool).error_kind == "unknown_episode"


def test_an_episode_still_going_at_max_turns_is_ended_there_with_its_outcome(make_pool):
    pool = make_pool([dom("count", "counting", {"turns": 3, "max_turns": 2})])
    pool.open("e", "count", Task(prompt="p"))
    assert one(pool).max_turns == 2
    pool.step("e", 1, "1")
    assert not one(pool).done
    pool.step("e", 2, "2")
    r = one(pool)
    assert r.done and r.info == {"right": 1.0, "max_turns_reached": 1.0} and r.outcome == pytest.approx(2 / 3)


def test_a_single_turn_env_is_one_action_scored_by_its_score(make_pool):
    pool = make_pool([dom("arith", "arithmetic", {"level": 2})], plugins=[])
    tasks = list(itertools.islice(Arithmetic(level=2).tasks("train", seed=3), 2))
    for i, task in enumerate(tasks):
        pool.open(f"a{i}", "arith", task)
    first = {r.episode_id: r for r in wait_for(pool, 2)}
    for i, task in enumerate(tasks):
        r = first[f"a{i}"]
        assert r.max_turns == 1 and r.tools == [] and [m.role for m in r.messages] == ["user"]
        assert r.messages[0].content == task.prompt
    pool.step("a0", 1, tasks[0].answer)
    pool.step("a1", 1, tasks[1].answer + "7")
    done = {r.episode_id: r for r in wait_for(pool, 2)}
    assert done["a0"].done and done["a0"].outcome == 1.0
    assert done["a1"].done and done["a1"].outcome == 0.0


def test_a_process_killed_mid_episode_fails_its_episodes_with_env_died_and_comes_back(make_pool):
    pool = make_pool([dom("count", "counting")], processes=2)
    for i in range(4):
        pool.open(f"e{i}", "count", Task(prompt="p"))
    pids = {r.episode_id: pid_of(r) for r in wait_for(pool, 4)}
    victim = pids["e0"]
    pool.step("e0", 1, "1")
    assert one(pool).reward == 1.0
    os.kill(victim, signal.SIGKILL)  # between two turns of its episodes
    lost = sorted(e for e, p in pids.items() if p == victim)
    failed = {r.episode_id: r for r in wait_for(pool, len(lost))}
    assert sorted(failed) == lost
    for r in failed.values():
        assert r.error_kind == "env_died" and r.done and r.outcome is None
        assert f"(pid {victim}) died with signal SIGKILL; episode dropped" in r.error
    assert failed["e0"].seq == 1, "a failure between turns names the last request sent"
    assert pool.counters["restarts"] == 1 and pool.counters["env_died"] == len(lost)
    survivor = next(e for e, p in pids.items() if p != victim)
    pool.step(survivor, 1, "1")
    assert one(pool).reward == 1.0, "the other process's episodes go on"
    pool.open("after", "count", Task(prompt="p"))
    r = one(pool)
    assert not r.error_kind and pid_of(r) not in (victim,)
    for seq in (1, 2, 3):
        pool.step("after", seq, str(seq))
        last = one(pool)
    assert last.done and last.outcome == 1.0
    assert gone(victim) and len(pool.pids) == 2


def reaped(pool: EnvPool, pid: int, timeout: float = 5.0) -> bool:
    """Whether `pid` is gone within `timeout` while the pool is polled (it kills and reaps a stuck process
    KILL_GRACE_S after the timeout, from `poll`)."""
    deadline = time.monotonic() + timeout
    while not gone(pid) and time.monotonic() < deadline:
        pool.poll(timeout=0.05)
    return gone(pid)


def test_a_hanging_step_is_cut_at_step_timeout_with_its_stack_logged_and_bystanders_get_env_restarted(make_pool):
    pool = make_pool([dom("sleepy", "sleepy"), dom("count", "counting")], processes=1, step_timeout_s=1.0)
    pool.open("stuck", "sleepy", Task(prompt="p"))
    pool.open("bystander", "count", Task(prompt="p"))
    pid = pid_of(next(r for r in wait_for(pool, 2) if r.episode_id == "bystander"))
    t0 = time.monotonic()
    pool.step("stuck", 1, "anything")
    replies = {r.episode_id: r for r in wait_for(pool, 2, timeout=5)}
    assert time.monotonic() - t0 < 1.0 + 1.0
    assert not gone(pid), "the pool answered without waiting for the kill (KILL_GRACE_S later)"
    assert replies["stuck"].error_kind == "timeout"
    assert "no answer to step 1 of episode stuck within 1 s (step_timeout_s)" in replies["stuck"].error
    bystander = replies["bystander"]
    assert bystander.error_kind == "env_restarted" and "stuck on episode stuck" in bystander.error
    assert "interrupted, not at fault" in bystander.error
    assert pool.counters["timeouts"] == 1 and pool.counters["restarts"] == 1
    assert pool.counters["episodes_interrupted"] == 1 and pool.counters["env_died"] == 0
    assert reaped(pool, pid), "the stuck process was not killed"
    log = (pool.log_dir / "env-0.log").read_text()
    assert "stuck on episode stuck for more than 1 s: its Python stack follows" in log, log
    assert "in wait_for_a_lookup_that_never_returns" in log and "envpool_plugins.py" in log, log
    pool.open("later", "count", Task(prompt="p"))
    r = one(pool)
    assert not r.error_kind and pid_of(r) != pid


def test_a_step_that_hangs_after_its_episode_was_closed_is_still_the_one_blamed(make_pool):
    """A dropped group's episodes are closed while their steps may be in flight; the process still serves
    those steps first, so one that hangs is the stuck one: the open queued behind it is a bystander."""
    pool = make_pool([dom("sleepy", "sleepy"), dom("count", "counting")], processes=1, step_timeout_s=1.0)
    pool.open("dropped", "sleepy", Task(prompt="p"))
    wait_for(pool, 1)
    pool.step("dropped", 1, "x")
    pool.close_episode("dropped")  # its group failed elsewhere
    pool.open("next", "count", Task(prompt="p"))
    r = one(pool, timeout=5)
    assert r.episode_id == "next" and r.error_kind == "env_restarted", r
    assert "stuck on episode dropped" in r.error
    assert pool.counters["timeouts"] == 1 and pool.counters["episodes_interrupted"] == 1
    pool.open("after", "count", Task(prompt="p"))
    assert not one(pool).error_kind


def test_a_hanging_open_is_cut_at_step_timeout_like_a_step(make_pool):
    pool = make_pool([dom("sleepy", "sleepy_open"), dom("count", "counting")], processes=1,
                     step_timeout_s=1.0)
    pool.open("bystander", "count", Task(prompt="p"))
    pid = pid_of(one(pool))
    t0 = time.monotonic()
    pool.open("stuck", "sleepy", Task(prompt="p"))
    replies = {r.episode_id: r for r in wait_for(pool, 2, timeout=5)}
    assert time.monotonic() - t0 < 1.0 + 1.0
    assert replies["stuck"].error_kind == "timeout" and "no answer to the open of episode stuck within 1 s" in replies[
        "stuck"].error
    assert replies["bystander"].error_kind == "env_restarted"
    assert reaped(pool, pid)
    assert "in wait_for_a_lookup_that_never_returns" in (pool.log_dir / "env-0.log").read_text()


def test_a_process_whose_environment_never_builds_fails_start_at_start_timeout_with_its_stack(tmp_path):
    pool = EnvPool([dom("slow", "slow_build")], log_dir=tmp_path, environ={"PYTHONPATH": PYTHONPATH},
                   plugins=["envpool_plugins"], start_timeout_s=1.5)
    t0 = time.monotonic()
    with pytest.raises(EnvPoolError, match=r"env-0 .* did not say Hello within 1.5 s \(start_timeout_s\)"):
        pool.start()
    assert time.monotonic() - t0 < 1.5 + 3
    assert pool.pids == {}
    assert "in load_a_dataset_forever" in (tmp_path / "env-0.log").read_text()


def test_time_queued_behind_other_episodes_steps_is_not_a_timeout(make_pool):
    pool = make_pool([dom("count", "counting", {"delay_s": 0.3})], processes=1, step_timeout_s=1.0)
    for i in range(5):
        pool.open(f"e{i}", "count", Task(prompt="p"))
    wait_for(pool, 5)
    t0 = time.monotonic()
    for i in range(5):
        pool.step(f"e{i}", 1, "1")
    replies = wait_for(pool, 5)
    assert time.monotonic() - t0 > 1.0, "the last step waited longer than step_timeout_s in all"
    assert all(r.reward == 1.0 and not r.error_kind for r in replies)
    assert pool.counters["timeouts"] == 0 and pool.counters["restarts"] == 0


def test_a_pool_started_without_waiting_serves_the_episodes_opened_before_hello(make_pool):
    pool = make_pool([dom("count", "counting")], wait=False, processes=2)
    for i in range(3):
        pool.open(f"e{i}", "count", Task(prompt="p"))
    assert all(not r.error_kind for r in wait_for(pool, 3))


def test_a_process_silent_past_start_timeout_is_restarted_and_then_ends_a_pool_that_did_not_wait(make_pool):
    pool = make_pool([dom("slow", "slow_build")], wait=False, start_timeout_s=1.0, max_failures_in_a_row=2)
    pool.open("e0", "slow", Task(prompt="p"))
    r = one(pool, timeout=5)
    assert r.error_kind == "env_restarted" and "did not say Hello within 1 s (start_timeout_s)" in r.error
    pool.open("e1", "slow", Task(prompt="p"))
    with pytest.raises(EnvPoolError, match="did not say Hello within 1 s .* 2 failures in a row"):
        wait_for(pool, 1, timeout=5)
    assert "in load_a_dataset_forever" in (pool.log_dir / "env-0.log").read_text()


def test_an_oversized_observation_arrives_truncated_with_a_marker_and_counted(make_pool):
    mb5 = 5 * 1024 * 1024
    pool = make_pool([dom("f", "flooding", {"reset_chars": 3000, "step_chars": mb5})],
                     max_observation_chars=1000)
    pool.open("e", "f", Task(prompt="p"))
    first = one(pool)
    assert first.messages[0].content == "r" * 1000 + "\n(... truncated: 3000 characters, 2000 dropped)"
    assert first.info == {"observations_truncated": 1.0, "observation_chars_dropped": 2000.0}
    pool.step("e", 1, "look it up")
    r = one(pool)
    dump, question = r.messages
    assert dump.role == "tool" and dump.name == "lookup"
    assert dump.content == "x" * 1000 + f"\n(... truncated: {mb5} characters, {mb5 - 1000} dropped)"
    assert question.content == "\n(... truncated: 4 characters, 4 dropped)", "the cap is on the whole observation"
    assert r.info == {"observations_truncated": 1.0, "observation_chars_dropped": float(mb5 - 1000 + 4)}


def test_rewards_that_are_not_real_numbers_are_verifier_errors_naming_the_authors_file_and_line(make_pool, monkeypatch):
    import importlib
    import inspect

    monkeypatch.syspath_prepend(str(HERE))
    envpool_plugins = importlib.import_module("envpool_plugins")  # for the lines the errors should name

    def line(func) -> str:
        return f"envpool_plugins.py:{inspect.getsourcelines(func)[1]}"

    outcome, step, score = (line(envpool_plugins.BadRewardEpisode.outcome), line(envpool_plugins.BadRewardEpisode.step),
                            line(envpool_plugins.BadScore.score))
    cases = {  # domain: (its options, the error expected; "" = a reward)
        "string": ({"outcome": "string"}, f"outcome() returned 'wrong' (str), not a real number (env bad_reward, {outcome})"),
        "str_number": ({"outcome": "str_number"}, f"outcome() returned '1.0' (str), not a real number (env bad_reward, {outcome})"),
        "none": ({"outcome": "none"}, f"outcome() returned None (NoneType), not a real number (env bad_reward, {outcome})"),
        "nan": ({"outcome": "nan"}, f"outcome() returned nan (float), not a finite number (env bad_reward, {outcome})"),
        "inf": ({"outcome": "inf"}, "outcome() returned inf (float), not a finite number"),
        "step": ({"step_reward": "str_number"}, f"step() returned '1.0' (str), not a real number (env bad_reward, {step})"),
        "good": ({"step_reward": "true", "outcome": "one"}, ""),
    }
    pool = make_pool([*(dom(d, "bad_reward", o) for d, (o, _) in cases.items()), dom("score", "bad_score")])
    for d in [*cases, "score"]:
        pool.open(d, d, Task(prompt="p"))
    wait_for(pool, len(cases) + 1)
    for d in [*cases, "score"]:
        pool.step(d, 1, "x")
    replies = {r.episode_id: r for r in wait_for(pool, len(cases) + 1)}
    for d, (_, error) in cases.items():
        r = replies[d]
        if not error:
            assert not r.error_kind and r.reward == 1.0 and r.outcome == 1.0, r
            continue
        assert r.error_kind == "verifier_error" and r.outcome is None and error in r.error, (d, r)
    assert replies["step"].reward == 0.0 and replies["string"].reward == 0.5, "a bad step reward is not kept"
    assert replies["score"].error_kind == "verifier_error"
    assert f"score() returned '1.0' (str), not a real number (env bad_score, {score})" in replies["score"].error
    assert pool.counters["verifier_errors"] == len(cases) - 1 + 1
    log = (pool.log_dir / "env-0.log").read_text()
    for shown in ("'wrong'", "None", "nan", "'1.0'", "inf"):  # each distinct value's first occurrence
        assert f"returned {shown} (" in log, (shown, log)


def test_a_verifier_that_raises_is_a_verifier_error_with_its_message_not_a_zero(make_pool):
    pool = make_pool([dom("v", "raising_verifier")])
    pool.open("e", "v", Task(prompt="p"))
    one(pool)
    pool.step("e", 1, "x")
    r = one(pool)
    assert r.error_kind == "verifier_error" and r.outcome is None and r.done
    assert "RuntimeError: the judge is unreachable" in r.error and r.reward == 0.25
    assert pool.counters["verifier_errors"] == 1 and pool.counters["episodes_open"] == 0


def test_a_step_that_raises_is_an_env_error_and_the_process_goes_on(make_pool):
    pool = make_pool([dom("bad", "raising_step"), dom("count", "counting")])
    pool.open("e", "bad", Task(prompt="p"))
    one(pool)
    pool.step("e", 1, "garbage")
    r = one(pool)
    assert r.error_kind == "env_error" and "ValueError: cannot parse action 'garbage'" in r.error
    assert pool.counters["env_errors"] == 1 and pool.counters["restarts"] == 0
    pool.open("ok", "count", Task(prompt="p"))
    assert not one(pool).error_kind


def test_close_stops_every_process_even_one_stuck_in_a_step(make_pool, tmp_path):
    pool = make_pool([dom("sleepy", "sleepy")], processes=2, step_timeout_s=60)
    pids = list(pool.pids.values())
    pool.open("e", "sleepy", Task(prompt="p"))
    one(pool)
    pool.step("e", 1, "x")
    time.sleep(0.2)  # the step is sleeping now
    t0 = time.monotonic()
    pool.close()
    assert time.monotonic() - t0 < 3, "SIGTERM ends a hanging step; no wait for the SIGKILL grace"
    assert len(pids) == 2 and all(gone(p) for p in pids)
    assert pool.pids == {}


def test_environment_processes_exit_when_the_pool_process_is_killed(tmp_path):
    code = (
        "import sys, time; from tidal.core.config import Domain, PluginRef\n"
        "from tidal.rollout.episodes.pool import EnvPool\n"
        f"pool = EnvPool([Domain(name='c', env=PluginRef(name='counting'))], processes=2, plugins=['envpool_plugins'], "
        f"log_dir={str(tmp_path)!r}, environ={{'PYTHONPATH': {PYTHONPATH!r}}})\n"
        "pool.start(); print(*pool.pids.values(), flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while not all(gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(gone(p) for p in pids), "orphaned environment processes"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_process_that_dies_on_every_episode_makes_poll_raise_naming_its_log(make_pool):
    pool = make_pool([dom("d", "dies_on_open")], max_failures_in_a_row=2)
    pool.open("e0", "d", Task(prompt="p"))
    r = one(pool)
    assert r.error_kind == "env_died" and "died with exit code 3" in r.error
    pool.open("e1", "d", Task(prompt="p"))
    with pytest.raises(EnvPoolError, match=r"env-0 .* 2 failures in a row .* see its log .*env-0\.log"):
        wait_for(pool, 1)
    with pytest.raises(EnvPoolError, match="2 failures in a row"):  # the pool stays broken
        pool.open("e2", "d", Task(prompt="p"))


def test_an_unknown_env_fails_start_with_the_registry_message_and_the_log(tmp_path):
    pool = EnvPool([dom("x", "no_such_env")], log_dir=tmp_path, environ={"PYTHONPATH": PYTHONPATH})
    with pytest.raises(EnvPoolError, match=r"no env named 'no_such_env'.*see its log .*env-0\.log"):
        pool.start()
    assert pool.pids == {}


def test_an_env_whose_factory_raises_fails_start_at_once_naming_the_domain_and_the_error(tmp_path):
    pool = EnvPool([dom("x", "raising_build")], processes=2, log_dir=tmp_path, plugins=["envpool_plugins"],
                   environ={"PYTHONPATH": PYTHONPATH})
    t0 = time.monotonic()
    with pytest.raises(EnvPoolError, match=r"domains\[x\]\.env: environment plugin 'raising_build' \(module envpool_plugins\) "
                                           r"failed to build: FileNotFoundError: tasks.jsonl is not in the package "
                                           r"\(envpool_plugins\.py:\d+\)"):
        pool.start()
    assert time.monotonic() - t0 < 10, "a configuration refused is not restarted"
    # in the log of whichever of the two processes failed first (the pool stops at the first refusal)
    logs = [p.read_text() for p in sorted(tmp_path.glob("env-*.log"))]
    assert any("envpool_plugins.py" in text for text in logs), "the traceback is in the log"


def test_the_example_guess_number_env_plays_in_the_pool(make_pool):
    pool = make_pool([dom("guess", "guess_number", {"high": 16})], plugins=["tidal_env_guess.plugin"])
    pool.open("g", "guess", Task(prompt="", answer="11"))
    first = one(pool)
    assert [t.name for t in first.tools] == ["hint"] and first.max_turns >= 4
    low, high, seq = 1, 16, 0
    while True:
        seq += 1
        guess = (low + high) // 2
        pool.step("g", seq, f"My guess is {guess}.")
        r = one(pool)
        assert not r.error_kind, r
        if r.done:
            break
        text = r.messages[0].content.lower()
        low, high = (guess + 1, high) if "higher" in text else (low, guess - 1)
    assert r.outcome == 1.0 and seq <= 4


def test_a_guess_game_of_unreadable_moves_is_lost_at_max_turns_not_a_verifier_error(make_pool):
    """An untrained policy seldom writes a number: its game ends at max_turns as lost (outcome 0.0), so its
    group trains, rather than as an outcome() that raises, which drops the group (verifier_error)."""
    pool = make_pool([dom("guess", "guess_number", {"high": 8, "max_turns": 3})],
                     plugins=["tidal_env_guess.plugin"])
    pool.open("g", "guess", Task(prompt="", answer="5"))
    assert one(pool).max_turns == 3
    for seq in (1, 2, 3):
        pool.step("g", seq, "no idea")
        r = one(pool)
        assert not r.error_kind and r.info["invalid_guesses"] == 1.0, r
    assert r.done and r.outcome == 0.0 and r.info["max_turns_reached"] == 1.0


def test_a_process_without_the_pools_keys_cannot_pose_as_an_environment(make_pool):
    """The pool and its processes speak CURVE with keys made for this pool alone: a local process that
    connects to the pool's socket (plaintext, or with keys of its own) gets no answer to its Hello, and
    the pool's own processes still serve."""
    import zmq

    from tidal.core.channels import dealer, make_hello
    from tidal.core.errors import ChannelTimeout
    from tidal.core.security import CurveClient

    pool = make_pool([dom("arith", "arithmetic")], processes=1)
    assert pool._keys_dir is not None and oct(pool._keys_dir.stat().st_mode & 0o777) == "0o700"
    public, secret = zmq.curve_keypair()
    own_keys = CurveClient(zmq.curve_keypair()[0], public, secret)
    for curve in (None, own_keys):
        with dealer(pool._ch.endpoint, curve=curve, linger=0) as stranger:
            with pytest.raises(ChannelTimeout):
                stranger.handshake(make_hello("env", "stranger"), timeout=1.0)
    assert pool.processes == 1 and all(s.ready for s in pool._slots)


def test_a_malformed_or_nested_frame_at_the_pool_is_counted_by_reason_and_episodes_go_on(make_pool):
    from tidal.core.channels import dealer
    from tidal.core.codec import MAGIC
    from tidal.core.protocol import PROTOCOL_VERSION
    from tidal.core.security import ChannelSecurity

    pool = make_pool([dom("count", "counting")])
    assert pool._ch is not None
    # a peer holding the pool's client keys (its own processes' pair): past CURVE, at the codec
    assert pool._keys_dir is not None
    curve = ChannelSecurity.from_role_keys(pool._keys_dir, "envproc", servers=["envpool"]).client("envpool")
    with dealer(pool._ch.endpoint, identity=b"rogue", linger=0, curve=curve) as rogue:
        rogue.socket.send(MAGIC + bytes(PROTOCOL_VERSION) + b"\x92\xacEpisodeReply" + b"\x91" * 200_000 + b"\xc0")
        rogue.socket.send(b"GET / HTTP/1.1\r\n\r\n")
        deadline = time.monotonic() + 10
        while sum(v for k, v in pool.counters.items() if k.startswith("protocol_errors/")) < 2:
            assert time.monotonic() < deadline, f"the pool did not count the bad frames: {pool.counters}"
            pool.poll(timeout=0.05)
    assert pool.counters["protocol_errors/not_tidal"] == 1
    pool.open("ok", "count", Task(prompt="p"))  # control: the pool still serves episodes
    assert not one(pool).error_kind


def test_a_domain_listed_twice_is_refused_naming_both_places(tmp_path):
    with pytest.raises(ConfigError) as e:
        EnvPool([dom("c", "counting"), dom("c", "sleepy")], log_dir=tmp_path)
    assert e.value.field == "domains[1].name" and "domains[1] and domains[0] are both named 'c'" in str(e.value)
