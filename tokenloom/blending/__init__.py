"""blending stage."""
