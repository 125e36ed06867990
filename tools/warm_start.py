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

from molt.console import ToolProgress


# The tool exactly as configs/agents/addition_tool_*.py declare it (it is part of the prompt).
CALCULATOR_TOOL = {"type": "function", "function": {"name": "calculator", "description": "solve the question",
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


def build_tool_examples(tokenizer, rows: list[dict], *, tool_share: float, seed: int) -> list[tuple[list[int], list[int]]]:
    """Conversations with the calculator tool in the prompt. A `tool_share` of them call it (no
    arguments: it solves the question), read its result and answer with it; the rest answer
    directly. Assistant turns are trained; the pieces are tokenized as the session endpoint does."""
    rng = random.Random(seed)
    examples = []
    for row in rows:
        question = row["messages"][-1]
        if rng.random() < tool_share:
            call = {"type": "function", "function": {"name": "calculator", "arguments": {}}}
            turns = [question, {"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "content": row["label"]}, {"role": "assistant", "content": row["label"]}]
        else:
            turns = [question, {"role": "assistant", "content": row["label"]}]
        ids, mask, rendered = [], [], ""
        for count in range(1, len(turns) + 1):
            is_reply = count % 2 == 0
            text = tokenizer.apply_chat_template(turns[:count], tools=[CALCULATOR_TOOL], tokenize=False,
                                                 add_generation_prompt=not is_reply)
            piece = text[len(rendered):]
            if is_reply:  # up to and including the end-of-turn token; what follows is context
                end = piece.index(tokenizer.eos_token) + len(tokenizer.eos_token)
                piece, text = piece[:end], rendered + piece[:end]
            piece_ids = tokenizer.encode(piece, add_special_tokens=False)
            ids += piece_ids
            mask += [int(is_reply)] * len(piece_ids)
            rendered = text
        examples.append((ids, mask))
    return examples


def pad_batch(batch: list[tuple[list[int], list[int]]], pad_token_id: int):
    """(token ids, 0/1 loss mask) pairs -> input_ids, labels (-100 where not trained) and
    attention_mask, each [batch, longest], right-padded."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_token_id)
    labels = torch.full((len(batch), width), -100)
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (ids, mask) in enumerate(batch):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        labels[row, :len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
        attention_mask[row, :len(ids)] = 1
    return input_ids, labels, attention_mask


def warm_start(model_dir: str, data_path: str, out_dir: str, *, steps: int, batch_size: int,
               learning_rate: float, seed: int, task: str = "answer", tool_share: float = 0.5) -> dict:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = [json.loads(line) for line in Path(data_path).read_text().splitlines() if line.strip()]
    if task == "answer":
        examples = build_examples(tokenizer, rows)
    else:
        examples = build_tool_examples(tokenizer, rows, tool_share=tool_share, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    # An MoE model trains with its load-balancing loss (the config's router_aux_loss_coef), as in
    # pretraining: without it the tiny Qwen3-MoE's routers collapse within these steps (one expert of
    # layer 1 never chosen) and the answer loss ends twice as high.
    balance = {"output_router_logits": True} if hasattr(model.config, "output_router_logits") else {}
    started = time.perf_counter()
    loss_value = float("nan")
    progress = ToolProgress(steps, desc=f"warm start ({task})")
    for _ in range(steps):
        input_ids, labels, attention_mask = pad_batch(rng.sample(examples, batch_size), tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **balance).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_value = loss.item()
        progress.update(loss=loss_value)
    progress.close()
    seconds = time.perf_counter() - started
    staging = Path(f"{out_dir}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    settings = {"base_model": str(model_dir), "data": str(data_path), "task": task, "tool_share": tool_share, "steps": steps,
                "batch_size": batch_size, "learning_rate": learning_rate, "seed": seed,
                "load_balancing_loss": bool(balance)}
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
    parser.add_argument("--task", choices=["answer", "tool"], default="answer",
                        help="answer: prompt -> sum; tool: the calculator tool in the prompt, called or not")
    parser.add_argument("--tool-share", type=float, default=0.5,
                        help="tool task: share of examples that call the calculator")
    args = parser.parse_args()
    summary = warm_start(args.model, args.data, args.out, steps=args.steps, batch_size=args.batch_size,
                         learning_rate=args.learning_rate, seed=args.seed, task=args.task,
                         tool_share=args.tool_share)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
