"""How `tidal run` shares this machine's cores among its roles."""

from tidal.integration.run import share_threads


def test_cores_are_shared_by_load_and_never_oversubscribed():
    assert share_threads(2, workers=2) == (1, 1)  # the 2-core demo machine: one each, no more
    assert share_threads(16, workers=2) == (8, 4)  # half to the learner, the rest split over workers
    assert share_threads(16, workers=2, learner_ranks=2) == (4, 4)
    assert share_threads(1, workers=3) == (1, 1)  # at least one thread, whatever the machine
    assert share_threads(16, workers=2, fixed=3) == (3, 3)  # launch.threads set: every role gets it
    for cores in (8, 32, 64):  # (with more workers than cores, each still gets one)
        learner, worker = share_threads(cores, workers=3)
        assert learner + 3 * worker <= cores
