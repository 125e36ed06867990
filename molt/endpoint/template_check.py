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


class TemplateError(ValueError):
    """The chat template cannot be used for capture."""


def turn_end_text(tokenizer) -> str:
    """What the chat template writes after an assistant turn's content (e.g. "<|im_end|>\\n"): the
    glue a session appends as context after a recorded reply before the next messages.

    It is read from the template itself, as the text after the content of a final assistant turn,
    and must be what the template also writes when more messages follow. A template that leaves
    the final assistant turn unclosed is refused: the next turn's rendering could not be told from
    the reply, and the session would record the reply twice."""
    marker = "MOLT-TURN-END-PROBE"
    conversation = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": marker}]
    final = tokenizer.apply_chat_template(conversation, tokenize=False)
    followed = tokenizer.apply_chat_template(conversation + [{"role": "user", "content": "Again."}], tokenize=False,
                                             add_generation_prompt=True)
    if marker not in final:
        raise TemplateError("the chat template does not render an assistant message's content as given")
    glue = final[final.rindex(marker) + len(marker):]
    # A template that re-renders earlier turns (find_prefix_breaks) may drop the content once more
    # messages follow; then only the final turn's end tells.
    after = followed[followed.rindex(marker) + len(marker):] if marker in followed else glue
    if not glue or not after.startswith(glue):
        raise TemplateError(
            f"the chat template leaves a final assistant turn unclosed (it renders {glue!r} after the reply, but "
            f"{after[:40]!r} once another message follows); capture needs the end-of-turn text the template "
            f"writes after every assistant turn. Fix the template (model.path's tokenizer_config.json or "
            f"chat_template.jinja) to close the final assistant turn")
    return glue
