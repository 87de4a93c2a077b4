"""``check_versions``: a batch scored by several reward-model versions is refused, naming them
(the Ray manager itself runs in tests/integration/reward_loop/test_manager.py)."""

from __future__ import annotations

import pytest

from weightsync.reward_loop.manager import VersionMixError, check_versions


def _out(version):
    return {"reward_score": 0.0, "reward_extra_info": {"rm_version": version}}


def test_one_version_or_none_passes():
    check_versions([_out(3), _out(3), {"reward_score": 1.0}])
    check_versions([_out(None), _out(None)])


def test_mixed_versions_are_named_unless_allowed():
    outs = [_out(3), _out(4), _out(3)]
    with pytest.raises(VersionMixError, match=r"versions \[3, 4\] \(version 3: samples \[0, 2\]; "
                                              r"version 4: samples \[1\]\)"):
        check_versions(outs)
    check_versions(outs, allow_mixed=True)
