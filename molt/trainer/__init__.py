"""Trainer ranks: the training loop, the learner step, the FSDP2 actor and critic, log-probs, batches,
diagnostics, checkpoints and the optimizer (DESIGN sections 1, 2.7)."""
