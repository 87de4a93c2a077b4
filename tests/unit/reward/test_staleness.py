"""The policy / reward model version drift check (``weightsync.reward.staleness``): pure logic."""

from __future__ import annotations

import warnings

import pytest

from weightsync.reward.staleness import (
    DEFAULT_MAX_VERSION_GAP,
    VersionDriftWarning,
    checked_max_gap,
    version_gap,
    warn_on_drift,
)


def test_gap_is_the_widest_pair_and_unknown_without_versions():
    assert version_gap([3, 5, None], [4])[0] == 1
    assert version_gap([10], [2, 3]) == (8, 10, 2)
    assert version_gap([None], [1]) is None and version_gap([1], []) is None


def test_warns_past_the_threshold_with_what_drifted_and_what_to_do():
    assert DEFAULT_MAX_VERSION_GAP == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_on_drift([5], [4], 1) == 1  # one step of lag: fine
        assert warn_on_drift([9], [0], None) == 9  # check off
    with pytest.warns(VersionDriftWarning, match=r"reward model version 2 and policy version 6 "
                                                 r"are 4 versions apart \(max_version_gap=1\).*"
                                                 r"sync the reward model"):
        assert warn_on_drift([6], [2], 1) == 4
    with pytest.raises(ValueError, match="max_version_gap must be an int >= 0 or None"):
        checked_max_gap(-1)


def test_drift_check_warns_once_per_drift():
    from weightsync.reward.staleness import DriftCheck

    check = DriftCheck(1)
    with pytest.warns(VersionDriftWarning):
        assert check([5], [1]) == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check([6], [1]) == 5  # the same drift: quiet
        assert check([6], [6]) == 0  # back in step
    with pytest.warns(VersionDriftWarning):
        assert check([9], [6]) == 3
    with pytest.raises(ValueError, match="max_version_gap"):
        DriftCheck(True)
