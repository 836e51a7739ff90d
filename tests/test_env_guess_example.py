"""The third-party environment example (examples/tidal-env-guess) installs beside tidal-core alone, is found
by name through its entry point, and plays through the tidal-core episode protocol; installed beside the
whole of Tidal, `tidal run` trains on it by its plugin name, its episodes multi-turn in environment
processes. Each in a fresh venv built the way tools/check_package_alone.py builds one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fresh_tidal import PREPARE, env_logs, tidal_run, tidal_venv, workspace_dists

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
            assert r.observation.messages[0].role == "tool" and r.info["tool_calls"] == 1.0 and not r.info["tool_errors"]
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
    assert ep.step('<tool_call>{"name": "search"}</tool_call>').info["invalid_calls"] == 1.0
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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tidal_run_trains_on_the_installed_guess_example_by_name_with_multi_turn_episodes(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import check_package_alone as alone

    dists = workspace_dists()
    py = tidal_venv(tmp_path, EXAMPLE)
    assert alone.tidal_dists(py) == sorted([*dists, "tidal-env-guess"])

    model = tmp_path / "model"
    out = subprocess.run([py, "-c", PREPARE, str(model), "guess_number"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == ["tidal-env-guess"]  # its entry point, no other
    listed = subprocess.run([py, "-m", "tidal.integration.cli", "plugins", "env"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert listed.returncode == 0 and re.search(r"^  guess_number +from guess_number$", listed.stdout, re.M), listed

    # high=8: max_turns 5, a prompt of ~190 characters; prompt + episodes.max_tokens + one turn and its
    # answer stay within the tiny model's 512 positions
    run_dir = tmp_path / "run"
    rc, log, _ = tidal_run(py, tmp_path, run_dir, f'model="{model}"', 'monitor.progress="log"',
                           "monitor.tensorboard=false", "workers=1", 'domains=[{env={name="guess_number", options={high=8}}}]',
                           "budget.versions=4", "sampling.max_tokens=8", "eval.every=4", "eval.size=8",
                           "rollout.episodes.max_tokens=200", "rollout.episodes.processes=1")
    assert rc == 0, log[-4000:] + env_logs(run_dir)

    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "completed" and final["versions"] == 4 and final["restarts"] == {}, final
    assert final["errors"] == {} and final["controller"]["controller/groups_dropped"] == 0, final
    assert [(e[0], sorted(e[2])) for e in final["eval"]] == [(0, ["guess_number"]), (4, ["guess_number"])]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    worker = [r["scalars"] for r in rows if r["source"] == "rollout-0" and "rollout/episodes/episodes" in r["scalars"]]
    assert worker, "no rollout worker row with episode counters in metrics.jsonl"
    last = worker[-1]
    assert last["rollout/episodes/episodes"] > 0 and last["rollout/episodes/turns_per_episode"] > 1, last
    assert last["rollout/episodes/failed"] == 0 and last["rollout/envpool/verifier_errors"] == 0, last
    env_log_files = sorted(p.name for p in (run_dir / "logs").glob("rollout-0-env-*.log"))
    assert env_log_files == ["rollout-0-env-0.log"], sorted(p.name for p in (run_dir / "logs").iterdir())
