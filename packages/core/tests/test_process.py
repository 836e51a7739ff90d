"""`exit_now`: a process ends without interpreter finalization, after what it queued on closed ZeroMQ
sockets has left (bounded), and without hanging on a socket it left open."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import zmq

from tidal.core.testing import free_endpoint

CHILD = """
import sys, zmq
from tidal.core.process import exit_now
endpoint, close, flush = sys.argv[1], sys.argv[2] == "close", float(sys.argv[3])
s = zmq.Context.instance().socket(zmq.PUSH)
s.connect(endpoint)  # nobody listens yet: the message waits in the socket's queue
s.send(b"last words")
if close:
    s.close(linger=10_000)
print("sent", flush=True)
exit_now(0, zmq_flush_s=flush)
"""


def _child(endpoint: str, close: bool, flush: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", CHILD, endpoint, "close" if close else "open", str(flush)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "sent"
    return p


@pytest.fixture
def reap():
    procs: list[subprocess.Popen] = []
    yield procs.append
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def test_a_message_queued_on_a_closed_socket_leaves_before_the_process_ends(reap):
    endpoint = free_endpoint()
    p = _child(endpoint, close=True, flush=10.0)
    reap(p)
    time.sleep(0.5)  # the child is in exit_now, its message still queued
    assert p.poll() is None, "exit_now ended the process with a message still queued"
    pull = zmq.Context.instance().socket(zmq.PULL)
    try:
        pull.bind(endpoint)
        assert pull.poll(10_000), "the queued message never arrived"
        assert pull.recv() == b"last words"
    finally:
        pull.close(linger=0)
    assert p.wait(10) == 0


def test_a_socket_left_open_does_not_hold_the_process(reap):
    p = _child(free_endpoint(), close=False, flush=0.5)
    reap(p)
    t0 = time.monotonic()
    assert p.wait(10) == 0
    assert time.monotonic() - t0 < 8  # the flush gave up after its bound (0.5 s), the process ended


def test_cpu_seconds_counts_a_process_and_one_of_its_threads_and_names_one_that_is_gone():
    import threading

    from tidal.core.process import cpu_seconds

    busy_s = 0.3
    done, release = threading.Event(), threading.Event()
    tid: list[int] = []

    def spin() -> None:
        tid.append(threading.get_native_id())
        end = time.thread_time() + busy_s
        while time.thread_time() < end:
            pass
        done.set()
        release.wait(30)  # alive until read

    before = cpu_seconds()
    t = threading.Thread(target=spin)
    t.start()
    assert done.wait(30)
    spent = cpu_seconds(thread=tid[0])
    release.set()
    t.join()
    assert spent >= busy_s - 0.05  # ticks of 10 ms
    assert cpu_seconds() - before >= busy_s - 0.05  # the process counts every thread's
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(30)
    with pytest.raises(ProcessLookupError, match=f"/proc/{p.pid}/stat"):
        cpu_seconds(p.pid)
