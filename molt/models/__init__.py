"""Hugging Face checkpoints on the trainer: sharded loading, vision-language models, MoE shapes."""
