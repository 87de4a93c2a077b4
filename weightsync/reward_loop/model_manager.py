"""``RewardModelManager``: the reward servers of a reward loop, behind one router.

verl's ``RewardModelManager(config, resource_pool)`` launches reward-model servers on the pool
and puts a router in front of them; so does this one. With a ``resource_pool`` (verl's
``RayResourcePool``, a Ray placement group or a list of them) it starts one server per
``rollout.tensor_model_parallel_size`` bundles (``weightsync serve-reward``, or
``serve-policy`` for a judge), each owned by a Ray actor on the node of its first bundle
(``launch``: verl's placement), waits for their health, and stops them at ``shutdown()``;
a killed actor or driver takes its server down with it. Without a pool the servers are ones
started beside the trainer and listed as ``reward_model.server_urls``. Either way the manager
puts a ``RewardRouter`` in front of them, on a thread of this process, and hands its address
to the reward-loop workers (``get_router_address()``, ``host:port``).

What it does besides routing:

- ``push(weights, version=None)``: one update to **every** server in one ``weightsync.connect``
  fan-out (so they serve the same version: the router refuses a mix); ``version`` None takes
  the highest version any server serves plus one. The session is kept for the next push (a
  push that fails closes it: the next one connects afresh; a push refused because another
  sender took a server's receivers meanwhile is made again at once on a fresh session).
- ``sleep(level)`` / ``wake_up()``: colocate mode (``reward_model.rollout.free_cache_engine``):
  every server's vLLM sleep mode through its control plane (``POST /sleep``, ``/wake_up``); a
  server that cannot sleep (vLLM's sleep mode needs CUDA or ROCm) answers 501 and the error
  names it.
- ``versions()``, ``stats()`` (the router's view), ``kind`` (``"discriminative"`` when every
  server is a reward server, ``"generative"`` when every one is a policy server).

Runs in the driver (the process that holds ``RewardLoopManager``); thread-safe for its blocking
methods. ``shutdown()`` stops the router, closes the push session and stops the servers it
launched.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from weightsync._runtime.threads import LoopThread
from weightsync.reward_loop.router import RewardRouter, RouterConfig


class RewardModelManager:
    def __init__(self, config: Any, resource_pool: Any = None, *,
                 server_urls: list[str] | None = None, api_key: str | None = None) -> None:
        """Args:
            config: the ``reward_model`` section (a mapping, ``DictConfig`` or
                ``RewardModelSection``) or the whole reward-loop config.
            resource_pool: where to launch the servers (verl's ``RayResourcePool``, a Ray
                ``PlacementGroup`` or a list of them; ``ray.init`` first); None: use
                ``server_urls``.
            server_urls: replaces ``reward_model.server_urls``.
            api_key: the servers' control-plane token (pushes, sleep / wake); launched
                servers get this one, or a random one when None.

        Raises:
            ValueError: no servers (neither a pool nor URLs), or both.
        """
        import secrets

        from weightsync.reward_loop.config import RewardLoopConfig, RewardModelSection

        if not isinstance(config, RewardModelSection):
            from weightsync.config import to_plain

            data = to_plain(config)
            if "reward_model" not in data:
                data = {"reward_model": data}
            config = RewardLoopConfig.from_any(data).reward_model
        self.config: RewardModelSection = config
        self.resource_pool = resource_pool
        urls = list(server_urls or config.server_urls)
        if resource_pool is not None and urls:
            raise ValueError("reward_model.server_urls: give either a resource pool (the "
                             "manager launches the servers) or server URLs, not both")
        if resource_pool is None and not urls:
            raise ValueError("reward_model.server_urls: no reward server given; pass a resource "
                             "pool (RewardModelManager(config, resource_pool)) or start each "
                             "with `weightsync serve-reward --model DIR` (a judge: `weightsync "
                             "serve-policy`) and list their URLs")
        self.launched: Any = None
        self._thread = LoopThread("weightsync-reward-router")
        self._session: Any = None
        try:
            if resource_pool is not None:
                from weightsync.reward_loop.launch import launch_servers

                api_key = api_key or secrets.token_hex(16)
                self.launched = launch_servers(config, resource_pool, api_key=api_key)
                urls = self.launched.urls
            self.server_urls = [u.rstrip("/") for u in urls]
            self.api_key = api_key
            router_cfg = config.router if isinstance(config.router, RouterConfig) else \
                RouterConfig(**dict(config.router))
            self.router = RewardRouter(self.server_urls, router_cfg)
            self._thread.run(self.router.start())
            if config.rollout.free_cache_engine:
                self.sleep()
        except BaseException:
            self.shutdown()
            raise

    # -- what the loop asks ------------------------------------------------------------------
    def get_router_address(self) -> str:
        return self.router.address

    @property
    def kind(self) -> str:
        kinds = {s.kind for s in self.router.servers}
        if kinds == {"reward"}:
            return "discriminative"
        if kinds == {"generative"}:
            return "generative"
        return "mixed"

    def versions(self, refresh: bool = True) -> dict[str, int | None]:
        if refresh:
            return self._thread.run(self.router.refresh())
        return self.router.versions()

    def stats(self) -> dict[str, dict[str, Any]]:
        return self.router.stats()

    # -- weights ---------------------------------------------------------------------------
    def push(self, weights: Any, *, version: int | None = None, strategy: Any = None,
             **push_kwargs: Any) -> Any:
        """One update of ``weights`` (a model or a state dict) to every server; -> the
        ``SyncStats``. ``strategy``: any the front door takes (default: a gloo / NCCL
        broadcast chosen by the tensors' device); used for the first push, kept after."""
        return self._thread.run(self._push(weights, version, strategy, push_kwargs))

    async def _push(self, weights: Any, version: int | None, strategy: Any,
                    push_kwargs: dict) -> Any:
        from weightsync.errors import CommunicatorReplacedError

        if version is None:
            current = [v for v in (await self.router.refresh()).values() if v is not None]
            version = max(current, default=0) + 1
        try:
            try:
                return await self._push_once(weights, version, strategy, push_kwargs)
            except CommunicatorReplacedError:
                # another sender took a server's receivers since the last push: refused at the
                # start, nothing moved; connect afresh once
                return await self._push_once(weights, version, strategy, push_kwargs)
        finally:
            await self.router.refresh()

    async def _push_once(self, weights: Any, version: int, strategy: Any,
                         push_kwargs: dict) -> Any:
        import weightsync as ws

        if self._session is None:
            self._session = await ws.connect(self.server_urls, strategy=strategy or "broadcast",
                                             api_key=self.api_key)
        try:
            return await self._session.push(weights, version=version, **push_kwargs)
        except BaseException:
            # the session may be unusable (a server lost its receivers, a transport broke):
            # the next push connects afresh
            session, self._session = self._session, None
            with contextlib.suppress(Exception):
                await session.close()
            raise

    # -- colocate mode: sleep and wake -----------------------------------------------------------
    def sleep(self, level: int | None = None) -> list[dict]:
        """Put every server to sleep (vLLM sleep mode ``level``, default
        ``reward_model.rollout.sleep_level``); -> each server's answer."""
        level = self.config.rollout.sleep_level if level is None else level
        return self._thread.run(self._all("/sleep", {"level": int(level)}))

    def wake_up(self) -> list[dict]:
        """Wake every server (weights and KV cache); -> each server's answer (wake seconds)."""
        return self._thread.run(self._all("/wake_up", {}))

    async def _all(self, path: str, body: dict) -> list[dict]:
        from weightsync._runtime.http import error_from_response

        http = self.router.http
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        answers = await asyncio.gather(
            *(http.post(u + path, json=body, headers=headers, timeout=600.0)
              for u in self.server_urls), return_exceptions=True)
        failed, out = [], []
        for url, r in zip(self.server_urls, answers, strict=True):
            if isinstance(r, BaseException):
                failed.append(f"{url}: {type(r).__name__}: {r}")
            elif r.status_code >= 400:
                failed.append(f"{url}: {error_from_response(url + path, r)}")
            else:
                out.append({"server": url, **r.json()})
        if failed:
            raise RuntimeError(f"POST {path} failed on {len(failed)} of "
                               f"{len(self.server_urls)} reward server(s): " + "; ".join(failed))
        return out

    def shutdown(self) -> None:
        """Stop the router, close the push session, stop the servers launched here.
        Idempotent."""
        try:
            if self._thread.started:
                async def _stop() -> None:
                    if self._session is not None:
                        await self._session.close()
                        self._session = None
                    await self.router.stop()

                try:
                    self._thread.run(_stop())
                finally:
                    self._thread.close()
        finally:
            self._stop_launched()

    def _stop_launched(self) -> None:
        launched, self.launched = self.launched, None
        if launched is not None:
            launched.shutdown()

    def __enter__(self) -> RewardModelManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
