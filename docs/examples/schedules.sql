-- docs/sql-api.md's schedules example, in plain psql, as a member of unitvisor_submitter:
--   psql -X "dbname=unitvisor user=my_control_plane" -f docs/examples/schedules.sql
-- (tests/integration/test_schedules.py runs it against a throwaway cluster and compares its output
-- with docs/examples/schedules.out.)
\set ON_ERROR_STOP on
\set SHOW_CONTEXT never
\pset footer off

-- When would '30 2 * * *' in Berlin run around the night clocks go forward? At the end of the gap.
SELECT unitvisor.cron_next('30 2 * * *', 'Europe/Berlin', '2026-03-28 12:00Z') AS utc,
       unitvisor.cron_next('30 2 * * *', 'Europe/Berlin', '2026-03-28 12:00Z') AT TIME ZONE 'Europe/Berlin' AS berlin;

-- A nightly report at 02:30 Berlin time: the run's keys are submit_run's argument names. Returns the
-- first due time (shown here only as a time in the future).
SELECT unitvisor.create_schedule(
    name     => 'nightly-report',
    cron     => '30 2 * * *',
    timezone => 'Europe/Berlin',
    run      => '{"argv": ["/opt/jobs/bin/report", "--daily"], "memory_max": 268435456, "max_attempts": 3,
                  "labels": {"team": "docs"}}',
    overlap  => 'skip',
    catch_up => 'one') > now() AS first_due_ahead;

SELECT name, cron, timezone, overlap, catch_up, paused, last_run_id FROM unitvisor.schedules;

-- Refused, each naming what is wrong.
\set ON_ERROR_STOP off
SELECT unitvisor.create_schedule('every-minute', '* * * * * *', 'UTC', '{"argv": ["/bin/true"]}');
SELECT unitvisor.create_schedule('every-minute', '* * * * *', 'Mars/Olympus', '{"argv": ["/bin/true"]}');
SELECT unitvisor.create_schedule('every-minute', '* * * * *', 'UTC', '{"argv": ["/bin/true"], "memroy_max": 1}');
SELECT unitvisor.create_schedule('every-minute', '* * * * *', 'UTC', '{"argv": ["/bin/true"], "river_job_id": 42}');
\set ON_ERROR_STOP on

-- The same mapping as a one-off submit, for a control plane that keeps its runs as JSON.
SELECT unitvisor.submit_run_spec('{"argv": ["/bin/true"], "priority": 5, "labels": {"team": "docs"}}') AS spec_run \gset
SELECT state, labels FROM unitvisor.run_status(:'spec_run');

-- Pause, resume, drop.
SELECT unitvisor.pause_schedule('nightly-report') AS was_paused;
SELECT unitvisor.pause_schedule('nightly-report', paused => false) AS was_paused;
SELECT unitvisor.drop_schedule('nightly-report') AS dropped;
