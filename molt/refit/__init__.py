"""Weight sync (DESIGN section 6): the interface, its gloo and NCCL backends, the engine-side receiver and
the coordinator of the refit protocol."""
