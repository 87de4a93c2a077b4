"""Exceptions with messages that say what was expected, what came, and what to do."""

from __future__ import annotations

from collections.abc import Sequence


class WeightSyncError(RuntimeError):
    """Base class for weightsync failures."""


class WeightMismatchError(WeightSyncError, ValueError):
    """Update metadata does not match the target model. Raised before any byte moves.

    ``offenders`` lists one human-readable line per offending parameter.
    """

    def __init__(self, offenders: Sequence[str], *, target: str = "target model") -> None:
        self.offenders = list(offenders)
        shown = self.offenders[:20]
        more = len(self.offenders) - len(shown)
        lines = "\n  ".join(shown) + (f"\n  ... and {more} more" if more > 0 else "")
        super().__init__(
            f"{len(self.offenders)} parameter(s) do not match the {target}; nothing was "
            f"loaded:\n  {lines}"
        )
        self.target = target

    def __reduce__(self):  # keep offenders and message intact through pickle (Ray, multiprocessing)
        return (_rebuild_mismatch, (type(self), self.offenders, self.target))


def _rebuild_mismatch(cls: type, offenders: list[str], target: str) -> WeightMismatchError:
    return cls(offenders, target=target)


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A peer did not answer within the configured timeout (it may have died)."""


class UpdateIncompleteError(WeightSyncError):
    """The engine holds a partially applied update and refuses to serve until a complete one
    lands."""


class EngineDiedError(WeightSyncError):
    """An engine (process, worker or actor) is gone. Preferred over the follow-on errors its
    death causes on the other engines (e.g. their collective failing)."""
