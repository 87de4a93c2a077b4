"""Asking the reward router from a reward function or a worker: ``chat_complete`` and
``classify``.

``chat_complete(router_address, chat_complete_request)`` is what verl's reward loop offers a
custom reward function for a generative reward model: POST the request to the router's
``/v1/chat/completions`` (a judge on ``weightsync serve-policy``) and return the answer as an
``openai`` ``ChatCompletion`` (``result.choices[0].message.content``). ``classify(...)`` scores
one text with a discriminative reward model through the router's ``/classify`` (vLLM's route,
``use_activation`` false: the raw score) and returns the score and the weight version behind
it. ``parse_verdict`` turns a judge's answer into a number.

Runs on the caller's event loop (a reward-loop worker's, or the caller's own); one HTTP client
per loop. An error answer raises ``RouterRequestError`` with the status and the router's or the
server's own message (which names the server).
"""

from __future__ import annotations

import re
from typing import Any

from weightsync._runtime.http import LoopClients

_HTTP = LoopClients(timeout_s=600.0)


class RouterRequestError(RuntimeError):
    """An error answer through the reward router; ``status`` is its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _url(router_address: str, path: str) -> str:
    base = router_address if "://" in router_address else f"http://{router_address}"
    return base.rstrip("/") + path


async def post_json(router_address: str, path: str, payload: dict,
                    headers: dict[str, str] | None = None) -> tuple[dict, dict[str, str]]:
    """POST ``payload`` to ``path`` through the router; -> (JSON body, response headers)."""
    url = _url(router_address, path)
    r = await _HTTP.get().post(url, json=payload, headers=headers or {})
    if r.status_code >= 400:
        try:
            detail = r.json().get("detail", r.text)
        except ValueError:
            detail = r.text
        raise RouterRequestError(r.status_code, f"POST {url}: HTTP {r.status_code}: "
                                                f"{str(detail)[:1000]}")
    return r.json(), dict(r.headers)


async def chat_complete(router_address: str, chat_complete_request: dict) -> Any:
    """One chat completion through the router -> ``openai.types.chat.ChatCompletion`` (with
    ``weight_version`` among its extra fields when the server tags its answers)."""
    from openai.types.chat import ChatCompletion

    body, _ = await post_json(router_address, "/v1/chat/completions", chat_complete_request)
    return ChatCompletion.model_validate(body)


async def classify(router_address: str, model: str | None, text: str, *,
                   use_activation: bool = False,
                   version: int | None = None) -> tuple[float, int | None]:
    """Score ``text`` through the router's ``/classify``; -> (the last label's score, the
    weight version that produced it). ``version``: only a server at that version may answer."""
    payload: dict[str, Any] = {"input": text, "use_activation": use_activation}
    if model:
        payload["model"] = model
    headers = {"x-weight-version": str(version)} if version is not None else None
    body, got = await post_json(router_address, "/classify", payload, headers)
    served = got.get("x-weight-version")
    return float(body["data"][-1]["probs"][-1]), int(served) if served else None


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_verdict(text: str, default: float = 0.0) -> float:
    """The last number in a judge's answer (``"... Score: 7"`` -> 7.0); ``default`` when it
    holds none."""
    found = _NUMBER.findall(text or "")
    return float(found[-1]) if found else default
