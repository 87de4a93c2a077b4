import asyncio
import os

import torch
import transformers

import weightsync as ws

URL = os.environ.get("WEIGHTSYNC_URL", "http://127.0.0.1:8000")  # a policy or reward server
TOKEN = os.environ.get("WEIGHTSYNC_API_KEY")  # the server's --api-key, if it has one
CHECKPOINT = os.environ.get("WEIGHTSYNC_MODEL", "models/tiny-policy")  # what the server serves


def load_model(path):
    """The trainer's copy of the served model (the class its config names), in fp32."""
    transformers.logging.disable_progress_bar()
    config = transformers.AutoConfig.from_pretrained(path)
    model_class = getattr(transformers, config.architectures[0])
    return model_class.from_pretrained(path, dtype=torch.float32)


def train_step(model, step):
    """Stands in for your optimizer step: every weight moves (enough to change the answers)."""
    torch.manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.02)


async def main(steps=3):
    model = load_model(CHECKPOINT)
    async with ws.connect([URL], strategy="broadcast", api_key=TOKEN) as sync:
        served = (await sync.status())[0]["version"]  # go on from the version the server serves
        for step in range(served + 1, served + steps + 1):
            train_step(model, step)
            stats = await sync.push(model, version=step)
            print(f"step {step}: {stats.total_bytes / 1e6:.2f} MB in {stats.seconds:.2f} s, "
                  f"the server now serves version {stats.versions[0]}")


asyncio.run(main())
