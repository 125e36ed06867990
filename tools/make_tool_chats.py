"""Chat rows for the tool demo's warm start (configs/demo.py:sft_tool, run by launch/demo_tool.sh):
each demo row's question with the calculator tool in the prompt. A `--tool-share` of them call it
(no arguments: it solves the question), read its result and answer with it; the rest answer
directly. `python -m molt.sft` trains on the assistant turns.

    python tools/make_tool_chats.py DATA.jsonl OUT.jsonl [--tool-share 0.5] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

# The tool exactly as configs/agents/addition_tool_*.py declare it (it is part of the prompt).
CALCULATOR_TOOL = {"type": "function", "function": {"name": "calculator", "description": "solve the question",
                                                    "parameters": {"type": "object"}}}


def build_tool_chats(rows: list[dict], *, tool_share: float, seed: int) -> list[dict]:
    """One chat row per demo row (its last message is the question, its label the sum)."""
    rng = random.Random(seed)
    chats = []
    for row in rows:
        question = row["messages"][-1]
        if rng.random() < tool_share:
            call = {"type": "function", "function": {"name": "calculator", "arguments": {}}}
            messages = [question, {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "content": row["label"]}, {"role": "assistant", "content": row["label"]}]
        else:
            messages = [question, {"role": "assistant", "content": row["label"]}]
        chats.append({"messages": messages, "tools": [CALCULATOR_TOOL]})
    return chats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", help="the demo's chat rows with messages and label (tools/make_demo_data.py)")
    parser.add_argument("out", help="the chat rows to write (.jsonl)")
    parser.add_argument("--tool-share", type=float, default=0.5, help="share of rows that call the calculator")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    chats = build_tool_chats(rows, tool_share=args.tool_share, seed=args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.partial")
    staging.write_text("".join(json.dumps(chat) + "\n" for chat in chats))
    staging.rename(out)
    print(f"wrote {out} ({len(chats)} rows, {sum(len(c['messages']) > 2 for c in chats)} calling the calculator)")


if __name__ == "__main__":
    main()
