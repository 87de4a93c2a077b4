"""What ``VLLMChatClient.complete`` takes and returns, and the ``ChatClient`` protocol (plain
data, no heavy imports)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(kw_only=True)
class ChatCompletionRequest:
    """One chat completion (``messages``) or one text completion (``prompt``: the legacy
    ``/v1/completions`` route, which also takes token ids).

    ``model``: None asks the server for its model. ``sampling``: OpenAI sampling arguments
    (``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, ...). ``return_token_ids``:
    vLLM's extension (prompt and completion token ids in the answer). ``logprobs``: the chosen
    tokens' logprobs (with this many alternatives). ``extra_body``: any other vLLM extension
    (``prompt_logprobs``, ``ignore_eos``, ``repetition_penalty``, ...), sent as given.
    """

    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    model: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    return_token_ids: bool = False
    logprobs: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("ChatCompletionRequest: give exactly one of messages (chat) or "
                             "prompt (text completion)")
        if self.messages is not None and not (
            isinstance(self.messages, list) and all(isinstance(m, dict) for m in self.messages)
        ):
            raise ValueError("messages: a list of {'role', 'content'} dicts")


@dataclass
class ChatResponse:
    """The first choice of an answer. ``weight_version``: the policy version whose weights
    produced every token of it (the server's ``x-weight-version``)."""

    text: str
    finish_reason: str | None
    completion_token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    weight_version: int | None = None


@runtime_checkable
class ChatClient(Protocol):
    """The reference's inference client (structural: implement it without subclassing):
    ``complete`` is async and returns ``(ChatResponse, info)``; ``sync_weights`` blocks until
    the server serves the pushed weights and returns the version as a string.
    ``VLLMChatClient`` implements it, and so does ``VLLMRewardClient`` (whose ``complete``
    refuses: a reward model does not generate)."""

    async def complete(self, request: ChatCompletionRequest) -> tuple[ChatResponse, dict[str, Any]]: ...

    def sync_weights(
        self, params: Mapping[str, Any], *, timeout_s: float = 600.0, version: int | None = None,
    ) -> str: ...
