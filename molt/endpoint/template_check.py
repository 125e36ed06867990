"""Start-up check: does the chat template keep earlier turns byte-identical as a conversation grows?

Segments continue only when the rendered history is a prefix of the next rendering; a template
that rewrites earlier turns (e.g. drops past reasoning) forces a new segment on every turn. This
renders a short multi-turn conversation with a tool call and says where the prefix breaks.
"""

from __future__ import annotations

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                           "parameters": {"type": "object"}}}]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 3+5?"},
    {"role": "assistant", "content": "Let me check.",
     "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"word": "sum"}}}]},
    {"role": "tool", "content": "addition"},
    {"role": "tool", "content": "plus"},
    {"role": "assistant", "content": "8"},
    {"role": "user", "content": "And 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "Thanks."},
]


def find_prefix_breaks(tokenizer) -> list[str]:
    """One line per assistant turn whose rendering changes once later messages are added."""
    problems = []
    for end, message in enumerate(CONVERSATION):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(CONVERSATION[:end + 1], tools=TOOLS, tokenize=False)
        later = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
        if not later.startswith(before):
            problems.append(f"the assistant turn at message {end} renders differently once "
                            f"{len(CONVERSATION) - end - 1} more messages follow")
    return problems
