"""tokenizers stage."""
