"""Version rejection acts on exactly the right tokens of a mixed-version trajectory."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tidal.staleness.rejection import VersionRejection
from tidal.staleness.versions import lag_histogram, lag_stats


def test_lag_stats_of_a_mixed_version_trajectory():
    s = lag_stats([3, 3, 4, 5, 5], current_version=6)
    assert (s.min_lag, s.max_lag, s.mean_lag) == (1, 3, pytest.approx(2.0))
    assert lag_stats([], 6).max_lag == 0


def test_mask_mode_masks_exactly_the_stale_tokens():
    adm = VersionRejection(max_lag=2, mode="mask").admit([3, 3, 4, 5, 5], current_version=6)
    assert adm.admit and adm.token_mask == [False, False, True, True, True]
    assert adm.reason == "stale_tokens_masked"


def test_boundary_lag_equal_to_max_is_kept():
    adm = VersionRejection(max_lag=2, mode="mask").admit([4, 4, 5], current_version=6)
    assert adm.admit and adm.token_mask is None


def test_drop_mode_drops_the_whole_trajectory():
    adm = VersionRejection(max_lag=2, mode="drop").admit([3, 4, 5], current_version=6)
    assert not adm.admit and adm.reason == "stale"
    assert VersionRejection(max_lag=2, mode="drop").admit([4, 5, 6], current_version=6).admit


def test_mask_mode_drops_when_nothing_is_left():
    adm = VersionRejection(max_lag=1, mode="mask").admit([1, 2, 3], current_version=6)
    assert not adm.admit and adm.reason == "stale"


def test_versions_ahead_of_the_learner_are_refused():
    adm = VersionRejection(max_lag=10).admit([5, 7], current_version=6)
    assert not adm.admit and adm.reason == "version_ahead"


def test_numpy_arrays_and_bad_config():
    adm = VersionRejection(max_lag=0, mode="mask").admit(np.array([5, 6, 6], np.int32), 6)
    assert adm.token_mask == [False, True, True]
    with pytest.raises(ValueError, match="mode must be"):
        VersionRejection(mode="trim")
    with pytest.raises(ValueError, match="max_lag must be"):
        VersionRejection(max_lag=-1)


def test_lag_histogram_clips_into_the_last_bin():
    assert lag_histogram([0, 1, 1, 5, 40, -2], num_bins=4).tolist() == [2, 2, 0, 2]


def test_rejection_and_gate_load_without_torch():
    code = (
        "import sys; from tidal.core.plugins import Registry; r = Registry();"
        "p = r.create('admission', 'version_rejection', max_lag=1);"
        "from tidal.staleness.depth import DepthGate; g = DepthGate(max_staleness=1, batch_size=2);"
        "assert p.admit([0, 1], 1).admit and g.capacity() == 4;"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_tokens_the_policy_did_not_sample_have_no_lag():
    """Observation tokens of a multi-turn sample (NO_VERSION) never make it stale, never get masked, and
    stay out of its lag statistics; a sample whose sampled tokens are all stale is still dropped."""
    from tidal.staleness.versions import NO_VERSION, sampled

    versions = [5, 5, NO_VERSION, NO_VERSION, 6, NO_VERSION, 7]
    assert sampled(versions).tolist() == [True, True, False, False, True, False, True]
    s = lag_stats(versions, 7)
    assert (s.min_lag, s.max_lag, s.mean_lag) == (0, 2, pytest.approx(1.25))
    assert VersionRejection(max_lag=2).admit(versions, 7).admit
    masked = VersionRejection(max_lag=1, mode="mask").admit(versions, 7)
    assert masked.admit and masked.token_mask == [False, False, True, True, True, True, True]
    assert not VersionRejection(max_lag=0, mode="mask").admit([3, NO_VERSION, 3], 7).admit
