"""Supervised warm start for the demo: a few steps of next-token training on prompt -> answer.

A from-scratch policy on a 320-token vocabulary almost never emits a bare number, so RL has no
signal to climb. A short supervised phase teaches the answer format (and a little arithmetic);
the RL run then has to do the rest. Writes a Hugging Face model directory.

    python tools/warm_start.py --model MODEL_DIR --data train.jsonl --out OUT_DIR [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


# The tool exactly as configs/agents/addition_tool_*.py declare it (it is part of the prompt).
ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "a+b",
                                             "parameters": {"type": "object"}}}


def build_examples(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(token ids, 0/1 loss mask) per row: prompt, then the answer and the eos token (trained)."""
    examples = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        answer_ids = tokenizer.encode(row["label"], add_special_tokens=False) + [tokenizer.eos_token_id]
        examples.append((prompt_ids + answer_ids, [0] * len(prompt_ids) + [1] * len(answer_ids)))
    return examples


def build_tool_examples(tokenizer, rows: list[dict], *, train_answer: bool) -> list[tuple[list[int], list[int]]]:
    """The tool-use conversation: a call to add(a, b), its result, the final answer. The call is
    trained, the answer only with `train_answer`; the pieces are tokenized as the session
    endpoint does."""
    examples = []
    for row in rows:
        a, b = (int(x) for x in row["messages"][-1]["content"].rstrip("=").split("+"))
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        turns = [row["messages"][-1], {"role": "assistant", "content": "", "tool_calls": [call]},
                 {"role": "tool", "content": str(a + b)}, {"role": "assistant", "content": row["label"]}]
        ids, mask, rendered = [], [], ""
        for count, trained in ((1, 0), (2, 1), (3, 0), (4, int(train_answer))):
            is_reply = count % 2 == 0
            text = tokenizer.apply_chat_template(turns[:count], tools=[ADD_TOOL], tokenize=False,
                                                 add_generation_prompt=not is_reply)
            piece = text[len(rendered):]
            if is_reply:  # up to and including the end-of-turn token; what follows is context
                end = piece.index(tokenizer.eos_token) + len(tokenizer.eos_token)
                piece, text = piece[:end], rendered + piece[:end]
            piece_ids = tokenizer.encode(piece, add_special_tokens=False)
            ids += piece_ids
            mask += [trained] * len(piece_ids)
            rendered = text
        examples.append((ids, mask))
    return examples


def warm_start(model_dir: str, data_path: str, out_dir: str, *, steps: int, batch_size: int,
               learning_rate: float, seed: int, task: str = "answer") -> dict:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = [json.loads(line) for line in Path(data_path).read_text().splitlines() if line.strip()]
    if task == "answer":
        examples = build_examples(tokenizer, rows)
    else:
        examples = build_tool_examples(tokenizer, rows, train_answer=task == "tool")
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    started = time.perf_counter()
    loss_value = float("nan")
    for _ in range(steps):
        batch = rng.sample(examples, batch_size)
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        attention_mask = torch.zeros((batch_size, width), dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            input_ids[row, :len(ids)] = torch.tensor(ids)
            labels[row, :len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
            attention_mask[row, :len(ids)] = 1
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_value = loss.item()
    seconds = time.perf_counter() - started
    staging = Path(f"{out_dir}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    settings = {"base_model": str(model_dir), "data": str(data_path), "task": task, "steps": steps,
                "batch_size": batch_size, "learning_rate": learning_rate, "seed": seed}
    (staging / "warm_start.json").write_text(json.dumps(settings, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return {"steps": steps, "final_loss": loss_value, "seconds": seconds, "out": str(out_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory to start from")
    parser.add_argument("--data", required=True, help="chat-format JSONL with messages and label")
    parser.add_argument("--out", required=True, help="output model directory")
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", choices=["answer", "tool", "tool-call"], default="answer",
                        help="answer: prompt -> sum; tool: prompt -> add(a, b) call -> result -> sum; "
                             "tool-call: the same conversation, training only the call")
    args = parser.parse_args()
    summary = warm_start(args.model, args.data, args.out, steps=args.steps, batch_size=args.batch_size,
                         learning_rate=args.learning_rate, seed=args.seed, task=args.task)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
