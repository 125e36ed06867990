"""Benchmark the trainer side, one figure per function (selected with --figures).

One run prints one JSON line per selected figure, then the command that produced them:
- loss_head_peak_memory_bytes (--figures loss_head): peak memory of the loss head, forward and
  backward of log-probs plus entropy (their sum is the loss), from final hidden states through the
  LM head: `compute_chunked_logprobs`, against the full-logits computation (hidden @ W.T, upcast,
  / temperature, gather - logsumexp, entropy from softmax) on the same float32 inputs (target
  ratio <= 0.2). Also reports each variant's median seconds (the chunked path recomputes logits).

CPU has no allocator statistics, so each variant runs in a fresh child process (this file with
--measure VARIANT): it allocates the inputs, takes its resident set size as the baseline, resets
the kernel's high-water mark, runs forward + backward and reports VmHWM - baseline. Variants
alternate, --repeats times each, and the medians are reported.

    python tools/bench/trainer.py [--figures loss_head] [--tokens 8192] [--vocab 32768]
                                  [--hidden 1024] [--chunk-tokens 1024] [--repeats 3]
"""

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # run from anywhere without installing molt

from molt.logprobs import compute_chunked_logprobs  # noqa: E402

KIB = 1024
MAX_THREADS = 2  # the bench machine's CPUs are shared with other workers


# -- loss head ----------------------------------------------------------------------------------


def full_loss_head(hidden: Tensor, weight: Tensor, targets: Tensor, args) -> tuple[Tensor, Tensor]:
    """Log-probs and entropy through whole [tokens, vocab] logits, as autograd would keep them."""
    logits = (hidden @ weight.T).float() / args.temperature  # [tokens, vocab]
    logsumexp = logits.logsumexp(-1)  # [tokens]
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logsumexp
    entropy = logsumexp - (logits.softmax(-1) * logits).sum(-1)
    return logprobs, entropy


def chunked_loss_head(hidden: Tensor, weight: Tensor, targets: Tensor, args) -> tuple[Tensor, Tensor]:
    return compute_chunked_logprobs(hidden, weight, targets, temperature=args.temperature,
                                    chunk_tokens=args.chunk_tokens, with_entropy=True)


LOSS_HEADS: dict[str, Callable] = {"chunked": chunked_loss_head, "full": full_loss_head}


def build_loss_head_inputs(num_tokens: int, vocab: int, hidden_size: int) -> tuple[Tensor, Tensor, Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=generator).mul_(hidden_size ** -0.5).requires_grad_()
    return hidden, weight, torch.randint(0, vocab, (num_tokens,), generator=generator)


def run_loss_head(variant: str, inputs: tuple[Tensor, Tensor, Tensor], args) -> float:
    """Seconds of one forward + backward of sum(log-probs) + sum(entropy)."""
    start = time.perf_counter()
    logprobs, entropy = LOSS_HEADS[variant](*inputs, args)
    (logprobs.sum() + entropy.sum()).backward()
    return time.perf_counter() - start


def read_status_kib(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS: resident now, VmHWM: its high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line; this benchmark needs Linux")


def measure_loss_head(args) -> None:
    """Child process: peak resident bytes above the inputs during one forward + backward."""
    torch.set_num_threads(min(MAX_THREADS, torch.get_num_threads()))
    # Warm-up on small inputs first, so library and thread-pool start-up is in the baseline.
    run_loss_head(args.measure, build_loss_head_inputs(16, 64, 16), args)
    inputs = build_loss_head_inputs(args.tokens, args.vocab, args.hidden)
    baseline_kib = read_status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    seconds = run_loss_head(args.measure, inputs, args)
    peak_kib = read_status_kib("VmHWM")
    print(json.dumps({"peak_bytes": (peak_kib - baseline_kib) * KIB, "seconds": seconds}), flush=True)


def measure_in_child(variant: str, args) -> dict:
    command = [sys.executable, __file__, "--measure", variant, "--tokens", str(args.tokens),
               "--vocab", str(args.vocab), "--hidden", str(args.hidden),
               "--chunk-tokens", str(args.chunk_tokens), "--temperature", str(args.temperature)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"--measure {variant} exited with {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def loss_head_figure(args) -> dict:
    runs: dict[str, list[dict]] = {"chunked": [], "full": []}
    for _ in range(args.repeats):  # alternate, so load from other processes hits both alike
        for variant in runs:
            runs[variant].append(measure_in_child(variant, args))
    peak = {variant: int(statistics.median(run["peak_bytes"] for run in results)) for variant, results in runs.items()}
    seconds = {variant: statistics.median(run["seconds"] for run in results) for variant, results in runs.items()}
    return {"figure": "loss_head_peak_memory_bytes", "value": peak["chunked"], "baseline": peak["full"],
            "ratio": round(peak["chunked"] / peak["full"], 3), "target": "<= 0.2",
            "tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "chunk_tokens": args.chunk_tokens,
            "dtype": "float32", "repeats": args.repeats,
            "seconds_median": round(seconds["chunked"], 3), "baseline_seconds_median": round(seconds["full"], 3),
            "path": "compute_chunked_logprobs forward + backward of sum(logprobs) + sum(entropy), "
                    "peak RSS above the inputs in a fresh process"}


FIGURES: dict[str, Callable[[argparse.Namespace], dict]] = {"loss_head": loss_head_figure}


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--figures", default=",".join(FIGURES),
                        help=f"comma-separated figures to run, from {', '.join(FIGURES)}")
    parser.add_argument("--tokens", type=int, default=8192, help="loss head: tokens in the batch")
    parser.add_argument("--vocab", type=int, default=32768, help="loss head: vocabulary size")
    parser.add_argument("--hidden", type=int, default=1024, help="loss head: hidden size")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="loss head: tokens per chunk")
    parser.add_argument("--temperature", type=float, default=1.0, help="loss head: sampling temperature")
    parser.add_argument("--repeats", type=int, default=3, help="fresh-process measurements per variant")
    parser.add_argument("--measure", choices=sorted(LOSS_HEADS), help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    unknown = sorted(set(args.figures.split(",")) - set(FIGURES))
    if unknown:
        parser.error(f"unknown figures {unknown}; choose from {sorted(FIGURES)}")
    return args


def main() -> None:
    args = parse_args()
    if args.measure:
        measure_loss_head(args)
        return
    for figure in args.figures.split(","):
        emit(FIGURES[figure](args))
    emit({"command": "python " + shlex.join(sys.argv)})


if __name__ == "__main__":
    main()
