"""How a server takes what a sender says about an update: its version and its training mode.

``UpdateControl`` hands every update's start to ``UpdatePolicy.prepare`` before the workers see
it. The Ludic reward spec's server takes both as given, and that is the default here: a forced
version is published even when it is not newer than the served one (a trainer that resumes from
an older checkpoint restarts its count; every answer still carries the version that served it),
and ``training_mode`` is information, logged with the update, never a reason to refuse it (the
engine still refuses names, shapes and dtypes the served model does not have).
``monotonic_versions`` (``--monotonic-versions``) refuses a version that is not newer (409), so
versions order the weights; ``strict_training_mode`` (``--strict-training-mode``) makes the mode
the update's name policy (``weightsync.validation.training_mode_offenders``: a head_only update
with backbone tensors, a full one with only the head: 400 naming them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from weightsync.types import TrainingMode

log = logging.getLogger("weightsync.servers.control")


@dataclass(frozen=True)
class UpdatePolicy:
    """``monotonic_versions``: an update's version must be newer than the served one (else the
    engine refuses it, 409). ``strict_training_mode``: the training mode is the update's name
    policy (else it is logged only)."""

    monotonic_versions: bool = False
    strict_training_mode: bool = False

    def prepare(self, start: Any, mode: TrainingMode | None,
                head_name_patterns: list[str] | None) -> None:
        """Set what the workers enforce on ``start`` (a ``WeightUpdateStart``): the version
        rule, and the name policy of ``mode`` (the update's mode, already resolved from the
        body, the start and the server's default) only when strict.

        Args:
            start: the update's start message; changed in place.
            mode: the update's training mode, None for no mode.
            head_name_patterns: the server's head patterns, used by a strict head_only update
                whose start names none.
        """
        start.allow_version_reset = not self.monotonic_versions
        if not self.strict_training_mode:
            start.training_mode = None
            return
        start.training_mode = mode
        if mode is not None and start.head_name_patterns is None and head_name_patterns:
            start.head_name_patterns = list(head_name_patterns)

    def mode_text(self, mode: TrainingMode | None) -> str:
        """``mode`` as the update's log line shows it."""
        name = mode.value if mode is not None else "none"
        return name if self.strict_training_mode or mode is None else f"{name} (information only)"


def server_update_policy(*, monotonic_versions: bool, allow_version_reset: bool,
                         strict_training_mode: bool, what: str) -> UpdatePolicy:
    """The policy a server's options ask for. ``allow_version_reset`` is the deprecated flag of
    the behaviour that is now the default: accepted, a warning says so; with
    ``monotonic_versions`` it contradicts it.

    Args:
        monotonic_versions: ``--monotonic-versions``.
        allow_version_reset: ``--allow-version-reset`` (deprecated, no effect).
        strict_training_mode: ``--strict-training-mode`` (or the server's fixed choice).
        what: the server, for messages.

    Returns:
        The ``UpdatePolicy`` for ``UpdateControl``.

    Raises:
        ValueError: both ``monotonic_versions`` and ``allow_version_reset``.
    """
    check_version_options(monotonic_versions=monotonic_versions,
                          allow_version_reset=allow_version_reset)
    if allow_version_reset:
        log.warning("%s: --allow-version-reset (allow_version_reset) is deprecated and has no "
                    "effect: an update's version is taken as given by default; "
                    "--monotonic-versions refuses versions that are not newer", what)
    return UpdatePolicy(monotonic_versions=monotonic_versions,
                        strict_training_mode=strict_training_mode)


def check_version_options(*, monotonic_versions: bool, allow_version_reset: bool) -> None:
    """Refuse the two version options together (a server config checks it when built).

    Args:
        monotonic_versions: ``--monotonic-versions``.
        allow_version_reset: ``--allow-version-reset`` (deprecated).

    Raises:
        ValueError: both are set.
    """
    if allow_version_reset and monotonic_versions:
        raise ValueError("allow_version_reset (--allow-version-reset) and monotonic_versions "
                         "(--monotonic-versions) contradict each other: give --monotonic-versions "
                         "alone to refuse versions that are not newer (--allow-version-reset is "
                         "deprecated: taking versions as given is the default)")
