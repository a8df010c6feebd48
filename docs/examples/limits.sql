-- docs/sql-api.md's concurrency limits example, in plain psql, as a member of unitvisor_submitter:
--   psql -X "dbname=unitvisor user=my_control_plane" -f docs/examples/limits.sql
-- (tests/integration/test_concurrency_limits.py runs it against a throwaway cluster and compares its
-- output with docs/examples/limits.out.)
\set ON_ERROR_STOP on
\set SHOW_CONTEXT never
\pset footer off

-- At most 2 live runs with team=batch, across the fleet (true: created; false: changed).
SELECT unitvisor.set_limit('batch', '{"team": "batch"}', 2) AS created;

-- Three imports that may run three at once, in the order they are submitted.
SELECT unitvisor.submit_run(ARRAY['/opt/jobs/bin/import', 'eu'], concurrency_key => 'imports',
                            concurrency_limit => 3, labels => '{"team": "batch"}') AS first \gset
SELECT unitvisor.submit_run(ARRAY['/opt/jobs/bin/import', 'us'], concurrency_key => 'imports',
                            concurrency_limit => 3, labels => '{"team": "batch"}');
SELECT concurrency_key, concurrency_limit, labels FROM unitvisor.runs WHERE id = :'first';

-- Each limit with its live runs now (no host has claimed anything here).
SELECT name, selector, max_live, live FROM unitvisor.limit_status();

-- Refused, each naming the argument.
\set ON_ERROR_STOP off
SELECT unitvisor.submit_run(ARRAY['/bin/true'], concurrency_limit => 3);
SELECT unitvisor.submit_run(ARRAY['/bin/true'], concurrency_key => 'imports', concurrency_limit => 0);
SELECT unitvisor.set_limit('batch', '{"team": 7}', 2);
SELECT unitvisor.set_limit('batch', '{"team": "batch"}', -1);
\set ON_ERROR_STOP on

SELECT unitvisor.drop_limit('batch') AS dropped;
SELECT unitvisor.cancel_run(id) FROM unitvisor.runs WHERE concurrency_key = 'imports';
