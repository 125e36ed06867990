"""The RL math: pure functions over tensors (DESIGN section 8)."""

from molt.objectives.advantages import compute_grpo_advantages
from molt.objectives.policy_loss import compute_ppo_clip_loss

__all__ = ["compute_grpo_advantages", "compute_ppo_clip_loss"]
