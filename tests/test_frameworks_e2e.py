"""End to end: agents written with real agent frameworks train through the session endpoint.

Each agent in tests/agents/ drives the calculator task with its framework's own loop: the OpenAI
Agents SDK on its Chat Completions model and on its Responses model, LangChain's `ChatOpenAI`
with the tool bound, and pydantic-ai (OpenAI provider, a tool and a structured output); and the
plain OpenAI SDK sampling one turn at its own temperature (the sampling contract). The model
is warm-started to call the tool and then answer, so most rollouts are two-turn tool
conversations; each must stay one segment (every later request continues the recorded one), and
the trainer must score the very tokens the engine sampled.
"""

import json
import math
from pathlib import Path

import pytest
from test_train_e2e import CHAT_AGENTS_BY_GROUP, DEMO, _job_sets, _torchrun, agents_by_group_env, finished_rollouts

# torchrun jobs: not in the unit tier; 600 s is above each job's own limit (420 s or less)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

AGENTS = Path(__file__).parent / "agents"
# Agents (tests/agents/chat_agents_by_group.py entries) that share a job, a group of each in turn:
# the Agents SDK file on its chat completions and its Responses model, LangChain, and the plain SDK
# with the agent's own temperature (0.7) on its first turn. pydantic-ai has a job of its own: its
# replies under a grammar carry the masked distribution's log-probs (below), which would raise the
# shared step's bound on the trainer's mismatch for every agent.
AGENTS_SDK = AGENTS / "openai_agents_sdk.py"
JOBS = {"four_frameworks": [f"{AGENTS_SDK}:api=chat", f"{AGENTS_SDK}:api=responses", AGENTS / "langchain_chat.py",
                            AGENTS / "temperature_override.py"],
        "pydantic_ai_chat": [AGENTS / "pydantic_ai_chat.py"]}
NEW_SEGMENT_REASONS = ("history_rewrite", "template_rewrite", "tools_changed", "version_change")
GROUPS_PER_AGENT = 2  # a step: each agent's 2 groups of 4 rollouts


@pytest.mark.parametrize("job", JOBS)
def test_framework_agents_train_one_clean_segment_per_rollout(tmp_path, tiny_tool_model_dir, demo_data_dir, job):
    out, log, agents = tmp_path / "run", tmp_path / "finished", JOBS[job]
    num_rollouts = 4 * GROUPS_PER_AGENT * len(agents)
    # Synchronous (from _job_sets), so the trainer scores each step's tokens under the weights that
    # sampled them; 32 tokens fit pydantic-ai's final_result call; 1024 fit its retry prompts.
    sets = _job_sets(tiny_tool_model_dir, demo_data_dir, out, **{
        "agent.path": CHAT_AGENTS_BY_GROUP, "train.num_steps": 2, "refit.check_every_steps": 2,
        "rollout.prompts_per_step": GROUPS_PER_AGENT * len(agents), "rollout.max_response_tokens": 32,
        "rollout.max_length": 1024})
    done = _torchrun(2, f"{DEMO}:tool_agent", sets, env=agents_by_group_env(log, *agents))
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    assert [r["step"] for r in steps] == [1, 2]
    failed = [line for line in done.stderr.splitlines() if "failed (" in line][:3]  # why, in the rank's log
    for row in steps:
        assert row["rollout/failed"] == 0, ({k: v for k, v in row.items() if k.startswith("rollout/failed_")}, failed)
        assert row["rollout/num_rollouts"] == num_rollouts and row["rollout/num_groups"] == num_rollouts // 4, row
        # One session per rollout, opened once; the tool turns continued its segment.
        assert row["drift/first_turn"] == num_rollouts, row
        assert row["rollout/segments_per_rollout"] == 1.0, row
        assert not {reason: row[f"drift/{reason}"] for reason in NEW_SEGMENT_REASONS if row.get(f"drift/{reason}")}
        # The trainer recomputes the engine's log-probs of the recorded tokens: KL(behaviour || trainer)
        # is rounding only (a token or context the engine did not see would show as ~1e-2 or more).
        # Replies under a grammar (pydantic-ai's tool_choice "required") carry the masked
        # distribution's log-probs (molt/endpoint/constraints.py), above the trainer's by the mass
        # the mask removed: small while the grammar allows the tokens this model writes (~0.03 at
        # most here), large when it forces tokens the model would not write.
        limit = 0.1 if row.get("drift/constrained") else 1e-6
        assert row["train/mismatch_kl"] < limit, row
        assert row["train/num_action_tokens"] > 0 and math.isfinite(row["train/loss"]), row
        assert row.get("drift/continued", 0) >= num_rollouts // 2, row  # the tool's turn continued it
    # Each agent, each step: all its rollouts, one segment each, at least half continued by a second
    # turn (the warm-started model calls the tool nearly always).
    finished = finished_rollouts(log)
    for name in (_entry_name(agent) for agent in agents):
        for version in (0, 1):
            mine = [r for r in finished if (r["agent"], r["version"]) == (name, version)]
            assert len(mine) == 4 * GROUPS_PER_AGENT and all(r["segments"] == 1 for r in mine), (name, version, mine)
            assert sum(r["ledger"].get("continued", 0) >= 1 for r in mine) >= len(mine) // 2, (name, version, mine)
    gaps = [r["refit/max_abs_logprob_diff"] for r in rows if "refit/max_abs_logprob_diff" in r]
    assert gaps and all(gap <= 1e-4 for gap in gaps), gaps


def _entry_name(agent) -> str:
    """The name tests/agents/chat_agents_by_group.py logs for an entry: the file's stem[:value]."""
    path, _, setting = str(agent).partition(":")
    return Path(path).stem + (f":{setting.partition('=')[2]}" if setting else "")
