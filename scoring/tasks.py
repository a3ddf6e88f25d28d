"""SQL of the per-task views: `tasks` (one row per task: its completion time, critical path, where the
time went, tokens reused, requests finished/skipped/failed, deadline met) and `task_summary`.

A task is the requests sharing a `session_id` (an agent run, a conversation); requests without one
are in no task. `depends_on` (request ids a request waited for) links them; the critical path is
walked back from the task's last finish by a recursive CTE, each step to the parent that finished
last (the one whose finish released the request). Formulas: docs/metrics.md "Tasks".
"""

from __future__ import annotations

import duckdb

# A request never sent because a parent failed, was dropped or aborted (the engine's status).
SKIPPED = "skipped"

TASKS = """
CREATE OR REPLACE VIEW tasks AS
WITH RECURSIVE ids AS (  -- a run's number, so that (run, request) is one integer key k
    SELECT run_id, CAST(row_number() OVER (ORDER BY run_id) AS BIGINT) * 1099511627776 AS base FROM runs
), r AS MATERIALIZED (
    SELECT q.run_id, q.request_id, ids.base + q.request_id AS k, session_id AS task_id, tenant, tier, status,
           arrival_s, first_scheduled_s, finish_s, prompt_tokens, output_tokens,
           coalesce(cached_tokens, 0) AS cached_tokens, {depends_on} AS depends_on, {think_s} AS think_s,
           {task_deadline_s} AS task_deadline_s
    FROM requests q JOIN ids ON ids.run_id = q.run_id WHERE session_id IS NOT NULL
), edge AS MATERIALIZED (
    SELECT k, base + parent_id AS parent_k, parents FROM (
        SELECT k, k - request_id AS base, len(depends_on) AS parents, unnest(depends_on) AS parent_id
        FROM r WHERE len(depends_on) > 0)
    UNION ALL
    -- a closed-loop session without depends_on: each turn with a think time waits for the turn before
    SELECT k, parent_k, 1 FROM (
        SELECT k, think_s, lag(k) OVER (PARTITION BY run_id, task_id ORDER BY request_id) AS parent_k
        FROM r WHERE depends_on IS NULL
    ) WHERE think_s IS NOT NULL AND parent_k IS NOT NULL
), gate AS MATERIALIZED (
    -- the parent that finished last released the request (ties: the lowest id); one parent needs no choice
    SELECT e.k, p.k AS parent_k, p.finish_s AS parent_finish_s FROM edge e JOIN r p ON p.k = e.parent_k
    WHERE e.parents = 1
    UNION ALL
    SELECT e.k, arg_max(p.k, (coalesce(p.finish_s, -1e308), -p.k)) AS parent_k, max(p.finish_s) AS parent_finish_s
    FROM edge e JOIN r p ON p.k = e.parent_k WHERE e.parents > 1
    GROUP BY e.k
), last AS (
    SELECT run_id, task_id, arg_max(k, (finish_s, -k)) AS k FROM r WHERE status = 'finished' GROUP BY run_id, task_id
), path(run_id, task_id, k, depth) AS (
    SELECT run_id, task_id, k, 0 FROM last
    UNION ALL
    SELECT p.run_id, p.task_id, g.parent_k, p.depth + 1
    FROM path p JOIN gate g ON g.k = p.k
    WHERE p.depth < 10000000  -- a dependency cycle (which a valid trace cannot hold) must not run forever
), cp AS (
    SELECT p.run_id, p.task_id,
           count(*) AS critical_path_requests,
           arg_max(q.arrival_s, p.depth) AS cp_first_arrival_s,
           sum(q.first_scheduled_s - q.arrival_s) AS cp_queue_s,
           sum(q.finish_s - q.first_scheduled_s) AS cp_llm_s,
           coalesce(sum(q.arrival_s - g.parent_finish_s), 0.0) AS cp_wait_s
    FROM path p
    JOIN r q ON q.k = p.k
    LEFT JOIN gate g ON g.k = p.k
    GROUP BY p.run_id, p.task_id
), links AS (
    SELECT q.run_id, q.task_id, count(*) AS links FROM edge e JOIN r q ON q.k = e.k GROUP BY q.run_id, q.task_id
), t AS (
    SELECT run_id, task_id, min(tenant) AS tenant, min(tier) AS tier,
           count(*) AS requests,
           count(*) FILTER (WHERE status = 'finished') AS finished,
           count(*) FILTER (WHERE status = '{skipped}') AS skipped,
           count(*) FILTER (WHERE status = 'unfinished') AS unfinished,
           count(*) FILTER (WHERE status NOT IN ('finished', '{skipped}', 'unfinished')) AS failed,
           min(arrival_s) FILTER (WHERE status <> '{skipped}') AS first_arrival_s,
           max(finish_s) FILTER (WHERE status = 'finished') AS last_finish_s,
           coalesce(sum(first_scheduled_s - arrival_s) FILTER (WHERE status <> '{skipped}'), 0.0) AS queue_s,
           coalesce(sum(finish_s - first_scheduled_s) FILTER (WHERE status = 'finished'), 0.0) AS llm_s,
           CAST(sum(prompt_tokens) AS BIGINT) AS prompt_tokens,
           CAST(sum(cached_tokens) AS BIGINT) AS reused_tokens,
           max(task_deadline_s) AS trace_deadline_s
    FROM r GROUP BY run_id, task_id
), d AS (
    SELECT t.*, coalesce(l.links, 0) AS links,
           cp.critical_path_requests, cp.cp_first_arrival_s, cp.cp_queue_s, cp.cp_llm_s, cp.cp_wait_s,
           t.finished = t.requests AS complete,
           -- the trace's own deadline wins over the SLO table's (tenant > tier > global)
           coalesce(t.trace_deadline_s, te.task_s, ti.task_s, g.task_s) AS deadline_s
    FROM t LEFT JOIN cp ON cp.run_id = t.run_id AND cp.task_id = t.task_id
    LEFT JOIN links l ON l.run_id = t.run_id AND l.task_id = t.task_id
    LEFT JOIN slo_table g ON g.scope = 'global'
    LEFT JOIN slo_table ti ON ti.scope = 'tier' AND ti.name = t.tier
    LEFT JOIN slo_table te ON te.scope = 'tenant' AND te.name = t.tenant
)
SELECT run_id, task_id, tenant, tier, requests, finished, skipped, unfinished, failed, complete, links,
       first_arrival_s, last_finish_s,
       CASE WHEN complete THEN last_finish_s - first_arrival_s END AS jct_s,
       critical_path_requests,
       cp_first_arrival_s - first_arrival_s AS cp_start_s,
       cp_queue_s, cp_llm_s, cp_wait_s,
       queue_s, llm_s,
       prompt_tokens, reused_tokens, reused_tokens / nullif(prompt_tokens, 0) AS reuse_rate,
       deadline_s,
       CASE WHEN deadline_s IS NOT NULL
            THEN complete AND coalesce(last_finish_s - first_arrival_s <= deadline_s, false) END AS met_deadline
FROM d
ORDER BY run_id, task_id
"""

_Q = "[0.5, 0.9, 0.99]"

TASK_SUMMARY = f"""
CREATE OR REPLACE VIEW task_summary AS
WITH a AS (
    SELECT run_id,
        CASE WHEN grouping(tier) = 0 THEN 'tier' WHEN grouping(tenant) = 0 THEN 'tenant' ELSE 'overall' END AS scope,
        CASE WHEN grouping(tier) = 0 THEN tier WHEN grouping(tenant) = 0 THEN tenant END AS name,
        count(*) AS tasks,
        count(*) FILTER (WHERE complete) AS complete,
        count(*) FILTER (WHERE skipped > 0) AS with_skipped,
        count(*) FILTER (WHERE failed > 0) AS with_failed,
        CAST(sum(requests) AS BIGINT) AS requests,
        CAST(sum(links) AS BIGINT) AS links,
        CAST(sum(finished) AS BIGINT) AS finished,
        CAST(sum(skipped) AS BIGINT) AS skipped,
        CAST(sum(unfinished) AS BIGINT) AS unfinished,
        CAST(sum(failed) AS BIGINT) AS failed,
        avg(jct_s) AS jct_mean_s,
        quantile_cont(jct_s, {_Q}) AS jct_q,
        max(jct_s) AS jct_max_s,
        -- shares of the complete tasks' summed completion time spent along their critical paths
        sum(cp_llm_s) FILTER (WHERE complete) / nullif(sum(jct_s), 0) AS cp_llm_share,
        sum(cp_queue_s) FILTER (WHERE complete) / nullif(sum(jct_s), 0) AS cp_queue_share,
        sum(cp_wait_s) FILTER (WHERE complete) / nullif(sum(jct_s), 0) AS cp_wait_share,
        sum(cp_start_s) FILTER (WHERE complete) / nullif(sum(jct_s), 0) AS cp_start_share,
        CAST(sum(prompt_tokens) AS BIGINT) AS prompt_tokens,
        CAST(sum(reused_tokens) AS BIGINT) AS reused_tokens,
        sum(reused_tokens) / nullif(sum(prompt_tokens), 0) AS reuse_rate,
        count(deadline_s) AS with_deadline,
        count(*) FILTER (WHERE met_deadline) AS met_deadline,
        -- unfinished, failed and skipped tasks count as misses
        count(*) FILTER (WHERE met_deadline) / nullif(count(deadline_s), 0) AS deadline_attainment
    FROM tasks
    GROUP BY GROUPING SETS ((run_id), (run_id, tier), (run_id, tenant))
)
SELECT a.* EXCLUDE (jct_q), jct_q[1] AS jct_p50_s, jct_q[2] AS jct_p90_s, jct_q[3] AS jct_p99_s,
       a.met_deadline / sp.duration_s AS task_goodput_per_s
FROM a JOIN run_span sp ON sp.run_id = a.run_id
ORDER BY a.run_id, CASE a.scope WHEN 'overall' THEN 0 WHEN 'tier' THEN 1 ELSE 2 END, a.name NULLS FIRST
"""

# Optional requests columns the task views read, and what stands in for a run without them.
_OPTIONAL = {"depends_on": "CAST(NULL AS BIGINT[])", "think_s": "CAST(NULL AS DOUBLE)",
             "task_deadline_s": "CAST(NULL AS DOUBLE)"}


def create_task_views(con: duckdb.DuckDBPyConnection, request_columns: set[str]) -> None:
    """Create `tasks` and `task_summary` over `requests` (whose columns are ``request_columns``)."""
    cols = {name: (name if name in request_columns else null) for name, null in _OPTIONAL.items()}
    con.execute(TASKS.format(skipped=SKIPPED, **cols))
    con.execute(TASK_SUMMARY)


__all__ = ["SKIPPED", "TASKS", "TASK_SUMMARY", "create_task_views"]
