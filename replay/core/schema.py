"""Column schemas of a run directory's tables: requests.parquet and steps.parquet.

Documented for users in docs/results.md. Times are simulated seconds since the trace start.
"""

from __future__ import annotations

import pyarrow as pa

RESULT_SCHEMA_VERSION = 1

# One row per trace request, whatever became of it.
REQUESTS_SCHEMA = pa.schema(
    [
        ("request_id", pa.int64()),
        ("tenant", pa.string()),
        ("tier", pa.string()),
        ("session_id", pa.int64()),  # null when the trace has none
        ("replica", pa.int32()),  # null if never routed (a closed-loop turn that never arrived)
        ("status", pa.string()),  # finished | unfinished | rejected (+ throttled, dropped: platform policies)
        ("reason", pa.string()),  # why rejected/dropped; null otherwise
        ("arrival_s", pa.float64()),  # effective arrival (closed-loop turns: predecessor finish + think_s)
        ("first_scheduled_s", pa.float64()),  # start of the first iteration that computed any of its tokens
        ("first_token_s", pa.float64()),  # end of the iteration that completed its prompt
        ("finish_s", pa.float64()),  # time of its last token (finished only)
        ("prompt_tokens", pa.int32()),
        ("output_tokens", pa.int32()),  # tokens the trace says it generates
        ("generated_tokens", pa.int32()),  # tokens it actually got (== output_tokens when finished)
        ("num_preemptions", pa.int32()),
        ("ttft_s", pa.float64()),  # first_token_s - arrival_s
        ("tpot_s", pa.float64()),  # (finish_s - first_token_s) / (output_tokens - 1); 0 for 1-token outputs
        ("e2e_s", pa.float64()),  # finish_s - arrival_s
        ("max_itl_s", pa.float64()),  # longest gap between consecutive tokens (null with < 2 tokens)
        ("ttft_slo_s", pa.float64()),  # per-request SLO overrides from the trace (null = use the SLO table)
        ("tpot_slo_s", pa.float64()),
        ("cached_tokens", pa.int32()),  # tokens its admissions reused from the prefix cache (not computed)
    ]
)

# Platform columns (docs/platform.md), appended after REQUESTS_SCHEMA's: 0 / null when unused.
PLATFORM_SCHEMA = pa.schema(
    [
        ("num_retries", pa.int32()),  # client retries after being throttled
        ("paused_s", pa.float64()),  # time held while its tier was paused
        ("num_resumes", pa.int32()),  # times it resumed from the journal after losing its KV
        ("tokens_lost", pa.int32()),  # generated tokens thrown away and generated again (no journal)
        ("recomputed_tokens", pa.int32()),  # tokens whose KV was computed again after losing it
        ("refused_s", pa.float64()),  # when it was throttled for good or dropped
    ]
)

# Prefill/decode disaggregation columns (docs/cluster.md), appended after the platform columns
# only in a replay with a decode pool: null for a request that never got that far (finished at its
# first token, rejected, still prefilling).
DISAGG_SCHEMA = pa.schema(
    [
        ("prefill_replica", pa.int32()),  # the prefill replica that emitted its first token
        ("decode_replica", pa.int32()),  # the decode replica its KV moved to (then also `replica`)
        ("handoff_wait_s", pa.float64()),  # first token -> transfer start: waiting for a decode replica with room
        ("transfer_s", pa.float64()),  # transfer start -> its KV landed (bytes / shared bandwidth + latency)
    ]
)

# A pool of several instance types (docs/cluster.md), appended last: the type (GPU) of the replica
# in `replica` (null when never routed).
INSTANCE_SCHEMA = pa.schema([("instance", pa.string())])
# prefill/decode pools: ``instance`` is the decoding replica's type, ``prefill_instance`` the prefilling one's
PD_INSTANCE_SCHEMA = pa.schema([("instance", pa.string()), ("prefill_instance", pa.string())])

# Speculative decoding (docs/runners.md), appended last in a replay with spec_method set: the
# acceptance rate the request drew (or the trace gave) and vLLM's spec-decode counters; the two
# ratios are null for a request that never verified drafts.
SPEC_SCHEMA = pa.schema(
    [
        ("spec_acceptance", pa.float64()),  # each draft's acceptance probability, given the earlier ones were accepted
        ("spec_num_drafts", pa.int32()),  # steps that verified drafts of it
        ("spec_num_draft_tokens", pa.int32()),  # drafts verified
        ("spec_num_accepted_tokens", pa.int32()),  # drafts accepted
        ("spec_acceptance_rate", pa.float64()),  # accepted / draft tokens
        ("spec_mean_acceptance_length", pa.float64()),  # 1 + accepted / drafts: tokens per verifying step
    ]
)

# One row per stretch of identical iterations on a replica (num_iterations >= 1).
STEPS_SCHEMA = pa.schema(
    [
        ("replica", pa.int32()),
        ("start_s", pa.float64()),
        ("duration_s", pa.float64()),  # whole stretch
        ("num_iterations", pa.int32()),
        ("prefill_tokens", pa.int64()),  # per iteration
        ("prefill_requests", pa.int32()),
        ("decode_requests", pa.int32()),
        ("batch_requests", pa.int32()),
        ("kv_blocks_used", pa.int32()),  # at the start of the stretch, after this step's allocation
        ("kv_blocks_total", pa.int32()),
        ("waiting", pa.int32()),  # queue length when the batch was chosen
        ("preemptions", pa.int32()),  # preemptions decided for this step
        ("tier_bytes", pa.int64()),  # bytes moved to/from the offload tiers since the replica's last row (null: no tiers)
    ]
)


def numeric_column(values, mask=None) -> pa.Array:
    """``pa.array(values, mask=mask)`` for a 1-d numpy array of ints or floats (null where ``mask``), made
    from its buffers: ``pa.array`` checks any ndarray for a masked one, which imports numpy.ma (~15 ms,
    a tenth of a small replay's start-up; tests/test_startup_speed.py)."""
    import numpy as np

    values = np.ascontiguousarray(values)
    validity = None if mask is None else pa.py_buffer(np.packbits(~mask, bitorder="little"))
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [validity, pa.py_buffer(values)])
