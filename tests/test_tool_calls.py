"""The incremental tool-call parser: its rules, and that any chunking of a text gives the same parts."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from molt.endpoint.messages import ToolCall
from molt.endpoint.tool_calls import ToolCallParser, build_tool_call_parser_factory, parse_all


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def call_block(name: str, **arguments) -> str:
    return block(json.dumps({"name": name, "arguments": arguments}))


def shape(parts) -> list:
    """Parts with each call as (name, arguments) (ids are random per parse)."""
    return [(p.name, json.loads(p.arguments)) if isinstance(p, ToolCall) else p for p in parts]


def test_plain_text_is_kept_as_written():
    assert parse_all("  The answer is 8.\n") == ["  The answer is 8.\n"]


def test_one_call_in_the_template_format():
    parts = parse_all(call_block("calculator", expression="3+5"))
    assert shape(parts) == [("calculator", {"expression": "3+5"})]
    assert parts[0].id.startswith("call_") and len(parts[0].id) > len("call_")


def test_text_before_between_and_after_calls_keeps_its_place():
    text = ("Let me compute.\n" + call_block("add", a=1, b=2) + "\nand\n" + call_block("mul", a=3, b=4)
            + "\nDone.")
    assert shape(parse_all(text)) == ["Let me compute.", ("add", {"a": 1, "b": 2}), "and",
                                      ("mul", {"a": 3, "b": 4}), "Done."]


def test_malformed_and_cut_blocks_stay_text():
    junk = block("not json")
    assert parse_all("a " + junk + " b") == ["a " + junk + " b"]
    assert parse_all(block('{"arguments": {}}')) == [block('{"arguments": {}}')]
    assert parse_all(block('{"name": "f", "arguments": [1]}')) == [block('{"name": "f", "arguments": [1]}')]
    cut = '<tool_call>\n{"name": "calc", "argu'
    assert shape(parse_all("x" + call_block("f") + cut)) == ["x", ("f", {}), cut]


def test_arguments_written_as_a_json_string_are_parsed():
    assert shape(parse_all(block('{"name": "f", "arguments": "{\\"a\\": 1}"}'))) == [("f", {"a": 1})]


def test_disabled_parser_returns_all_text():
    text = call_block("f", a=1)
    parser = ToolCallParser(enabled=False)
    assert "".join(parser.feed(text[:5]) + parser.feed(text[5:]) + parser.finish()) == text


def test_a_partial_marker_is_held_back_until_decided():
    parser = ToolCallParser()
    assert parser.feed("answer <tool") == ["answer"]
    assert parser.feed("box>") == [" <toolbox>"]
    assert parser.finish() == []


# -- any chunking gives the same parts -----------------------------------------------------------

PIECES = st.one_of(
    st.text(alphabet=" \nab<>/{}\"", max_size=12),
    st.builds(lambda name, value: call_block(name, v=value), st.sampled_from(["f", "g"]), st.integers(0, 9)),
    st.just(block("junk")),
    st.just("<tool_call>"),
    st.just("</tool_call>"),
)


def parse_in_chunks(text: str, cuts: list[int]) -> list:
    parser = ToolCallParser()
    parts, start = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        parts += parser.feed(text[start:cut])
        start = cut
    parts += parser.finish()
    merged = []
    for part in parts:
        if isinstance(part, str) and merged and isinstance(merged[-1], str):
            merged[-1] += part
        else:
            merged.append(part)
    return merged


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(PIECES, max_size=8), data=st.data())
def test_any_chunking_gives_the_parts_of_the_whole_text(pieces, data):
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    whole = parse_all(text)
    assert shape(parse_in_chunks(text, cuts)) == shape(whole)
    # Nothing is lost: the text parts and the calls' blocks cover the text up to whitespace.
    calls = [p for p in whole if isinstance(p, ToolCall)]
    assert len(calls) <= text.count("<tool_call>")
    assert "".join(p for p in whole if isinstance(p, str)).replace(" ", "").replace("\n", "") == \
        _without_parsed_blocks(text, len(calls)).replace(" ", "").replace("\n", "")


def _without_parsed_blocks(text: str, num_calls: int) -> str:
    """The text with its well-formed call blocks removed (as a naive one-shot parse finds them)."""
    out, position = "", 0
    while True:
        start = text.find("<tool_call>", position)
        end = text.find("</tool_call>", start) if start >= 0 else -1
        if start < 0 or end < 0:
            return out + text[position:]
        body = text[start + len("<tool_call>"):end]
        try:
            call = json.loads(body)
            parsed = isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"] \
                and isinstance(call.get("arguments", {}), dict)
        except json.JSONDecodeError:
            parsed = False
        out += text[position:start] + ("" if parsed else text[start:end + len("</tool_call>")])
        position = end + len("</tool_call>")


def test_a_vllm_parser_by_name_reads_the_whole_reply(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    parser = build_tool_call_parser_factory("pythonic", tokenizer)(True)
    assert parser.feed('[calc(e="1+') == [] and parser.feed('1")]') == []
    assert shape(parser.finish()) == [("calc", {"e": "1+1"})]
    disabled = build_tool_call_parser_factory("pythonic", tokenizer)(False)
    assert disabled.feed("[calc()]") == ["[calc()]"]
    with pytest.raises(ValueError, match="not a vLLM tool parser"):
        build_tool_call_parser_factory("no-such-format", tokenizer)
    with pytest.raises(ValueError, match="does not fit model.path's tokenizer"):
        build_tool_call_parser_factory("mistral", tokenizer)
