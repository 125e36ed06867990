import json

from molt.endpoint.tool_calls import parse_tool_calls


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_plain_text_has_no_calls():
    assert parse_tool_calls("  The answer is 8.\n") == ("The answer is 8.", [])


def test_one_call_in_the_template_format():
    text = block('{"name": "calculator", "arguments": {"expression": "3+5"}}')
    content, calls = parse_tool_calls(text)
    assert content == ""
    assert len(calls) == 1
    assert calls[0].name == "calculator"
    assert json.loads(calls[0].arguments) == {"expression": "3+5"}
    assert calls[0].id.startswith("call_") and len(calls[0].id) > len("call_")


def test_text_around_calls_is_the_content_and_calls_keep_their_order():
    text = ("Let me compute.\n"
            + block('{"name": "add", "arguments": {"a": 1, "b": 2}}') + "\n"
            + block('{"name": "mul", "arguments": {"a": 3, "b": 4}}') + "\n")
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute."
    assert [call.name for call in calls] == ["add", "mul"]
    assert [json.loads(call.arguments) for call in calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert calls[0].id != calls[1].id


def test_arguments_are_reserialized_as_json_text():
    content, calls = parse_tool_calls(block('{"name": "f", "arguments": {"x":[1,2],  "y": "é"}}'))
    assert calls[0].arguments == '{"x": [1, 2], "y": "é"}'


def test_missing_arguments_mean_an_empty_object_and_string_arguments_are_decoded():
    _, calls = parse_tool_calls(block('{"name": "now"}') + block('{"name": "f", "arguments": "{\\"x\\": 1}"}'))
    assert [call.arguments for call in calls] == ["{}", '{"x": 1}']


def test_invalid_json_block_stays_in_the_content():
    bad = block('{"name": "calculator", "arguments": {"expression": ')
    good = block('{"name": "calculator", "arguments": {"expression": "1+1"}}')
    content, calls = parse_tool_calls(f"Hi {bad} {good}")
    assert content == f"Hi {bad}"
    assert len(calls) == 1 and json.loads(calls[0].arguments) == {"expression": "1+1"}


def test_blocks_that_are_json_but_not_calls_stay_in_the_content():
    for body in ['["calculator"]', '{"arguments": {}}', '{"name": 3}', '{"name": "f", "arguments": [1]}',
                 '{"name": "f", "arguments": "not json"}']:
        content, calls = parse_tool_calls(block(body))
        assert calls == [] and content == block(body), body


def test_unclosed_block_is_content():
    text = 'Sure.\n<tool_call>\n{"name": "calculator", "argu'
    assert parse_tool_calls(text) == (text, [])
