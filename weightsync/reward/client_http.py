"""The reward client's HTTP calls that are more than one request: bounded retries, the poll of
the server's background tasks after a sync, and the tokenizer check.

Who calls: ``VLLMRewardClient`` (``weightsync.reward.client``), on its own event loops, with the
``httpx.AsyncClient`` of that loop. Retries are the reference client's retrying session made
explicit: a connection error (refused, reset, timed out) or a 5xx answer is retried up to
``max_retries`` times, ``backoff_s`` doubling between tries; a 4xx is the caller's fault and is
returned at once. The background-task poll is the reference's end of a sync: ``POST
/get_num_background_tasks`` until it answers 0, bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from weightsync.errors import WeightSyncError

#: Texts the tokenizer check tokenizes on both sides: words, digits, code, punctuation, accents.
TOKENIZER_PROBES = (
    "The quick brown fox jumps over the lazy dog.",
    "Q: What is 12 * 34?\nA: 408",
    "def add(a, b):\n    return a + b  # sum",
    "Naïve café, déjà vu! (1999)",
)


class TokenizerMismatchError(ValueError):
    """The trainer's tokenizer and the reward server's tokenize a probe text differently."""


async def request_with_retries(
    http: Any, method: str, url: str, *, max_retries: int, backoff_s: float, **kwargs: Any
) -> Any:
    """``http.request(method, url, **kwargs)``, retried on a connection error or a 5xx.

    Returns:
        The last response (a 5xx when every try got one).

    Raises:
        httpx.TransportError: every try failed to connect / read.
    """
    import httpx

    for attempt in range(max_retries + 1):
        try:
            r = await http.request(method, url, **kwargs)
        except httpx.TransportError:
            if attempt >= max_retries:
                raise
        else:
            if r.status_code < 500 or attempt >= max_retries:
                return r
        await asyncio.sleep(backoff_s * (2 ** attempt))
    raise AssertionError("unreachable")  # pragma: no cover


async def wait_background_tasks(
    http: Any, server_url: str, *, timeout_s: float, interval_s: float = 0.2,
    max_retries: int = 0, backoff_s: float = 0.5,
) -> int:
    """Poll ``POST /get_num_background_tasks`` until it answers 0.

    Returns:
        How many polls it took (0: the server has no such route, nothing to wait for).

    Raises:
        WeightSyncError: still busy after ``timeout_s``, or an error answer.
    """
    url = server_url + "/get_num_background_tasks"
    deadline = time.monotonic() + timeout_s
    polls = 0
    while True:
        r = await request_with_retries(http, "POST", url, max_retries=max_retries,
                                       backoff_s=backoff_s)
        if r.status_code in (404, 405):
            return polls
        polls += 1
        if r.status_code >= 400:
            raise WeightSyncError(f"{url}: HTTP {r.status_code}: {r.text[:200]}")
        n = int(r.json().get("num_background_tasks", 0))
        if n == 0:
            return polls
        if time.monotonic() > deadline:
            raise WeightSyncError(
                f"{url}: {n} background task(s) still running {timeout_s:g}s after the sync; "
                f"the server did not finish its part of the update"
            )
        await asyncio.sleep(interval_s)


async def check_tokenizer(tok: Any, http: Any, server_url: str, token_count: Any) -> Any:
    """Compare how ``tok`` and the server tokenize ``TOKENIZER_PROBES``: the server's
    ``/tokenize`` when it has one, else ``await token_count(text)`` (the count its ``/score``
    reports). A path is loaded with ``AutoTokenizer``.

    Returns:
        The tokenizer object.

    Raises:
        TokenizerMismatchError: a probe tokenizes differently, naming it and both sides.
    """
    if isinstance(tok, str):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok)
    for text in TOKENIZER_PROBES:
        mine = list(tok(text)["input_ids"])
        r = await http.post(server_url + "/tokenize", json={"prompt": text})
        if r.status_code == 200 and "tokens" in r.json():
            theirs: list[int] | int = list(r.json()["tokens"])
            same = theirs == mine
        else:  # no /tokenize: compare the count the score route reports for this text
            theirs = await token_count(text)
            same = theirs == len(mine)
        if not same:
            shown = theirs if isinstance(theirs, int) else f"{len(theirs)} tokens {theirs[:12]}"
            raise TokenizerMismatchError(
                f"tokenizer check against reward server {server_url}: probe {text!r} is "
                f"{len(mine)} tokens {mine[:12]} for the trainer's tokenizer but {shown} on "
                f"the server; give the trainer the reward model's tokenizer (or "
                f"tokenizer=None to skip the check)"
            )
    return tok
