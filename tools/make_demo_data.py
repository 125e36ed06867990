"""Write the demo task, one-digit addition, as chat-format prompt rows.

Each row is {"messages": [{"role": "user", "content": "3+5="}], "label": "8", "metadata": {...}},
written to OUT_DIR/train.jsonl (problems drawn uniformly) and OUT_DIR/eval.jsonl (by default each
of the 100 problems once: the task's whole space, so the eval set covers the problems training
sees) (or .parquet). Rows are a pure function of the seed.

    python tools/make_demo_data.py OUT_DIR [--num-train 4096] [--num-eval 100] [--format jsonl|parquet]
"""

import argparse
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


EVAL_LAYOUT = "each of the 100 problems once, in a seeded order"


def build_addition_rows(num_rows: int, rng: random.Random, split: str) -> list[dict]:
    """`num_rows` problems a+b with a, b in 0..9: drawn uniformly for training; for evaluation each
    of the 100 problems once, in a seeded order (repeating the order past 100 rows)."""
    if split == "eval":
        problems = [(a, b) for a in range(10) for b in range(10)]
        rng.shuffle(problems)
        pairs = [problems[index % len(problems)] for index in range(num_rows)]
    else:
        pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(num_rows)]
    rows = []
    for index, (a, b) in enumerate(pairs):
        rows.append(
            {
                "messages": [{"role": "user", "content": f"{a}+{b}="}],
                "label": str(a + b),
                "metadata": {"split": split, "index": index, "a": a, "b": b},
            }
        )
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_parquet(rows: list[dict], path: Path) -> None:
    # Explicit schema so `messages` is a list of structs and `metadata` a struct, whatever rows hold.
    schema = pa.schema(
        [
            ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
            ("label", pa.string()),
            (
                "metadata",
                pa.struct(
                    [("split", pa.string()), ("index", pa.int64()), ("a", pa.int64()), ("b", pa.int64())]
                ),
            ),
        ]
    )
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def make_demo_data(
    out_dir: str | Path,
    *,
    num_train: int = 4096,
    num_eval: int = 100,
    seed: int = 0,
    file_format: str = "jsonl",
) -> Path:
    """Write train and eval splits of the addition task to `out_dir` and return its path."""
    writers = {"jsonl": write_jsonl, "parquet": write_parquet}
    if file_format not in writers:
        raise ValueError(f"unknown file_format {file_format!r}; choose one of {sorted(writers)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = {"train": num_train, "eval": num_eval}
    for split, num_rows in splits.items():
        # One generator per split, so the eval rows do not depend on num_train.
        rows = build_addition_rows(num_rows, random.Random(f"{split}:{seed}"), split)
        writers[file_format](rows, out_dir / f"{split}.{file_format}")
    # What was written, so a launcher can tell an older layout (eval rows drawn with repeats) apart.
    settings = {"seed": seed, "num_train": num_train, "num_eval": num_eval, "eval": EVAL_LAYOUT}
    (out_dir / "settings.json").write_text(json.dumps(settings) + "\n")
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="directory to write train/eval files into (created if missing)")
    parser.add_argument("--num-train", type=int, default=4096)
    parser.add_argument("--num-eval", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", dest="file_format", default="jsonl", choices=["jsonl", "parquet"])
    args = parser.parse_args()
    out_dir = make_demo_data(
        args.out_dir,
        num_train=args.num_train,
        num_eval=args.num_eval,
        seed=args.seed,
        file_format=args.file_format,
    )
    for path in sorted(out_dir.glob(f"*.{args.file_format}")):
        print(f"wrote {path} ({path.stat().st_size / 1e3:.1f} kB)")


if __name__ == "__main__":
    main()
