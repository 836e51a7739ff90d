"""The OpenAI-client agent example (examples/openai-agent), trained by `tidal run` as it is: the agent runs
from a fresh venv of its own that holds `openai` and nothing of Tidal, and the run's episodes are its
conversations with the policy's OpenAI-compatible endpoint (integration/recipes/agent.toml)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fresh_tidal import env_logs, tidal_run

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "openai-agent"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tidal_run_trains_the_openai_client_agent_running_from_its_own_venv(tmp_path):
    uv = shutil.which("uv") or "uv"
    venv = tmp_path / "agent-venv"
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, timeout=120)
    agent_py = str(venv / "bin" / "python")
    subprocess.run([uv, "pip", "install", "--quiet", "--python", agent_py, "-r", str(EXAMPLE / "requirements.txt")],
                   check=True, timeout=300)
    alone = subprocess.run([agent_py, "-c", "import importlib.util as u; print(u.find_spec('tidal'), u.find_spec('openai') is not None)"],
                           capture_output=True, text=True, timeout=60)
    assert alone.stdout.split() == ["None", "True"], alone  # the agent's venv knows openai, not Tidal

    from tidal.rollout.tiny import TOOL_ALPHABET, build_tiny_model

    model = build_tiny_model(tmp_path / "model", alphabet=TOOL_ALPHABET, seed=0)
    command = json.dumps([agent_py, str(EXAMPLE / "agent.py"), "{prompt}"])
    domains = (f'domains=[{{name="calculator-agent", env={{name="agent", options={{command={command}, '
               f'tasks={{name="multiply"}}, parser="tags", parser_options={{tags={{calc=["calculator","expression"]}}}}, '
               f'max_turns=3}}}}}}]')
    run_dir = tmp_path / "run"
    rc, log, _ = tidal_run(sys.executable, tmp_path, run_dir, f'model="{model}"', 'monitor.progress="log"',
                           "monitor.tensorboard=false", "workers=1", domains, "budget.versions=3", "eval.every=3",
                           "eval.size=8", "sampling.max_tokens=8", "rollout.episodes.processes=2",
                           # each episode starts the agent (python + import openai, ~1 s of CPU): 8 a version
                           "group_size=4", "batch_groups=2",
                           recipe=ROOT / "integration" / "recipes" / "agent.toml")
    assert rc == 0, log[-4000:] + env_logs(run_dir)
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "completed" and final["versions"] == 3 and final["errors"] == {}, final
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    worker = [r["scalars"] for r in rows if r["source"] == "rollout-0" and "rollout/episodes/episodes" in r["scalars"]]
    assert worker and worker[-1]["rollout/episodes/episodes"] >= 24 and worker[-1]["rollout/episodes/failed"] == 0
    agents = sorted((run_dir / "logs").glob("agent-*.log"))  # one per episode: what each agent printed
    assert len(agents) >= 24 + 16, len(agents)  # the trained episodes, and two held-out rounds of 8
