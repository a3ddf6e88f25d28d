"""Live endpoints: drive a running OpenAI-compatible server with a trace and measure it (docs/live.md)."""
