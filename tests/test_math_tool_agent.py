"""The calculator and the math-verify grading of configs/agents/math_tool_openai.py (the large recipes' agent)."""

import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor
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


GRADING_CASES = [
    ("\\boxed{1/2}", "0.5", True),  # math-verify compares values, not strings
    ("The answer is $\\frac{3}{4}$.", "0.75", True),
    ("\\boxed{0.5}", "1/2", True),
    ("so the total is \\boxed{1,234}.", "1234", True),
    ("Step 1: 3 apples. The answer is 42.", "42", True),
    ("\\boxed{7} then 8", "7", True),  # the boxed answer wins over later numbers
    ("\\boxed{1/3}", "0.33", False),  # not equal at math-verify's precision
    ("the answer is 41", "42", False),
    ("I do not know", "42", False),  # no answer
    ("", "42", False),
    ("42", "forty-two", False),  # a label math-verify cannot parse matches nothing
]


@pytest.mark.parametrize("text, label, correct", GRADING_CASES)
def test_grading_by_math_verify_on_the_main_thread(text, label, correct):
    assert math_tool.grade(text, label) is correct


def test_grading_off_the_main_thread_runs_without_signal_timeouts():
    # math-verify's SIGALRM time limits raise ValueError off the main thread; grade() drops them there.
    with ThreadPoolExecutor(max_workers=1) as pool:
        results = list(pool.map(lambda case: math_tool.grade(case[0], case[1]), GRADING_CASES))
    assert results == [correct for _, _, correct in GRADING_CASES]


def test_agent_file_loads_as_a_chat_agent_runner():
    assert isinstance(load_agent_runner(str(AGENT)), ChatAgentRunner)
