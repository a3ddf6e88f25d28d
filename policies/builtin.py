"""Imports every built-in policy module so that each registers itself (one line per policy file)."""

from servelab.policies import orca, round_robin, sarathi, srpt, static, vllm_v0  # noqa: F401
