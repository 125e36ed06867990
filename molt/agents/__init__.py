"""The agent API (DESIGN section 3)."""

from molt.agents.base import AgentRunnerBase, Result, RolloutOutcome, RolloutRequest, SamplingParams, load_agent_runner
from molt.agents.chat import ChatAgent, ChatAgentRunner, ChatContext
from molt.agents.env import Env, StepEnvRunner, StepState

__all__ = ["AgentRunnerBase", "ChatAgent", "ChatAgentRunner", "ChatContext", "Env", "Result", "RolloutOutcome",
           "RolloutRequest", "SamplingParams", "StepEnvRunner", "StepState", "load_agent_runner"]
