"""``check_rendezvous``: a broadcast ``sync_info`` whose store accepts no connection is refused
(400 naming the address) before any worker waits for it; a store that is there, and sync infos
of other kinds, let the join go ahead."""

from __future__ import annotations

import asyncio
import datetime

import pytest

from weightsync.servers.control import ServiceError, check_rendezvous
from weightsync.testing.servers import free_port


def _info(port: int, **kw) -> dict:
    return {"type": "torch_distributed", "master_addr": "127.0.0.1", "master_port": port,
            "world_size": 2, **kw}


def test_nothing_listening_is_a_400_naming_the_address():
    port = free_port()
    with pytest.raises(ServiceError) as e:
        asyncio.run(check_rendezvous(_info(port, join_timeout_s=60)))
    assert e.value.status == 400
    assert f"nothing accepts connections at 127.0.0.1:{port}" in e.value.message


def test_an_unresolvable_host_and_a_bad_field_are_400s():
    with pytest.raises(ServiceError, match="nothing accepts connections at no-such-host.invalid"):
        asyncio.run(check_rendezvous({**_info(29500), "master_addr": "no-such-host.invalid"}))
    with pytest.raises(ServiceError, match="sync_info: .*master_port"):
        asyncio.run(check_rendezvous(_info(0)))


def test_a_store_that_is_there_lets_the_join_go_ahead():
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    where = asyncio.run(check_rendezvous(_info(store.port)))
    assert where == f"joining the sender's group at 127.0.0.1:{store.port}"
    store.set("still", "usable")  # the probe's connection left the store working
    assert store.get("still") == b"usable"


def test_other_sync_infos_are_the_workers_to_check():
    assert "empty" in asyncio.run(check_rendezvous({"type": "empty"}))
