"""One clients layer: how the sending process reaches its engines.

``Channel`` (``channel.py``) calls one endpoint method on one engine; ``FanOutClient``
(``fanout.py``) is the one ``InferenceEngineClient`` the senders use, over any number of
channels, with one error policy. The channels: ``EndpointChannel`` (in this process),
``LocalChannel`` (``local_process.py``), ``RayChannel`` (``ray_actor.py``), ``HttpChannel``
(``http_control.py``), ``VLLMChannel`` (``vllm_engine.py``), ``VLLMNativeChannel``
(``vllm_native.py``: an engine through vLLM's own weight-transfer API); ``as_channel`` picks
one for an object. Importing this package imports no heavy dependency (httpx, Ray and vLLM load where they
are used).
"""

from weightsync.clients.channel import (
    ADAPTERS,
    Channel,
    ChannelAdapter,
    EndpointChannel,
    as_channel,
    register_channel_adapter,
)
from weightsync.clients.fanout import FanOutClient
from weightsync.clients.http_control import HttpChannel
from weightsync.clients.local_process import LocalChannel
from weightsync.clients.policy import gather
from weightsync.clients.ray_actor import RayChannel, actor_label
from weightsync.clients.vllm_engine import VLLMChannel
from weightsync.clients.vllm_native import VLLMNativeChannel

__all__ = [
    "ADAPTERS", "Channel", "ChannelAdapter", "EndpointChannel", "FanOutClient", "HttpChannel",
    "LocalChannel", "RayChannel", "VLLMChannel", "VLLMNativeChannel", "actor_label", "as_channel", "gather",
    "register_channel_adapter",
]
