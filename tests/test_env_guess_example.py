"""The third-party environment example (examples/tidal-env-guess) installs beside tidal-core alone, is found
by name through its entry point, and plays through the tidal-core episode protocol, in a fresh venv built
the way tools/check_package_alone.py builds one."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tidal-env-guess"

PLAY = textwrap.dedent('''
    import importlib.util
    from tidal.core.episodes import Episode, EpisodicEnvironment, is_episodic
    from tidal.core.plugins import registry

    assert importlib.util.find_spec("tidal.rollout") is None, "tidal-rollout must not be installed here"
    assert "guess_number" in registry.names("env"), registry.names("env")
    assert registry.provider("env", "guess_number") == "guess_number"
    env = registry.build("env", "guess_number", {"low": 1, "high": 32}, field="domains.guess")
    assert is_episodic(env) and isinstance(env, EpisodicEnvironment) and env.max_turns == 7

    def play(task, hint_first):
        ep = env.episode(task)
        assert isinstance(ep, Episode) and [t.name for t in ep.tools] == ["hint"]
        assert "1 to 32" in ep.reset().messages[0].content
        low, high, rewards, infos = 1, 32, [], {}
        if hint_first:
            r = ep.step('<tool_call>{"name": "hint", "arguments": {}}</tool_call>')
            assert r.observation.messages[0].role == "tool" and r.info == {"tool_calls": 1.0}
            parity = int(task.answer) % 2
            assert r.observation.messages[0].content == f"The number is {['even', 'odd'][parity]}."
        for turn in range(env.max_turns):
            guess = (low + high) // 2
            r = ep.step(f"{guess}")
            rewards.append(r.reward)
            if r.done:
                return ep.outcome(), rewards
            low, high = (guess + 1, high) if r.observation.messages[0].content == "Higher." else (low, guess - 1)
        return ep.outcome(), rewards

    tasks = list(env.tasks("eval", seed=1))[:4]
    assert len(tasks) == 4 and all(1 <= int(t.answer) <= 32 for t in tasks)
    for i, task in enumerate(tasks):
        outcome, rewards = play(task, hint_first=i % 2 == 0)
        assert outcome == 1.0 and all(r >= 0 for r in rewards) and abs(sum(rewards) - 0.1) < 1e-9, rewards

    # a game not won: outcome 0.0, a step reward only for coming closer, bad moves answered, not raised
    ep = env.episode(tasks[0])
    ep.reset()
    wrong = 1 if tasks[0].answer != "1" else 2
    first, again = ep.step(str(wrong)), ep.step(str(wrong))
    assert first.reward > 0 and again.reward == 0.0 and not again.done
    assert ep.step("no idea").info == {"invalid_guesses": 1.0}
    assert ep.step('<tool_call>{"name": "search"}</tool_call>').info == {"invalid_calls": 1.0}
    assert ep.outcome() == 0.0
    print("played", len(tasks), "games")
''')


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_guess_example_installs_with_tidal_core_alone_and_plays_through_the_episode_protocol(tmp_path,
                                                                                                 monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import check_package_alone as alone

    wheels = alone.build_wheels(["tidal-core", EXAMPLE], tmp_path / "dist")
    py = alone.fresh_venv(tmp_path / "venv", wheels)
    assert alone.tidal_dists(py) == ["tidal-core", "tidal-env-guess"]
    assert alone.run_readme(EXAMPLE / "README.md", py, tmp_path, "tidal-env-guess") == 1
    out = subprocess.run([py, "-c", PLAY], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "played 4 games" in out.stdout
