#!/usr/bin/env bash
# GuideLLM from PyPI, the third-party client that tests/test_guidellm_serve_live.py runs unchanged against
# `servelab serve` (issue #30's acceptance).
#
#   source .ci/guidellm.sh      install guidellm==0.8.1 (once) into its own venv and export
#                               SERVELAB_TEST_GUIDELLM_VENV (the test finds GuideLLM there)
#
# GuideLLM brings torch, transformers, datasets and httpx: it gets a venv of its own (.guidellm-venv,
# or SERVELAB_GUIDELLM_VENV), with the local CPU torch 2.13.0 wheel (the default torch wheel is a CUDA
# build of several GiB). Nothing is downloaded at test time: the test gives GuideLLM a locally trained
# tokenizer and HF_HUB_OFFLINE=1. An install that fails fails the run (sourced under `set -e`): CI must
# run that test, and SERVELAB_TEST_REQUIRE_GUIDELLM=1 (set by .ci/run) turns its skip into a failure.

_servelab_guidellm_install() {
  local root venv log t_start
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  venv="${SERVELAB_GUIDELLM_VENV:-$root/.guidellm-venv}"
  log="${TMPDIR:-/tmp}/servelab-guidellm-install.log"
  t_start=$(date +%s)
  if [ ! -x "$venv/bin/guidellm" ] || ! "$venv/bin/python" -c \
       "import guidellm, importlib.metadata as m; assert m.version('guidellm') == '0.8.1'" >/dev/null 2>&1; then
    echo "guidellm.sh: installing guidellm==0.8.1 into $venv" >&2
    python3 -m venv --clear "$venv"  # a venv without a working guidellm (an install cut short) starts over
    "$venv/bin/pip" install -q 'guidellm==0.8.1' 'torch==2.13.0' >"$log" 2>&1 \
      || { tail -n 30 "$log" >&2; echo "guidellm.sh: install failed (log: $log)" >&2; return 1; }
  fi
  export SERVELAB_TEST_GUIDELLM_VENV="$venv"
  echo "guidellm.sh: guidellm ready in $venv after $(( $(date +%s) - t_start )) s" >&2
}

_servelab_guidellm_install
