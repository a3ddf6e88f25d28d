"""The `servelab` command line."""
