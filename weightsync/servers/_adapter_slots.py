"""Which version of a LoRA adapter a policy-server request runs on, when the server keeps
several (``serve-policy --enable-lora --adapter-slots N``, N >= 2).

Each adapter-only update of adapter ``a`` is installed in the next of ``a``'s N version slots
(vLLM adapter ids ``weightsync.lora_adapter.adapter_id(a, slot)``, in turn), never in the slot
that serves: requests in flight finish on the version they started with, new requests get the
new version as soon as it landed, and the update waits only for requests still running on the
slot it reuses (those that started N versions ago). With N = 1 (the default) the one slot is
rewritten, so the update waits for every request of ``a`` and holds new ones back meanwhile.

Two parts, on the server's event loop:

* ``SEATED``: a context variable the control plane sets when a request takes its seat at the
  update gate (``UpdateControl.serving``): ``{adapter: slot}``, the slot that seat keeps from
  being rewritten. ASGI runs the request's app in the task that took the seat, so vLLM's
  handler sees it.
* ``SlotTable``: takes the place of vLLM's table of adapter names
  (``OpenAIServingModels.lora_requests``, a dict of ``LoRARequest`` by name; ``install``):
  looking a name up answers the ``LoRARequest`` of the slot the request's seat keeps, else the
  latest published; ``/v1/models`` still lists each name once. ``publish`` makes a slot the
  latest.

Callers: ``weightsync.servers.control`` (``SEATED``), ``weightsync.servers.policy``
(``install``, ``publish``).
"""

from __future__ import annotations

import contextvars
from typing import Any

#: ``{adapter name: slot}`` of the request running in this context (None: no slot was seated)
SEATED: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar(
    "weightsync_seated_adapter_slot", default=None)


class SlotTable(dict):
    """vLLM's adapter table (name -> ``LoRARequest``) that answers a request the slot its seat
    keeps (see the module docstring). vLLM's own adapter routes keep working on it: a name they
    load or unload is an ordinary entry (an unload forgets the name's slots too)."""

    def __init__(self, items: Any = ()) -> None:
        super().__init__(items)
        self.slots: dict[str, dict[int, Any]] = {}
        self.listed: dict[str, Any] = {}  # name -> its latest LoRARequest under the name itself

    def _seated(self, name: Any) -> Any:
        seated = SEATED.get()
        if not seated or name not in seated:
            return None
        return self.slots.get(name, {}).get(seated[name])

    def __getitem__(self, name: Any) -> Any:
        request = self._seated(name)
        return request if request is not None else super().__getitem__(name)

    def get(self, name: Any, default: Any = None) -> Any:
        request = self._seated(name)
        return request if request is not None else super().get(name, default)

    def values(self) -> Any:
        """What vLLM lists (``/v1/models``): each name once, under the name itself (a slot's
        ``LoRARequest`` carries the slot's own name, ``lora_adapter.slot_lora_name``)."""
        return [self.listed.get(name, request) for name, request in self.items()]

    def __delitem__(self, name: Any) -> None:
        super().__delitem__(name)
        self.slots.pop(name, None)
        self.listed.pop(name, None)

    def pop(self, name: Any, *default: Any) -> Any:
        self.slots.pop(name, None)
        self.listed.pop(name, None)
        return super().pop(name, *default)

    def __setitem__(self, name: Any, request: Any) -> None:  # vLLM's own load route
        self.slots.pop(name, None)
        self.listed.pop(name, None)
        super().__setitem__(name, request)

    def publish(self, name: str, slot: int, request: Any, listed: Any) -> None:
        """``request`` (the ``LoRARequest`` of ``name``'s slot ``slot``) serves ``name`` from
        now on; requests seated on another slot keep theirs. ``listed``: the same under
        ``name`` itself, for ``values()``."""
        self.slots.setdefault(name, {})[slot] = request
        super().__setitem__(name, request)
        self.listed[name] = listed


def install(models: Any) -> SlotTable | None:
    """Put a ``SlotTable`` in place of ``models.lora_requests`` (vLLM's
    ``OpenAIServingModels``), keeping its entries; None when ``models`` has no such table."""
    table = getattr(models, "lora_requests", None)
    if isinstance(table, SlotTable):
        return table
    if not isinstance(table, dict):
        return None
    models.lora_requests = SlotTable(table)
    return models.lora_requests
