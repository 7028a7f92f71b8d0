"""Migration scripts, one revision per file."""
