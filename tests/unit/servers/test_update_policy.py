"""``UpdatePolicy``: what the workers of a server enforce on an update's start, by default the
reward spec's rules (versions and training mode taken as given), with ``--monotonic-versions``
/ ``--strict-training-mode`` ours. The prepared start goes into a real ``WeightUpdateEndpoint``
over a real torch module, which accepts or refuses it."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

import weightsync as ws
from weightsync.engine import WeightUpdateEndpoint
from weightsync.errors import UpdateRefusedError, WeightMismatchError
from weightsync.loaders.torch_module import TorchModuleWeightLoader
from weightsync.servers._update_policy import (
    UpdatePolicy,
    check_version_options,
    server_update_policy,
)
from weightsync.types import TensorMeta, TrainingMode

HEAD_ONLY = TrainingMode.HEAD_ONLY


def endpoint(version: int = 5) -> tuple[WeightUpdateEndpoint, list[TensorMeta]]:
    module = torch.nn.ModuleDict({"backbone": torch.nn.Linear(2, 2), "score": torch.nn.Linear(2, 1)})
    manifest = [TensorMeta(n, "float32", list(t.shape)) for n, t in module.state_dict().items()]
    return WeightUpdateEndpoint(TorchModuleWeightLoader(module=module), version=version,
                                name="eng"), manifest


def start(policy: UpdatePolicy, version: int, manifest: list[TensorMeta],
          mode: TrainingMode | None, patterns: list[str] | None = None) -> ws.WeightUpdateStart:
    s = ws.WeightUpdateStart(update_id=f"u{version}", version=version, manifest=manifest)
    policy.prepare(s, mode, patterns)
    return s


def test_by_default_an_older_version_and_any_training_mode_are_taken():
    ep, manifest = endpoint(version=5)
    s = start(UpdatePolicy(), 2, manifest, HEAD_ONLY, ["score."])
    assert s.allow_version_reset and s.training_mode is None and s.head_name_patterns is None
    asyncio.run(ep.start_weight_update(s.to_dict()))  # backbone tensors in a head_only update
    assert ep.status().update.version == 2
    assert UpdatePolicy().mode_text(HEAD_ONLY) == "head_only (information only)"
    assert UpdatePolicy().mode_text(None) == "none"


def test_monotonic_versions_refuses_a_version_that_is_not_newer():
    ep, manifest = endpoint(version=5)
    policy = UpdatePolicy(monotonic_versions=True)
    for version in (2, 5):
        with pytest.raises(UpdateRefusedError, match=f"update version {version} is not newer"):
            asyncio.run(ep.start_weight_update(start(policy, version, manifest, None).to_dict()))
    assert ep.version == 5
    asyncio.run(ep.start_weight_update(start(policy, 6, manifest, None).to_dict()))


def test_strict_training_mode_is_the_updates_name_policy():
    ep, manifest = endpoint()
    policy = UpdatePolicy(strict_training_mode=True)
    s = start(policy, 6, manifest, HEAD_ONLY, ["score."])
    assert s.training_mode is HEAD_ONLY and s.head_name_patterns == ["score."]
    assert policy.mode_text(HEAD_ONLY) == "head_only"
    with pytest.raises(WeightMismatchError, match="backbone.weight: not a head parameter"):
        asyncio.run(ep.start_weight_update(s.to_dict()))
    head = [m for m in manifest if m.name.startswith("score.")]
    asyncio.run(ep.start_weight_update(start(policy, 6, head, HEAD_ONLY).to_dict()))


def test_the_deprecated_flag_is_accepted_and_warns_and_contradictions_are_named(caplog):
    with caplog.at_level(logging.WARNING, logger="weightsync.servers.control"):
        p = server_update_policy(monotonic_versions=False, allow_version_reset=True,
                                 strict_training_mode=False, what="reward server m")
    assert p == UpdatePolicy()
    assert "--allow-version-reset (allow_version_reset) is deprecated" in caplog.text
    assert server_update_policy(monotonic_versions=True, allow_version_reset=False,
                                strict_training_mode=True, what="x") == UpdatePolicy(True, True)
    with pytest.raises(ValueError, match=r"allow_version_reset \(--allow-version-reset\) and "
                                         r"monotonic_versions \(--monotonic-versions\)"):
        check_version_options(monotonic_versions=True, allow_version_reset=True)
