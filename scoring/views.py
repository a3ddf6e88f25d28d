"""SQL of the derived views (request_metrics, slo_attainment, latency_summary, goodput, fairness, ...).

They read only the base relations `requests`, `steps`, `runs` and `slo_table`, so the same SQL
serves Parquet-backed views and a collected DuckDB file. Formulas are documented in docs/metrics.md.
"""

from __future__ import annotations

import duckdb

from servelab.scoring.tasks import create_task_views

# Percentiles every latency summary reports (DuckDB quantile_cont: linear interpolation, like numpy/vLLM).
QUANTILES = (0.5, 0.9, 0.95, 0.99, 0.999)
QUANTILE_NAMES = ("p50", "p90", "p95", "p99", "p999")
LATENCY_METRICS = ("ttft_s", "tpot_s", "e2e_s", "queue_s", "max_itl_s")
END_STATUSES = ("finished", "unfinished", "rejected", "throttled", "dropped")
# live runs (servelab bench; docs/live.md), and a replay's client timeouts (aborted: replay/platform/abort.py)
LIVE_STATUSES = ("failed", "timeout", "cancelled", "aborted")
# never sent: a request it depends on did not finish (trace schema v2; replay/core/depends.py). A miss, as
# every status but finished is.
DEPENDENT_STATUSES = ("skipped",)

# TPOT per metric variant; the other columns are identical.
TPOT_VARIANTS = {
    # vLLM bench serve: decode time over the gaps after the first token; NULL for a one-token output, which
    # vLLM leaves out of its TPOT list (its goodput check counts it as TPOT 0: met_tpot below)
    "request_metrics": "CASE WHEN output_tokens > 1 THEN (finish_s - first_token_s) / (output_tokens - 1) END",
    # GuideLLM: whole latency over all output tokens (includes TTFT)
    "request_metrics_guidellm": "CASE WHEN output_tokens > 0 THEN (finish_s - arrival_s) / output_tokens END",
    # DistServe simulator: decode time over all output tokens
    "request_metrics_distserve": "CASE WHEN output_tokens > 0 THEN (finish_s - first_token_s) / output_tokens END",
}

RUN_SPAN = """
CREATE OR REPLACE VIEW run_span AS
WITH e AS (
    SELECT run_id,
           max(greatest(arrival_s, coalesce(first_token_s, arrival_s), coalesce(finish_s, arrival_s))) AS last_event_s
    FROM requests GROUP BY run_id
), s AS (
    SELECT run_id, max(start_s + duration_s) AS last_step_end_s FROM steps GROUP BY run_id
), x AS (
    -- where the replay stopped (a horizon may cut it before the last arrival), else the last event
    SELECT e.run_id, coalesce(u.simulated_span_s, greatest(e.last_event_s, coalesce(s.last_step_end_s, e.last_event_s)))
               AS end_s,
           u.source_duration_s, coalesce(u.num_gpus, 1) AS num_gpus
    FROM e LEFT JOIN s USING (run_id) LEFT JOIN runs u USING (run_id)
), r AS (
    -- the requests offered: those arriving by the run's end (later ones were never sent; counted apart)
    SELECT q.run_id,
           count(*) FILTER (WHERE q.arrival_s IS NULL OR q.arrival_s <= x.end_s) AS requests,  -- as offered_requests
           count(*) FILTER (WHERE q.arrival_s > x.end_s) AS after_horizon,
           min(q.arrival_s) FILTER (WHERE q.arrival_s <= x.end_s) AS first_arrival_s,
           max(q.arrival_s) FILTER (WHERE q.arrival_s <= x.end_s) AS last_arrival_s,
           max(q.finish_s) FILTER (WHERE q.status = 'finished') AS last_finish_s
    FROM requests q JOIN x USING (run_id) GROUP BY q.run_id
)
SELECT r.run_id, r.requests, r.after_horizon, r.first_arrival_s, r.last_arrival_s, r.last_finish_s, x.end_s,
       -- vLLM-style benchmark duration: first arrival to last finish (to the run's end if none finished);
       -- an imported run keeps its source's own (vLLM's runs from before its first Poisson gap)
       coalesce(x.source_duration_s, nullif(coalesce(r.last_finish_s, x.end_s) - r.first_arrival_s, 0.0)) AS duration_s,
       nullif(coalesce(r.last_finish_s, x.end_s) - r.first_arrival_s, 0.0) AS measured_duration_s,
       r.last_finish_s IS NOT NULL AS duration_to_finish,  -- false: nothing finished, so to the run's end
       CASE WHEN r.requests > 1 AND r.last_arrival_s > r.first_arrival_s
            THEN (r.requests - 1) / (r.last_arrival_s - r.first_arrival_s) END AS offered_rate_rps,
       x.num_gpus
FROM r JOIN x USING (run_id)
"""

# The requests a run was offered: every row but those arriving after the run's end (a `--until`
# horizon stops the replay before them; run_span.after_horizon counts them). A request with no arrival
# was never sent because one it depends on did not finish (`skipped`): a miss, so it stays.
OFFERED = """
CREATE OR REPLACE VIEW offered_requests AS
SELECT q.* FROM requests q JOIN run_span sp ON sp.run_id = q.run_id
WHERE q.arrival_s IS NULL OR q.arrival_s <= sp.end_s
"""

REQUEST_METRICS = """
CREATE OR REPLACE VIEW {name} AS
WITH base AS (
    SELECT r.*,
           r.status = 'finished' AS finished,
           coalesce(r.ttft_slo_s, te.ttft_s, ti.ttft_s, g.ttft_s) AS eff_ttft_slo_s,
           coalesce(r.tpot_slo_s, te.tpot_s, ti.tpot_s, g.tpot_s) AS eff_tpot_slo_s,
           coalesce(r.e2e_slo_s, te.e2e_s, ti.e2e_s, g.e2e_s) AS eff_e2e_slo_s,
           coalesce(r.max_stall_slo_s, te.max_stall_s, ti.max_stall_s, g.max_stall_s) AS eff_max_stall_slo_s,
           sp.end_s AS run_end_s
    FROM offered_requests r
    LEFT JOIN run_span sp ON sp.run_id = r.run_id
    LEFT JOIN slo_table g ON g.scope = 'global'
    LEFT JOIN slo_table ti ON ti.scope = 'tier' AND ti.name = r.tier
    LEFT JOIN slo_table te ON te.scope = 'tenant' AND te.name = r.tenant
), m AS (
    SELECT run_id, request_id, tenant, tier, session_id, replica, status, reason, finished,
           arrival_s, first_scheduled_s, first_token_s, finish_s,
           prompt_tokens, output_tokens, generated_tokens, num_preemptions, num_retries, paused_s,
           first_scheduled_s - arrival_s AS queue_s,
           first_token_s - arrival_s AS ttft_s,
           CASE WHEN finished THEN {tpot} END AS tpot_s,
           CASE WHEN finished THEN finish_s - arrival_s END AS e2e_s,
           max_itl_s,
           -- a finished request with one token never waited between tokens
           CASE WHEN finished THEN coalesce(max_itl_s, 0.0) END AS max_stall_s,
           -- starvation: time until first scheduled, or until the run ended for one never scheduled
           CASE WHEN first_scheduled_s IS NOT NULL THEN first_scheduled_s - arrival_s
                WHEN status = 'unfinished' THEN run_end_s - arrival_s END AS wait_s,
           eff_ttft_slo_s AS ttft_slo_s, eff_tpot_slo_s AS tpot_slo_s,
           eff_e2e_slo_s AS e2e_slo_s, eff_max_stall_slo_s AS max_stall_slo_s
    FROM base
)
SELECT *,
       CASE WHEN ttft_slo_s IS NOT NULL THEN finished AND coalesce(ttft_s <= ttft_slo_s, false) END AS met_ttft,
       -- a finished output of at most one token has no gap to be late (vLLM's goodput: TPOT 0, met)
       CASE WHEN tpot_slo_s IS NOT NULL THEN finished AND coalesce(tpot_s <= tpot_slo_s, output_tokens <= 1, false) END AS met_tpot,
       CASE WHEN e2e_slo_s IS NOT NULL THEN finished AND coalesce(e2e_s <= e2e_slo_s, false) END AS met_e2e,
       CASE WHEN max_stall_slo_s IS NOT NULL THEN finished AND coalesce(max_stall_s <= max_stall_slo_s, false) END AS met_stall,
       finished
         AND (ttft_slo_s IS NULL OR coalesce(ttft_s <= ttft_slo_s, false))
         AND (tpot_slo_s IS NULL OR coalesce(tpot_s <= tpot_slo_s, output_tokens <= 1, false))
         AND (e2e_slo_s IS NULL OR coalesce(e2e_s <= e2e_slo_s, false))
         AND (max_stall_slo_s IS NULL OR coalesce(max_stall_s <= max_stall_slo_s, false)) AS met_all
FROM m
"""

# Grouping sets shared by the per-run summaries: the whole run, each tier, each tenant.
_SCOPE = """
    CASE WHEN grouping(tier) = 0 THEN 'tier' WHEN grouping(tenant) = 0 THEN 'tenant' ELSE 'overall' END AS scope,
    CASE WHEN grouping(tier) = 0 THEN tier WHEN grouping(tenant) = 0 THEN tenant END AS name"""
_SCOPE_ORDER = "run_id, CASE scope WHEN 'overall' THEN 0 WHEN 'tier' THEN 1 ELSE 2 END, name NULLS FIRST"

# Requests arriving after the run's end, per scope: never offered, so in no denominator, but counted
# (`after_horizon`) so that they do not vanish. Joined on a summary's (run_id, scope, name).
_LATE = f"""late AS (
    SELECT q.run_id, {_SCOPE}, count(*) AS after_horizon
    FROM requests q JOIN run_span sp ON sp.run_id = q.run_id WHERE q.arrival_s > sp.end_s
    GROUP BY GROUPING SETS ((q.run_id), (q.run_id, tier), (q.run_id, tenant))
)"""
_LATE_JOIN = "LEFT JOIN late l ON l.run_id = {t}.run_id AND l.scope = {t}.scope AND l.name IS NOT DISTINCT FROM {t}.name"

_STATUS_COUNTS = ",\n".join(f"    count(*) FILTER (WHERE status = '{s}') AS {s}" for s in END_STATUSES + LIVE_STATUSES + DEPENDENT_STATUSES)

SLO_ATTAINMENT = f"""
CREATE OR REPLACE VIEW slo_attainment AS
WITH a AS (
SELECT run_id, {_SCOPE},
    count(*) AS requests,
{_STATUS_COUNTS},
    CAST(coalesce(sum(num_preemptions), 0) AS BIGINT) AS preemptions,
    count(*) FILTER (WHERE num_preemptions > 0) AS preempted_requests,
    count(*) FILTER (WHERE met_all) AS met_all,
    count(*) FILTER (WHERE met_all) / count(*) AS attainment,
    count(*) FILTER (WHERE met_ttft) / nullif(count(met_ttft), 0) AS attainment_ttft,
    count(*) FILTER (WHERE met_tpot) / nullif(count(met_tpot), 0) AS attainment_tpot,
    count(*) FILTER (WHERE met_e2e) / nullif(count(met_e2e), 0) AS attainment_e2e,
    count(*) FILTER (WHERE met_stall) / nullif(count(met_stall), 0) AS attainment_stall
FROM request_metrics
GROUP BY GROUPING SETS ((run_id), (run_id, tier), (run_id, tenant))
), {_LATE}
SELECT * FROM (SELECT a.*, coalesce(l.after_horizon, 0) AS after_horizon FROM a {_LATE_JOIN.format(t="a")})
ORDER BY {_SCOPE_ORDER}
"""

_Q = "[" + ", ".join(repr(q) for q in QUANTILES) + "]"

_PER_METRIC = ",\n".join(
    f"count({m}) AS {m}__n, avg({m}) AS {m}__mean, quantile_cont({m}, {_Q}) AS {m}__q, "
    f"min({m}) AS {m}__min, max({m}) AS {m}__max"
    for m in LATENCY_METRICS
)
_UNSTACK = "\nUNION ALL\n".join(
    f"SELECT run_id, scope, name, '{m}' AS metric, {m}__n AS n, {m}__mean AS mean, "
    + ", ".join(f"{m}__q[{i + 1}] AS {n}" for i, n in enumerate(QUANTILE_NAMES))
    + f", {m}__min AS min, {m}__max AS max FROM a WHERE {m}__n > 0"
    for m in LATENCY_METRICS
)

# Aggregate every metric in one pass, then stack: far cheaper than UNPIVOT over all requests.
LATENCY_SUMMARY = f"""
CREATE OR REPLACE VIEW latency_summary AS
WITH a AS MATERIALIZED (
    SELECT run_id, {_SCOPE},
{_PER_METRIC}
    FROM request_metrics WHERE finished
    GROUP BY GROUPING SETS ((run_id), (run_id, tier), (run_id, tenant))
)
SELECT * FROM (
{_UNSTACK}
)
ORDER BY {_SCOPE_ORDER}, metric
"""

GOODPUT = f"""
CREATE OR REPLACE VIEW goodput AS
WITH g AS (
    SELECT run_id, {_SCOPE},
        count(*) AS requests,
        count(*) FILTER (WHERE finished) AS completed,
        count(*) FILTER (WHERE met_all) AS met_all,
        sum(output_tokens) FILTER (WHERE finished) AS completed_output_tokens,
        sum(prompt_tokens + output_tokens) FILTER (WHERE finished) AS completed_total_tokens
    FROM request_metrics
    GROUP BY GROUPING SETS ((run_id), (run_id, tier), (run_id, tenant))
), {_LATE}
SELECT * FROM (
SELECT g.run_id, g.scope, g.name, g.requests, completed, met_all,
       met_all / g.requests AS attainment,
       sp.duration_s,
       completed / sp.duration_s AS request_throughput_rps,
       coalesce(completed_output_tokens, 0) / sp.duration_s AS output_throughput_tps,
       coalesce(completed_total_tokens, 0) / sp.duration_s AS total_token_throughput_tps,
       met_all / sp.duration_s AS goodput_rps,
       sp.num_gpus,
       met_all / sp.duration_s / sp.num_gpus AS goodput_rps_per_gpu,
       sp.offered_rate_rps,
       coalesce(l.after_horizon, 0) AS after_horizon
FROM g JOIN run_span sp USING (run_id) {_LATE_JOIN.format(t="g")})
ORDER BY {_SCOPE_ORDER}
"""

COST = """
CREATE OR REPLACE VIEW cost AS
WITH p AS (
    SELECT p.* EXCLUDE (gpu_s), coalesce(p.gpu_s, p.gpus * sp.duration_s) AS gpu_s, sp.duration_s,
           coalesce(p.gpu_s, p.gpus * sp.duration_s) / 3600.0 * p.price_per_gpu_hour AS dollars
    FROM pools p JOIN run_span sp USING (run_id)
), c AS (
    SELECT run_id,
        CASE WHEN grouping(pool) = 0 THEN 'pool' WHEN grouping(gpu) = 0 THEN 'gpu' ELSE 'overall' END AS scope,
        CASE WHEN grouping(pool) = 0 THEN pool WHEN grouping(gpu) = 0 THEN gpu END AS name,
        CASE WHEN grouping(pool) = 0 THEN any_value(role) END AS role,
        CAST(sum(gpus) AS BIGINT) AS gpus,  -- provisioned: an autoscaled pool's most replicas x TP
        sum(gpu_s) AS gpu_s,
        sum(gpu_s) / any_value(duration_s) AS mean_gpus,  -- time-averaged
        -- NULL unless every pool in the group has a price
        CASE WHEN count(price_per_gpu_hour) = count(*) THEN sum(dollars) END AS dollars
    FROM p
    GROUP BY GROUPING SETS ((run_id), (run_id, pool), (run_id, gpu))
), t AS (
    SELECT run_id, CAST(sum(coalesce(generated_tokens, 0)) AS BIGINT) AS output_tokens FROM requests GROUP BY run_id
)
SELECT c.*, t.output_tokens, g.completed, g.met_all,
       c.dollars / nullif(t.output_tokens, 0) * 1e6 AS dollars_per_million_output_tokens,
       c.dollars / nullif(g.completed, 0) AS dollars_per_request,
       g.met_all / nullif(c.dollars, 0) AS goodput_requests_per_dollar,
       -- one definition of goodput per GPU (the goodput view's): per GPU provisioned (runs.num_gpus)
       CASE WHEN c.scope = 'overall' THEN g.goodput_rps_per_gpu ELSE g.met_all / g.duration_s / nullif(c.gpus, 0) END
           AS goodput_rps_per_gpu,
       g.met_all / g.duration_s / nullif(c.mean_gpus, 0) AS goodput_rps_per_mean_gpu  -- per GPU held on average
FROM c JOIN t USING (run_id) JOIN goodput g ON g.run_id = c.run_id AND g.scope = 'overall'
ORDER BY c.run_id, CASE c.scope WHEN 'overall' THEN 0 WHEN 'pool' THEN 1 ELSE 2 END, c.name
"""

TENANT_SUMMARY = f"""
CREATE OR REPLACE VIEW tenant_summary AS
WITH {_LATE}, t AS (
SELECT m.run_id, tenant,
    count(*) AS requests,
    count(*) FILTER (WHERE finished) AS finished,
    count(*) FILTER (WHERE status = 'unfinished') AS unfinished,
    count(*) FILTER (WHERE status IN ('rejected', 'throttled', 'dropped')) AS refused,
    count(*) FILTER (WHERE met_all) / count(*) AS attainment,
    CAST(sum(prompt_tokens + output_tokens) AS BIGINT) AS tokens_demanded,
    -- a prompt counts as served once its first token exists; outputs as generated
    CAST(sum(CASE WHEN first_token_s IS NOT NULL THEN prompt_tokens ELSE 0 END + coalesce(generated_tokens, 0)) AS BIGINT) AS tokens_served,
    sum(CASE WHEN first_token_s IS NOT NULL THEN prompt_tokens ELSE 0 END + coalesce(generated_tokens, 0))
        / nullif(sum(prompt_tokens + output_tokens), 0) AS service_ratio,
    quantile_cont(ttft_s, 0.5) FILTER (WHERE finished) AS ttft_p50_s,
    quantile_cont(ttft_s, 0.99) FILTER (WHERE finished) AS ttft_p99_s,
    quantile_cont(tpot_s, 0.5) FILTER (WHERE finished) AS tpot_p50_s,
    quantile_cont(tpot_s, 0.99) FILTER (WHERE finished) AS tpot_p99_s,
    max(wait_s) AS max_wait_s,
    count(*) FILTER (WHERE met_all) / any_value(sp.duration_s) AS goodput_rps
FROM request_metrics m JOIN run_span sp ON sp.run_id = m.run_id
GROUP BY m.run_id, tenant
)
SELECT t.*, coalesce(l.after_horizon, 0) AS after_horizon
FROM t LEFT JOIN late l ON l.run_id = t.run_id AND l.scope = 'tenant' AND l.name IS NOT DISTINCT FROM t.tenant
ORDER BY t.run_id, t.tenant NULLS FIRST
"""

FAIRNESS = """
CREATE OR REPLACE VIEW fairness AS
SELECT run_id,
    count(*) AS tenants,
    -- Jain's index (sum x)^2 / (n sum x^2); NULL when every x is 0
    sum(service_ratio) ^ 2 / nullif(count(service_ratio) * sum(service_ratio ^ 2), 0) AS jain_service,
    sum(attainment) ^ 2 / nullif(count(attainment) * sum(attainment ^ 2), 0) AS jain_attainment,
    min(service_ratio) AS min_service_ratio,
    min(attainment) AS worst_tenant_attainment,
    first(tenant ORDER BY attainment, tenant NULLS FIRST) AS worst_tenant,
    max(max_wait_s) AS max_wait_s,
    first(tenant ORDER BY max_wait_s DESC NULLS LAST, tenant NULLS FIRST) AS longest_wait_tenant
FROM tenant_summary
GROUP BY run_id
ORDER BY run_id
"""

RESOURCE_SUMMARY = """
CREATE OR REPLACE VIEW resource_summary AS
SELECT run_id,
    CASE WHEN grouping(replica) = 0 THEN 'replica' ELSE 'overall' END AS scope,
    replica,
    count(DISTINCT replica) AS replicas,
    sum(duration_s) AS busy_s,
    CAST(sum(num_iterations) AS BIGINT) AS iterations,
    -- time-weighted: a stretch counts for as long as it lasted
    sum(batch_requests * duration_s) / nullif(sum(duration_s), 0) AS mean_batch_requests,
    max(batch_requests) AS max_batch_requests,
    sum(kv_blocks_used / nullif(kv_blocks_total, 0) * duration_s) / nullif(sum(duration_s), 0) AS mean_kv_util,
    max(kv_blocks_used / nullif(kv_blocks_total, 0)) AS max_kv_util,
    sum(waiting * duration_s) / nullif(sum(duration_s), 0) AS mean_waiting,
    max(waiting) AS max_waiting,
    CAST(sum(prefill_tokens * num_iterations) AS BIGINT) AS prefill_tokens,
    CAST(sum(decode_requests * num_iterations) AS BIGINT) AS decode_tokens,
    CAST(sum(preemptions) AS BIGINT) AS preemptions
FROM steps
GROUP BY GROUPING SETS ((run_id), (run_id, replica))
ORDER BY run_id, scope, replica
"""

REPLICA_BALANCE = """
CREATE OR REPLACE VIEW replica_balance AS
WITH req AS (
    SELECT run_id, replica, count(*) AS requests FROM offered_requests WHERE replica IS NOT NULL GROUP BY run_id, replica
), busy AS (
    SELECT run_id, replica, sum(duration_s) AS busy_s FROM steps GROUP BY run_id, replica
), per AS (
    SELECT run_id, replica, coalesce(req.requests, 0) AS requests, coalesce(busy.busy_s, 0.0) AS busy_s
    FROM req FULL OUTER JOIN busy USING (run_id, replica)
)
SELECT run_id,
    count(*) AS replicas,
    min(requests) AS min_requests, max(requests) AS max_requests,
    min(busy_s) AS min_busy_s, max(busy_s) AS max_busy_s,
    max(busy_s) / nullif(avg(busy_s), 0) AS busy_max_over_mean,
    sum(busy_s) ^ 2 / nullif(count(*) * sum(busy_s ^ 2), 0) AS jain_busy,
    sum(requests) ^ 2 / nullif(count(*) * sum(requests ^ 2), 0) AS jain_requests
FROM per
GROUP BY run_id
ORDER BY run_id
"""

ATTAINMENT_VS_RATE = """
CREATE OR REPLACE VIEW attainment_vs_rate AS
SELECT a.run_id, sp.offered_rate_rps, a.requests, a.attainment, g.goodput_rps, g.request_throughput_rps
FROM slo_attainment a
JOIN goodput g ON g.run_id = a.run_id AND g.scope = 'overall'
JOIN run_span sp ON sp.run_id = a.run_id
JOIN runs u ON u.run_id = a.run_id
-- a run stopped by Ctrl-C/SIGTERM (an interrupted sweep level) measured less than its level: no point
WHERE a.scope = 'overall' AND u.stopped_by IS DISTINCT FROM 'interrupt'
ORDER BY sp.offered_rate_rps NULLS LAST, a.run_id
"""

# Table macro: ``SELECT * FROM resource_timeline(10.0)`` gives 10-second buckets. A stretch is
# split across the buckets it overlaps, so long decode stretches are counted where they ran.
RESOURCE_TIMELINE = """
CREATE OR REPLACE MACRO resource_timeline(bucket_s) AS TABLE
WITH s AS (
    SELECT run_id, replica, start_s, start_s + duration_s AS end_s, batch_requests, waiting,
           kv_blocks_used / nullif(kv_blocks_total, 0) AS kv_util,
           unnest(range(CAST(floor(start_s / bucket_s) AS BIGINT),
                        CAST(floor((start_s + duration_s) / bucket_s) AS BIGINT) + 1)) AS k
    FROM steps WHERE duration_s > 0
), o AS (
    SELECT *, least(end_s, (k + 1) * bucket_s) - greatest(start_s, k * bucket_s) AS overlap_s FROM s
)
SELECT run_id, replica, k * bucket_s AS t_s,
       sum(overlap_s) / bucket_s AS busy_share,
       sum(batch_requests * overlap_s) / sum(overlap_s) AS mean_batch_requests,
       sum(kv_util * overlap_s) / sum(overlap_s) AS mean_kv_util,
       sum(waiting * overlap_s) / sum(overlap_s) AS mean_waiting
FROM o WHERE overlap_s > 0
GROUP BY run_id, replica, k
ORDER BY run_id, replica, t_s
"""

# Grouping sets shared by the cache and speculation views: the whole run, each tenant, each replica.
_SCOPE_TENANT_REPLICA = """    CASE WHEN grouping(tenant) = 0 THEN 'tenant' WHEN grouping(replica) = 0 THEN 'replica' ELSE 'overall' END AS scope,
    CASE WHEN grouping(tenant) = 0 THEN tenant WHEN grouping(replica) = 0 THEN CAST(replica AS VARCHAR) END AS name"""

PREFIX_CACHE = f"""
CREATE OR REPLACE VIEW prefix_cache AS
SELECT run_id,
{_SCOPE_TENANT_REPLICA},
    count(*) AS requests,
    CAST(sum(prompt_tokens) AS BIGINT) AS prompt_tokens,
    CAST(sum(cached_tokens) AS BIGINT) AS cached_tokens,
    -- of those, served to requests that were preempted: a re-admission re-reads its own blocks
    CAST(coalesce(sum(cached_tokens) FILTER (WHERE num_preemptions > 0), 0) AS BIGINT) AS cached_tokens_preempted,
    -- tokens served from the cache per prompt token (re-admissions after preemption can add more)
    sum(cached_tokens) / nullif(sum(prompt_tokens), 0) AS hit_rate,
    count(*) FILTER (WHERE cached_tokens > 0) / count(*) AS requests_with_hit
FROM offered_requests
GROUP BY GROUPING SETS ((run_id), (run_id, tenant), (run_id, replica))
ORDER BY run_id, scope, name
"""

# With offload tiers (replay/core/kv/tiers.py): requests.parquet has kv_load_s and cached_tokens_<tier> per
# tier (gpu first). Tier names come from the run, so the per-tier columns are unpivoted by pattern.
KV_TIERS = f"""
CREATE OR REPLACE VIEW kv_tiers AS
WITH t AS (
    UNPIVOT (SELECT run_id, tenant, replica, prompt_tokens, COLUMNS('^cached_tokens_.+$')
             FROM offered_requests WHERE kv_load_s IS NOT NULL)
    ON COLUMNS('^cached_tokens_.+$') INTO NAME tier VALUE tokens
)
SELECT run_id, substr(tier, 15) AS tier,
{_SCOPE_TENANT_REPLICA},
    CAST(sum(prompt_tokens) AS BIGINT) AS prompt_tokens,
    CAST(sum(tokens) AS BIGINT) AS cached_tokens,
    sum(tokens) / nullif(sum(prompt_tokens), 0) AS hit_rate
FROM t WHERE tokens IS NOT NULL
GROUP BY GROUPING SETS ((run_id, tier), (run_id, tier, tenant), (run_id, tier, replica))
ORDER BY run_id, scope, name, tier
"""

# Speculative decoding (requests.parquet's spec_ columns, a replay with spec_method set): vLLM's
# spec-decode metrics summed over requests that verified drafts, per run, tenant and replica.
SPEC_DECODE = f"""
CREATE OR REPLACE VIEW spec_decode AS
SELECT run_id,
{_SCOPE_TENANT_REPLICA},
    count(*) AS requests,
    CAST(sum(spec_num_drafts) AS BIGINT) AS num_drafts,
    CAST(sum(spec_num_draft_tokens) AS BIGINT) AS num_draft_tokens,
    CAST(sum(spec_num_accepted_tokens) AS BIGINT) AS num_accepted_tokens,
    sum(spec_num_accepted_tokens) / nullif(sum(spec_num_draft_tokens), 0) AS acceptance_rate,
    1 + sum(spec_num_accepted_tokens) / nullif(sum(spec_num_drafts), 0) AS mean_acceptance_length,
    avg(spec_mean_acceptance_length) AS mean_request_acceptance_length
FROM offered_requests WHERE spec_num_drafts > 0
GROUP BY GROUPING SETS ((run_id), (run_id, tenant), (run_id, replica))
ORDER BY run_id, scope, name
"""

# Where a first token's time went: waiting, loading KV from lower tiers, the rest (prefill compute
# and the iterations it shared); finished requests.
TTFT_BREAKDOWN = """
CREATE OR REPLACE VIEW ttft_breakdown AS
SELECT run_id,
    CASE WHEN grouping(tenant) = 0 THEN 'tenant' ELSE 'overall' END AS scope,
    CASE WHEN grouping(tenant) = 0 THEN tenant END AS name,
    count(*) AS requests,
    avg(first_token_s - arrival_s) AS mean_ttft_s,
    avg(first_scheduled_s - arrival_s) AS mean_queue_s,
    avg(kv_load_s) AS mean_load_s,
    avg(first_token_s - first_scheduled_s - kv_load_s) AS mean_compute_s,
    quantile_cont(first_token_s - arrival_s, 0.99) AS p99_ttft_s,
    quantile_cont(kv_load_s, 0.99) AS p99_load_s
FROM offered_requests WHERE status = 'finished' AND kv_load_s IS NOT NULL
GROUP BY GROUPING SETS ((run_id), (run_id, tenant))
ORDER BY run_id, scope, name
"""

# Bytes each replica moved to and from its offload tiers (steps.parquet tier_bytes: writes of evicted or
# computed blocks, loads of hits, swaps), and that rate over the span of its steps.
KV_BYTES_MOVED = """
CREATE OR REPLACE VIEW kv_bytes_moved AS
SELECT run_id, replica,
    CAST(sum(tier_bytes) AS BIGINT) AS bytes_moved,
    CAST(max(tier_bytes) AS BIGINT) AS max_step_bytes,
    count(*) FILTER (WHERE tier_bytes > 0) AS steps_moving,
    sum(tier_bytes) / nullif(max(start_s + duration_s) - min(start_s), 0) AS bytes_per_s
FROM steps WHERE tier_bytes IS NOT NULL
GROUP BY run_id, replica
ORDER BY run_id, replica
"""

# GuideLLM 0.8's summary statistics of the finished ("successful") requests, beside ours (docs/metrics.md
# "GuideLLM's definitions"): each request's value with a weight (ITL: output tokens - 1; TPOT, which
# includes TTFT: output tokens; TTFT and E2E: 1); equal values merged; the mean weighted; a
# percentile p is the first value whose cumulative weight share reaches p (nearest rank, no
# interpolation). Times in seconds here, in ms in GuideLLM.
GUIDELLM_SUMMARY = """
CREATE OR REPLACE VIEW guidellm_summary AS
WITH f AS (SELECT * FROM request_metrics WHERE finished), v AS (
    SELECT run_id, 'ttft_s' AS metric, ttft_s AS value, 1 AS weight FROM f WHERE ttft_s IS NOT NULL
    UNION ALL
    SELECT run_id, 'itl_s', (finish_s - first_token_s) / (output_tokens - 1), output_tokens - 1 FROM f
    WHERE output_tokens > 1
    UNION ALL
    SELECT run_id, 'tpot_s', (finish_s - arrival_s) / output_tokens, output_tokens FROM f WHERE output_tokens > 0
    UNION ALL
    SELECT run_id, 'e2e_s', e2e_s, 1 FROM f
), merged AS (
    SELECT run_id, metric, value, CAST(sum(weight) AS DOUBLE) AS weight, count(*) AS requests
    FROM v WHERE weight > 0 GROUP BY run_id, metric, value
), cdf AS (
    SELECT *, sum(weight) OVER (PARTITION BY run_id, metric ORDER BY value ROWS UNBOUNDED PRECEDING)
              / sum(weight) OVER (PARTITION BY run_id, metric) AS share
    FROM merged
)
SELECT run_id, metric, CAST(sum(requests) AS BIGINT) AS requests, sum(weight) AS weight,
       sum(value * weight) / sum(weight) AS mean,
       min(value) FILTER (WHERE share >= 0.5) AS p50, min(value) FILTER (WHERE share >= 0.9) AS p90,
       min(value) FILTER (WHERE share >= 0.95) AS p95, min(value) FILTER (WHERE share >= 0.99) AS p99,
       min(value) AS min, max(value) AS max
FROM cdf GROUP BY run_id, metric ORDER BY run_id, metric
"""

# Creation order matters: each view reads the ones before it.
DERIVED_VIEWS: tuple[tuple[str, str], ...] = (
    ("run_span", RUN_SPAN),
    ("offered_requests", OFFERED),
    *((name, REQUEST_METRICS.format(name=name, tpot=tpot)) for name, tpot in TPOT_VARIANTS.items()),
    ("slo_attainment", SLO_ATTAINMENT),
    ("latency_summary", LATENCY_SUMMARY),
    ("goodput", GOODPUT),
    ("cost", COST),
    ("tenant_summary", TENANT_SUMMARY),
    ("fairness", FAIRNESS),
    ("resource_summary", RESOURCE_SUMMARY),
    ("replica_balance", REPLICA_BALANCE),
    ("attainment_vs_rate", ATTAINMENT_VS_RATE),
    ("resource_timeline", RESOURCE_TIMELINE),
)


def create_views(con: duckdb.DuckDBPyConnection) -> None:
    for _, sql in DERIVED_VIEWS:
        con.execute(sql)
    con.execute(GUIDELLM_SUMMARY)
    columns = {row[0] for row in con.execute("DESCRIBE requests").fetchall()}
    create_task_views(con, columns)
    if "cached_tokens" in columns:  # (runs written before prefix caching have no such column)
        con.execute(PREFIX_CACHE)
    if "kv_load_s" in columns:  # runs with offload tiers
        con.execute(KV_TIERS)
        con.execute(TTFT_BREAKDOWN)
    if "spec_num_drafts" in columns:  # runs with speculative decoding
        con.execute(SPEC_DECODE)
    if "tier_bytes" in {row[0] for row in con.execute("DESCRIBE steps").fetchall()}:
        con.execute(KV_BYTES_MOVED)
