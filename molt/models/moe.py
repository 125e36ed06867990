"""Mixture-of-experts shapes read from a Hugging Face config: how many routed experts a layer has."""

EXPERT_COUNT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts")


def count_experts(config) -> int:
    """The routed experts per MoE layer of a Hugging Face config (0 for a dense model)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return next((getattr(config, name) for name in EXPERT_COUNT_FIELDS if getattr(config, name, None)), 0)
