"""preprocess stage."""
