"""`tidal samples RUN_DIR`: the transcripts a worker wrote (tidal.rollout.worker.transcripts), printed readably and
filtered; a folder without any says what to set; TensorBoard and the report's summary find them."""

from __future__ import annotations

import json

import pytest

from tidal.core.protocol import ChatMessage
from tidal.integration.cli import main
from tidal.integration.samples import samples_dir, summary, to_tensorboard
from tidal.rollout.episodes.multiturn import EpisodeRun, Seat, Segment
from tidal.rollout.worker.transcripts import (
    TranscriptsConfig,
    TranscriptWriter,
    episode_record,
    single_record,
)


def _episode(n: int, version: int) -> EpisodeRun:
    seg = Segment(prompt=[1], versions=[version, version], step_rewards=[0.0, 1.0], finish="stop")
    seat = Seat(segments=[seg], conversation=[ChatMessage(role="user", content=f"Convert {n} km to m"),
                                              ChatMessage(role="assistant", content="<call>unit_factor km m</call>"),
                                              ChatMessage(role="tool", content="<result>1000</result>", name="unit_factor"),
                                              ChatMessage(role="assistant", content=f"{n}000\nthat is all")])
    return EpisodeRun(group_id=f"unitconv-{n:07d}", index=0, id=f"unitconv-{n:07d}:0", seats={"": seat},
                      turns=2, outcome=1.0, turn_versions=[version, version])


@pytest.fixture
def run_dir(tmp_path):
    w = TranscriptWriter(TranscriptsConfig(dir=str(tmp_path / "samples")), "rollout-0")
    for n in range(1, 5):
        w.write(episode_record(_episode(n, version=n), "rollout-0", "unitconv"))
    w.write(episode_record(_episode(9, version=4), "rollout-0", "unitconv", "timeout",
                           "episode unitconv-0000009:0: the step took longer than 3 s"))
    w.write(single_record("rollout-0", "arithmetic", "arithmetic-0000001", "arithmetic-0000001:0", "What is 6 x 7?",
                          "42", 1.0, [2, 2, 3], "stop"))
    w.close()
    return tmp_path


def _samples(capsys, *args) -> tuple[int, str, str]:
    rc = main(["samples", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_newest_transcripts_turn_by_turn(run_dir, capsys):
    rc, out, _ = _samples(capsys, run_dir, "-n", "2", "--domain", "unitconv")
    assert rc == 0
    blocks = out.strip().split("\n\n")
    assert len(blocks) == 2 and "episode unitconv-0000004:0" in blocks[0] and "FAILED timeout" in blocks[1]
    lines = blocks[0].splitlines()
    assert lines[0] == "[unitconv]  version 4  reward 1  episode unitconv-0000004:0"
    assert lines[1:] == ["  user: Convert 4 km to m",
                         "  assistant: <call>unit_factor km m</call>",
                         "      → unit_factor(...)",
                         "      (step reward 0, v4)",
                         "  tool[unit_factor]: <result>1000</result>",
                         "  assistant: 4000",
                         "      that is all",
                         "      (step reward 1, v4)"]
    assert "reward -" in blocks[1] and "the step took longer than 3 s" in blocks[1]


def test_filters_and_raw_records(run_dir, capsys):
    rc, out, _ = _samples(capsys, run_dir, "--failed", "--json")
    (rec,) = [json.loads(line) for line in out.splitlines()]
    assert rc == 0 and rec["error_kind"] == "timeout" and rec["episode_id"] == "unitconv-0000009:0"
    rc, out, _ = _samples(capsys, run_dir, "--version", "2", "--json", "-n", "0")
    assert rc == 0 and [json.loads(line)["episode_id"] for line in out.splitlines()] == [
        "unitconv-0000002:0", "arithmetic-0000001:0"]  # any of its tokens written by version 2
    rc, out, _ = _samples(capsys, run_dir, "--domain", "arithmetic")
    assert rc == 0 and out.splitlines()[1:] == ["  user: What is 6 x 7?", "  assistant: 42", "      (step reward 1, v3)"]
    rc, _, err = _samples(capsys, run_dir, "--domain", "chess")
    assert rc == 1 and "none of the 6 transcripts" in err and "arithmetic, unitconv" in err


def test_a_folder_without_transcripts_says_what_to_set(tmp_path, capsys):
    rc, _, err = _samples(capsys, tmp_path)
    assert rc == 1 and "no transcripts in" in err and "rollout.transcripts.every" in err
    rc, _, err = _samples(capsys, tmp_path / "nowhere")
    assert rc == 2 and "is not a folder" in err


def test_a_configured_folder_tensorboard_text_and_the_summary(run_dir, tmp_path):
    other = tmp_path / "elsewhere"
    (run_dir / "samples").rename(other)
    (run_dir / "config.json").write_text(json.dumps({"rollout": {"transcripts": {"dir": str(other)}}}))
    assert samples_dir(run_dir) == other
    assert summary(run_dir) == {"dir": str(other), "count": 6, "failed": 1, "command": f"tidal samples {run_dir}"}

    from tensorboardX import SummaryWriter

    tb = SummaryWriter(str(tmp_path / "tb"))
    assert to_tensorboard(tb, run_dir, step=7, per_domain=2) == 3
    tb.close()
    events = b"".join(p.read_bytes() for p in (tmp_path / "tb").rglob("events.*"))
    assert b"samples/unitconv" in events and b"samples/arithmetic" in events and b"unit_factor" in events
