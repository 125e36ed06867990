"""Write a reasoning-gym procedural task as chat-format prompt rows, generated offline.

    python tools/make_reasoning_gym_data.py OUT_DIR --dataset basic_arithmetic \\
        [--num-train 4096] [--num-eval 256] [--seed 0] \\
        [--param min_terms=2 --param max_terms=2 --param min_digits=1 --param max_digits=1]

Each row is {"messages": [{"role": "user", "content": <question>}], "label": <answer>,
"metadata": {"reasoning_gym": <the package's entry: question, answer, metadata>}}: what the
package's `score_answer(answer, entry)` needs (configs/agents/reasoning_gym_task.py grades with it).
Writes OUT_DIR/eval.jsonl, then OUT_DIR/train.jsonl without any eval question, so the two are
disjoint; rows are a pure function of the dataset, its parameters and the seed.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

import reasoning_gym

from molt.console import ToolProgress

# reasoning-gym derives entry i from `seed + i`: the eval split's seed is far from the train
# split's, so the two draw from different generator states, not from shifted copies of each other.
EVAL_SEED_OFFSET = 1_000_000_007
# Train rows are drawn from up to this many times num_train entries before giving up (the eval
# questions are skipped; a task with a small question space may have few others).
MAX_DRAWS_PER_TRAIN_ROW = 4


def build_row(entry: dict, split: str) -> dict:
    """The prompt row of one reasoning-gym entry; the entry goes into metadata as JSON (tuples
    become lists), so what the scorer reads is what the prompt file holds."""
    stored = json.loads(json.dumps({"question": entry["question"], "answer": entry["answer"],
                                    "metadata": entry.get("metadata", {})}))
    return {"messages": [{"role": "user", "content": entry["question"]}], "label": str(entry["answer"]),
            "metadata": {"split": split, "reasoning_gym": stored}}


def build_eval_rows(dataset: str, num_rows: int, seed: int, params: dict) -> list[dict]:
    entries = reasoning_gym.create_dataset(dataset, size=num_rows, seed=seed + EVAL_SEED_OFFSET, **params)
    return [build_row(entries[index], "eval") for index in range(num_rows)]


def build_train_rows(dataset: str, num_rows: int, seed: int, params: dict, held_out: set[str]) -> list[dict]:
    """`num_rows` rows whose question is not in `held_out` (the eval questions)."""
    max_draws = num_rows * MAX_DRAWS_PER_TRAIN_ROW
    entries = reasoning_gym.create_dataset(dataset, size=max_draws, seed=seed, **params)
    rows, progress = [], ToolProgress(num_rows, desc=f"{dataset} train rows")
    for index in range(max_draws):
        if len(rows) == num_rows:
            break
        entry = entries[index]
        if entry["question"] not in held_out:
            rows.append(build_row(entry, "train"))
            progress.update()
    progress.close()
    if len(rows) < num_rows:
        raise ValueError(f"only {len(rows)} of {max_draws} {dataset} entries have a question outside the "
                         f"eval split; lower --num-train ({num_rows}) or --num-eval, or widen the task's params")
    return rows


def make_reasoning_gym_data(out_dir: str | Path, *, dataset: str, num_train: int = 4096, num_eval: int = 256,
                            seed: int = 0, params: dict | None = None) -> Path:
    """Write OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl (disjoint by question) and return OUT_DIR."""
    params = params or {}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    eval_rows = build_eval_rows(dataset, num_eval, seed, params)
    held_out = {row["metadata"]["reasoning_gym"]["question"] for row in eval_rows}
    train_rows = build_train_rows(dataset, num_train, seed, params, held_out)
    for split, rows in (("eval", eval_rows), ("train", train_rows)):
        staging = out_dir / f"{split}.jsonl.partial"  # a file is complete or absent, for idempotent launchers
        staging.write_text("".join(json.dumps(row) + "\n" for row in rows))
        staging.rename(out_dir / f"{split}.jsonl")
    return out_dir


def parse_param(text: str) -> tuple[str, object]:
    """'min_digits=1' -> ('min_digits', 1); a value that is not a Python literal stays a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--param {text!r}: expected KEY=VALUE, e.g. min_digits=1")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to write train.jsonl and eval.jsonl into (created if missing)")
    parser.add_argument("--dataset", required=True, help="a reasoning-gym dataset name, e.g. basic_arithmetic")
    parser.add_argument("--num-train", type=int, default=4096)
    parser.add_argument("--num-eval", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--param", type=parse_param, action="append", default=[],
                        help="a dataset config field, KEY=VALUE (repeatable), e.g. max_digits=1")
    args = parser.parse_args()
    out_dir = make_reasoning_gym_data(args.out_dir, dataset=args.dataset, num_train=args.num_train,
                                      num_eval=args.num_eval, seed=args.seed, params=dict(args.param))
    for path in sorted(out_dir.glob("*.jsonl")):
        print(f"wrote {path} ({path.stat().st_size / 1e3:.1f} kB)")


if __name__ == "__main__":
    main()
