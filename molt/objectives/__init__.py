"""The RL math: pure functions over tensors (DESIGN section 8)."""

from molt.objectives.advantages import (compute_dr_grpo_advantages, compute_gae_advantages,
                                        compute_group_mean_advantages, compute_grpo_advantages,
                                        compute_reinforce_pp_advantages, compute_rloo_advantages, whiten)
from molt.objectives.kl import (AdaptiveKLController, compute_kl_estimate, compute_kl_loss,
                                compute_kl_reward_penalty)
from molt.objectives.policy_loss import (LOSS_AGGREGATIONS, aggregate_tokens, check_importance_options,
                                         compute_cispo_loss, compute_entropy_bonus, compute_gspo_loss,
                                         compute_importance_weights, compute_loss_denominator, compute_ppo_clip_loss,
                                         compute_trust_region_weights, count_sequences, token_entropy_from_logits)
from molt.objectives.value_loss import compute_value_loss

__all__ = ["LOSS_AGGREGATIONS", "AdaptiveKLController", "aggregate_tokens", "check_importance_options",
           "compute_cispo_loss", "compute_dr_grpo_advantages", "compute_entropy_bonus", "compute_gae_advantages",
           "compute_group_mean_advantages", "compute_grpo_advantages", "compute_gspo_loss",
           "compute_importance_weights", "compute_kl_estimate", "compute_kl_loss", "compute_kl_reward_penalty",
           "compute_loss_denominator", "compute_ppo_clip_loss", "compute_reinforce_pp_advantages",
           "compute_rloo_advantages", "compute_trust_region_weights", "compute_value_loss", "count_sequences",
           "token_entropy_from_logits", "whiten"]
