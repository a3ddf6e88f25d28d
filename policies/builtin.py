"""Imports every built-in policy module so that each registers itself (one line per policy file)."""

from servelab.policies import orca, round_robin, sarathi, srpt, static, vllm_v0  # noqa: F401
from servelab.policies import tiers  # noqa: F401
from servelab.policies import fair  # noqa: F401
from servelab.policies import edf  # noqa: F401
