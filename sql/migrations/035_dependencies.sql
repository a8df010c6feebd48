-- unitvisor schema 35 (issue 25, item 1): dependencies between runs.
--
-- submit_run(..., after => ARRAY[run ids], after_policy => 'succeeded' | 'finished'): the run is not
-- due until every run it names has ended (and, for 'succeeded', the default, succeeded). When one it
-- needs can no longer succeed (it ended failed, cancelled, expired or skipped), the run ends `skipped`,
-- a new terminal state, with a reason naming that run, and so on down the chain. Only runs that exist
-- can be named, so a cycle cannot be made: a run can only name runs submitted before it.
--
-- The claim is untouched. A run waiting for its dependencies is queued without a spawn job, as a held
-- run is (030): no claim, heartbeat or explain pass ever looks at it. Every transition that ends a run
-- (record_outcome, cancel_run, expiry, a skip itself, an admin's UPDATE) passes through the trigger
-- runs_settle_dependants, which settles each run that names it (settle_dependencies): makes its spawn job
-- once all it names have ended as it needs (not while it is held: release_run makes it then), or ends it
-- skipped. A dependant is settled under its row lock, in a statement of its own, so two sessions ending
-- its two dependencies at once release it exactly once (the later sees the earlier's commit), and
-- after_met_at records that it was released. submit_run locks the runs it names (FOR SHARE), so a run
-- ending while a dependant of it is submitted either sees the dependant's edge or is seen ended by it.
--
-- A run some live run names is kept by retention (prune) until that run has ended. resume_run takes a
-- skipped run too (it waits for what it names again), and resume_run(run, with_dependants => true)
-- reopens also the runs that were skipped below the resumed one.
--
-- Expand only, for 0.9.0 daemons and CLIs: a new table, new nullable columns, one more allowed state
-- (an older CLI shows `skipped` as it reads it; an older daemon never claims such a run: it has no job),
-- new functions, and submit_run two more arguments, last and defaulted (DROP and CREATE; grants again).
-- resume_run, release_run, run_status, wait_reason, waited_for and prune keep their signatures and
-- results (replaced in place).

-- -- the dependencies ---------------------------------------------------------------------------------

ALTER TABLE unitvisor.runs
    -- What the run needs of the runs it names (run_dependencies): 'succeeded' or 'finished'. NULL: it
    -- names none.
    ADD COLUMN after_policy text,
    -- When every run it names had ended as it needs, and it was released (settle_dependencies). NULL
    -- while it waits for them (or names none); cleared again by a resume.
    -- after_policy is checked by check_after (the error names runs_after_policy_valid), as every
    -- argument is by a function, not a CHECK (022: a CHECK is tried again on every update of the row).
    ADD COLUMN after_met_at timestamptz;

-- skipped: one of the runs it runs after can no longer succeed (a swap of the closed vocabulary, as 006
-- did for expired). NOT VALID: `unitvisor migrate` validates it after this transaction commits, with
-- writes going on; every existing row satisfies the new list.
ALTER TABLE unitvisor.runs DROP CONSTRAINT runs_state_valid;
ALTER TABLE unitvisor.runs ADD CONSTRAINT runs_state_valid CHECK (state IN
    ('queued', 'starting', 'running', 'succeeded', 'failed', 'cancelled', 'expired', 'skipped')) NOT VALID;

-- One row per run a run runs after (submit_run's after). Both ends are runs; a row goes with either
-- (retention keeps a run that a live run names: needed_by_live_run).
CREATE TABLE unitvisor.run_dependencies (
    run_id   uuid NOT NULL REFERENCES unitvisor.runs (id) ON DELETE CASCADE,
    after_id uuid NOT NULL REFERENCES unitvisor.runs (id) ON DELETE CASCADE,
    PRIMARY KEY (run_id, after_id)
);
-- The runs that name one: runs_settle_dependants' look-up when a run ends, and `runs --after`.
CREATE INDEX run_dependencies_after_idx ON unitvisor.run_dependencies (after_id);

ALTER TABLE unitvisor.run_dependencies ENABLE ROW LEVEL SECURITY;
CREATE POLICY run_dependencies_submitter_reads ON unitvisor.run_dependencies FOR SELECT TO unitvisor_submitter
    USING (true);
-- A host sees the dependencies of the runs it may see, as their attempts and events.
CREATE POLICY run_dependencies_host_reads ON unitvisor.run_dependencies FOR SELECT TO unitvisor_host
    USING (EXISTS (SELECT 1 FROM unitvisor.runs r WHERE r.id = run_dependencies.run_id));

-- Skips not yet counted in a daemon's unitvisor_runs_skipped_total: one row per skip, inserted by
-- settle_dependencies (only inserted, so sessions that skip runs never wait for each other), and
-- deleted by the daemon that counts it (count_skips): each skip is counted once in the fleet.
CREATE TABLE unitvisor.uncounted_skips (
    run_id     uuid NOT NULL,
    skipped_at timestamptz NOT NULL DEFAULT now()
);

-- -- the one rule -------------------------------------------------------------------------------------

-- The states a run ends in, as retention sees them: 'skipped' is one more (the one list, 008).
CREATE OR REPLACE FUNCTION unitvisor.retention_states() RETURNS text[]
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT ARRAY['succeeded', 'failed', 'cancelled', 'expired', 'skipped']::text[]
$$;

-- Whether a run it runs after, now in `state`, is what a run with this after_policy needs: succeeded,
-- or (for 'finished') ended in any way. A run that has ended and is not what it needs can no longer be
-- (only a resume brings it back): the dependant is skipped.
CREATE FUNCTION unitvisor.dependency_met(after_policy text, state text) RETURNS boolean
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT state = 'succeeded' OR (after_policy = 'finished' AND state = ANY (unitvisor.retention_states()))
$$;

-- submit_run's after, each run once in the order given (NULLs kept, for check_after to refuse); NULL
-- for NULL or an empty array: no dependencies.
CREATE FUNCTION unitvisor.after_ids(after uuid[]) RETURNS uuid[]
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT nullif(ARRAY(SELECT a.id FROM unnest(after) WITH ORDINALITY a(id, n)
                        GROUP BY a.id ORDER BY min(a.n)), '{}')
$$;

-- The checks of submit_run's after and after_policy, in one place, each refusal naming its argument.
-- The runs named are locked (FOR SHARE, in id order) until the submit commits: one of them ending now
-- waits for it and then settles the new run (its trigger sees the new row), or has committed already,
-- and the new run sees it ended. Any run that exists may be named: the roles that call submit_run
-- themselves (a submitter, an admin) see every run, and a host's role reaches it only through the
-- daemon's paths (submit_due_schedules; River's submit_river_run, submit_run_spec), which submit what a
-- submitter wrote. A host's own view (host_may_see) is no rule there: a schedule naming a run pinned to
-- another host, whose trial create_schedule ran as its submitter, would be refused at every due time.
CREATE FUNCTION unitvisor.check_after(after uuid[], after_policy text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    max_after constant integer := 1000;
    missing uuid;
BEGIN
    IF check_after.after_policy IS NOT NULL AND check_after.after_policy NOT IN ('succeeded', 'finished') THEN
        RAISE EXCEPTION 'after_policy: must be succeeded or finished, not %', quote_literal(left(check_after.after_policy, 64))
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = 'runs_after_policy_valid';
    END IF;
    IF check_after.after IS NULL THEN
        IF check_after.after_policy IS NOT NULL THEN
            RAISE EXCEPTION 'after_policy: only with after (the runs it runs after)'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        RETURN;
    END IF;
    IF array_position(check_after.after, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'after: must not hold NULL (each element is the id of a run it runs after)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF cardinality(check_after.after) > max_after THEN
        RAISE EXCEPTION 'after: names % runs, at most % may be named', cardinality(check_after.after), max_after
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM 1 FROM unitvisor.runs r WHERE r.id = ANY (check_after.after) ORDER BY r.id FOR SHARE;
    SELECT a.id INTO missing FROM unnest(check_after.after) WITH ORDINALITY a(id, n)
    WHERE NOT EXISTS (SELECT 1 FROM unitvisor.runs r WHERE r.id = a.id)
    ORDER BY a.n LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'after: no run % (only a run that exists can be named)', missing
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END $$;

-- Settle a queued run that waits for the runs it names: skipped when one of them has ended as it does
-- not need (the reason names that run); released when all have ended as it needs (after_met_at, an
-- event, and its spawn job unless it is held: release_run makes it then); else nothing. Returns what
-- it did: 'skipped', 'released', 'waiting', or NULL (not a waiting run: no such run, not queued, no
-- dependencies, released already).
--
-- The run's row is taken with an UPDATE first, and the runs it names read in the statements after it:
-- in READ COMMITTED each has its own snapshot, taken after the lock, so of two sessions ending its two
-- dependencies at once the second to get the lock sees the first's commit, and releases it, once.
-- (An UPDATE, not only a lock, so that a REPEATABLE READ session that comes second fails to serialize
-- instead of reading from before the first's commit.)
CREATE FUNCTION unitvisor.settle_dependencies(run_id uuid) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    dependant unitvisor.runs;
    broken record;
    ended text;
    released_why text;
BEGIN
    UPDATE unitvisor.runs r SET updated_at = now()
    WHERE r.id = settle_dependencies.run_id AND r.state = 'queued' AND r.after_policy IS NOT NULL
      AND r.after_met_at IS NULL
    RETURNING r.* INTO dependant;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    SELECT p.id, p.state INTO broken FROM unitvisor.run_dependencies d JOIN unitvisor.runs p ON p.id = d.after_id
    WHERE d.run_id = dependant.id AND p.state = ANY (unitvisor.retention_states())
      AND NOT unitvisor.dependency_met(dependant.after_policy, p.state)
    ORDER BY p.finished_at, p.id LIMIT 1;
    IF FOUND THEN
        DELETE FROM unitvisor.spawn_jobs j WHERE j.run_id = dependant.id AND j.state = 'available';
        DELETE FROM unitvisor.run_waits w WHERE w.run_id = dependant.id;
        -- A state change: runs_settle_dependants settles the runs that name this one in turn.
        UPDATE unitvisor.runs r SET state = 'skipped', finished_at = now(), updated_at = now()
        WHERE r.id = dependant.id;
        INSERT INTO unitvisor.uncounted_skips (run_id) VALUES (dependant.id);
        INSERT INTO unitvisor.run_events (run_id, state, reason)
        VALUES (dependant.id, 'skipped', format('run %s, which it runs after, ended %s; it needed it to %s', broken.id,
                broken.state, CASE WHEN dependant.after_policy = 'succeeded' THEN 'succeed' ELSE 'end' END));
        RETURN 'skipped';
    END IF;
    -- No row left: every run it names was pruned (their rows go with them), which retention does only
    -- once no run that has not ended names them, so only a resumed run meets this. Nothing is left to
    -- wait for or to judge: released (waiting would be for ever, with no reason to show), and the event
    -- says why. (The aggregate below would return no row, and so 'waiting', for no row at all.)
    IF NOT EXISTS (SELECT 1 FROM unitvisor.run_dependencies d WHERE d.run_id = dependant.id) THEN
        released_why := 'the runs it runs after were pruned (retention): nothing is left to wait for';
    ELSE
        SELECT string_agg(format('%s %s', s.n, s.state), ', ' ORDER BY s.state) INTO ended
        FROM (SELECT p.state, count(*) AS n FROM unitvisor.run_dependencies d JOIN unitvisor.runs p ON p.id = d.after_id
              WHERE d.run_id = dependant.id GROUP BY p.state) s
        HAVING bool_and(unitvisor.dependency_met(dependant.after_policy, s.state));
        IF ended IS NULL THEN
            RETURN 'waiting';
        END IF;
        released_why := format('the runs it runs after have ended (%s)', ended);
    END IF;
    UPDATE unitvisor.runs r SET after_met_at = now() WHERE r.id = dependant.id;
    IF dependant.held_at IS NULL THEN
        INSERT INTO unitvisor.spawn_jobs AS j (run_id, priority, scheduled_at)
        VALUES (dependant.id, dependant.priority, greatest(now(), dependant.not_before))
        ON CONFLICT (run_id) WHERE state = 'available' DO NOTHING;
    END IF;
    INSERT INTO unitvisor.run_events (run_id, state, reason)
    VALUES (dependant.id, 'queued', released_why ||
            CASE WHEN dependant.held_at IS NOT NULL THEN '; it is still held' ELSE '' END);
    RETURN 'released';
END $$;

-- When a run ends, each run that names it is settled, one at a time in id order (so that two sessions
-- settling the same runs lock them in the same order). One index probe for a run nobody names.
CREATE FUNCTION unitvisor.settle_dependants() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    dependant uuid;
BEGIN
    FOR dependant IN SELECT d.run_id FROM unitvisor.run_dependencies d WHERE d.after_id = NEW.id ORDER BY d.run_id LOOP
        PERFORM unitvisor.settle_dependencies(dependant);
    END LOOP;
    RETURN NULL;
END $$;

CREATE TRIGGER runs_settle_dependants AFTER UPDATE OF state ON unitvisor.runs
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state
          AND NEW.state IN ('succeeded', 'failed', 'cancelled', 'expired', 'skipped'))
    EXECUTE FUNCTION unitvisor.settle_dependants();

-- The completion signal (005) for skipped runs too.
DROP TRIGGER runs_notify_finished ON unitvisor.runs;
CREATE TRIGGER runs_notify_finished AFTER UPDATE OF state ON unitvisor.runs
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state
          AND NEW.state IN ('succeeded', 'failed', 'cancelled', 'expired', 'skipped'))
    EXECUTE FUNCTION unitvisor.notify_run_finished();

-- Whether a run that is not ended names this one: retention keeps it until that run has ended.
CREATE FUNCTION unitvisor.needed_by_live_run(run_id uuid) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT 1 FROM unitvisor.run_dependencies d JOIN unitvisor.runs c ON c.id = d.run_id
                   WHERE d.after_id = needed_by_live_run.run_id AND c.state <> ALL (unitvisor.retention_states()))
$$;

-- The skips no daemon has counted yet, taken by this one (each daemon's reconcile pass): how many. A
-- skip another daemon is counting right now is left to it (its row is locked, and gone once it commits).
CREATE FUNCTION unitvisor.count_skips(host_id text, host_epoch bigint) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    counted integer;
BEGIN
    PERFORM unitvisor.check_fence(count_skips.host_id, count_skips.host_epoch);
    WITH gone AS (DELETE FROM unitvisor.uncounted_skips s
                  WHERE s.ctid = ANY (ARRAY(SELECT o.ctid FROM unitvisor.uncounted_skips o FOR UPDATE SKIP LOCKED))
                  RETURNING 1)
    SELECT count(*)::integer INTO counted FROM gone;
    RETURN counted;
END $$;

-- -- why it waits -------------------------------------------------------------------------------------

-- The runs a waiting run still waits for, in words: the first submitted, and how many more ("run X
-- (running) and 2 more"). NULL when it waits for none (not queued, released, no dependencies).
CREATE FUNCTION unitvisor.after_text(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT format('run %s (%s)%s', f.id, f.state, CASE WHEN f.n > 1 THEN format(' and %s more', f.n - 1) ELSE '' END)
    FROM (SELECT p.id, p.state, count(*) OVER () AS n
          FROM unitvisor.run_dependencies d JOIN unitvisor.runs p ON p.id = d.after_id
          WHERE d.run_id = r.id AND p.state <> ALL (unitvisor.retention_states())
          ORDER BY p.created_at, p.seq, p.id LIMIT 1) f
    WHERE r.state = 'queued' AND r.after_policy IS NOT NULL AND r.after_met_at IS NULL
$$;

-- wait_reason as in 030, with the runs it waits for: after its hold (both must clear), before the rest.
CREATE OR REPLACE FUNCTION unitvisor.wait_reason(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN r.state <> 'queued' THEN NULL
                WHEN r.held_at IS NOT NULL THEN unitvisor.held_text(r) || coalesce('; and waits for ' || unitvisor.after_text(r), '')
                WHEN unitvisor.after_text(r) IS NOT NULL THEN 'waits for ' || unitvisor.after_text(r)
                WHEN r.not_before > now() THEN format('not before %s',
                    to_char(r.not_before AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'))
                ELSE (SELECT w.reason FROM unitvisor.run_waits w WHERE w.run_id = r.id) END
$$;

-- waited_for as in 030, with the runs it waits for after its release (the reason of its expiry).
CREATE OR REPLACE FUNCTION unitvisor.waited_for(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(
        'its release: ' || unitvisor.held_text(r),
        'the runs it runs after: ' || unitvisor.after_text(r),
        unitvisor.key_blocker_text(r),
        unitvisor.limit_text(r),
        unitvisor.fleet_refusal(r),
        (SELECT format('%s attempt(s), none of which started; the last: %s', count(*),
                       (SELECT coalesce(l.outcome, 'open') || coalesce(' (' || l.reason || ')', '')
                        FROM unitvisor.attempts l WHERE l.run_id = r.id ORDER BY l.attempt DESC LIMIT 1))
         FROM unitvisor.attempts a WHERE a.run_id = r.id HAVING count(*) > 0),
        'a host to claim it')
$$;

-- run_status as in 006 (same columns): a skipped run's outcome is `skipped` and its reason the skip's
-- (which run it needed), as an expired run's are the expiry's.
CREATE OR REPLACE FUNCTION unitvisor.run_status(run_id uuid)
RETURNS TABLE (id uuid, state text, created_at timestamptz, finished_at timestamptz, attempts integer,
               attempt integer, host_id text, outcome text, exit_status text, reason text,
               cancel_requested boolean, wait_reason text, labels jsonb)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT r.id, r.state, r.created_at, r.finished_at,
        (SELECT count(*)::integer FROM unitvisor.attempts c WHERE c.run_id = r.id),
        a.attempt, a.host_id,
        CASE WHEN r.state IN ('expired', 'skipped') THEN r.state ELSE a.outcome END,
        CASE WHEN r.state = 'skipped' THEN NULL ELSE a.exit_status END,
        CASE WHEN r.state IN ('expired', 'skipped') THEN (SELECT e.reason FROM unitvisor.run_events e
                                                           WHERE e.run_id = r.id AND e.state = r.state
                                                           ORDER BY e.id DESC LIMIT 1)
             ELSE a.reason END,
        r.cancel_requested_at IS NOT NULL,
        unitvisor.wait_reason(r),
        r.labels
    FROM unitvisor.runs r
    LEFT JOIN LATERAL (
        SELECT l.attempt, l.host_id, l.outcome, l.exit_status, l.reason FROM unitvisor.attempts l
        WHERE l.run_id = r.id ORDER BY l.attempt DESC LIMIT 1) a ON true
    WHERE r.id = run_status.run_id
$$;

-- -- release and resume -------------------------------------------------------------------------------

-- release_run as in 030, and a run that still waits for the runs it names gets no job yet:
-- settle_dependencies makes it when they have ended.
CREATE OR REPLACE FUNCTION unitvisor.release_run(run_id uuid, OUT state text, OUT changed boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    released record;
BEGIN
    UPDATE unitvisor.runs r SET held_at = NULL, held_by = NULL, updated_at = now()
    FROM (SELECT o.id FROM unitvisor.runs o WHERE o.id = release_run.run_id FOR UPDATE) old
    WHERE r.id = old.id AND r.state = 'queued' AND r.held_at IS NOT NULL
    RETURNING r.priority, r.not_before, r.after_policy IS NOT NULL AND r.after_met_at IS NULL AS waiting INTO released;
    IF NOT FOUND THEN
        SELECT r.state INTO release_run.state FROM unitvisor.runs r WHERE r.id = release_run.run_id;
        changed := false;
        RETURN;
    END IF;
    IF NOT released.waiting THEN
        INSERT INTO unitvisor.spawn_jobs AS j (run_id, priority, scheduled_at)
        VALUES (release_run.run_id, released.priority, greatest(now(), released.not_before))
        ON CONFLICT (run_id) WHERE state = 'available' DO NOTHING;
    END IF;
    INSERT INTO unitvisor.run_events (run_id, state, reason)
    VALUES (release_run.run_id, 'queued', 'released by ' || session_user ||
            CASE WHEN released.waiting THEN '; it still waits for the runs it runs after' ELSE '' END);
    release_run.state := 'queued';
    changed := true;
END $$;

-- resume_run as in 030, for a skipped run too, and with the runs skipped below it when asked
-- (with_dependants). The resumed run is queued again: with a spawn job when it names no run, else
-- waiting for the runs it names again (settle_dependencies: released at once when they have all ended
-- as it needs, skipped again at once when one of them still cannot). With with_dependants, every run
-- skipped below it (a run naming it, a run naming that one, ...) is reopened the same way, the nearest
-- first, and waits for it: dependants counts them. Without it, they stay skipped.
CREATE FUNCTION unitvisor.resume_run(run_id uuid, with_dependants boolean,
                                     OUT state text, OUT changed boolean, OUT dependants integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    resumed record;
    below uuid;
BEGIN
    dependants := 0;
    UPDATE unitvisor.runs r SET state = 'queued', cancel_requested_at = NULL, finished_at = NULL, updated_at = now(),
        start_deadline = CASE WHEN r.start_deadline <= now() THEN NULL ELSE r.start_deadline END,
        held_at = NULL, held_by = NULL, after_met_at = NULL
    FROM (SELECT o.id, o.start_deadline FROM unitvisor.runs o WHERE o.id = resume_run.run_id FOR UPDATE) old
    WHERE r.id = old.id AND r.state IN ('failed', 'cancelled', 'expired', 'skipped')
    RETURNING r.priority, r.not_before, r.after_policy, old.start_deadline AS old_deadline,
              r.start_deadline AS new_deadline
    INTO resumed;
    IF NOT FOUND THEN
        SELECT r.state INTO resume_run.state FROM unitvisor.runs r WHERE r.id = resume_run.run_id;
        changed := false;
        RETURN;
    END IF;
    IF resumed.after_policy IS NULL THEN
        -- A job left behind by an older race is the job this run needs: keep it, never fail on it.
        INSERT INTO unitvisor.spawn_jobs AS j (run_id, priority, scheduled_at)
        VALUES (resume_run.run_id, resumed.priority, greatest(now(), resumed.not_before))
        ON CONFLICT (run_id) WHERE state = 'available' DO NOTHING;
    END IF;
    INSERT INTO unitvisor.run_events (run_id, state, reason)
    VALUES (resume_run.run_id, 'queued', 'resumed by an operator' ||
            CASE WHEN resumed.old_deadline IS DISTINCT FROM resumed.new_deadline
                 THEN format('; its start deadline %s has passed and no longer applies',
                             to_char(resumed.old_deadline AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'))
                 ELSE '' END);
    PERFORM unitvisor.settle_dependencies(resume_run.run_id);
    IF coalesce(resume_run.with_dependants, false) THEN
        -- Nearest first (the longest path from the resumed run): each then waits for a run reopened
        -- before it. The graph has no cycle (a run names only runs that existed before it).
        FOR below IN
            WITH RECURSIVE down(id, depth) AS (
                SELECT d.run_id, 1 FROM unitvisor.run_dependencies d JOIN unitvisor.runs c ON c.id = d.run_id
                WHERE d.after_id = resume_run.run_id AND c.state = 'skipped'
                UNION ALL
                SELECT d.run_id, down.depth + 1 FROM down
                JOIN unitvisor.run_dependencies d ON d.after_id = down.id
                JOIN unitvisor.runs c ON c.id = d.run_id
                WHERE c.state = 'skipped')
            SELECT down.id FROM down GROUP BY down.id ORDER BY max(down.depth), down.id
        LOOP
            UPDATE unitvisor.runs r SET state = 'queued', cancel_requested_at = NULL, finished_at = NULL,
                updated_at = now(), held_at = NULL, held_by = NULL, after_met_at = NULL,
                start_deadline = CASE WHEN r.start_deadline <= now() THEN NULL ELSE r.start_deadline END
            WHERE r.id = below AND r.state = 'skipped';
            CONTINUE WHEN NOT FOUND;
            INSERT INTO unitvisor.run_events (run_id, state, reason)
            VALUES (below, 'queued', format('resumed by an operator with run %s, which it runs after', resume_run.run_id));
            PERFORM unitvisor.settle_dependencies(below);
            dependants := dependants + 1;
        END LOOP;
    END IF;
    SELECT r.state INTO resume_run.state FROM unitvisor.runs r WHERE r.id = resume_run.run_id;
    changed := true;
END $$;

-- The one-argument form (006): the run alone, its skipped dependants left as they are. Replaced in
-- place, so that its grants stay; its body is the one above.
CREATE OR REPLACE FUNCTION unitvisor.resume_run(run_id uuid, OUT state text, OUT changed boolean)
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT s.state, s.changed FROM unitvisor.resume_run(resume_run.run_id, false) s
$$;

-- -- retention ----------------------------------------------------------------------------------------

-- prune as in 008, and a run that a live run names is kept (needed_by_live_run): the dependant's
-- `show` and its settling need it until it has ended. Its dependencies' rows go with whichever end
-- is pruned.
CREATE OR REPLACE FUNCTION unitvisor.prune(older_than interval, batch_size integer DEFAULT 1000, dry_run boolean DEFAULT false)
RETURNS TABLE (runs bigint, attempts bigint, events bigint, jobs bigint, busy boolean)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    cutoff timestamptz;
    ids uuid[];
BEGIN
    IF prune.older_than IS NULL OR prune.older_than <= interval '0' THEN
        RAISE EXCEPTION 'older_than: must be more than zero (how old a finished run must be to go)'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF prune.batch_size IS NULL OR prune.batch_size NOT BETWEEN 1 AND 100000 THEN
        RAISE EXCEPTION 'batch_size: % is out of range (1 to 100000)', prune.batch_size
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    cutoff := now() - prune.older_than;
    IF coalesce(prune.dry_run, false) THEN
        RETURN QUERY
        WITH doomed AS (
            SELECT r.id FROM unitvisor.runs r
            WHERE r.finished_at < cutoff AND r.state = ANY (unitvisor.retention_states())
              AND NOT EXISTS (SELECT 1 FROM unitvisor.attempts a WHERE a.run_id = r.id AND a.outcome IS NULL)
              AND NOT unitvisor.needed_by_live_run(r.id))
        SELECT (SELECT count(*) FROM doomed),
               (SELECT count(*) FROM unitvisor.attempts a JOIN doomed d ON d.id = a.run_id),
               (SELECT count(*) FROM unitvisor.run_events e JOIN doomed d ON d.id = e.run_id),
               (SELECT count(*) FROM unitvisor.spawn_jobs j
                WHERE j.run_id IN (SELECT d.id FROM doomed d)
                   OR (j.state <> 'available' AND j.claimed_at < cutoff)),
               false;
        RETURN;
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtextextended('unitvisor-retention', 0)) THEN
        RETURN QUERY SELECT 0::bigint, 0::bigint, 0::bigint, 0::bigint, true;
        RETURN;
    END IF;
    -- The oldest first, on runs_finished_idx; locked, so that a resume or an outcome that comes now
    -- either waits for this batch (and then finds no run) or is skipped by it.
    SELECT array_agg(o.id) INTO ids FROM (
        SELECT r.id FROM unitvisor.runs r
        WHERE r.finished_at < cutoff AND r.finished_at IS NOT NULL AND r.state = ANY (unitvisor.retention_states())
          AND NOT EXISTS (SELECT 1 FROM unitvisor.attempts a WHERE a.run_id = r.id AND a.outcome IS NULL)
          AND NOT unitvisor.needed_by_live_run(r.id)
        ORDER BY r.finished_at
        LIMIT prune.batch_size
        FOR UPDATE OF r SKIP LOCKED) o;
    ids := coalesce(ids, '{}');
    -- Children first, each counted (ON DELETE CASCADE would delete them too, without a count).
    WITH gone AS (DELETE FROM unitvisor.run_events e WHERE e.run_id = ANY (ids) RETURNING 1)
    SELECT count(*) INTO events FROM gone;
    WITH gone AS (DELETE FROM unitvisor.attempts a WHERE a.run_id = ANY (ids) RETURNING 1)
    SELECT count(*) INTO attempts FROM gone;
    WITH gone AS (DELETE FROM unitvisor.spawn_jobs j WHERE j.run_id = ANY (ids) RETURNING 1)
    SELECT count(*) INTO jobs FROM gone;
    DELETE FROM unitvisor.run_waits w WHERE w.run_id = ANY (ids);
    WITH gone AS (DELETE FROM unitvisor.runs r WHERE r.id = ANY (ids) RETURNING 1)
    SELECT count(*) INTO runs FROM gone;
    -- Then the claimed and discarded jobs of runs that are kept, oldest first.
    WITH gone AS (
        DELETE FROM unitvisor.spawn_jobs j WHERE j.id IN (
            SELECT o.id FROM unitvisor.spawn_jobs o
            WHERE o.state <> 'available' AND o.claimed_at < cutoff
            ORDER BY o.claimed_at LIMIT prune.batch_size
            FOR UPDATE SKIP LOCKED)
        RETURNING 1)
    SELECT jobs + count(*) INTO jobs FROM gone;
    busy := false;
    RETURN NEXT;
END $$;


-- -- submit_run: after ------------------------------------------------------------------------------
--
-- As in 034, with after and after_policy last and defaulted: a run that names runs is queued without a
-- spawn job, its dependencies recorded, and settled at once (all ended already: released; one ended as
-- it does not need: skipped). DROP and CREATE (the signature changes), then the grants again.
DROP FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer, bigint,
    integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz, timestamptz, bigint,
    text, integer, integer, text, text[], boolean, integer, boolean, integer, jsonb, boolean, bigint);
CREATE FUNCTION unitvisor.submit_run(
    argv                  text[],
    environment           jsonb   DEFAULT '{}'::jsonb,
    working_directory     text    DEFAULT NULL,
    run_user              text    DEFAULT NULL,
    memory_max            bigint  DEFAULT NULL,
    cpu_quota_percent     integer DEFAULT NULL,
    tasks_max             integer DEFAULT NULL,
    io_weight             integer DEFAULT NULL,
    runtime_max_sec       bigint  DEFAULT NULL,
    max_attempts          integer DEFAULT 1,
    host_pin              text    DEFAULT NULL,
    priority              integer DEFAULT 0,
    retry_backoff_sec     integer DEFAULT 10,
    retry_backoff_max_sec integer DEFAULT 600,
    retry_on              text[]  DEFAULT NULL,
    private_network       boolean DEFAULT false,
    idempotency_key       text    DEFAULT NULL,
    labels                jsonb   DEFAULT '{}'::jsonb,
    concurrency_key       text    DEFAULT NULL,
    not_before            timestamptz DEFAULT NULL,
    start_deadline        timestamptz DEFAULT NULL,
    memory_high           bigint  DEFAULT NULL,
    stop_signal           text    DEFAULT NULL,
    stop_timeout          integer DEFAULT NULL,
    warn_before           integer DEFAULT NULL,
    warn_signal           text    DEFAULT NULL,
    -- Failure rules (027).
    fail_on               text[]  DEFAULT NULL,
    count_lost            boolean DEFAULT false,
    max_lost_attempts     integer DEFAULT 3,
    -- 030: hold (held at once: queued, never claimed until release_run).
    hold                  boolean DEFAULT false,
    -- 032: how many runs of its concurrency_key may be live at once (1: one at a time, as before).
    concurrency_limit     integer DEFAULT 1,
    -- 033: placement. Labels every host that runs it must have ([host] labels), and whether a retry
    -- prefers another host than the one its last attempt failed on (NULL: after a lost attempt only).
    host_labels           jsonb   DEFAULT '{}'::jsonb,
    avoid_failed_host     boolean DEFAULT NULL,
    -- 034: the River job this run was made from (River source, docs/river.md); one run per job.
    river_job_id          bigint  DEFAULT NULL,
    -- 035: the runs it runs after, and what it needs of them ('succeeded', the default, or 'finished').
    after                 uuid[]  DEFAULT NULL,
    after_policy          text    DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- Bare names in the statements are runs' columns (ON CONFLICT's idempotency_key); the arguments are
-- always written submit_run.<name>.
#variable_conflict use_column
DECLARE
    new_id uuid;
    env jsonb := coalesce(submit_run.environment, '{}'::jsonb);
    run_labels jsonb := coalesce(submit_run.labels, '{}'::jsonb);
    -- Kept short (TERM, not sigterm); a warning's signal is USR1 unless named (Slurm's --signal's).
    run_stop_signal text := unitvisor.signal_short_name(submit_run.stop_signal);
    run_warn_signal text := unitvisor.signal_short_name(
        CASE WHEN submit_run.warn_before IS NULL THEN submit_run.warn_signal
             ELSE coalesce(submit_run.warn_signal, 'USR1') END);
    -- Failure rules (027): signal names in one spelling, as attempts record them.
    retry_rules text[] := unitvisor.normalised_failure_rules(submit_run.retry_on);
    fail_rules text[] := unitvisor.normalised_failure_rules(submit_run.fail_on);
    problem record;
    placement record;
    -- 035: the runs named in after, each once, in the order given (NULL: none).
    parents uuid[] := unitvisor.after_ids(submit_run.after);
    refused_constraint text;
    refused_state text;
    refused_column text;
BEGIN
    -- Every argument's check, written once (run_argument_problem, which the table's trigger runs_arguments_valid
    -- calls too): the first refused argument, in an error that names it and the constraint it breaks.
    problem := unitvisor.run_argument_problem(submit_run.argv, env, submit_run.working_directory,
        submit_run.run_user, submit_run.memory_max, submit_run.memory_high, submit_run.cpu_quota_percent,
        submit_run.tasks_max, submit_run.io_weight, submit_run.runtime_max_sec, submit_run.max_attempts,
        submit_run.retry_backoff_sec, submit_run.retry_backoff_max_sec, retry_rules, run_labels,
        submit_run.idempotency_key, submit_run.concurrency_key, submit_run.not_before, submit_run.start_deadline,
        run_stop_signal, submit_run.stop_timeout, submit_run.warn_before, run_warn_signal,
        fail_rules, submit_run.count_lost, submit_run.max_lost_attempts,
        submit_run.concurrency_limit);
    IF problem.hint IS NOT NULL THEN
        RAISE EXCEPTION '%', problem.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs',
                  CONSTRAINT = problem.constraint_name, HINT = problem.hint;
    ELSIF problem.message IS NOT NULL THEN
        RAISE EXCEPTION '%', problem.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = problem.constraint_name;
    END IF;
    -- Placement's own check (033), beside run_argument_problem's: the table's trigger runs_placement_valid asks it too.
    placement := unitvisor.placement_problem(coalesce(submit_run.host_labels, '{}'::jsonb));
    IF placement.message IS NOT NULL THEN
        RAISE EXCEPTION '%', placement.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = placement.constraint_name;
    END IF;

    -- 034: River's ids are bigserial, from 1. Checked here, where the argument is named (the column's
    -- CHECK, runs_river_job_id_valid, is the backstop for a write that does not come through here).
    IF submit_run.river_job_id <= 0 THEN
        RAISE EXCEPTION 'river_job_id: must be a River job''s id (a positive bigint), or NULL (none)'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs',
                  CONSTRAINT = 'runs_river_job_id_valid';
    END IF;

    -- Sizes, once every argument has its form (so that a name it echoes is a valid name): one helper
    -- holds every bound, so that a later submit_run calls it instead of repeating them.
    PERFORM unitvisor.check_run_sizes(submit_run.argv, env, submit_run.working_directory, submit_run.host_pin,
                                      retry_rules);

    -- A retried submit: the run its key made, whatever the other arguments say now (as Stripe's and
    -- River's idempotency keys: the key names the request, the first one wins). Nothing is written.
    IF submit_run.idempotency_key IS NOT NULL THEN
        SELECT r.id INTO new_id FROM unitvisor.runs r WHERE r.idempotency_key = submit_run.idempotency_key;
        IF FOUND THEN
            RETURN new_id;
        END IF;
    END IF;

    -- Checked after the look-up: a retried submit must find its run even once its deadline has passed.
    -- now() is the database's clock (the transaction's start), not the caller's.
    IF submit_run.start_deadline <= now() THEN
        RAISE EXCEPTION 'start_deadline: must be in the future (it is not after the database''s now())'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs',
                  CONSTRAINT = 'runs_start_deadline_valid';
    END IF;

    -- 035: after and after_policy, checked in one place (check_after). After the look-up, as the
    -- deadline: a retried submit finds its run even once a run it named has been pruned.
    PERFORM unitvisor.check_after(parents, submit_run.after_policy);

    -- A constraint this function did not foresee (one added later) must not leak the row either:
    -- caught, and raised again with its name but without the DETAIL that holds the row.
    BEGIN
        INSERT INTO unitvisor.runs (argv, environment, working_directory, run_user, memory_max,
            cpu_quota_percent, tasks_max, io_weight, runtime_max_sec, max_attempts, host_pin, priority,
            retry_backoff_sec, retry_backoff_max_sec, retry_on, private_network, idempotency_key, labels,
            concurrency_key, not_before, start_deadline, memory_high,
            stop_signal, stop_timeout, warn_before, warn_signal, fail_on, count_lost, max_lost_attempts,
            held_at, held_by, concurrency_limit, host_labels, avoid_failed_host, river_job_id, after_policy)
        VALUES (submit_run.argv, env, submit_run.working_directory,
            submit_run.run_user, submit_run.memory_max, submit_run.cpu_quota_percent, submit_run.tasks_max,
            submit_run.io_weight, submit_run.runtime_max_sec, submit_run.max_attempts, submit_run.host_pin,
            submit_run.priority, submit_run.retry_backoff_sec, submit_run.retry_backoff_max_sec,
            retry_rules, coalesce(submit_run.private_network, false), submit_run.idempotency_key,
            run_labels, submit_run.concurrency_key, submit_run.not_before, submit_run.start_deadline,
            submit_run.memory_high,
            run_stop_signal, submit_run.stop_timeout, submit_run.warn_before, run_warn_signal,
            fail_rules, submit_run.count_lost, submit_run.max_lost_attempts,
            CASE WHEN submit_run.hold THEN now() END, CASE WHEN submit_run.hold THEN session_user END,
            submit_run.concurrency_limit, coalesce(submit_run.host_labels, '{}'::jsonb),
            submit_run.avoid_failed_host, submit_run.river_job_id,
            CASE WHEN parents IS NOT NULL THEN coalesce(submit_run.after_policy, 'succeeded') END)
        -- Another submit with the same key committed since the look-up above (this waited for it):
        -- insert nothing, and return its run below.
        ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING id INTO new_id;
        IF new_id IS NULL THEN
            SELECT r.id INTO STRICT new_id FROM unitvisor.runs r WHERE r.idempotency_key = submit_run.idempotency_key;
            RETURN new_id;
        END IF;
        -- not_before: the first job is not due before it (the claim takes only due jobs). A held run
        -- gets none: release_run makes it (a held run holds no job, so no claim ever looks at it).
        -- A run with dependencies gets none either: settle_dependencies makes it once every run it names
        -- has ended as it needs (at once, below, when they all have), or ends it skipped.
        IF NOT coalesce(submit_run.hold, false) AND parents IS NULL THEN
            INSERT INTO unitvisor.spawn_jobs (run_id, priority, scheduled_at)
            VALUES (new_id, submit_run.priority, greatest(now(), submit_run.not_before));
        END IF;
        INSERT INTO unitvisor.run_events (run_id, state, reason)
        VALUES (new_id, 'queued', CASE WHEN coalesce(submit_run.hold, false) THEN 'submitted, held by ' || session_user
                                       ELSE 'submitted' END);
        IF parents IS NOT NULL THEN
            INSERT INTO unitvisor.run_dependencies (run_id, after_id) SELECT new_id, p FROM unnest(parents) p;
            PERFORM unitvisor.settle_dependencies(new_id);
        END IF;
    EXCEPTION WHEN integrity_constraint_violation THEN
        GET STACKED DIAGNOSTICS refused_constraint = CONSTRAINT_NAME, refused_state = RETURNED_SQLSTATE,
                                refused_column = COLUMN_NAME;
        -- An explicit NULL for an argument whose column has none (max_attempts, priority, the backoffs, argv):
        -- the column's NOT NULL refused it; the argument is named, as every other refusal names its own.
        IF refused_state = '23502' AND refused_column <> '' THEN
            RAISE EXCEPTION '%: must not be NULL (leave it out for its default)', refused_column
                USING ERRCODE = 'not_null_violation', SCHEMA = 'unitvisor', TABLE = 'runs', COLUMN = refused_column;
        END IF;
        RAISE EXCEPTION 'the run was refused by constraint %', coalesce(nullif(refused_constraint, ''), '(unnamed)')
            USING ERRCODE = refused_state, CONSTRAINT = coalesce(refused_constraint, '');
    END;
    RETURN new_id;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz,
    timestamptz, bigint, text, integer, integer, text, text[], boolean, integer, boolean, integer, jsonb, boolean, bigint, uuid[], text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz,
    timestamptz, bigint, text, integer, integer, text, text[], boolean, integer, boolean, integer, jsonb, boolean, bigint, uuid[], text) TO unitvisor_submitter;

-- -- grants -------------------------------------------------------------------------------------------

GRANT SELECT ON unitvisor.run_dependencies TO unitvisor_submitter, unitvisor_host;
REVOKE EXECUTE ON FUNCTION unitvisor.dependency_met(text, text), unitvisor.after_ids(uuid[]),
    unitvisor.check_after(uuid[], text), unitvisor.settle_dependencies(uuid), unitvisor.settle_dependants(),
    unitvisor.needed_by_live_run(uuid), unitvisor.after_text(unitvisor.runs),
    unitvisor.resume_run(uuid, boolean), unitvisor.count_skips(text, bigint) FROM PUBLIC;
-- wait_reason and waited_for (granted to both) call after_text with the caller's rights, and it reads
-- the list of ended states (retention_states, 008's); the rest is called by submit_run, resume_run and
-- the trigger as the owner.
GRANT EXECUTE ON FUNCTION unitvisor.after_text(unitvisor.runs), unitvisor.dependency_met(text, text),
    unitvisor.retention_states() TO unitvisor_submitter, unitvisor_host;
GRANT EXECUTE ON FUNCTION unitvisor.resume_run(uuid, boolean) TO unitvisor_submitter;
GRANT EXECUTE ON FUNCTION unitvisor.count_skips(text, bigint) TO unitvisor_host;
