-- docs/river.md's example of unitvisor's side of a River job, in plain psql, as a member of
-- unitvisor_submitter (what a platform's reconciler reads; the daemons make these runs themselves):
--   psql -X "dbname=unitvisor user=my_control_plane" -f docs/examples/river.sql
-- (tests/integration/test_river.py runs it against a throwaway cluster and compares its output with
-- docs/examples/river.out.)
\set ON_ERROR_STOP on
\set SHOW_CONTEXT never
\pset footer off

-- The run a daemon makes of River job 42: the spec function's keys, and river_job_id (schema 34).
SELECT unitvisor.submit_run_spec('{"argv": ["/opt/platform/bin/worker", "--run", "pr-7"],
                                   "labels": {"platform_run_id": "pr-7"}, "river_job_id": 42}') AS run \gset

-- What a platform's reconciler reads: the run of a River job, by the job's id or by its own label.
SELECT state, river_job_id, labels FROM unitvisor.runs WHERE river_job_id = 42;
SELECT river_job_id FROM unitvisor.runs_with_labels('{"platform_run_id": "pr-7"}') s
    JOIN unitvisor.runs r ON r.id = s.id;

-- Refused, each naming what is wrong: not a River job's id; a second run for one River job.
\set ON_ERROR_STOP off
SELECT unitvisor.submit_run(argv => '{/bin/true}', river_job_id => 0);
SELECT unitvisor.submit_run(argv => '{/bin/true}', river_job_id => 42);
\set ON_ERROR_STOP on

SELECT (unitvisor.cancel_run(:'run')).state;
