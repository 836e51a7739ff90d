"""Agentic runs end to end (`tidal run`, every role a real process, environment processes beside each
worker): what an outside environment's failures cost a multi-turn run, and how process rewards travel.

One run of `acme-faulty` (a third-party distribution on the roles' path): multiplication episodes with a
calculator, where four episodes fail one way each: one kills its environment process with SIGKILL
mid-episode, then one calls a Python tool that sleeps forever, one a Python tool that prints 100 MB, and
one has a verifier that raises. The run finishes; each
failure is counted where it happened (environment restarts, tool errors, dropped groups by kind), and
no failure became a zero reward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]


ACME = '''
import os
import signal
import time

from tidal.core.episodes import Observation, StepResult
from tidal.core.plugins import hookimpl
from tidal.core.protocol import ChatMessage
from tidal.rollout.envs.multiply import Multiply
from tidal.rollout.tiny import TOOL_ALPHABET
from tidal.core.toolenv import ToolEpisode
from tidal.rollout.tools.python import PythonTool

FAULTS = ("kill", "hang", "flood", "verifier")


class FaultyEpisode(ToolEpisode):
    def __init__(self, env, task):
        super().__init__(env, task)
        self.fault = ""

    def step(self, action, role="agent"):
        if self.turns == 0:
            self.fault = self.env.claim(self.task)
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)  # the environment process dies mid-episode
        if self.fault in ("hang", "flood") and self.turns == 0:
            self.turns += 1
            code = "import time; time.sleep(10**6)" if self.fault == "hang" else "print('x' * 10**8)"
            result = (self.env.python if self.fault == "hang" else self.env.flooding).run({"code": code})
            self.env.mark(self.fault + ".done")
            # what the tiny model's characters can show of it (a character it lacks is a render_error)
            shown = "".join(c for c in self.env.parser.format_result(None, result) if c in TOOL_ALPHABET)[:40]
            return StepResult(observation=Observation(messages=[ChatMessage(role="tool", name="python", content=shown)]),
                              info={"tool_calls": 1.0, "tool_errors": float(bool(result.error)),
                                    f"tool_{result.error or 'ok'}": 1.0})
        return super().step(action, role)

    def outcome(self):
        if self.fault == "verifier":
            self.env.mark("verifier.done")
            raise RuntimeError("acme verifier crashed")
        return super().outcome()


def _older(path, seconds):
    try:
        return time.time() - os.path.getmtime(path) > seconds
    except FileNotFoundError:
        return False


class Faulty(Multiply):
    """Multiply where one episode each, across all its processes, kills its environment process and, once
    that is over, hangs a tool, floods a tool's output and has its verifier raise: each fault is claimed
    once through a marker file in `markers`, so the run sees every one exactly once."""

    def __init__(self, markers="", **options):
        super().__init__(**options)
        self.markers = markers
        self.python = PythonTool(timeout_s=1.0)  # the hang: cut by the wall clock
        # the flood must be cut by the output cap, not the clock: on a loaded machine the sandbox alone can take
        # a second to start, and a 1 s limit turned the flood into a timeout (seen with tests side by side)
        self.flooding = PythonTool(timeout_s=60.0)

    def mark(self, name):
        try:
            os.close(os.open(os.path.join(self.markers, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def claim(self, task):
        """The next fault not yet played, for at most one episode of a group (a group whose verifier
        raised is dropped whole, and what its other episodes did with it)."""
        if any(os.path.exists(os.path.join(self.markers, f"{f}.task")) and
               open(os.path.join(self.markers, f"{f}.task")).read() == task.prompt for f in FAULTS):
            return ""
        for fault in FAULTS:
            if fault != "kill" and not _older(os.path.join(self.markers, "kill"), 1.0):
                return ""  # the others wait until the killed process's episodes are over (it held many)
            if self.mark(fault):
                with open(os.path.join(self.markers, f"{fault}.task"), "w") as f:
                    f.write(task.prompt)
                return fault
        return ""

    def episode(self, task):
        return FaultyEpisode(self, task)


@hookimpl
def tidal_envs():
    return {"acme-faulty": Faulty}
'''


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model with the tool alphabet (no warm start: this run tests failures, not learning) and
    the acme plugin distribution on a path entry every role, and every environment process, inherits."""
    from tidal.rollout.tiny import TOOL_ALPHABET, build_tiny_model

    root = tmp_path_factory.mktemp("agentic")
    model = build_tiny_model(root / "model", seed=0, alphabet=TOOL_ALPHABET)
    site = root / "site"
    site.mkdir()
    (site / "acme_agentic.py").write_text(ACME)
    info = site / "acme_agentic-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-agentic\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[tidal]\nacme_agentic = acme_agentic\n")
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return model, env


def test_environment_and_tool_failures_are_counted_and_the_run_finishes(world, tmp_path, tidal_cli):
    run_dir = tmp_path / "run"
    markers = tmp_path / "markers"
    markers.mkdir()
    rc, out = tidal_cli.run(world, run_dir, f'domains=[{{env={{name="acme-faulty", options={{markers="{markers}"}}}}}}]', "workers=1",
                        "budget.versions=30", "eval.every=0", "sampling.max_tokens=8", 'sampling.stop=["\\n"]',
                        "rollout.episodes.max_tokens=64", "rollout.episodes.step_timeout_s=20",
                        "rollout.episodes.processes=2", "group_size=4", "batch_groups=4")
    assert rc == 0, out[-4000:] + tidal_cli.logs(run_dir)
    f = json.loads((run_dir / "final.json").read_text())
    assert f["status"] == "completed" and f["versions"] == 30, f["status"]
    last = f["rollout"]["rollout-0"]  # the worker's final counters
    # the environment process killed with -9: its episodes failed and retried (counted), the process restarted
    assert last["rollout/envpool/env_died"] >= 1 and last["rollout/envpool/restarts"] >= 1, last
    assert last["rollout/episodes/failed/env_died"] >= 1, last
    assert last["rollout/episodes/retried"] >= 1, last  # an infrastructure failure is retried, not dropped
    # the verifier that raises: counted as an error, its group dropped (never a zero reward)
    assert last["rollout/envpool/verifier_errors"] >= 1 and last["rollout/episodes/failed/verifier_error"] >= 1
    # the tool that sleeps forever and the one that floods its output: error observations, counted
    assert last["rollout/episodes/tool_errors"] >= 2 and last["rollout/episodes/tool_calls"] >= 2, last
    assert last["rollout/episodes/info/tool_timeout"] >= 1 and last["rollout/episodes/info/tool_output_limit"] >= 1
    ctl = f["controller"]
    assert ctl.get("controller/groups_dropped/verifier_error", 0) >= 1, ctl
    assert ctl["controller/groups_done"] >= 120  # 30 steps x 4 groups trained
    env_logs = sorted((run_dir / "logs").glob("rollout-0-env-*.log"))
    assert env_logs, sorted(p.name for p in (run_dir / "logs").iterdir())
    log = "".join(p.read_text(errors="replace") for p in env_logs)
    assert "acme verifier crashed" in log
    assert {"kill", "hang", "flood", "verifier"} <= {p.name for p in markers.iterdir()}


def test_the_tool_demo_learns_to_call_the_calculator(tmp_path):
    """`tidal demo --task tools`, shortened: from a warm start that calls the calculator about one time in
    five (greedy accuracy ~17 %), async GRPO rewarded by the final answer alone raises held-out accuracy
    by at least 30 points, and the report has the tool-call rate."""
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "tidal.integration.cli", "demo", "--task", "tools", "--out", str(out),
                           "budget.versions=40", "eval.every=10"], capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["eval_end"] >= summary["eval_start"] + 0.30, summary["eval"]
    assert summary["episodes"]["tool_calls_per_episode"] >= 0.7, summary["episodes"]  # the warm start: ~0.2
    assert (out / "run" / "report.png").is_file()
    assert "tool calls per episode" in proc.stdout and "RL phase:" in proc.stdout

    # what the model wrote (issue 39's done-when): a multi-turn transcript with a calculator call, shown
    assert summary["samples"]["count"] >= 1 and summary["samples"]["dir"] == str(out / "run" / "samples")
    shown = subprocess.run([sys.executable, "-m", "tidal.integration.cli", "samples", str(out / "run"), "-n", "0"],
                           capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stdout[-3000:] + shown.stderr[-3000:]
    called = [b for b in shown.stdout.split("\n\n") if "→ calculator(...)" in b and "tool[calculator]: <result>" in b]
    assert called, shown.stdout[-3000:]
    assert called[-1].startswith("[multiply]  version ") and called[-1].count("  assistant: ") >= 2, called[-1]
    assert "<calc>" in called[-1] and "step reward" in called[-1], called[-1]
