"""The whole system as `tidal run` starts it: every role a real process (or a Ray actor), real sockets.

- a short async GRPO run on arithmetic raises held-out accuracy (the demo, smaller);
- sync mode runs the same roles in lock-step (no sample older than the version it was trained at);
- `kill -9` of a rollout worker, the buffer and the learner mid-run (the learner between two
  checkpoints): the run finishes, and the trajectories the learner trained on are exactly the ones the
  buffer acknowledged, minus what the buffer still holds at the end (no loss, no duplicates);
- the README's Ray command line, through `uv run`, places the same roles on a local Ray head.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tidal.core.channels import sub
from tidal.core.errors import ChannelTimeout
from tidal.core.protocol import Ack
from tidal.core.security import ChannelSecurity
from tidal.integration.run import relay_folder

pytestmark = [pytest.mark.system, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def sft_model(warm_cache):
    """A tiny model warm-started like the demo's: the carry drill from a demonstrator who forgets the
    carry 60 % of the time (half a minute of SFT; built once per session, whichever worker asks first)."""
    from tidal.integration.sft import accuracy, built_once
    from tidal.rollout.envs.tasks import Arithmetic

    def build(root):
        from tidal.integration.sft import SFTConfig, sft
        from tidal.rollout.tiny import build_tiny_model

        base = build_tiny_model(root / "base", seed=0)
        sft(base, root / "sft", Arithmetic(level=5), SFTConfig(steps=1000, batch=64, lr=1e-3, carry_slip=0.6))

    root = built_once(warm_cache, {"test": "system"}, build)
    start = accuracy(root / "sft", Arithmetic(level=5), n=200, max_tokens=5)
    assert 0.3 < start < 0.8, f"the warm start should be right on some problems and wrong on others: {start}"
    return root / "sft"


def tidal_run(run_dir: Path, model: Path, *overrides: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "tidal.integration.cli", "run", str(Path(__file__).parent / "recipes" / "tiny.toml"),
            f'model="{model}"', f'run_dir="{run_dir}"', "monitor.progress=\"log\"", "monitor.log_every_s=5", *overrides]
    return subprocess.Popen(args, stdout=open(run_dir.with_suffix(".log"), "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def finish(proc: subprocess.Popen, run_dir: Path, timeout: float) -> dict:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
        pytest.fail(f"the run did not finish within {timeout} s:\n{run_dir.with_suffix('.log').read_text()[-4000:]}"
                    + _role_logs(run_dir))
    log = run_dir.with_suffix(".log").read_text()
    assert rc == 0, log[-4000:] + _role_logs(run_dir)
    return json.loads((run_dir / "final.json").read_text())


def _role_logs(run_dir: Path, chars: int = 1500) -> str:
    """The end of each role's log: what a failed run's own log cannot say about its roles."""
    return "".join(f"\n--- {p.name} (end)\n{p.read_text(errors='replace')[-chars:]}"
                   for p in sorted((run_dir / "logs").glob("*.log")))


def test_async_run_raises_heldout_accuracy(tmp_path, sft_model):
    run_dir = tmp_path / "run"
    final = finish(tidal_run(run_dir, sft_model, "budget.versions=30", "eval.every=15"), run_dir, 600)
    evals = final["eval"]
    start, end = evals[0][1], evals[-1][1]
    print(f"held-out accuracy {start:.3f} -> {end:.3f} over {[e[0] for e in evals]}")
    assert evals[0][0] == 0 and evals[-1][0] == 30
    assert end >= start + 0.15, evals  # the stated margin: 15 points in 30 versions (the demo runs 120)
    assert (run_dir / "report.png").stat().st_size > 10_000
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["source"] for r in rows} >= {"learner-0", "controller", "rollout-0", "rollout-1"}
    assert any(r["source"].startswith("buffer") for r in rows)
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    # the wait a user feels: from the roles' launch to the first trained step, in final.json and the console
    assert 0 < final["launch_to_first_step_s"] < 600, final["launch_to_first_step_s"]
    log = run_dir.with_suffix(".log").read_text()
    assert f"first trained step {final['launch_to_first_step_s']:.1f} s after launch" in log, log[-2000:]


def test_sequence_parallel_learner_on_two_ranks_raises_heldout_accuracy(tmp_path, sft_model):
    """`learner.parallel.sp = 2` (Ulysses) with the learner on 2 ranks: both ranks train every batch, each
    on its half of every packed row; the run completes and held-out accuracy rises by the async run's
    margin (15 points in 30 versions). Evaluated only at the start and the end, to keep it short."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    final = finish(tidal_run(run_dir, sft_model, "budget.versions=30", "eval.every=30", "learner.parallel.sp=2",
                             "--nproc", "2"), run_dir, 600)
    evals = final["eval"]
    start, end = evals[0][1], evals[-1][1]
    print(f"sp=2: held-out accuracy {start:.3f} -> {end:.3f} over {[e[0] for e in evals]}, "
          f"run {time.monotonic() - t0:.0f} s")
    assert final["status"] == "completed" and [e[0] for e in evals] == [0, 30]
    assert end >= start + 0.15, evals
    log = (run_dir / "logs" / "learner.log").read_text()  # the local launcher's learner spawns its ranks
    for rank in (0, 1):
        assert f"rank {rank}: sequence-parallel rank {rank} of 2 (ulysses: ulysses 2 x ring 1)" in log, log[-3000:]


def test_sync_mode_trains_every_sample_at_the_version_that_made_it(tmp_path, sft_model):
    run_dir = tmp_path / "run"
    finish(tidal_run(run_dir, sft_model, "mode=\"sync\"", "budget.versions=4", "eval.every=0"), run_dir, 400)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lags = [r["scalars"]["staleness/lag_mean"] for r in rows if r["source"] == "learner-0"]
    assert len(lags) == 4 and all(lag == 0.0 for lag in lags), lags


def test_a_run_rewarded_by_an_llm_judge_finishes_with_the_judges_failures_counted(tmp_path, sft_model):
    """The domain's reward is the `judge` plugin against a scripted OpenAI-compatible judge over real HTTP
    (score 10 for the right answer, 0 otherwise; every 9th call hangs past the judge's timeout): the run
    trains its versions, the hung calls' groups are dropped as reward errors and counted, and the judge's
    calls, latency and timeouts are in metrics.jsonl."""
    sys.path.insert(0, str(REPO / "packages" / "rollout" / "tests"))
    from judge_server import JudgeServer

    def rule(text: str, n: int) -> str | None:
        completion, _, reference = text.partition("|")
        return None if n % 9 == 0 else f"SCORE={10 if completion.strip() == reference.strip() else 0}"

    server = JudgeServer(rule=rule, hang_s=5)
    try:
        judge = ('{ name = "judge", options = { endpoint = "' + server.endpoint
                 + '", rubric = "{completion}|{reference}", timeout_s = 1.5 } }')
        run_dir = tmp_path / "run"
        final = finish(tidal_run(run_dir, sft_model, "budget.versions=4", "eval.every=0", "workers=1",
                                 f"domains=[{{ env = {{ name = \"arithmetic\", options = {{ level = 5 }} }}, reward = {judge} }}]"),
                       run_dir, 400)
    finally:
        server.close()
    assert final["status"] == "completed" and final["versions"] == 4, final["status"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    worker = {k: v for r in rows if r["source"] == "rollout-0" for k, v in r["scalars"].items()}
    assert worker["reward/judge/calls"] >= 4 * 64 and worker["reward/judge/errors/timeout"] >= 1, worker
    assert worker["rollout/groups/dropped/reward_error"] >= 1 and worker["reward/judge/latency_ms_median"] > 0
    assert 0 < worker["rollout/reward_mean"] < 1  # right answers scored 1 by the judge, wrong ones 0


def _pids(run_dir: Path) -> dict[str, int]:
    try:
        return json.loads((run_dir / "pids.json").read_text())
    except (OSError, ValueError):
        return {}


def _learner_version(run_dir: Path) -> int:
    try:
        rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    versions = [json.loads(r)["scalars"].get("train/version", 0) for r in rows if '"learner-0"' in r]
    return int(max(versions, default=0))


class AckWatch:
    """What the buffer acknowledged, seen two ways: on the buffer's ack topic (subscribed with the driver's
    key: the run's channels are CURVE) and in each worker's own record (`rollout.acked_log` pointing at
    `logs_dir`/acked-<name>.txt). Neither alone sees everything across a kill -9: a resend answered in the
    first milliseconds of a restarted buffer can reach the worker before this subscriber has joined again,
    and a worker killed just after an ack came in may not have written it down."""

    def __init__(self, run_dir: Path, logs_dir: Path, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not (run_dir / "roles" / "buffer.json").is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        cfg = json.loads((run_dir / "roles" / "buffer.json").read_text())
        sec = ChannelSecurity.from_role_keys(run_dir / "keys", "driver", servers=["buffer"])
        self.sub = sub(cfg["publish"], topics=["ack/"], linger=0, curve=sec.client("buffer"))
        self.group_size = int(cfg.get("group_size", 8))
        self.logs_dir = logs_dir
        self.seen: set[str] = set()

    def poll(self, timeout: float) -> None:
        try:
            _, msg = self.sub.recv(timeout=timeout)
        except ChannelTimeout:
            return
        if isinstance(msg, Ack) and msg.ok and msg.kind == "group":
            # workers send each group as one message; its samples are <group id>:<index> (G of them)
            self.seen.update(m for gid in msg.ids for k in range(self.group_size) if (m := f"{gid}:{k}") not in msg.refused)
        elif isinstance(msg, Ack) and msg.ok:
            self.seen.update(msg.ids)

    def close(self) -> None:
        self.sub.close()

    def all(self) -> set[str]:
        """Every acknowledged trajectory id, from both sources."""
        acked = set(self.seen)
        for log in self.logs_dir.glob("acked-rollout-*.txt"):
            acked.update(log.read_text().split())
        print(f"acknowledgements: {len(self.seen)} seen on the ack topic, {len(acked)} with the workers' records")
        return acked


def check_exactly_once(run_dir: Path, final: dict, acked: set[str], version: int) -> None:
    """The learner trained each acknowledged trajectory at most once and no other; what it did not train
    is still in the buffer: 0 acknowledged lost, 0 trained twice."""
    progress = json.loads((run_dir / "checkpoints" / "latest" / "progress.json").read_text())
    trained = progress["trained_ids"]
    assert progress["version"] == version
    assert len(trained) == len(set(trained)), "a trajectory was trained on twice"
    assert set(trained) <= acked, f"trained on {len(set(trained) - acked)} never-acknowledged trajectories"
    left = int(final["buffer"]["depth/live_trajectories"])
    print(f"acknowledged {len(acked)}, trained {len(trained)}, still in the buffer {left}")
    assert len(acked) == len(trained) + left, "an acknowledged trajectory was lost"


def test_kill_9_of_each_role_loses_and_duplicates_nothing(tmp_path, sft_model):
    run_dir = tmp_path / "run"
    proc = tidal_run(run_dir, sft_model, "budget.versions=60", "eval.every=0", "learner.checkpoint_every=3",
                     "learner.simulate_s_per_sample=0.003",  # ~0.2 s more per step: time for three kills
                     "learner.record_trained_ids=true", "launch.heartbeat_timeout_s=30",
                     f'rollout.acked_log="{tmp_path}/acked-{{name}}.txt"')
    acks = AckWatch(run_dir, tmp_path)
    killed: list[str] = []
    learner_killed_at = -1
    plan = [(5, "rollout-1"), (15, "buffer"), (25, "learner")]  # (learner version reached, role to kill)
    last_kill = -10  # the learner version at the last kill
    try:
        deadline = time.monotonic() + 700
        while proc.poll() is None and time.monotonic() < deadline:
            acks.poll(0.2)
            # each kill once the run has moved on from the last one by 3 versions (after the buffer's, that
            # means it is back and serving), not after a wall time: on an idle machine the whole run takes
            # 20 s; the learner's one step after a checkpoint (every 3), so that it dies holding trained
            # batches it has not acknowledged yet, which it must be served again
            version = _learner_version(run_dir) if plan else -1
            if (plan and version >= max(plan[0][0], last_kill + 3)
                    and (plan[0][1] != "learner" or version % 3 == 1)):
                role = plan.pop(0)[1]
                pid = _pids(run_dir).get(role)
                if pid:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                        killed.append(role)
                        learner_killed_at = version if role == "learner" else learner_killed_at
                    except ProcessLookupError:
                        pass
                    last_kill = version
        final = finish(proc, run_dir, 60)
    finally:
        acks.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert killed == ["rollout-1", "buffer", "learner"]
    acked = acks.all()
    assert final["restarts"] == {"rollout-1": 1, "buffer": 1, "learner": 1}
    # each restart is an event row (report.png marks it) and `tidal status` shows them
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if "event/" in line]
    assert sorted(k.split("/")[2] for r in rows for k in r["scalars"] if k.startswith("event/restart/")) == \
        ["buffer", "learner", "rollout-1"]
    status = subprocess.run([sys.executable, "-m", "tidal.integration.cli", "status", str(run_dir)],
                            capture_output=True, text=True, timeout=60)
    assert f"{run_dir}: completed at version 60/60" in status.stdout, status.stdout + status.stderr
    assert "restarts    buffer 1, learner 1, rollout-1 1" in status.stdout, status.stdout
    resumed = [int(m) for m in re.findall(r"resumed from .* at step (\d+)", (run_dir / "logs" / "learner.log").read_text())]
    assert resumed and resumed[-1] < learner_killed_at, (resumed, learner_killed_at)  # steps past it were lost
    check_exactly_once(run_dir, final, acked, 60)


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.xdist_group("ray")  # one Ray cluster at a time on this machine: each starts its own head
def test_ray_launcher_runs_the_readme_command_through_uv_run(tmp_path):
    """The README's Ray command line as written, `uv run ... tidal run RECIPE launcher.name=ray`, from
    the repository root: under `uv run`, Ray's uv hook would ship the folder to workers whose fresh
    environment holds no Tidal; the launcher turns it off, and the run completes on a local head it
    starts and shuts down. pids.json names each role's node and pid."""
    pytest.importorskip("ray")
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH: this test runs the README's `uv run` command line")
    from tidal.rollout.tiny import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny", seed=0)  # what is trained does not matter here: the launch does
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_UV_RUN_RUNTIME_ENV"}  # Ray's default
    args = [uv, "run", "--locked", "--all-packages", "tidal", "run", "integration/recipes/arithmetic.toml",
            f'model="{model}"', "launcher.name=ray", "budget.versions=2", "eval.every=0", "workers=1",
            f'run_dir="{run_dir}"', "monitor.progress=log"]
    seen: dict[str, dict] = {}
    with open(tmp_path / "run.log", "w") as out:
        proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 420
        while proc.poll() is None and time.monotonic() < deadline:
            try:  # each role's entry while it runs (the file keeps only the running roles)
                seen.update(json.loads((run_dir / "pids.json").read_text()))
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # the driver stops its roles and its Ray head
            proc.wait(timeout=120)
            pytest.fail("the Ray run did not finish within 420 s:\n" + (tmp_path / "run.log").read_text()[-4000:]
                        + _role_logs(run_dir))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    log = (tmp_path / "run.log").read_text()
    assert proc.returncode == 0, log[-4000:] + _role_logs(run_dir)
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "completed" and final["versions"] == 2, final["status"]
    assert "uv run hook is off" in log
    assert set(seen) == {"buffer", "learner", "rollout-0"}, seen
    for name, where in seen.items():
        assert where["node"] and isinstance(where["pid"], int), (name, where)
    assert (run_dir / "logs" / "rollout-0.log").read_text()


@pytest.fixture
def two_nodes(monkeypatch):
    """A Ray cluster of two nodes on this machine (`ray.cluster_utils.Cluster`: a head raylet on this
    machine's address and a second raylet on 127.0.0.2, each with its own object store and workers):
    (cluster, the second node, its address)."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
    try:
        second = cluster.add_node(num_cpus=4, node_ip_address="127.0.0.2")
        yield cluster, second, "127.0.0.2"
    finally:
        cluster.shutdown()


@pytest.mark.xdist_group("ray")
def test_two_node_ray_cluster_survives_losing_a_node(tmp_path, sft_model, two_nodes):
    """A run on a Ray cluster of two nodes, with the learner's 2 ranks and the 2 rollout workers spread over
    both (`placement = "spread"`), each node's worker fetching weights from the relay on its node
    (`weights_relay`): once it has trained 9 versions, the second node is lost (every role process on it
    killed with SIGKILL, then its raylet). Its learner rank and rollout worker are placed again on the node
    left and reconnect to the same endpoints (the worker to that node's relay); the run finishes its 30
    versions with the async run's learning margin, with 0 acknowledged trajectories lost and 0 trained
    twice."""
    cluster, second, second_ip = two_nodes
    run_dir = tmp_path / "run"
    proc = tidal_run(run_dir, sft_model, "budget.versions=30", "eval.every=30", "launcher.name=ray",
                     f'launcher.options.address="{cluster.address}"', 'launcher.options.placement="spread"',
                     "launcher.options.weights_relay=true",
                     "learner.checkpoint_every=3", "learner.record_trained_ids=true", "launch.heartbeat_timeout_s=30",
                     f'rollout.acked_log="{tmp_path}/acked-{{name}}.txt"', "--nproc", "2")
    acks = AckWatch(run_dir, tmp_path, timeout=180)
    before: dict = {}
    try:
        deadline = time.monotonic() + 800
        while proc.poll() is None and time.monotonic() < deadline:
            acks.poll(0.2)
            if not before and _learner_version(run_dir) >= 9:
                before = json.loads((run_dir / "pids.json").read_text())
                lost = [pid for where in before.values()
                        for node, pid in zip(where.get("nodes", [where["node"]]), where.get("pids", [where["pid"]]), strict=True)
                        if node == second_ip]
                for pid in lost:  # the node's machine goes: its processes die with no chance to clean up
                    os.killpg(pid, signal.SIGKILL)
                cluster.remove_node(second, allow_graceful=False)
        final = finish(proc, run_dir, 60)
    finally:
        acks.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        # the lost node's relay was killed, not stopped: its socket folder is left (on a real node, in its /tmp)
        shutil.rmtree(relay_folder(run_dir).replace("{node}", second_ip), ignore_errors=True)
    assert before, "the run ended before the node could be lost"
    head_ip = before["buffer"]["node"]
    assert head_ip != second_ip
    # where the roles were: the servers on the driver's node, the rest spread over both
    assert before["learner"]["nodes"] == [head_ip, second_ip], before
    assert {before["rollout-0"]["node"], before["rollout-1"]["node"]} == {head_ip, second_ip}, before
    roles = {name: json.loads((run_dir / "roles" / f"{name}.json").read_text()) for name in ("buffer", "rollout-0")}
    assert roles["buffer"]["ingest"].startswith(f"tcp://{head_ip}:"), roles["buffer"]["ingest"]
    assert roles["rollout-0"]["controller"].startswith(f"tcp://{head_ip}:")
    after = json.loads((run_dir / "pids.json").read_text()) if (run_dir / "pids.json").is_file() else {}
    acked = acks.all()
    lost_roles = {name for name, where in before.items()
                  if second_ip in where.get("nodes", [where["node"]]) and not name.startswith("relay@")}
    assert lost_roles >= {"learner"} and len(lost_roles) == 2, lost_roles
    # (the lost node's relay may have been counted as a restart before the cluster saw its node die)
    restarts = {k: v for k, v in final["restarts"].items() if not k.startswith("relay@")}
    assert restarts == dict.fromkeys(sorted(lost_roles), 1), final["restarts"]
    driver_log = (run_dir / "logs" / "driver.log").read_text()
    assert f"rank 0 on {head_ip}, rank 1 on {head_ip}" in driver_log, driver_log[-3000:]
    # weights: each node's workers from the relay on that node, which took each version once from the learner
    assert {f"relay@{head_ip}", f"relay@{second_ip}"} <= set(before), before
    assert f"relay@{second_ip} went with its node" in driver_log
    assert roles["rollout-0"]["weights"].startswith("ipc:///tmp/tidal-relay-") and "{node}" in roles["rollout-0"]["weights"]
    relayed = (run_dir / "logs" / f"relay@{head_ip}.log").read_text()
    assert "relayed version 30:" in relayed, relayed[-2000:]
    assert "relayed version 5:" in (run_dir / "logs" / f"relay@{second_ip}.log").read_text()
    evals = final["eval"]
    start, end = evals[0][1], evals[-1][1]
    print(f"two nodes, one lost at version 9: held-out accuracy {start:.3f} -> {end:.3f}; placed {before}, end {after}")
    assert final["status"] == "completed" and [e[0] for e in evals] == [0, 30], final["status"]
    assert end >= start + 0.15, evals
    check_exactly_once(run_dir, final, acked, 30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its parent's wait() is gone for our purposes
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.parametrize("how", ["ctrl-c", "kill -9"])
def test_stopping_the_driver_leaves_no_process_behind(tmp_path, sft_model, how):
    run_dir = tmp_path / "run"
    proc = tidal_run(run_dir, sft_model, "budget.versions=1000", "eval.every=0")
    try:
        deadline = time.monotonic() + 180
        while _learner_version(run_dir) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = _pids(run_dir)
        assert set(pids) == {"buffer", "learner", "rollout-0", "rollout-1"} and all(map(_alive, pids.values()))
        if how == "ctrl-c":
            os.kill(proc.pid, signal.SIGINT)  # what a terminal sends the driver (the roles have their own session)
            assert proc.wait(timeout=120) == 1  # the run did not complete its budget
            assert json.loads((run_dir / "final.json").read_text())["status"] == "interrupted"
        else:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while any(map(_alive, pids.values())) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [name for name, pid in pids.items() if _alive(pid)]
        if left:  # where each survivor is stuck: every role dumps its threads' stacks to its log on USR1
            for name in left:
                os.kill(pids[name], signal.SIGUSR1)
            time.sleep(2)
        assert not left, f"orphaned role processes: {left}" + _role_logs(run_dir, 6000)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _pids(run_dir).values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
