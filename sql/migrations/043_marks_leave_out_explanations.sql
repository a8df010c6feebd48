-- unitvisor schema: the explanation of why runs wait no longer moves the marks it is read by (issue 23,
-- point 4: 1,000 runs that no host accepts, and 10,000 behind one key, add at most 5% to the idle
-- fleet's server CPU at 300 hosts).
--
-- 041's and 042's marks took the newest run event's id as the sign that a run's state changed. The
-- fleet upkeep's explanation of a wait (explain_waiting's `waiting: ...` events, state queued) is a run
-- event too, though it changes no run's state and no host's work. So every pass that wrote reasons made
-- every host's next heartbeat walk the queue again (041), and every round that wrote reasons was followed
-- by a whole round more that wrote none (042): over 10,000 runs behind a key, eleven passes of about 55 ms
-- at 300 hosts, which bench.scale's (S5) saw as 1.1 ms of server CPU per host per minute against an idle
-- 8.0 (docs/benchmarks.md, "0.11.0 with 043").
--
-- Now queue_mark reads the newest run event that is not such an explanation, from an index of those
-- events: one newest-first probe, as before. Nothing a mark stands for is lost: a reason is computed from
-- hosts, keys, limits and the clock, never from another reason, and every other event still moves it.
--
-- What it costs: one more index entry per run event written (all but the explanations), at the right
-- edge of a bigint btree as the primary key's; and building the index in this migration, about 0.5 s per
-- million run events, while writes to run_events wait (README, Upgrade: on a big database, build it beforehand
-- with CREATE INDEX CONCURRENTLY, which IF NOT EXISTS below then takes as it is).

-- As 008: a concurrent build that failed or was cut short leaves an invalid index of this name, which IF NOT
-- EXISTS alone would take for good; so would it a relation of this name on another table. Refuse both.
DO $$
DECLARE
    wrong text;
BEGIN
    SELECT format('run_events_change_idx is %s',
                  CASE WHEN i.indexrelid IS NULL OR i.indrelid <> 'unitvisor.run_events'::regclass
                       THEN 'not an index of unitvisor.run_events'
                       ELSE 'invalid (a CREATE INDEX CONCURRENTLY failed or is still running)' END)
    INTO wrong
    FROM pg_class c LEFT JOIN pg_index i ON i.indexrelid = c.oid
    WHERE c.relname = 'run_events_change_idx' AND c.relnamespace = 'unitvisor'::regnamespace
      AND (i.indexrelid IS NULL OR i.indrelid <> 'unitvisor.run_events'::regclass OR NOT (i.indisvalid AND i.indisready));
    IF wrong IS NOT NULL THEN
        RAISE EXCEPTION 'migration 043_marks_leave_out_explanations: %', wrong
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'wait for a build still running to end; else DROP INDEX CONCURRENTLY unitvisor.run_events_change_idx and build it again (README, Upgrade)';
    END IF;
END $$;

-- The run events that stand for a change (every one but explain_waiting's): the predicate is written the
-- same way in queue_mark, so that the planner takes this index for its max().
CREATE INDEX IF NOT EXISTS run_events_change_idx ON unitvisor.run_events (id)
    WHERE NOT (state = 'queued' AND reason LIKE 'waiting: %');

-- queue_mark as in 041, its run event the newest that is not an explanation of a wait.
CREATE OR REPLACE FUNCTION unitvisor.queue_mark() RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN format('%s/%s', coalesce((SELECT max(j.id) FROM unitvisor.spawn_jobs j), 0),
                  coalesce((SELECT max(e.id) FROM unitvisor.run_events e
                            WHERE NOT (e.state = 'queued' AND e.reason LIKE 'waiting: %')), 0));
END $$;
