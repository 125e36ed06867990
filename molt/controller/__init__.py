"""Rank 0's rollout controller: the prompt stream, dispatch, group rules, engine routing and evaluation
runs (DESIGN sections 1, 2.1-2.2, 2.6)."""
