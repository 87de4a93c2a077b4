"""Ask a policy server one question with the `openai` client; print the answer and the weight
version that produced it (the server's `x-weight-version` header).

    python examples/chat.py                      # the server at $WEIGHTSYNC_URL (default :8000)
    python examples/chat.py "What is 2 + 2?"

Greedy decoding (temperature 0): the same weights give the same answer, so a changed answer
means changed weights. The OpenAI routes need no token (`--api-key` guards the weight routes).
"""

import os
import sys

from openai import OpenAI

URL = os.environ.get("WEIGHTSYNC_URL", "http://127.0.0.1:8000")  # a policy server

client = OpenAI(base_url=URL + "/v1", api_key="unused")
model = client.models.list().data[0].id  # the name the server serves its model under
question = " ".join(sys.argv[1:]) or "Hello! Who are you?"
raw = client.chat.completions.with_raw_response.create(
    model=model, messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0)
answer = raw.parse().choices[0].message.content
print(f"weight version {raw.headers['x-weight-version']}: {answer!r}")
