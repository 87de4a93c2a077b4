import asyncio
import os

import torch
import transformers

import weightsync as ws

URL = os.environ.get("WEIGHTSYNC_URL", "http://127.0.0.1:8000")  # a policy or reward server
TOKEN = os.environ.get("WEIGHTSYNC_API_KEY")  # the server's --api-key, if it has one
CHECKPOINT = os.environ.get("WEIGHTSYNC_MODEL", "./model")  # the weights the server started from


def load_model(path):
    """The trainer's copy of the served model (the class its config names), in fp32."""
    config = transformers.AutoConfig.from_pretrained(path)
    model_class = getattr(transformers, config.architectures[0])
    return model_class.from_pretrained(path, torch_dtype=torch.float32)


def train_step(model):
    """Stands in for your optimizer step: every weight moves."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.99)


async def main(steps=3):
    model = load_model(CHECKPOINT)
    async with ws.connect([URL], strategy="broadcast", api_key=TOKEN) as sync:
        for step in range(1, steps + 1):
            train_step(model)
            stats = await sync.push(model, version=step)
            print(f"step {step}: {stats.total_bytes / 1e6:.2f} MB in {stats.seconds:.2f} s, "
                  f"the server now serves version {stats.versions[0]}")


asyncio.run(main())
