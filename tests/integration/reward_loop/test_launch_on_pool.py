"""verl's call, ``RewardLoopManager(config, rm_resource_pool=pool)``, on a simulated two-node Ray
cluster (``ray.cluster_utils.Cluster``; each node has one CPU and a resource of its own, and the
pool's two placement groups each ask for one node's resource): the manager launches one real
``weightsync serve-reward`` per bundle, each on its bundle's node, scores a batch through the
router over both (equal to transformers), and leaves nothing running: a server whose actor is
killed outright (``ray.kill``: SIGKILL, as when the driver dies) is taken down by its guard, the
others by ``shutdown()``; every server process is gone and every port closed."""

from __future__ import annotations

import socket
import time

import psutil
import pytest
import torch

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NODES = ("rm_node_a", "rm_node_b")
PROMPTS = ["Tom has 3 apples and buys 4 more. How many?", "What is 6 times 7?"]
RESPONSES = ["He has 3 + 4 = 7 apples.\n#### 7", "6 * 7 = 42, so #### 41"]
TRUTHS = ["7", "42"]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {NODES[0]: 1}, "object_store_memory": 80 << 20,
        "include_dashboard": False})
    c.add_node(num_cpus=1, resources={NODES[1]: 1}, object_store_memory=80 << 20)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False, configure_logging=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _node_of(resource: str) -> str:
    (node,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
    return node


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _port_closed(url: str) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return True
    return False


def _wait(predicate, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return predicate()


def _scores_by_transformers(model_dir: str) -> list[float]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    texts = [f"user: {p}\nassistant: {r}\n" for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir,
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(model(**tok(t, return_tensors="pt")).logits[0, 0]) for t in texts]


def test_manager_launches_servers_on_the_pool_scores_and_stops_them(
        cluster, tiny_reward_model_dir, tiny_policy_model_dir):
    from ray.util.placement_group import placement_group, remove_placement_group
    from transformers import AutoTokenizer

    from weightsync.reward_loop import RewardLoopManager
    from weightsync.reward_loop.data import RewardBatch

    # verl's RayResourcePool makes one placement group per node; here each is pinned to a node
    pool = [placement_group([{"CPU": 0.5, res: 1}], strategy="STRICT_PACK") for res in NODES]
    config = {
        "actor_rollout_ref": {"model": {"path": tiny_policy_model_dir}},
        "reward_model": {
            "enable": True, "num_workers": 2, "model": {"path": tiny_reward_model_dir},
            "rollout": {"dtype": "float32", "max_model_len": 256, "start_timeout_s": 400,
                        "server_args": ["--kv-cache-memory-bytes", str(64 << 20)]},
        },
    }
    manager = RewardLoopManager(config, rm_resource_pool=pool)
    try:
        launched = manager.reward_model_manager.launched
        infos = list(launched.infos)
        # one server per bundle, each on the node of its bundle
        assert [i["node_id"] for i in infos] == [_node_of(res) for res in NODES]
        assert all(not _port_closed(i["url"]) for i in infos)

        batch = RewardBatch.from_texts(AutoTokenizer.from_pretrained(tiny_policy_model_dir),
                                       PROMPTS * 2, RESPONSES * 2, data_sources="openai/gsm8k",
                                       ground_truths=TRUTHS * 2)
        out = manager.compute_scores(batch)
        want = _scores_by_transformers(tiny_reward_model_dir) * 2
        assert [o["reward_score"] for o in out] == pytest.approx(want, abs=1e-4)
        served = {url: s["served"] for url, s in manager.reward_model_manager.stats().items()}
        assert set(served) == {i["url"] for i in infos}
        assert all(n > 0 for n in served.values()), served  # the router used both servers

        # replica 1's actor dies outright (what the driver's death does to it): its guard
        # takes the server's whole process group down
        victim = infos[1]
        server_group = [p.pid for p in psutil.Process(victim["pid"]).children(recursive=True)]
        ray.kill(launched.actors[1], no_restart=True)
        assert _wait(lambda: _gone(victim["pid"]) and _port_closed(victim["url"])), victim
        assert _wait(lambda: all(_gone(p) for p in [*server_group, victim["guard_pid"]]))
    finally:
        manager.shutdown()
    for info in infos:
        assert _wait(lambda info=info: _gone(info["pid"]) and _gone(info["guard_pid"])), info
        assert _port_closed(info["url"]), info
    for pg in pool:
        remove_placement_group(pg)
