"""Fidelity against real serving: import real benchmark runs as run directories, and validate the
simulator against them (docs/fidelity.md)."""
