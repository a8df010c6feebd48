-- docs/sql-api.md's example of a graceful stop (schema 26), in plain psql. Run as a role that is a
-- member of unitvisor_submitter:
--   psql -X "dbname=unitvisor user=my_control_plane" -f docs/examples/graceful_stop.sql
-- (tests/integration/test_graceful_stop.py runs it against a throwaway cluster and compares its output
-- with docs/examples/graceful_stop.out.)
\set ON_ERROR_STOP on
\set SHOW_CONTEXT never
\pset footer off

-- A training job that may run an hour: stopped by SIGINT (on cancel, and at the hour), SIGKILL 30 s
-- later if it is still there, and sent SIGUSR1 five minutes before the hour, to checkpoint.
SELECT unitvisor.submit_run(
    argv            => ARRAY['/opt/jobs/bin/train', '--resume-from', '/var/lib/train/ckpt'],
    runtime_max_sec => 3600,
    stop_signal     => 'SIGINT',
    stop_timeout    => 30,
    warn_before     => 300) AS run_id \gset

-- Signal names are kept short; the warning's signal is USR1 unless named.
SELECT stop_signal, stop_timeout, warn_before, warn_signal FROM unitvisor.runs WHERE id = :'run_id';

-- A warning needs a runtime limit to come before; a signal must be one of the list.
\set ON_ERROR_STOP off
SELECT unitvisor.submit_run(ARRAY['/bin/true'], warn_before => 60);
SELECT unitvisor.submit_run(ARRAY['/bin/true'], stop_signal => 'SEGV');
\set ON_ERROR_STOP on

SELECT state, changed FROM unitvisor.cancel_run(:'run_id');
