-- docs/sql-api.md's example, in plain psql: what a control plane in any language does.
-- Run as a role that is a member of unitvisor_submitter:
--   psql -X "dbname=unitvisor user=my_control_plane" -f docs/examples/sql_api.sql
-- (tests/integration/test_sql_api_example.py runs it against a throwaway cluster and compares its
-- output with docs/examples/sql_api.out, so this example cannot rot.)
\set ON_ERROR_STOP on
\set SHOW_CONTEXT never
\pset footer off

-- Hear about finished runs: one notification per run that reaches succeeded, failed, cancelled, expired
-- or skipped.
LISTEN unitvisor_run_finished;

-- Submit, with a key so that a retry after a lost COMMIT cannot queue the run twice, and labels to
-- find it again.
SELECT unitvisor.submit_run(
    argv            => ARRAY['/usr/bin/env', 'echo', 'hello'],
    environment     => '{"GREETING": "hi"}',
    memory_max      => 268435456,
    labels          => '{"team": "docs", "pipeline": "nightly"}',
    idempotency_key => 'nightly-2026-11-30') AS run_id \gset

-- The same submit again (the client timed out, say): the same run, nothing new queued.
SELECT unitvisor.submit_run(ARRAY['/usr/bin/env', 'echo', 'hello'],
                            idempotency_key => 'nightly-2026-11-30') = :'run_id' AS same_run;

-- How it stands.
SELECT state, attempts, attempt, host_id, outcome, cancel_requested, labels
FROM unitvisor.run_status(:'run_id');

-- Every run of the team's nightly pipeline.
SELECT count(*) AS nightly_runs FROM unitvisor.runs_with_labels('{"team": "docs", "pipeline": "nightly"}');

-- A refused argument: one message naming it, and nothing written.
\set ON_ERROR_STOP off
SELECT unitvisor.submit_run(ARRAY['/bin/true'], memory_max => 1024);
\set ON_ERROR_STOP on

-- Cancel it (queued: cancelled at once). The notification arrives when this commits.
SELECT state, changed FROM unitvisor.cancel_run(:'run_id');
SELECT state, finished_at IS NOT NULL AS finished FROM unitvisor.run_status(:'run_id');

-- Runs that must never overlap share a concurrency key: they start one at a time, in the order
-- submitted, on whichever hosts. This one may not start before 03:00 UTC, and ends as expired if it
-- has not started by 05:00 UTC.
SELECT unitvisor.submit_run(ARRAY['/opt/jobs/bin/migrate'], concurrency_key => 'db-migrate',
                            not_before => '2099-06-01 03:00Z', start_deadline => '2099-06-01 05:00Z') AS migration \gset
SELECT state, wait_reason FROM unitvisor.run_status(:'migration');

-- A deadline before the run may even start is refused.
\set ON_ERROR_STOP off
SELECT unitvisor.submit_run(ARRAY['/bin/true'], not_before => '2099-06-01 03:00Z',
                            start_deadline => '2099-06-01 02:00Z');
\set ON_ERROR_STOP on
SELECT state, changed FROM unitvisor.cancel_run(:'migration');

-- A run submitted held: queued, but no host claims it until it is released (hold_run holds a queued
-- one the same way). Why it waits says so, and by whom; a running run cannot be held.
SELECT unitvisor.submit_run(ARRAY['/opt/jobs/bin/report'], hold => true) AS report \gset
SELECT state, wait_reason LIKE 'held since % UTC by ' || session_user || ' (release it: unitvisor release %)' AS held
FROM unitvisor.run_status(:'report');
SELECT state, changed FROM unitvisor.hold_run(:'report');
SELECT state, changed FROM unitvisor.release_run(:'report');
SELECT state, wait_reason FROM unitvisor.run_status(:'report');
SELECT state, changed FROM unitvisor.cancel_run(:'report');

-- Runs after runs (schema 35): a load after an extract, a report after the load. They wait without a
-- spawn job, and say for what. The extract cancelled, the two below it end skipped, each naming the run
-- it needed; resumed with its dependants, they wait for it again.
SELECT unitvisor.submit_run(ARRAY['/opt/jobs/bin/extract']) AS extract \gset
SELECT unitvisor.submit_run(ARRAY['/opt/jobs/bin/load'], after => ARRAY[:'extract']::uuid[]) AS load \gset
SELECT unitvisor.submit_run(ARRAY['/opt/jobs/bin/summary'], after => ARRAY[:'load']::uuid[],
                            after_policy => 'succeeded') AS summary \gset
SELECT state, wait_reason FROM unitvisor.run_status(:'load');
SELECT state, changed FROM unitvisor.cancel_run(:'extract');
SELECT state, outcome, reason FROM unitvisor.run_status(:'summary');
SELECT state, changed, dependants FROM unitvisor.resume_run(:'extract', with_dependants => true);
SELECT state, wait_reason FROM unitvisor.run_status(:'summary');
SELECT state, changed FROM unitvisor.cancel_run(:'extract');
