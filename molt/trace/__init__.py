"""The data that crosses ranks: experiences (one per trajectory segment), routed experts, images,
generations (DESIGN section 5)."""
