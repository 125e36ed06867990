"""The calculator and answer check of configs/agents/math_tool_openai.py (the large recipes' agent)."""

import importlib.util
import json
from pathlib import Path

import pytest

from molt.agents import ChatAgentRunner, load_agent_runner

AGENT = Path(__file__).resolve().parents[1] / "configs" / "agents" / "math_tool_openai.py"
spec = importlib.util.spec_from_file_location("math_tool_openai", AGENT)
math_tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(math_tool)


def call(expression: str) -> str:
    return math_tool.calculate(json.dumps({"expression": expression}))


@pytest.mark.parametrize("expression, expected", [
    ("2 * (3 + 4)", "14"), ("7 / 2", "3.5"), ("8 / 2", "4"), ("-3 ** 2", "-9"), ("17 // 5 + 17 % 5", "5"),
    ("2 ** 0.5", "1.414213562"),
])
def test_calculator_evaluates_arithmetic(expression, expected):
    assert call(expression) == expected


@pytest.mark.parametrize("expression", [
    "__import__('os').system('true')", "x + 1", "1 / 0", "9 ** 9 ** 9", "(((9 ** 64) ** 64) ** 64) ** 64", "1 +",
])
def test_calculator_refuses_code_and_runaway_numbers(expression):
    assert call(expression).startswith("error: ")


def test_calculator_refuses_malformed_arguments():
    assert math_tool.calculate("not json").startswith("error: ")
    assert math_tool.calculate('{"expr": "1"}').startswith("error: ")


@pytest.mark.parametrize("text, label, reward", [
    ("so the total is \\boxed{1,234}.", "1234", True),
    ("Step 1: 3 apples. The answer is 42.", "42", True),
    ("\\boxed{7} then 8", "7", True),  # the boxed answer wins over later numbers
    ("the answer is 41", "42", False),
    ("I do not know", "42", False),
    ("42", "forty-two", False),
])
def test_answer_check(text, label, reward):
    assert math_tool.answers_match(math_tool.extract_answer(text), label) is reward


def test_agent_file_loads_as_a_chat_agent_runner():
    assert isinstance(load_agent_runner(str(AGENT)), ChatAgentRunner)
