"""On a GPU with the CUDA build of vLLM: the engine paths a CPU cannot take. Each test runs its engine
in a fresh process, as a rollout rank does, with a time limit, so a hang is a failure with its output.

- A rollout rank holds the torchrun world when it builds its engine; on CUDA vLLM would fork its
  engine core into that world and hang in a store barrier (finding 2 of issue 27), unless Molt makes
  it spawn (molt.distributed.devices.vllm_worker_start_method).
- A colocated engine (layout.colocate) sized by rollout.engine_memory_fraction sleeps while the
  trainer steps (rollout.sleep_while_training): its GPU memory comes back to the trainer, and after
  waking it generates again.

Not yet run: no GPU with the CUDA build of vLLM was at hand when they were written (tools/gpu_check.sh
runs `pytest -m gpu` on a machine with PyTorch only, where these skip).
"""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

ENGINE_SECONDS = 600  # engine start on a GPU (eager, tiny model) plus generation; a hang ends here


def cuda_vllm() -> bool:
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return current_platform.is_cuda()


needs_cuda_vllm = pytest.mark.skipif(not cuda_vllm(), reason="needs a GPU and the CUDA build of vLLM")

PREAMBLE = """
import asyncio, json, os, socket, sys
import torch
import torch.distributed as dist
from molt.agents.base import SamplingParams
from molt.config import MoltConfig
from molt.distributed.devices import apply_vllm_worker_start_method
from molt.rollout.engine import RolloutEngine

def engine_config(model_dir):
    cfg = MoltConfig(device="cuda")
    cfg.model.path = model_dir
    cfg.rollout.max_length = 256
    cfg.rollout.enforce_eager = True  # a faster start; CUDA graphs are not what these tests check
    return cfg

async def sample(engine):
    generation = await engine.generate(list(range(10, 20)), SamplingParams(max_tokens=8, seed=1))
    assert len(generation.token_ids) == len(generation.logprobs) > 0, generation
    assert all(value <= 0 for value in generation.logprobs), generation.logprobs
    return generation.token_ids
"""


def run_script(body: str, model_dir) -> dict:
    script = PREAMBLE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script, str(model_dir)], capture_output=True, text=True,
                          timeout=ENGINE_SECONDS)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_cuda_vllm
def test_an_engine_starts_in_a_process_that_holds_a_cuda_torch_distributed_world(tiny_model_dir):
    """As a rollout rank: the world (gloo + NCCL, as molt.train makes it) exists before the engine;
    with vLLM's default fork the engine core would join it and wait forever."""
    result = run_script("""
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
        apply_vllm_worker_start_method(os.environ, "cuda")

        async def main():
            engine = RolloutEngine.start(engine_config(sys.argv[1]), seed=0)
            try:
                tokens = await sample(engine)
            finally:
                engine.shutdown()
            return tokens

        tokens = asyncio.run(main())
        print(json.dumps({"tokens": tokens, "method": os.environ["VLLM_WORKER_MULTIPROC_METHOD"]}))
    """, tiny_model_dir)
    assert result["method"] == "spawn" and result["tokens"]


@needs_cuda_vllm
def test_a_colocated_engine_sleeps_frees_its_memory_and_wakes_to_generate(tiny_model_dir):
    result = run_script("""
        cfg = engine_config(sys.argv[1])
        cfg.layout.colocate = True
        cfg.rollout.engine_memory_fraction = 0.3
        cfg.rollout.sleep_while_training = True
        apply_vllm_worker_start_method(os.environ, "cuda")

        async def main():
            engine = RolloutEngine.start(cfg, seed=0)
            try:
                await sample(engine)
                awake_free = torch.cuda.mem_get_info()[0]
                await engine.sleep()
                asleep_free = torch.cuda.mem_get_info()[0]
                await engine.wake_up()
                after = await sample(engine)
            finally:
                engine.shutdown()
            return awake_free, asleep_free, torch.cuda.mem_get_info()[1], after

        awake_free, asleep_free, total, after = asyncio.run(main())
        print(json.dumps({"awake_free": awake_free, "asleep_free": asleep_free, "total": total, "after": after}))
    """, tiny_model_dir)
    # Asleep, the engine's share (0.3 of the GPU: KV cache and weights) is back, less what vLLM keeps
    # (its CUDA context and allocator slack): at least half of the share.
    assert result["asleep_free"] - result["awake_free"] > 0.15 * result["total"], result
    assert result["after"]
