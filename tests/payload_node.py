"""A second node for the payload tests, in its own process (tests/test_payloads.py).

    python tests/payload_node.py serve NODE SPILL_DIR BUDGET_BYTES
        A PayloadStore with node id NODE. Reads JSON commands from stdin, one a line, answers each
        with one JSON line: {"offload": SEED, "scale": N} -> the reference's dict; {"metrics": 1}
        -> the store's metrics; {"quit": 1} -> closes the store and exits.
    python tests/payload_node.py consume NODE REF_JSON
        A consumer with node id NODE reloading the reference (consume=False) over and over;
        prints "started" after the first reload. The tests kill it mid-transfer.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from molt.transport.payloads import PayloadClient, PayloadRef, PayloadStore  # noqa: E402


def make_tensors(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    """One payload of every field kind, sized by `scale`; equal for equal arguments everywhere."""
    generator = torch.Generator().manual_seed(seed)
    tokens = 64 * scale
    floats = torch.randn(tokens, generator=generator)
    floats[:3] = torch.tensor([float("nan"), float("inf"), -0.0])  # bit patterns must survive too
    return {
        "token_ids": torch.randint(0, 2**31 - 1, (tokens,), generator=generator, dtype=torch.int32),
        "action_mask": (torch.rand(tokens, generator=generator) < 0.5).to(torch.uint8),
        "behavior_logprobs": floats,
        "policy_versions": torch.randint(-1, 9, (tokens,), generator=generator, dtype=torch.int64),
        "routed_experts": torch.randint(-1, 64, (tokens, 2, 4), generator=generator, dtype=torch.int16),
        "pixel_values": torch.randn(3, 8 * scale, generator=generator).to(torch.bfloat16),
        "image": torch.randint(0, 256, (16 * scale, 12, 3), generator=generator, dtype=torch.uint8),
        "is_last": torch.tensor(True),
        "empty": torch.zeros(0, 5, dtype=torch.float64),
    }


def serve(node: str, spill_dir: str, budget_bytes: int) -> None:
    store = PayloadStore(node, budget_bytes=budget_bytes, spill_dir=spill_dir)
    print(json.dumps({"prefix": store.prefix, "address": store.address}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if "offload" in command:
            ref = store.offload(make_tensors(command["offload"], command.get("scale", 1)))
            print(json.dumps(ref.to_dict()), flush=True)
        elif "metrics" in command:
            print(json.dumps(store.metrics()), flush=True)
        else:
            break
    store.close()


def consume(node: str, ref_json: str) -> None:
    client = PayloadClient(node)
    ref = PayloadRef.from_dict(json.loads(ref_json))
    client.reload(ref, consume=False)
    print("started", flush=True)
    while True:
        client.reload(ref, consume=False)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        consume(sys.argv[2], sys.argv[3])
