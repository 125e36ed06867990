"""Engine routing, end to end: a torchrun job with two rollout ranks logs the prompt tokens its
engines were given and those they computed (the rest came from vLLM's prefix cache), and running
a group's rollouts on one engine (rollout.group_affinity) computes fewer than spreading them."""

import json
import random
from pathlib import Path

import pytest
from test_train_e2e import DEMO, _job_sets, _torchrun

# torchrun jobs: not in the unit tier; 600 s is above each job's own limit (420 s or less)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_the_engine_counts_prompt_tokens_and_those_it_computed_past_the_prefix_cache(engine):
    from molt.agents.base import SamplingParams

    rollout_engine, sampling = engine.engine, SamplingParams(max_tokens=2, temperature=1.0)
    prompt = [(index * 37) % 251 + 3 for index in range(200)]  # a prompt no other test sends
    counts = [(rollout_engine.prompt_tokens, rollout_engine.prefill_tokens)]
    for _ in range(2):
        engine.run(rollout_engine.generate(prompt, sampling))
        counts.append((rollout_engine.prompt_tokens, rollout_engine.prefill_tokens))
    (prompt_0, prefill_0), (prompt_1, prefill_1), (prompt_2, prefill_2) = counts
    assert prompt_1 - prompt_0 == prompt_2 - prompt_1 == 200
    # The first request computes all 200 tokens; the second finds its first block (128 tokens on CPU) cached.
    assert (prefill_1 - prefill_0, prefill_2 - prefill_1) == (200, 200 - 128)


def write_long_prompts(path: Path, num_rows: int, context_words: int = 60, seed: int = 0) -> None:
    """Addition rows behind a context of random words that differs from row to row, so engines can
    share prompt prefixes only within a group. vLLM on CPU caches whole blocks of 128 tokens: the
    context makes each prompt about 300 tokens of the tiny model's tokenizer, two blocks to reuse."""
    rng = random.Random(seed)
    words = ["amber", "basalt", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper"]
    with path.open("w") as file:
        for index in range(num_rows):
            a, b = rng.randrange(10), rng.randrange(10)
            context = " ".join(rng.choice(words) for _ in range(context_words))
            file.write(json.dumps({"messages": [{"role": "user", "content": f"{context}. {a}+{b}="}],
                                   "label": str(a + b), "metadata": {"index": index}}) + "\n")


def run_two_engine_job(tmp_path: Path, tiny_model_dir, demo_data_dir, *, group_affinity: bool,
                       num_steps: int = 3) -> list[dict]:
    """The synchronous demo on 1 trainer + 2 rollout ranks, 4 prompts x 4 samples a step; its step rows."""
    data, out = tmp_path / "long_prompts.jsonl", tmp_path / f"affinity-{group_affinity}"
    write_long_prompts(data, num_rows=64)
    done = _torchrun(3, DEMO, _job_sets(tiny_model_dir, demo_data_dir, out, **{
        "data.train_path": data, "layout.num_rollout_ranks": 2, "rollout.max_length": 512,
        "rollout.max_response_tokens": 4, "refit.check_every_steps": 0, "train.num_steps": num_steps,
        "rollout.group_affinity": group_affinity}))
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["step"] >= 1]


def test_grouped_routing_prefills_each_prompt_about_once_and_less_than_spread_routing(
        tmp_path, tiny_model_dir, demo_data_dir):
    grouped = run_two_engine_job(tmp_path, tiny_model_dir, demo_data_dir, group_affinity=True)
    spread = run_two_engine_job(tmp_path, tiny_model_dir, demo_data_dir, group_affinity=False)
    for rows in (grouped, spread):
        assert [row["step"] for row in rows] == [1, 2, 3]
        for row in rows:  # 16 rollouts of prompts > 256 tokens each, one turn: all counted, some cached
            assert row["rollout/prompt_tokens"] > 16 * 256, row
            assert 0 < row["rollout/prefill_tokens"] < row["rollout/prompt_tokens"], row
    for affine, spread_row in zip(grouped, spread):  # the same prompts, step by step
        assert affine["rollout/prompt_tokens"] == spread_row["rollout/prompt_tokens"]
        # A prompt is computed in full once on each engine its group ran on: two spread, one grouped.
        assert affine["rollout/prefill_tokens"] < spread_row["rollout/prefill_tokens"]
        assert affine["rollout/prefill_tokens"] < 0.5 * affine["rollout/prompt_tokens"]
    for name, rows in (("grouped", grouped), ("spread", spread)):  # shown with -s
        print(f"{name}: (prefill tokens, prompt tokens, step seconds) per step:",
              [(r["rollout/prefill_tokens"], r["rollout/prompt_tokens"], round(r["time/step_seconds"], 2)) for r in rows])
