"""indexed stage."""
