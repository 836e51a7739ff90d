"""A run that cannot learn says so (issue 59): a newcomer's own single-turn environment whose tasks the tiny
model cannot answer (`three plus four=` -> `7`, never seen) gives every group equal rewards (all 0), so
GRPO's advantages are all 0 and nothing is trained. `tidal run` warns in the console within the first 20
versions with what it means and what to try, ends `learned nothing: ...` in final.json with exit code 3,
and `tidal status` shows the share of samples with a signal. `tidal sft` warm-starts the same environment
from its reference answers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.system, pytest.mark.timeout(600)]
RECIPE = Path(__file__).parent / "recipes" / "tiny.toml"

WORDS = '''
import random
import zlib

from tidal.core.interfaces import Task
from tidal.core.plugins import hookimpl

NAMES = "zero one two three four five six seven eight nine".split()


class Words:
    """`three plus four=` -> `7`: additions of two digits written as words."""

    def tasks(self, split, seed):
        rng = random.Random(seed)
        while True:
            a, b = rng.randrange(10), rng.randrange(10)
            prompt = f"{NAMES[a]} plus {NAMES[b]}="
            if (zlib.crc32(prompt.encode()) % 5 == 0) == (split == "eval"):
                yield Task(prompt=prompt, answer=str(a + b))

    def score(self, task, completion):
        return float(completion.split("\\n", 1)[0].strip() == task.answer)


@hookimpl
def tidal_envs():
    return {"words": Words}
'''


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A fresh tiny model (no warm start) and the `words` plugin installed as a distribution on the path."""
    from tidal.rollout.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("no-signal")
    model = build_tiny_model(root / "model", seed=0)
    site = root / "site"
    site.mkdir()
    (site / "words_tidal.py").write_text(WORDS)
    info = site / "words_tidal-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: words-tidal\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[tidal]\nwords = words_tidal\n")
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return model, env


def test_a_run_whose_groups_all_have_equal_rewards_warns_and_ends_learned_nothing(world, tmp_path, tidal_cli):
    run_dir = tmp_path / "run"
    rc, out = tidal_cli.run(world, run_dir, 'domains=[{env={name="words"}}]', "workers=1", "budget.versions=24",
                            "eval.every=0", "sampling.max_tokens=3", "launch.fail_without_signal=true", timeout=420)
    final = json.loads((run_dir / "final.json").read_text())
    assert rc == 3, out[-3000:] + tidal_cli.logs(run_dir)
    assert final["status"].startswith("learned nothing: 24 versions trained"), final["status"]
    assert "resume" not in final  # nothing to continue: its budget is spent
    assert final["signal"]["samples_with_signal_frac"] < 0.01 and final["signal"]["versions_observed"] == 24
    assert final["signal"]["signal/zero_variance_frac"] == 1.0 and final["signal"]["signal/all_zero_frac"] == 1.0
    # the console's warning, once, within the first 20 versions, naming what to try
    warnings = [line for line in out.splitlines() if "no learning signal in the first 20 versions" in line]
    assert len(warnings) == 1 and "tidal sft" in warnings[0] and "partial credit" in warnings[0], out[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sum(1 for r in rows if r["scalars"].get("event/no_signal")) == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["signal"]["samples_with_signal_frac"] < 0.01 and summary["signal"]["zero_variance_groups_frac"] == 1.0
    status = subprocess.run([sys.executable, "-m", "tidal.integration.cli", "status", str(run_dir)],
                            capture_output=True, text=True, timeout=60)
    assert "learned nothing" in status.stdout and "% of the last step's samples had a nonzero advantage" in status.stdout, \
        status.stdout + status.stderr


def test_tidal_sft_warm_starts_the_same_environment_from_its_reference_answers(world, tmp_path):
    """The first stage for that environment: `tidal sft RECIPE` fits the fresh model on the environment's
    reference answers and writes a model folder `tidal run` takes; held-out accuracy (greedy) rises from 0."""
    model, env = world
    out = tmp_path / "sft"
    recipe = str(RECIPE)
    done = subprocess.run([sys.executable, "-m", "tidal.integration.cli", "sft", recipe, f'model="{model}"',
                           'domains=[{env={name="words"}}]', "sampling.max_tokens=3", "--steps", "120",
                           "--out", str(out)], capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    before = float(re.search(r"held-out accuracy before: ([\d.]+)%", done.stdout).group(1))
    after = float(re.search(r"SFT done in \d+ s: loss [\d.]+, held-out accuracy ([\d.]+)%", done.stdout).group(1))
    assert before < 5 and after >= 25, done.stdout
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert f'model="{out}"' in done.stdout.splitlines()[-1]  # the next stage's command line
