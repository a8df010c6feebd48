-- unitvisor schema: retention, history kept in bounds (issue 13).
--
-- Finished runs older than an age go, with their attempts, events, spawn jobs and wait reasons; so do
-- claimed and discarded spawn jobs of the runs that are kept, which are history only once claimed
-- (nothing reads them: the claim, the probe, explain_waiting and cancel_run look at available jobs
-- only; the attempt row is the record of a claim). One batch per call, so that the caller commits
-- between batches: row locks and the snapshot are held for one batch, never for the whole backlog, and
-- vacuum is never held back by a long transaction.
--
-- Expand only: three indexes and four functions; nothing the previous release reads or calls changes.
-- The indexes are built without CONCURRENTLY (a migration is one transaction): while they are built,
-- writes to runs and spawn_jobs wait, for a time in proportion to their size (about 0.5 s per million
-- rows). On a big database the operator builds them beforehand with CREATE INDEX CONCURRENTLY, which
-- does not block writes (README, Upgrade, gives the statements: these names and definitions), and
-- IF NOT EXISTS takes them as they are. Changed after release (0.4.0) to IF NOT EXISTS and the check
-- below: a database without them gets the same indexes as before, and one that applied 008 is not
-- migrated again.

-- The states a run ends in, as retention sees them (006 added `expired`): the one list to extend when a
-- terminal state is added, in that state's migration: CREATE OR REPLACE this function with one more
-- element, and nothing else here changes. The index below does not name the states (finished_at is set
-- exactly when a run reaches a terminal state: 004's record_outcome and cancel_run, and 0.1.0's paths
-- before them), so a new state needs no new index, as long as it sets finished_at too.
CREATE FUNCTION unitvisor.retention_states() RETURNS text[]
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT ARRAY['succeeded', 'failed', 'cancelled', 'expired']::text[]
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.retention_states() FROM PUBLIC;

-- A concurrent build that failed or was cut short leaves an invalid index of its name (not used by the
-- planner, nor kept up to date if it never got ready), which IF NOT EXISTS alone would take for good;
-- so would it a relation of that name on another table. Refuse both, saying what to do.
DO $$
DECLARE
    wrong text;
BEGIN
    SELECT string_agg(format('%s is %s', c.relname,
                             CASE WHEN i.indexrelid IS NULL OR i.indrelid <> expected.tab THEN 'not an index of ' || expected.tab::text
                                  ELSE 'invalid (a CREATE INDEX CONCURRENTLY failed or is still running)' END), '; ')
    INTO wrong
    FROM (VALUES ('runs_finished_idx', 'unitvisor.runs'::regclass),
                 ('spawn_jobs_run_idx', 'unitvisor.spawn_jobs'::regclass),
                 ('spawn_jobs_done_idx', 'unitvisor.spawn_jobs'::regclass)) AS expected(name, tab)
    JOIN pg_class c ON c.relname = expected.name AND c.relnamespace = 'unitvisor'::regnamespace
    LEFT JOIN pg_index i ON i.indexrelid = c.oid
    WHERE i.indexrelid IS NULL OR i.indrelid <> expected.tab OR NOT (i.indisvalid AND i.indisready);
    IF wrong IS NOT NULL THEN
        RAISE EXCEPTION 'migration 008_retention: %', wrong
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'wait for a build still running to end; else DROP INDEX CONCURRENTLY unitvisor.<name> and build it again (README, Upgrade)';
    END IF;
END $$;

-- Old finished runs, oldest first, without reading a live run's entry: live runs have no finished_at.
CREATE INDEX IF NOT EXISTS runs_finished_idx ON unitvisor.runs (finished_at) WHERE finished_at IS NOT NULL;
-- Every delete of a run (and the ON DELETE CASCADE of spawn_jobs.run_id) finds its jobs here; without
-- it, each deleted run costs a scan of the whole spawn_jobs table (001 indexes available jobs only).
CREATE INDEX IF NOT EXISTS spawn_jobs_run_idx ON unitvisor.spawn_jobs (run_id);
-- Old claimed and discarded jobs (both have claimed_at: 001's spawn_jobs_claim_valid and claim_jobs).
CREATE INDEX IF NOT EXISTS spawn_jobs_done_idx ON unitvisor.spawn_jobs (claimed_at) WHERE state <> 'available';

-- prune: delete one batch of history older than older_than, as the admin (`unitvisor prune`), or
-- count all of it (dry_run; batch_size is then ignored). Returns what it deleted (would delete), and
-- busy = true, deleting nothing, while another session's prune holds the lock: one pruner of the fleet
-- at a time (a transaction-level advisory lock, as declare_dead_hosts' upkeep; the others skip, and
-- the lock goes with the batch's commit, so a pruner that dies holds nothing). A caller loops while
-- runs or jobs come back equal to batch_size (more may be left), committing between calls.
--
-- What is never deleted: a run that is not in a terminal state, or whose finished_at is younger than
-- older_than, or that has an attempt without an outcome (whatever its state says: an admin's UPDATE,
-- a late outcome), or that another session holds locked right now (a resume, an outcome: SKIP LOCKED,
-- it is met again by the next batch); an available spawn job of a run that is kept.
--
-- Invoker's rights, granted to nobody: the admin (the owner) runs it. Hosts prune through
-- prune_history below.
CREATE FUNCTION unitvisor.prune(older_than interval, batch_size integer DEFAULT 1000, dry_run boolean DEFAULT false)
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
              AND NOT EXISTS (SELECT 1 FROM unitvisor.attempts a WHERE a.run_id = r.id AND a.outcome IS NULL))
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
REVOKE EXECUTE ON FUNCTION unitvisor.prune(interval, integer, boolean) FROM PUBLIC;

-- The least age a host may prune at: a control plane that reads a run's result after it finished
-- (run_status, on the unitvisor_run_finished NOTIFY or a poll) has at least this long to do it,
-- whatever a host's [retention] keep_finished says (a mistyped config, or a host role's DSN in the
-- wrong hands). The admin's `unitvisor prune` is not bound by it.
CREATE FUNCTION unitvisor.prune_history_min_age() RETURNS interval
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT interval '1 hour'
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.prune_history_min_age() FROM PUBLIC;

-- prune_history: prune's batch, as a host's daemon (its [retention] pass): fenced (a host declared
-- dead prunes nothing) and checked against the caller's identity as every host write, with older_than
-- at least prune_history_min_age() and batch_size at most 10000 (a batch is one transaction: it must
-- stay well under the session's statement_timeout). Deleting history is not a host's own business but
-- the fleet's: every host role may do it, because any one daemon of the fleet may be the one holding
-- the lock, but only for runs older than its argument and never younger than the floor above.
CREATE FUNCTION unitvisor.prune_history(host_id text, host_epoch bigint, older_than interval,
                                        batch_size integer DEFAULT 1000)
RETURNS TABLE (runs bigint, attempts bigint, events bigint, jobs bigint, busy boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.check_fence(prune_history.host_id, prune_history.host_epoch);
    IF prune_history.older_than IS NULL OR prune_history.older_than < unitvisor.prune_history_min_age() THEN
        RAISE EXCEPTION 'older_than: a host prunes only runs finished at least % ago (the admin''s unitvisor prune may go lower)',
            unitvisor.prune_history_min_age()
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF prune_history.batch_size IS NULL OR prune_history.batch_size NOT BETWEEN 1 AND 10000 THEN
        RAISE EXCEPTION 'batch_size: % is out of range (1 to 10000)', prune_history.batch_size
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN QUERY SELECT * FROM unitvisor.prune(prune_history.older_than, prune_history.batch_size, false);
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.prune_history(text, bigint, interval, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.prune_history(text, bigint, interval, integer) TO unitvisor_host;
