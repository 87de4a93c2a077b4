"""``RewardModelManager``: the reward servers of a reward loop, behind one router.

verl's ``RewardModelManager`` launches reward-model servers and a router in front of them. Here
the servers are ``weightsync serve-reward`` (discriminative) or ``weightsync serve-policy`` (a
generative judge) processes started beside the trainer (one per GPU, or colocated), given as
``reward_model.server_urls``; the manager puts a ``RewardRouter`` in front of them, on a thread
of this process, and hands its address to the reward-loop workers
(``get_router_address()``, ``host:port``).

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
methods. ``shutdown()`` stops the router and closes the push session.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from weightsync._runtime.threads import LoopThread
from weightsync.reward_loop.router import RewardRouter, RouterConfig


class RewardModelManager:
    def __init__(self, config: Any, server_urls: list[str] | None = None, *,
                 api_key: str | None = None) -> None:
        """``config``: the ``reward_model`` section (a mapping, ``DictConfig`` or
        ``RewardModelSection``) or the whole reward-loop config; ``server_urls`` replaces
        ``reward_model.server_urls``; ``api_key``: the servers' control-plane token (pushes,
        sleep / wake)."""
        from weightsync.reward_loop.config import RewardLoopConfig, RewardModelSection

        if not isinstance(config, RewardModelSection):
            from weightsync.config import to_plain

            data = to_plain(config)
            if "reward_model" not in data:
                data = {"reward_model": data}
            config = RewardLoopConfig.from_any(data).reward_model
        self.config: RewardModelSection = config
        urls = list(server_urls or config.server_urls)
        if not urls:
            raise ValueError("reward_model.server_urls: no reward server given; start each with "
                             "`weightsync serve-reward --model DIR` (a judge: `weightsync "
                             "serve-policy`) and list their URLs")
        self.server_urls = [u.rstrip("/") for u in urls]
        self.api_key = api_key
        self._thread = LoopThread("weightsync-reward-router")
        router_cfg = config.router if isinstance(config.router, RouterConfig) else RouterConfig(
            **dict(config.router))
        self.router = RewardRouter(self.server_urls, router_cfg)
        self._session: Any = None
        self._thread.run(self.router.start())
        if config.rollout.free_cache_engine:
            self.sleep()

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
        if not self._thread.started:
            return

        async def _stop() -> None:
            if self._session is not None:
                await self._session.close()
                self._session = None
            await self.router.stop()

        self._thread.run(_stop())
        self._thread.close()

    def __enter__(self) -> RewardModelManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
