"""Where ranks run and how they talk: placement, per-device settings, process-group timeouts, the Slurm
environment, process lifetime, the trainer mesh and expert parallelism."""
