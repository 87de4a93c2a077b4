"""The child side of ``LocalEngineProcess``: builds a module and serves its endpoint.

Runs as ``python -m weightsync.local.worker FD SPEC_JSON`` (started by ``process.py``; ``FD`` is
its end of a socket pair). Builds the module from ``module_factory`` (``"pkg.mod:fn"``), a
``TorchModuleWeightLoader`` and a ``WeightUpdateEndpoint``, sends ``{"ready": true}`` and then
answers one JSON request at a time: ``{"id", "method", "kwargs"}`` -> ``{"id", "result"}`` or
``{"id", "error_type", "message"}``. Besides the endpoint's methods it serves ``ping``,
``get_version``, ``get_state``, ``get_world_size``, ``state_digest``, ``save_state_dict`` and
``stop``. It leaves with ``os._exit`` after closing its receiver: a process holding a gloo group
can hang in interpreter shutdown.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from typing import Any

from weightsync.local import _wire

log = logging.getLogger(__name__)


def resolve_factory(spec: str) -> Any:
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"module_factory must look like 'pkg.mod:fn', got {spec!r}")
    fn = importlib.import_module(module)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"module_factory {spec!r} is not callable")
    return fn


class _Service:
    def __init__(self, name: str, module: Any, world_size: int) -> None:
        from weightsync.engine import WeightUpdateEndpoint
        from weightsync.loaders.torch_module import TorchModuleWeightLoader

        self.name = name
        self.module = module
        self.world_size = world_size
        self.loader = TorchModuleWeightLoader(module=module)
        self.endpoint = WeightUpdateEndpoint(self.loader, name=name)

    async def handle(self, method: str, kwargs: dict[str, Any]) -> Any:
        local = getattr(self, f"_m_{method}", None)
        if local is not None:
            return local(**kwargs)
        result = await self.endpoint.call(method, kwargs)
        return result

    # -- extra methods ---------------------------------------------------------------------------
    def _m_ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "name": self.name}

    def _m_get_version(self) -> int:
        return self.endpoint.version

    def _m_get_world_size(self) -> int:
        return self.world_size

    def _m_get_state(self) -> dict[str, Any]:
        receiver = self.endpoint.receiver
        return {**self.endpoint.status().to_dict(), "loads": self.loader.loads,
                # which training rank's copy an every_rank IPC receiver read last
                "last_replica": getattr(receiver, "last_replica", None)}

    def _m_state_digest(self, names: list[str] | None = None) -> dict[str, dict[str, Any]]:
        from weightsync.digest import state_digest

        return state_digest(self.loader.state_dict(), names)

    def _m_save_state_dict(self, path: str) -> dict[str, Any]:
        from safetensors.torch import save_file

        sd = {n: t.detach().cpu().contiguous().clone() for n, t in self.loader.state_dict().items()}
        save_file(sd, path)
        return {"path": path, "num_tensors": len(sd)}


def run(conn: Any, spec: dict[str, Any]) -> None:
    """Process entry point (spawn target)."""
    code = 0
    try:
        code = _serve(conn, spec)
    finally:
        try:
            conn.close()
        finally:
            os._exit(code)


def _serve(conn: Any, spec: dict[str, Any]) -> int:
    name = spec["name"]
    logging.basicConfig(level=spec.get("log_level", "WARNING"))
    try:
        import torch

        if spec.get("num_threads"):
            torch.set_num_threads(int(spec["num_threads"]))
        factory = resolve_factory(spec["module_factory"])
        module = factory(**(spec.get("factory_kwargs") or {}))
        service = _Service(name, module, int(spec.get("world_size", 1)))
    except BaseException as e:
        conn.send_bytes(_wire.dumps({"ready": False, **_wire.error_payload(e)}))
        return 1
    conn.send_bytes(_wire.dumps({"ready": True, "pid": os.getpid()}))
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                raw = conn.recv_bytes()
            except (EOFError, OSError):
                return 0  # the parent went away
            msg = _wire.loads(raw)
            mid, method = msg.get("id"), msg.get("method")
            if method == "stop":
                _close(loop, service)
                conn.send_bytes(_wire.dumps({"id": mid, "result": None}))
                return 0
            try:
                result = loop.run_until_complete(service.handle(method, msg.get("kwargs") or {}))
                reply = {"id": mid, "result": result}
            except BaseException as e:  # reported to the parent, which re-raises
                log.debug("%s: %s failed: %s", name, method, e)
                reply = {"id": mid, **_wire.error_payload(e)}
            conn.send_bytes(_wire.dumps(reply))
    finally:
        loop.close()


def _close(loop: asyncio.AbstractEventLoop, service: _Service) -> None:
    try:
        loop.run_until_complete(service.endpoint.close())
    except Exception:  # pragma: no cover - best effort on the way out
        log.exception("closing the receiver failed")


def main(argv: list[str] | None = None) -> None:
    import sys
    from multiprocessing.connection import Connection

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python -m weightsync.local.worker FD SPEC_JSON")
    run(Connection(int(args[0])), _wire.loads(args[1].encode()))


if __name__ == "__main__":
    main()
