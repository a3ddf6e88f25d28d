"""``servelab serve``: an OpenAI-compatible HTTP server whose tokens come on the simulated engine's schedule."""
