"""A reasoning-gym task in Molt: the data generator (tools/make_reasoning_gym_data.py) and the Env
(configs/agents/reasoning_gym_task.py) whose reward is the package's own score_answer."""

import asyncio
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import reasoning_gym

from molt.agents import RolloutRequest, SamplingParams, StepEnvRunner, load_agent_runner
from molt.agents.env import StepState, run_with_timeout
from molt.config import load_config, validate_config
from molt.controller.prompts import load_prompt_rows
from molt.trace.generation import Generation

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "configs" / "agents" / "reasoning_gym_task.py"
PARAMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # the recipe's, with * and / too


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_data = load_module(ROOT / "tools" / "make_reasoning_gym_data.py", "make_reasoning_gym_data")
task = load_module(AGENT, "reasoning_gym_task")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reasoning-gym")
    return make_data.make_reasoning_gym_data(out, dataset="basic_arithmetic", num_train=512, num_eval=64,
                                             seed=3, params=PARAMS)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_pass_molts_dataset_checker_and_carry_the_packages_entry(data_dir):
    for split, num_rows in (("train", 512), ("eval", 64)):
        rows = load_prompt_rows(data_dir / f"{split}.jsonl")
        assert len(rows) == num_rows
        for row in rows:
            entry = row.metadata["reasoning_gym"]
            assert row.messages == [{"role": "user", "content": entry["question"]}]
            assert row.label == entry["answer"]
            assert entry["metadata"]["source_dataset"] == "basic_arithmetic"
            assert row.metadata["split"] == split
    # The stored entry is the package's own (tuples as lists): the first train row is entry 0 of seed 3.
    first = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=3, **PARAMS)[0]
    assert read_rows(data_dir / "train.jsonl")[0]["metadata"]["reasoning_gym"] == json.loads(json.dumps(first))


def test_train_and_eval_share_no_question(data_dir):
    train = {row["metadata"]["reasoning_gym"]["question"] for row in read_rows(data_dir / "train.jsonl")}
    held_out = {row["metadata"]["reasoning_gym"]["question"] for row in read_rows(data_dir / "eval.jsonl")}
    assert len(held_out) > 32 and len(train) > 256  # a real spread of questions on both sides
    assert not train & held_out


def test_rows_are_a_function_of_the_seed(data_dir, tmp_path):
    again = make_data.make_reasoning_gym_data(tmp_path / "again", dataset="basic_arithmetic", num_train=512,
                                              num_eval=64, seed=3, params=PARAMS)
    other = make_data.make_reasoning_gym_data(tmp_path / "other", dataset="basic_arithmetic", num_train=512,
                                              num_eval=64, seed=4, params=PARAMS)
    for split in ("train.jsonl", "eval.jsonl"):
        assert (again / split).read_bytes() == (data_dir / split).read_bytes()
        assert (other / split).read_bytes() != (data_dir / split).read_bytes()
    assert not list(again.glob("*.partial"))


def test_a_question_space_too_small_for_a_disjoint_eval_split_is_refused(tmp_path):
    # 100 questions "a + b"; 300 eval draws hold out nearly all of them.
    small = {**PARAMS, "operators": ("+",), "allow_parentheses": False, "allow_negation": False}
    with pytest.raises(ValueError, match="outside the eval split; lower --num-train"):
        make_data.make_reasoning_gym_data(tmp_path, dataset="basic_arithmetic", num_train=400, num_eval=300,
                                          params=small)


@pytest.mark.parametrize("text, expected", [("min_digits=1", ("min_digits", 1)),
                                            ("operators=('+', '-')", ("operators", ("+", "-"))),
                                            ("format_style=simple", ("format_style", "simple"))])
def test_param_values_are_python_literals_or_strings(text, expected):
    assert make_data.parse_param(text) == expected


def sampled_replies(label: str) -> list[str]:
    """Right, right with whitespace, wrong, and malformed replies (some get the package's partial credit)."""
    wrong = str(int(label) + 1)
    return [label, f" {label}\n", wrong, f"-{label}", f"{label}0", f"{label}.0", f"<answer>{label}</answer>",
            "", "   ", "the answer", f"{label} {label}"]


def step(state_kwargs: dict) -> float:
    state = StepState(observation_text="", turn=0, sampling_params=SamplingParams(max_tokens=6), **state_kwargs)
    return asyncio.run(task.ReasoningGymEnv().step(state)).reward


def test_reward_is_the_packages_score_answer_on_sampled_replies(data_dir):
    # The scorer of the dataset that generated the rows, on the entry as the package made it.
    dataset = reasoning_gym.create_dataset("basic_arithmetic", size=64, seed=3 + make_data.EVAL_SEED_OFFSET,
                                           **PARAMS)
    rewards = []
    for index, row in enumerate(read_rows(data_dir / "eval.jsonl")[:16]):
        for reply in sampled_replies(row["label"]):
            reward = step({"action_text": reply, "label": row["label"], "metadata": row["metadata"]})
            assert reward == dataset.score_answer(reply.strip(), dataset[index]), (reply, row["label"])
            rewards.append(reward)
    assert {0.0, 1.0} < set(rewards)  # and partial credits in between: the package's grading, not ==


def test_a_row_without_the_entry_is_refused():
    with pytest.raises(ValueError, match="no metadata.reasoning_gym entry"):
        step({"action_text": "3", "label": "3", "metadata": {"split": "train"}})


@dataclass
class PlayedReply:
    """A sampler that returns `reply`'s token ids (the real tokenizer's) for every request."""

    tokenizer: object
    reply: str

    async def generate(self, token_ids, sampling):
        ids = self.tokenizer.encode(self.reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return Generation(token_ids=ids, logprobs=[-0.5] * len(ids), policy_versions=[0] * len(ids),
                          finish_reason="stop")


@pytest.mark.parametrize("reply", ["-6", "-60", "x"])
def test_the_agent_file_rewards_a_rollout_with_the_rows_entry(data_dir, tiny_model_dir, reply):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    row = {"messages": [{"role": "user", "content": "Calculate ( 2 + -8 )."}], "label": "-6",
           "metadata": {"reasoning_gym": {"question": "Calculate ( 2 + -8 ).", "answer": "-6",
                                          "metadata": {"source_dataset": "basic_arithmetic"}}}}
    runner = load_agent_runner(str(AGENT))
    assert isinstance(runner, StepEnvRunner)
    request = RolloutRequest(rollout_id=0, group_id=0, sample_index=0, messages=row["messages"], label=row["label"],
                             tools=None, sampling=SamplingParams(max_tokens=6), max_length=64, max_turns=1,
                             policy_version=0, metadata=row["metadata"])
    outcome = asyncio.run(run_with_timeout(runner, request, PlayedReply(tokenizer, reply), tokenizer, 10.0))
    assert outcome.failure == "", outcome.error
    scorer = reasoning_gym.get_score_answer_fn("basic_arithmetic")
    assert outcome.experiences[0].reward == scorer(reply, row["metadata"]["reasoning_gym"])
    assert outcome.experiences[0].reward == {"-6": 1.0, "-60": 2 / 3, "x": 0.0}[reply]


def test_the_recipe_and_its_warm_start_load_and_validate():
    cfg = load_config(str(ROOT / "configs" / "reasoning_gym.py"), [])
    validate_config(cfg, require_files=False)  # the model and data are generated by launch/reasoning_gym.sh
    assert cfg.agent.path == str(AGENT)
    assert cfg.rollout.max_length >= 54 + cfg.rollout.max_response_tokens  # the longest prompt is 54 tokens
    assert cfg.eval.data_path.endswith("eval.jsonl") and cfg.data.train_path.endswith("train.jsonl")
    sft = load_config(str(ROOT / "configs" / "reasoning_gym.py") + ":sft", [])
    assert sft.sft.output_dir == cfg.model.path and sft.sft.data_path == cfg.data.train_path
