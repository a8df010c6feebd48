-- Failure rules (schema 27; docs/sql-api.md, "Failure rules"): a run retried after exit 75 or a kill by
-- SIGTERM (or a timeout, or its host lost), ended at once by exit 3, whose lost attempts do not count,
-- up to two of them.
SELECT unitvisor.submit_run(
    argv              => ARRAY['/opt/jobs/bin/export'],
    max_attempts      => 3,
    retry_on          => ARRAY['exit:75', 'signal:SIGTERM', 'timeout', 'lost'],
    fail_on           => ARRAY['exit:3'],
    max_lost_attempts => 2) AS run_id \gset

-- The signal as the attempts record it.
SELECT retry_on, fail_on, count_lost, max_lost_attempts FROM unitvisor.runs WHERE id = :'run_id';

-- What its rules decide after an attempt, as record_outcome will.
SELECT e.ending, f.retry, f.why
FROM unitvisor.runs r,
     (VALUES ('attempt 1 exits 75', 1, 0, 'exit-code', 'exit:75'),
             ('attempt 3 exits 75', 3, 0, 'exit-code', 'exit:75'),
             ('attempt 1 exits 3', 1, 0, 'exit-code', 'exit:3'),
             ('attempt 1 exits 1', 1, 0, 'exit-code', 'exit:1'),
             ('attempt 3 lost, the first lost', 3, 1, 'lost', NULL),
             ('attempt 4 lost, the second lost', 4, 2, 'lost', NULL)) AS e(ending, attempt, lost, outcome, exit_status),
     LATERAL unitvisor.failure_verdict(r.max_attempts, r.retry_on, r.fail_on, r.count_lost, r.max_lost_attempts,
                                       r.cancel_requested_at IS NOT NULL, e.attempt, e.lost, e.outcome,
                                       e.exit_status) AS f
WHERE r.id = :'run_id';

-- A code in both lists is refused, by name.
SELECT unitvisor.submit_run(ARRAY['/opt/jobs/bin/export'], retry_on => ARRAY['exit:3'], fail_on => ARRAY['exit:3']);

SELECT state, changed FROM unitvisor.cancel_run(:'run_id');
