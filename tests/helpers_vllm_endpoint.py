"""The real vLLM server of the live tests (.ci/vllm.sh starts it; CI does), found through
SERVELAB_TEST_ENDPOINT. A module that needs it does ``ENDPOINT, pytestmark = vllm_endpoint()``:
without a server its tests skip, or, with SERVELAB_TEST_REQUIRE_ENDPOINT=1 (as in CI), fail."""

from __future__ import annotations

import os
from urllib.parse import urlparse

import pytest

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def vllm_endpoint() -> tuple[str | None, pytest.MarkDecorator]:
    endpoint = os.environ.get("SERVELAB_TEST_ENDPOINT")
    if not endpoint and os.environ.get("SERVELAB_TEST_REQUIRE_ENDPOINT") == "1":
        pytest.fail("SERVELAB_TEST_REQUIRE_ENDPOINT=1 but SERVELAB_TEST_ENDPOINT is unset: the vLLM server did not "
                    "start", pytrace=False)
    if endpoint:
        assert urlparse(endpoint).hostname in LOOPBACK, f"live tests use loopback servers only, not {endpoint}"
    return endpoint, pytest.mark.skipif(not endpoint, reason="SERVELAB_TEST_ENDPOINT is unset (source .ci/vllm.sh "
                                                             "to start a vLLM CPU server)")
