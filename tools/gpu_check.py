"""The trainer side on one GPU, with PyTorch and without vLLM (issue 27): one prepared run, under 8
minutes on one H200, that reports PASS or FAIL and its figures for each part, whatever the others do.

Parts (each in its own process, so a crash or an out-of-memory in one leaves the others' results):
- mesh: `molt.distributed.parallelize.build_trainer_mesh(device_type="cuda", timeout_seconds=...)` under
  `torchrun --standalone --nproc_per_node=1` (NCCL beside gloo, as molt.train's ranks start), then an
  all-reduce on the mesh's data-parallel group and on its FSDP mesh's group (finding 1: NCCL groups
  need ProcessGroupNCCL.Options).
- fsdp2_1b: `tools/bench/trainer.py --figures gpu_scale`: a random ~1.1B Qwen3 (hidden 2048, 16
  layers, vocab 151936, built from a transformers Qwen3Config in code, no download), FSDP2 with fp32
  master weights and bf16 compute, every block checkpointed, chunked log-probs, 4 x 4096 = 16K
  tokens in one packed micro-batch: peak memory, tokens/s and MFU against the H200's dense BF16
  peak, 989 TFLOP/s (NVIDIA's H200 datasheet: 1,979 TFLOP/s BF16 "with sparsity", half that dense).
- logprobs_fp32: `molt.trainer.logprobs.compute_chunked_logprobs` on bf16 hidden states and LM-head weight
  against float64 log_softmax of the same bf16 values (finding 11: log-probs must be float32 under
  bf16 compute); PASS when the largest |error| is at most LOGPROB_TOLERANCE. For scale it also
  reports the error of logits computed in bf16 and upcast after (what finding 11 describes).
- pytest_gpu: `pytest -m gpu` over the test files that hold gpu-marked tests, with vLLM hidden
  (`sys.modules["vllm"] = None`, so a machine with vLLM runs it as one without): tests that need
  vLLM must skip. The refit sender's gather and cast on CUDA streams with a stand-in consumer
  (finding 3) is a gpu-marked test in tests/test_weight_sync.py, run here.

Each part prints JSON lines; this script adds its status and seconds, prints every line and appends
it to OUT/results.jsonl (OUT: --out, else $OUT, else ./gpu_check_out); each part's stderr goes to
OUT/<part>.log. Exit status 0 when every part passed, 1 otherwise.

    bash tools/gpu_check.sh                 # one GPU
    bash tools/gpu_check.sh --cpu-smoke     # every part, tiny, on CPU (CI: tests/test_bench_smoke.py)
    python tools/gpu_check.py [--out DIR] [--parts mesh,fsdp2_1b,logprobs_fp32,pytest_gpu] [--cpu-smoke]
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PARTS = ("mesh", "fsdp2_1b", "logprobs_fp32", "pytest_gpu")
# Seconds each part may take on the GPU (their sum stays under 8 minutes, start-up included).
PART_LIMIT_SECONDS = {"mesh": 90, "fsdp2_1b": 210, "logprobs_fp32": 60, "pytest_gpu": 100}
TOTAL_LIMIT_SECONDS = 470
# float32 logits of bf16 inputs are off by ~1e-6 here; bf16 logits upcast after by ~1e-2 (measured
# on CPU at 256 tokens x 8192 vocab x 512 hidden), TF32 matmuls by ~1e-3.
LOGPROB_TOLERANCE = 1e-4
MESH_TIMEOUT_SECONDS = 60


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


# -- the parts, each run in its own process (--part NAME) ------------------------------------------


def run_mesh_part(cpu_smoke: bool) -> None:
    """Under torchrun: the trainer mesh on this rank's device, then an all-reduce on its groups."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO_ROOT))
    from molt.distributed.parallelize import build_trainer_mesh

    device_type = "cpu" if cpu_smoke else "cuda"
    if device_type == "cuda":  # build_trainer_mesh: a CUDA rank sets its device first
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo" if cpu_smoke else "cpu:gloo,cuda:nccl")  # as molt.train's ranks
    try:
        mesh = build_trainer_mesh(num_trainer_ranks=dist.get_world_size(), device_type=device_type,
                                  timeout_seconds=MESH_TIMEOUT_SECONDS)
        device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
        groups = {"dp_group": mesh.dp_group, "fsdp_mesh": mesh.fsdp_mesh.get_group()}
        results = {}
        for name, group in groups.items():
            value = torch.ones(4, device=device)
            dist.all_reduce(value, group=group)
            results[name] = {"sum": value.tolist()[0],
                             "backend": type(group._get_backend(device)).__name__}
        expected = float(dist.get_world_size())
        emit({"figure": "trainer_mesh", "device_type": device_type, "world_size": dist.get_world_size(),
              "mesh": str(mesh.mesh), "all_reduce": results,
              "ok": all(result["sum"] == expected for result in results.values())})
    finally:
        dist.destroy_process_group()


def run_logprobs_part(cpu_smoke: bool) -> None:
    """compute_chunked_logprobs on bf16 inputs against float64, in [chunk, vocab] pieces."""
    import torch

    sys.path.insert(0, str(REPO_ROOT))
    from molt.trainer.logprobs import compute_chunked_logprobs

    num_tokens, vocab, hidden_size, chunk = (256, 4096, 256, 64) if cpu_smoke else (4096, 151936, 2048, 1024)
    device = torch.device("cpu" if cpu_smoke else "cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator, device=device).bfloat16()
    # logits with a standard deviation of ~2, as a trained LM head's are
    weight = (torch.randn(vocab, hidden_size, generator=generator, device=device) * 2 * hidden_size ** -0.5).bfloat16()
    targets = torch.randint(0, vocab, (num_tokens,), generator=generator, device=device)
    logprobs, entropy = compute_chunked_logprobs(hidden, weight, targets, temperature=1.0, chunk_tokens=chunk,
                                                 with_entropy=True)
    errors = {"molt": 0.0, "bf16_logits_upcast": 0.0}
    entropy_error = 0.0
    for start in range(0, num_tokens, chunk):
        rows = slice(start, start + chunk)
        reference = torch.log_softmax(hidden[rows].double() @ weight.double().T, dim=-1)
        target_reference = reference.gather(-1, targets[rows, None]).squeeze(-1)
        errors["molt"] = max(errors["molt"], (logprobs[rows].double() - target_reference).abs().max().item())
        upcast = torch.log_softmax((hidden[rows] @ weight.T).double(), dim=-1).gather(-1, targets[rows, None])
        errors["bf16_logits_upcast"] = max(errors["bf16_logits_upcast"],
                                           (upcast.squeeze(-1) - target_reference).abs().max().item())
        entropy_reference = -(reference.exp() * reference).sum(-1)
        entropy_error = max(entropy_error, (entropy[rows].double() - entropy_reference).abs().max().item())
    emit({"figure": "logprobs_fp32_max_abs_error", "value": errors["molt"], "target": f"<= {LOGPROB_TOLERANCE}",
          "baseline": errors["bf16_logits_upcast"], "entropy_max_abs_error": entropy_error,
          "logprobs_dtype": str(logprobs.dtype), "tokens": num_tokens, "vocab": vocab, "hidden": hidden_size,
          "chunk_tokens": chunk, "device": device.type,
          "tf32_matmul_allowed": torch.backends.cuda.matmul.allow_tf32,
          "path": "compute_chunked_logprobs(bf16 hidden, bf16 weight) against float64 log_softmax of the same values",
          "baseline_path": "bf16 logits (hidden @ weight.T in bf16), upcast after",
          "ok": math.isfinite(errors["molt"]) and errors["molt"] <= LOGPROB_TOLERANCE})


PART_FUNCTIONS = {"mesh": run_mesh_part, "logprobs_fp32": run_logprobs_part}


# -- the driver: one process per part, its JSON lines, PASS or FAIL --------------------------------


def gpu_test_files() -> list[str]:
    """The test files that hold gpu-marked tests: `pytest -m gpu` selects nothing from the others."""
    return sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "tests").glob("test_*.py")
                  if "mark.gpu" in path.read_text())


def part_command(part: str, cpu_smoke: bool, out: Path) -> list[str]:
    smoke = ["--cpu-smoke"] if cpu_smoke else []
    if part == "mesh":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                __file__, "--part", "mesh", *smoke]
    if part == "fsdp2_1b":
        tiny = ["--gpu-device", "cpu", "--gpu-preset", "tiny", "--gpu-sequences", "2", "--gpu-sequence-tokens", "64",
                "--gpu-chunk-tokens", "32", "--gpu-warmup-steps", "1", "--gpu-steps", "1"]
        return [sys.executable, str(REPO_ROOT / "tools" / "bench" / "trainer.py"), "--figures", "gpu_scale",
                *(tiny if cpu_smoke else ["--gpu-warmup-steps", "1", "--gpu-steps", "3"])]
    if part == "pytest_gpu":
        hide_vllm = ("import sys; sys.modules['vllm'] = None; import pytest; "
                     "sys.exit(pytest.main(sys.argv[1:]))")
        return [sys.executable, "-c", hide_vllm, "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider",
                f"--junitxml={out / 'pytest_gpu.xml'}", *gpu_test_files()]
    return [sys.executable, __file__, "--part", part, *smoke]


def read_junit(path: Path) -> dict:
    """Counts from pytest's JUnit XML: tests, failures, errors, skipped."""
    import xml.etree.ElementTree as ElementTree

    if not path.is_file():
        return {}
    suite = ElementTree.parse(path).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]}


def judge(part: str, returncode: int, records: list[dict], out: Path, cpu_smoke: bool) -> tuple[bool, dict]:
    """PASS or FAIL of a finished part, and what its summary line adds."""
    if part == "pytest_gpu":
        counts = read_junit(out / "pytest_gpu.xml")
        # On a GPU the gpu tests that need no vLLM must run, not all skip; on CPU every one skips.
        ran = counts.get("tests", 0) > 0 and (cpu_smoke or counts["passed"] > 0)
        return returncode == 0 and ran, {
            "counts": counts, "files": gpu_test_files(),
            "note": "finding 3 (the refit sender's gather/cast on CUDA streams, stand-in consumer) is a gpu-marked "
                    "test in tests/test_weight_sync.py; vLLM hidden, so tests that need it must skip"}
    figures = [record for record in records if "figure" in record]
    if part == "fsdp2_1b":
        names = {record["figure"] for record in figures}
        ok = {"gpu_peak_memory_bytes", "gpu_tokens_per_second", "gpu_mfu"} <= names
        return returncode == 0 and ok and all(record.get("all_stepped") for record in figures), {}
    return returncode == 0 and bool(figures) and all(record.get("ok") for record in figures), {}


def run_part(part: str, args, deadline: float) -> bool:
    """Run one part within its limit (and the run's), record its lines and its status."""
    limit = max(1.0, min(PART_LIMIT_SECONDS[part], deadline - time.monotonic()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    with open(args.out / f"{part}.log", "w") as log:
        try:
            done = subprocess.run(part_command(part, args.cpu_smoke, args.out), cwd=REPO_ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=log, text=True, timeout=limit)
            returncode, stdout = done.returncode, done.stdout
        except subprocess.TimeoutExpired as expired:
            returncode, stdout = None, expired.stdout or ""
            stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    ok, extra = judge(part, returncode if returncode is not None else -1, records, args.out, args.cpu_smoke)
    summary = {"part": part, "status": "PASS" if ok else "FAIL", "returncode": returncode,
               "timed_out": returncode is None, "limit_seconds": round(limit),
               "seconds": round(time.monotonic() - started, 1), "log": str(args.out / f"{part}.log"), **extra}
    with open(args.out / "results.jsonl", "a") as results:
        for record in [*({"part": part, **record} for record in records), summary]:
            results.write(json.dumps(record) + "\n")
            emit(record)
    return ok


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu_check_out"),
                        help="results directory (default: $OUT, else ./gpu_check_out)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="every part tiny and on CPU (gloo): checks this script, measures nothing")
    parser.add_argument("--part", choices=sorted(PART_FUNCTIONS), help=argparse.SUPPRESS)  # one part's process
    args = parser.parse_args()
    unknown = sorted(set(args.parts.split(",")) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    return args


def main() -> int:
    args = parse_args()
    if args.part:
        PART_FUNCTIONS[args.part](args.cpu_smoke)
        return 0
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.jsonl").unlink(missing_ok=True)
    deadline = time.monotonic() + TOTAL_LIMIT_SECONDS
    statuses = {part: run_part(part, args, deadline) for part in args.parts.split(",")}
    verdict = {"gpu_check": "PASS" if all(statuses.values()) else "FAIL",
               "parts": {part: "PASS" if ok else "FAIL" for part, ok in statuses.items()},
               "cpu_smoke": args.cpu_smoke, "results": str(args.out / "results.jsonl")}
    with open(args.out / "results.jsonl", "a") as results:
        results.write(json.dumps(verdict) + "\n")
    emit(verdict)
    return 0 if all(statuses.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
