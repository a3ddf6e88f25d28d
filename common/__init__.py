"""Small shared pieces: errors, registries, atomic file writes."""
