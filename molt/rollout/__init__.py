"""Rollout ranks: the vLLM engine, the session endpoint's host, agent workers and route capture
(DESIGN sections 1, 2.3-2.5)."""
