"""``weightsync.compat.skyrl``: skyrl-train 0.3.1's weight-sync API on weightsync.

Fast tier: SkyRL's names and signatures, its data types and error texts, its strategy choice,
chunk cutting, the IPC strategy end to end inside one process (real shared memory, the engine
side run as SkyRL's vLLM worker runs it: the request pickled, ``receive_weights`` iterated), and
``RemoteWeightLoader`` against a real HTTP server on 127.0.0.1. The broadcast and the IPC
between processes: ``tests/integration/compat/test_skyrl_processes.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import pickle

import pytest
import torch

import weightsync.compat.skyrl as sk

# skyrl-train 0.3.1's ``skyrl_train.weight_sync.__all__``, plus the helpers its trainers and
# tests import from elsewhere in skyrl-train
SKYRL_NAMES = [
    "WeightChunk", "WeightExtractor", "WeightLoader", "WeightUpdateRequest", "LoraLoadRequest",
    "BroadcastWeightUpdateRequest", "CudaIpcWeightUpdateRequest", "WeightTransferStrategy",
    "WeightTransferSender", "WeightTransferReceiver", "WeightSyncInitInfo", "BroadcastInitInfo",
    "CudaIpcInitInfo", "BroadcastTransferStrategy", "BroadcastWeightTransferSender",
    "BroadcastWeightTransferReceiver", "CudaIpcTransferStrategy", "CudaIpcWeightTransferSender",
    "CudaIpcWeightTransferReceiver", "get_transfer_strategy_cls",
    "yield_module_grouped_chunks", "RemoteWeightLoader", "get_default_config",
]


def test_every_skyrl_name_is_here_with_its_signature() -> None:
    assert sorted(sk.__all__) == sorted(SKYRL_NAMES)
    for strategy in (sk.BroadcastTransferStrategy, sk.CudaIpcTransferStrategy):
        assert issubclass(strategy, sk.WeightTransferStrategy)
        for method, params in (("create_init_info", ["cfg"]),
                               ("create_sender", ["init_info", "inference_client"]),
                               ("create_receiver", ["init_info"])):
            assert isinstance(inspect.getattr_static(strategy, method), staticmethod)
            assert list(inspect.signature(getattr(strategy, method)).parameters) == params
    assert inspect.iscoroutinefunction(sk.WeightTransferSender.send_chunks)
    assert list(inspect.signature(sk.WeightTransferSender.send_chunks).parameters) == [
        "self", "chunks"]
    assert sk.BroadcastInitInfo.strategy_type() is sk.BroadcastTransferStrategy
    assert sk.CudaIpcInitInfo.strategy_type() is sk.CudaIpcTransferStrategy


def test_weight_chunk_keeps_string_dtypes_and_counts_elements_and_bytes() -> None:
    chunk = sk.WeightChunk(names=["a.w", "a.b"], dtypes=["torch.float32", "torch.bfloat16"],
                           shapes=[[4, 3], [4]],
                           tensors=[torch.zeros(4, 3), torch.zeros(4, dtype=torch.bfloat16)])
    assert (len(chunk), chunk.total_numel, chunk.total_size_bytes) == (2, 16, 56)
    assert chunk.dtypes == ["torch.float32", "torch.bfloat16"]
    with pytest.raises(ValueError, match=r"All lists must have the same length\. Got names=2, "
                                         r"dtypes=1, shapes=2, tensors=2"):
        sk.WeightChunk(names=["a", "b"], dtypes=["torch.float32"], shapes=[[1], [1]],
                       tensors=[torch.zeros(1), torch.zeros(1)])


def test_requests_check_lengths_and_lora_requests_carry_only_a_path() -> None:
    with pytest.raises(ValueError, match="names, dtypes, shapes must have the same length"):
        sk.BroadcastWeightUpdateRequest(names=["a", "b"], dtypes=["bfloat16"], shapes=[[1]])
    req = sk.BroadcastWeightUpdateRequest(names=["a"], dtypes=["bfloat16"], shapes=[[2]])
    assert len(req) == 1 and req.transfer is None
    lora = sk.LoraLoadRequest(lora_path="/adapters/x")
    assert (lora.lora_path, lora.names, len(lora)) == ("/adapters/x", [], 0)


def test_strategy_choice_follows_backend_and_placement() -> None:
    cfg = sk.get_default_config()  # SkyRL's defaults: nccl, colocated
    assert sk.get_transfer_strategy_cls(cfg) is sk.CudaIpcTransferStrategy
    cfg.trainer.placement.colocate_all = False
    assert sk.get_transfer_strategy_cls(cfg) is sk.BroadcastTransferStrategy
    from omegaconf import OmegaConf  # a SkyRL trainer passes its DictConfig

    dict_cfg = OmegaConf.create({"generator": {"weight_sync_backend": "gloo"},
                                 "trainer": {"placement": {"colocate_all": True}}})
    assert sk.get_transfer_strategy_cls(dict_cfg) is sk.BroadcastTransferStrategy
    cfg.generator.weight_sync_backend = "mpi"
    with pytest.raises(ValueError, match="generator.weight_sync_backend"):
        sk.get_transfer_strategy_cls(cfg)


def test_broadcast_init_info_counts_every_engine_worker_and_offsets_engines() -> None:
    cfg = sk.get_default_config()
    g = cfg.generator
    g.weight_sync_backend, g.num_inference_engines = "gloo", 3
    g.inference_engine_tensor_parallel_size, g.inference_engine_pipeline_parallel_size = 2, 2
    info = sk.BroadcastTransferStrategy.create_init_info(cfg)
    assert (info.world_size, info.rank_offset, info.group_name, info.backend) == (
        13, 1, "skyrl", "gloo")
    assert 0 < info.master_port < 65536 and info.master_addr
    assert info.override_existing_receiver is False  # SkyRL's default "auto"
    assert [info.for_engine(i, 2, 2).rank_offset for i in range(3)] == [1, 5, 9]
    assert info.for_engine(2, 2, 2).master_port == info.master_port
    g.override_existing_update_group = "enable"
    ipc = sk.CudaIpcTransferStrategy.create_init_info(cfg)
    assert (ipc.model_dtype_str, ipc.override_existing_receiver) == ("bfloat16", True)
    assert ipc.for_engine(1, 2, 2) is ipc
    g.model_dtype = "bf16"
    with pytest.raises(ValueError, match="generator.model_dtype: unknown dtype 'bf16'"):
        sk.CudaIpcTransferStrategy.create_init_info(cfg)
    g.model_dtype, g.weight_sync_backend = "bfloat16", "mpi"
    with pytest.raises(ValueError, match="generator.weight_sync_backend must be 'nccl' or "):
        sk.BroadcastTransferStrategy.create_init_info(cfg)


def test_ipc_request_serializes_as_data_and_refuses_bad_bytes() -> None:
    req = sk.CudaIpcWeightUpdateRequest(
        names=["a", "b"], dtypes=["bfloat16"] * 2, shapes=[[2, 3], [5]], sizes=[6, 5],
        ipc_handles={"rank0": [{"kind": "shm", "nbytes": 32}]}, transfer={"type": "x"})
    data = req.serialize()
    marker = b"__END_OF_REQUEST__"  # SkyRL's
    assert len(data) % 4 == 0 and data.rstrip(b"\x00").endswith(marker)
    assert sk.CudaIpcWeightUpdateRequest.deserialize(data) == req
    with pytest.raises(ValueError, match="End marker not found"):
        sk.CudaIpcWeightUpdateRequest.deserialize(data.replace(marker, b""))
    with pytest.raises(ValueError, match="Failed to deserialize"):
        sk.CudaIpcWeightUpdateRequest.deserialize(b"Zm9v!" + data)  # not base64 any more
    evil = pickle.dumps(req)  # a pickle is never loaded
    with pytest.raises(ValueError, match="Failed to deserialize"):
        sk.CudaIpcWeightUpdateRequest.deserialize(evil + marker)


def test_module_chunks_group_by_module_batch_by_threshold_and_gather_lazily() -> None:
    params = {"m.l0.attn.q.weight": torch.ones(100), "m.l0.mlp.up.weight": torch.ones(100),
              "m.l0.attn.k.weight": torch.ones(100), "m.l1.attn.q.weight": torch.ones(100)}
    gathered: list[int] = []

    def gather(p: torch.Tensor) -> torch.Tensor:
        gathered.append(1)
        return p * 2

    chunks = sk.yield_module_grouped_chunks(params, torch.bfloat16, gather,
                                            lambda n, p, t: [10, 10])
    first = next(chunks)
    # the first module and the next (whose size decides that the chunk is full), as SkyRL's;
    # the third module waits
    assert len(gathered) == 3
    assert first.names == ["m.l0.attn.q.weight", "m.l0.attn.k.weight"]  # not consecutive
    assert first.dtypes == ["torch.bfloat16"] * 2 and first.shapes == [[10, 10]] * 2
    assert first.tensors[0].dtype == torch.bfloat16 and float(first.tensors[0][0]) == 2.0
    assert [c.names for c in chunks] == [["m.l0.mlp.up.weight"], ["m.l1.attn.q.weight"]]
    # bf16 modules of 400, 200 and 200 bytes: a 650-byte threshold takes the first two together
    batched = list(sk.yield_module_grouped_chunks(params, torch.bfloat16, lambda p: p,
                                                  lambda n, p, t: list(t.shape), 650 / 2**30))
    assert [len(c) for c in batched] == [3, 1]


class InProcessEngine:
    """SkyRL's engine client for one engine in this process, doing with each call what
    SkyRL's vLLM worker does: init info and requests arrive pickled, ``receive_weights`` is
    iterated to the end and the pairs loaded (here: copied)."""

    def __init__(self, model_dtype: str | None = None) -> None:
        self.receiver = None
        self.model_dtype = model_dtype
        self.loaded: dict[str, torch.Tensor] = {}
        self.requests: list = []

    async def init_weight_update_communicator(self, init_info) -> None:
        info = pickle.loads(pickle.dumps(init_info.for_engine(0, 1, 1)))
        if self.model_dtype is not None:  # an engine told another dtype than the trainer
            info = dataclasses.replace(info, model_dtype_str=self.model_dtype)
        self.receiver = info.strategy_type().create_receiver(info)

    async def update_named_weights(self, request) -> None:
        request = pickle.loads(pickle.dumps(request))
        self.requests.append(request)
        for name, tensor in self.receiver.receive_weights(request):
            self.loaded[name] = tensor.clone()


def _ipc_setup(engine: InProcessEngine, dtype: str = "bfloat16"):
    cfg = sk.get_default_config()
    cfg.generator.model_dtype = dtype
    strategy = sk.get_transfer_strategy_cls(cfg)
    info = strategy.create_init_info(cfg)
    asyncio.run(engine.init_weight_update_communicator(info))
    return strategy.create_sender(info, engine)


def test_ipc_sends_chunks_through_shared_memory_in_the_model_dtype() -> None:
    engine = InProcessEngine()
    sender = _ipc_setup(engine)
    try:
        params = {f"m.layers.{i}.mlp.{p}.weight": torch.randn(6, 4)
                  for i in range(3) for p in ("up", "down")}
        for step in range(2):  # the buffers are reused from the second update on
            params = {n: t + step for n, t in params.items()}
            chunks = sk.yield_module_grouped_chunks(params, torch.float32, lambda p: p,
                                                    lambda n, p, t: list(t.shape))
            asyncio.run(sender.send_chunks(chunks))
            assert engine.loaded.keys() == params.keys()
            for name, t in params.items():  # cast by the layer to the model's bf16
                assert torch.equal(engine.loaded[name], t.to(torch.bfloat16)), name
        req = engine.requests[-1]
        assert isinstance(req, sk.CudaIpcWeightUpdateRequest) and len(engine.requests) == 6
        assert (req.dtypes, req.sizes, list(req.ipc_handles)) == (
            ["bfloat16"] * 2, [24, 24], ["rank0"])
        assert req.ipc_handles["rank0"][0]["kind"] == "shm"
    finally:
        sender.teardown()
        engine.receiver.teardown()


def test_ipc_reshapes_to_the_declared_shape_and_names_a_wrong_one() -> None:
    engine = InProcessEngine("float32")
    sender = _ipc_setup(engine, "float32")
    try:
        t = torch.arange(12, dtype=torch.float32)
        chunk = sk.WeightChunk(names=["w"], dtypes=["torch.float32"], shapes=[[3, 4]],
                               tensors=[t])
        asyncio.run(sender.send_chunks([chunk]))
        assert torch.equal(engine.loaded["w"], t.view(3, 4))
        bad = sk.WeightChunk(names=["v"], dtypes=["torch.float32"], shapes=[[5, 4]],
                             tensors=[t])
        with pytest.raises(ValueError, match=r"'v' declares shape \[5, 4\] but its tensor "
                                             r"holds 12 elements"):
            asyncio.run(sender.send_chunks([bad]))
    finally:
        sender.teardown()
        engine.receiver.teardown()


def test_an_engine_told_another_dtype_refuses_with_skyrls_text() -> None:
    engine = InProcessEngine(model_dtype="float16")
    sender = _ipc_setup(engine, "bfloat16")
    try:
        chunk = sk.WeightChunk(names=["w"], dtypes=["torch.bfloat16"], shapes=[[2]],
                               tensors=[torch.ones(2, dtype=torch.bfloat16)])
        with pytest.raises(ValueError, match="mismatch dtype: src bfloat16, dst torch.float16"):
            asyncio.run(sender.send_chunks([chunk]))
        assert engine.loaded == {}
        with pytest.raises(ValueError, match="not made by weightsync.compat.skyrl's sender"):
            list(engine.receiver.receive_weights(sk.CudaIpcWeightUpdateRequest(
                names=["w"], dtypes=["float16"], shapes=[[2]], sizes=[2], ipc_handles={})))
    finally:
        sender.teardown()
        engine.receiver.teardown()


# --- RemoteWeightLoader against a real HTTP server -------------------------------------------


async def _with_server(run):
    """Run ``run(url, posts)`` against an aiohttp server on 127.0.0.1 that records every POST
    (route, JSON body) and answers ``{"success": true}``."""
    from aiohttp import web

    posts: list[tuple[str, object]] = []

    async def record(request: web.Request) -> web.Response:
        posts.append((request.path, await request.json() if request.can_read_body else None))
        return web.json_response({"success": True})

    app = web.Application()
    app.router.add_post("/{route}", record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await run(f"http://127.0.0.1:{port}", posts)
    finally:
        await runner.cleanup()


def test_remote_loader_posts_skyrls_routes_and_payloads() -> None:
    info = sk.BroadcastInitInfo(master_addr="10.0.0.1", master_port=29500, rank_offset=1,
                                world_size=2, group_name="g", backend="nccl",
                                model_dtype_str="bfloat16", override_existing_receiver=True)
    req = sk.BroadcastWeightUpdateRequest(names=["w"], dtypes=["bfloat16"], shapes=[[4, 4]])

    async def run(url, posts):
        vllm, sglang = sk.RemoteWeightLoader(url, "vllm"), sk.RemoteWeightLoader(url, "sglang")
        answers = [await vllm.init_communicator(info), await vllm.load_weights(req),
                   await vllm.destroy_group(), await sglang.init_communicator(info),
                   await sglang.load_weights(req)]
        return answers, posts

    answers, posts = asyncio.run(_with_server(run))
    assert answers == [{"success": True}] * 5
    assert posts == [
        ("/init_weight_update_communicator", dataclasses.asdict(info)),
        ("/update_weights", {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[4, 4]],
                             "transfer": None}),
        ("/destroy_weights_update_group", None),
        ("/init_weights_update_group", {"master_address": "10.0.0.1", "master_port": 29500,
                                        "rank_offset": 1, "world_size": 2, "group_name": "g",
                                        "backend": "nccl"}),
        ("/update_weights_from_distributed", {"name": "w", "dtype": "bfloat16",
                                              "shape": [4, 4]}),
    ]


def test_remote_loader_refuses_ipc_and_unknown_backends_before_posting() -> None:
    ipc = sk.CudaIpcInitInfo(model_dtype_str="bfloat16", override_existing_receiver=False)
    req = sk.BroadcastWeightUpdateRequest(names=["w"], dtypes=["bfloat16"], shapes=[[1]])

    async def run(url, posts):
        with pytest.raises(ValueError, match="only support BroadcastTransferStrategy, got: "
                                             "CudaIpcTransferStrategy"):
            await sk.RemoteWeightLoader(url, "vllm").init_communicator(ipc)
        with pytest.raises(ValueError, match="Invalid engine backend: trt"):
            await sk.RemoteWeightLoader(url, "trt").load_weights(req)
        return posts

    assert asyncio.run(_with_server(run)) == []
