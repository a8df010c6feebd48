-- unitvisor schema: nothing that cannot start costs a claim, and the fleet's counts cost per host, not
-- per open attempt (issue 23, point 3).
--
-- Before: the heartbeat's "is there work for me" (claimable) walked the available jobs in claim order and
-- asked host_refusal (regular expressions) of each until one was accepted. It did not look at a run's
-- concurrency key, nor at this host's free slots: 10,000 runs queued behind one key made every host's
-- heartbeat say "there is work", every poll, and the claim that followed walked all 10,000 jobs (the
-- concurrency_blocker of each) to take nothing, about 144 ms of server time per host per poll. 1,000 runs
-- that no host accepts cost 1,000 host_refusal calls per heartbeat. And the claim's fair share and the
-- submitter's wake trigger counted every open attempt of the fleet (1.5 ms per submitter COMMIT with
-- 9,600 open).
--
-- Now:
-- * Every spawn job carries its run's concurrency key and kind (what host_refusal reads of a run:
--   argv[0], user, environment names, memory_max, pin), filled in at its INSERT by a trigger, whoever
--   inserts it (submit_run, a retry in record_outcome, resume_run, of any release), and indexed for
--   the available jobs: keyless jobs by kind, keyed jobs by key.
-- * host_has_work(host): the heartbeat's claimable. False for a host that is not active, cannot start
--   units or has every slot taken (max_runs open attempts). Otherwise it looks at one job per kind of
--   keyless run (the oldest), asks host_refusal once for that kind, and then only whether one job of an
--   accepted kind is due and not overdue; and at the head of each concurrency key's queue only (the
--   one run of the key that concurrency_blocker lets start, when none of the key is starting or
--   running). Its cost follows the number of kinds and keys waiting, not the number of runs: 10,000
--   runs behind one key are one key, 1,000 runs of a rollout no host accepts are one kind. A run waits
--   for its `not_before` (and a retry for its backoff) as its job's scheduled_at, which is due or not.
--   (unitvisor has no dependencies between runs; nothing else holds a queued run back.)
-- * claim_jobs passes over the jobs of a key that wait behind its head on the job's own row (its
--   concurrency_key), instead of joining each to its run and asking concurrency_blocker: a claim among
--   10,000 runs behind one key reads their job rows, not their runs.
-- * host_open_attempts: the number of open attempts of each host, kept by triggers on attempts (every
--   insert, settlement and delete, by any function of any release). The claim's fair share (`busy`)
--   and notify_spawn_targets (each live host's free slots) read one row per host instead of counting
--   the fleet's open attempts. A separate table, not a column of hosts: the heartbeat updates the host
--   row every poll (and a second connection may renew it while the loop is busy), and a counter there
--   would make a claim's transaction hold the row that the heartbeat needs.
--
-- Expand only: two columns (nullable), one table, triggers, indexes, helpers; heartbeat, claim_jobs and
-- notify_spawn_targets replaced in place with the same names, arguments and results, so 0.7.x daemons
-- claim and are told of work by the new rules.

-- -- what a job is -------------------------------------------------------------------------------------

-- The kind of a run: what host_refusal reads of it (besides the host), so that one answer holds for
-- every run of a kind. Environment names only (sorted), never their values, which may be secrets.
CREATE FUNCTION unitvisor.run_kind(r unitvisor.runs) RETURNS text
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT md5(jsonb_build_array(
        r.argv[1], r.run_user, r.memory_max, r.host_pin,
        CASE WHEN jsonb_typeof(r.environment) = 'object'
             THEN (SELECT coalesce(jsonb_agg(e.name ORDER BY e.name), '[]') FROM jsonb_object_keys(r.environment) AS e(name))
             ELSE r.environment END)::text)
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.run_kind(unitvisor.runs) FROM PUBLIC;

-- runs first, then spawn_jobs, in the order a submit takes them: a submit that has inserted its run
-- and waits for spawn_jobs (locked by the ALTER below) would otherwise deadlock with this migration's
-- CREATE INDEX on runs further down (it waits for that submit's lock on runs). Held to the commit, it
-- holds submits for the migration's few seconds (a lock timeout to a daemon or CLI, tried again), never
-- a deadlock. (A fresh-clone run's big-migration test, submits running throughout, failed on one.)
LOCK TABLE unitvisor.runs IN SHARE MODE;
ALTER TABLE unitvisor.spawn_jobs ADD COLUMN concurrency_key text, ADD COLUMN kind text;

-- Filled in from the run at every INSERT. SECURITY DEFINER: a submitter's session inserts through
-- submit_run (a definer already), but the trigger must read the run whoever inserts.
CREATE FUNCTION unitvisor.describe_spawn_job() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    SELECT r.concurrency_key, unitvisor.run_kind(r) INTO NEW.concurrency_key, NEW.kind
    FROM unitvisor.runs r WHERE r.id = NEW.run_id;
    RETURN NEW;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.describe_spawn_job() FROM PUBLIC;
CREATE TRIGGER spawn_jobs_describe BEFORE INSERT ON unitvisor.spawn_jobs
    FOR EACH ROW EXECUTE FUNCTION unitvisor.describe_spawn_job();

-- The jobs waiting now (only those: claimed and discarded jobs are history, and never read again).
UPDATE unitvisor.spawn_jobs j SET concurrency_key = r.concurrency_key, kind = unitvisor.run_kind(r)
FROM unitvisor.runs r WHERE r.id = j.run_id AND j.state = 'available';

-- The keyless jobs by kind (host_has_work's walk).
CREATE INDEX spawn_jobs_kind_idx ON unitvisor.spawn_jobs (kind, scheduled_at)
    WHERE state = 'available' AND concurrency_key IS NULL;
-- The keys that have a job waiting (a skip scan: one probe per key).
CREATE INDEX spawn_jobs_key_idx ON unitvisor.spawn_jobs (concurrency_key)
    WHERE state = 'available' AND concurrency_key IS NOT NULL;
-- The heartbeat's "a job has waited long" (its upkeep flag, as in 012): the oldest available job by
-- scheduled_at. spawn_jobs_available_idx leads with priority, so that EXISTS walked every available job
-- younger than `waited` to find none: 10,000 jobs behind a key, 10,000 rows on every heartbeat of every host.
CREATE INDEX spawn_jobs_due_idx ON unitvisor.spawn_jobs (scheduled_at) WHERE state = 'available';
-- A key's queued runs numbered NULL (submitted before 013, or resumed since): concurrency_blocker's
-- third look-up. Without it, the look-up for a numbered run walked every queued run of the key
-- (runs_queued_key_idx has no seq) to find none: 10,000 rows for each run behind a key of 10,000.
CREATE INDEX runs_queued_key_unnumbered_idx ON unitvisor.runs (concurrency_key, created_at, id)
    WHERE state = 'queued' AND concurrency_key IS NOT NULL AND seq IS NULL;

-- -- the head of a key's queue ---------------------------------------------------------------------------

-- The queued run of `key` that concurrency_blocker puts first (numbered NULL first, by created_at and
-- id; then by seq), or NULL when none is queued. Whether it may start (nothing of its key starting or
-- running) is concurrency_blocker's to say.
CREATE FUNCTION unitvisor.key_head(key text) RETURNS unitvisor.runs
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(
        (SELECT r FROM unitvisor.runs r
         WHERE r.concurrency_key = key AND r.state = 'queued' AND r.seq IS NULL
         ORDER BY r.created_at, r.id LIMIT 1),
        (SELECT r FROM unitvisor.runs r
         WHERE r.concurrency_key = key AND r.state = 'queued' AND r.seq IS NOT NULL
         ORDER BY r.seq LIMIT 1))
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.key_head(text) FROM PUBLIC;

-- The available jobs of concurrency keys that a claim may look at: per key with a job waiting, the job of
-- its head when nothing of the key is starting or running; and the jobs of a key that has no queued run
-- at all (stale: their runs moved on), at most 10 a key, so that a claim discards them. Every other job of
-- a key waits behind its head: concurrency_blocker says so for each, and no claim need look at them.
-- Due or not, overdue or not: the claim's query decides that, as for any job. One skip-scan probe and a
-- few index look-ups per key, for at most `max_keys` keys: past that (many keys waiting, say one per
-- run of a burst), NULL, and the claim asks concurrency_blocker of each keyed job it fetches, as 013
-- did, which costs what it takes, not the number of keys.
CREATE FUNCTION unitvisor.key_head_jobs(max_keys integer DEFAULT 64) RETURNS bigint[]
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    key text;
    head unitvisor.runs;
    ids bigint[] := '{}';
    keys integer := 0;
BEGIN
    SELECT j.concurrency_key INTO key FROM unitvisor.spawn_jobs j
    WHERE j.state = 'available' AND j.concurrency_key IS NOT NULL ORDER BY j.concurrency_key LIMIT 1;
    WHILE key IS NOT NULL LOOP
        keys := keys + 1;
        IF keys > max_keys THEN
            RETURN NULL;
        END IF;
        head := unitvisor.key_head(key);
        IF head.id IS NULL THEN
            ids := ids || ARRAY(SELECT j.id FROM unitvisor.spawn_jobs j
                                WHERE j.state = 'available' AND j.concurrency_key = key LIMIT 10);
        ELSIF unitvisor.concurrency_blocker(head) IS NULL THEN
            ids := ids || ARRAY(SELECT j.id FROM unitvisor.spawn_jobs j
                                WHERE j.run_id = head.id AND j.state = 'available');
        END IF;
        SELECT j.concurrency_key INTO key FROM unitvisor.spawn_jobs j
        WHERE j.state = 'available' AND j.concurrency_key > key ORDER BY j.concurrency_key LIMIT 1;
        IF NOT FOUND THEN
            key := NULL;
        END IF;
    END LOOP;
    RETURN ids;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.key_head_jobs(integer) FROM PUBLIC;

-- -- open attempts per host ------------------------------------------------------------------------------

CREATE TABLE unitvisor.host_open_attempts (
    host_id text PRIMARY KEY,
    open    integer NOT NULL DEFAULT 0
);
REVOKE ALL ON unitvisor.host_open_attempts FROM PUBLIC;

-- Moves a host's count by `delta`. Row triggers with a WHEN clause: an update of an attempt that does not
-- open or settle it (mark_started, an output tail) costs no call.
CREATE FUNCTION unitvisor.count_open_attempt() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP IN ('UPDATE', 'DELETE') AND OLD.outcome IS NULL THEN
        UPDATE unitvisor.host_open_attempts c SET open = c.open - 1 WHERE c.host_id = OLD.host_id;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') AND NEW.outcome IS NULL THEN
        UPDATE unitvisor.host_open_attempts c SET open = c.open + 1 WHERE c.host_id = NEW.host_id;
        IF NOT FOUND THEN
            INSERT INTO unitvisor.host_open_attempts AS c (host_id, open) VALUES (NEW.host_id, 1)
            ON CONFLICT (host_id) DO UPDATE SET open = c.open + 1;
        END IF;
    END IF;
    RETURN NULL;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.count_open_attempt() FROM PUBLIC;
CREATE TRIGGER attempts_count_insert AFTER INSERT ON unitvisor.attempts
    FOR EACH ROW WHEN (NEW.outcome IS NULL) EXECUTE FUNCTION unitvisor.count_open_attempt();
CREATE TRIGGER attempts_count_update AFTER UPDATE ON unitvisor.attempts
    FOR EACH ROW WHEN ((OLD.outcome IS NULL) <> (NEW.outcome IS NULL)
                       OR (OLD.outcome IS NULL AND OLD.host_id IS DISTINCT FROM NEW.host_id))
    EXECUTE FUNCTION unitvisor.count_open_attempt();
CREATE TRIGGER attempts_count_delete AFTER DELETE ON unitvisor.attempts
    FOR EACH ROW WHEN (OLD.outcome IS NULL) EXECUTE FUNCTION unitvisor.count_open_attempt();

-- The counts as they are now, under this migration's lock on attempts (the triggers above are in force
-- from its commit, and nothing else writes attempts meanwhile).
LOCK TABLE unitvisor.attempts IN SHARE MODE;
INSERT INTO unitvisor.host_open_attempts (host_id, open)
SELECT a.host_id, count(*) FROM unitvisor.attempts a WHERE a.outcome IS NULL GROUP BY a.host_id;


-- -- is there work for this host -------------------------------------------------------------------------

-- Whether a claim by `me` now could take a run, or discard a stale job: the heartbeat's claimable (see the
-- head of this file). It may say true where the claim then takes nothing (the fair share holds a burst's
-- run for another host within spread_grace, the memory budget is used up, another host took it first),
-- never false where the claim would take one, except for a keyed job left by a run that moved on while
-- its key still has queued runs (no claim looks at it; the run it belongs to is not queued).
CREATE FUNCTION unitvisor.host_has_work(me unitvisor.hosts) RETURNS boolean
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    this_kind text;
    this_key text;
    head unitvisor.runs;
    keys integer := 0;
BEGIN
    IF me.state <> 'active' OR NOT me.can_start
            OR (SELECT count(*) FROM unitvisor.attempts a WHERE a.host_id = me.id AND a.outcome IS NULL)
               >= me.max_runs THEN
        RETURN false;
    END IF;
    -- Keyless runs: one kind at a time (a skip scan over spawn_jobs_kind_idx).
    SELECT j.kind INTO this_kind FROM unitvisor.spawn_jobs j
    WHERE j.state = 'available' AND j.concurrency_key IS NULL ORDER BY j.kind LIMIT 1;
    WHILE this_kind IS NOT NULL LOOP
        -- The oldest job of the kind stands for all of them before host_refusal (the kind is what it reads).
        SELECT r.* INTO head FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
        WHERE j.state = 'available' AND j.concurrency_key IS NULL AND j.kind = this_kind
        ORDER BY j.scheduled_at LIMIT 1;
        IF head.state <> 'queued' THEN
            RETURN true;  -- a stale job: the claim discards it
        END IF;
        IF unitvisor.host_refusal(me, head) IS NULL AND EXISTS (
                SELECT 1 FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
                WHERE j.state = 'available' AND j.concurrency_key IS NULL AND j.kind = this_kind
                  AND j.scheduled_at <= now()
                  AND (r.state <> 'queued' OR r.start_deadline IS NULL OR NOT unitvisor.is_overdue(r))) THEN
            RETURN true;
        END IF;
        SELECT j.kind INTO this_kind FROM unitvisor.spawn_jobs j
        WHERE j.state = 'available' AND j.concurrency_key IS NULL AND j.kind > this_kind
        ORDER BY j.kind LIMIT 1;
        IF NOT FOUND THEN
            this_kind := NULL;
        END IF;
    END LOOP;
    -- Keyed runs: the head of each key, when it may start (key_head_jobs), due, not overdue, accepted;
    -- for at most 64 keys: past them, "maybe", and the claim decides (as before 020), so that a fleet
    -- running thousands of keys at once does not pay a probe per key on every heartbeat.
    SELECT j.concurrency_key INTO this_key FROM unitvisor.spawn_jobs j
    WHERE j.state = 'available' AND j.concurrency_key IS NOT NULL ORDER BY j.concurrency_key LIMIT 1;
    WHILE this_key IS NOT NULL LOOP
        keys := keys + 1;
        IF keys > 64 THEN
            RETURN true;
        END IF;
        head := unitvisor.key_head(this_key);
        IF head.id IS NULL THEN
            RETURN true;  -- stale jobs only: the claim discards them
        END IF;
        IF unitvisor.concurrency_blocker(head) IS NULL
                AND EXISTS (SELECT 1 FROM unitvisor.spawn_jobs j
                            WHERE j.run_id = head.id AND j.state = 'available' AND j.scheduled_at <= now())
                AND (head.start_deadline IS NULL OR NOT unitvisor.is_overdue(head))
                AND unitvisor.host_refusal(me, head) IS NULL THEN
            RETURN true;
        END IF;
        SELECT j.concurrency_key INTO this_key FROM unitvisor.spawn_jobs j
        WHERE j.state = 'available' AND j.concurrency_key > this_key ORDER BY j.concurrency_key LIMIT 1;
        IF NOT FOUND THEN
            this_key := NULL;
        END IF;
    END LOOP;
    RETURN false;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.host_has_work(unitvisor.hosts) FROM PUBLIC;

-- heartbeat as in 012, its claimable from host_has_work.
CREATE OR REPLACE FUNCTION unitvisor.heartbeat(host_id text, host_epoch bigint, waited interval)
RETURNS TABLE (host_state text, claimable boolean, cancels boolean, upkeep boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.require_host(heartbeat.host_id);
    RETURN QUERY
    UPDATE unitvisor.hosts h SET heartbeat_at = now()
    WHERE h.id = heartbeat.host_id AND h.epoch = heartbeat.host_epoch AND h.state <> 'dead'
    RETURNING h.state,
        unitvisor.host_has_work(h),
        EXISTS (SELECT 1 FROM unitvisor.attempts a JOIN unitvisor.runs r ON r.id = a.run_id
                WHERE a.host_id = heartbeat.host_id AND a.outcome IS NULL AND r.cancel_requested_at IS NOT NULL),
        EXISTS (SELECT 1 FROM unitvisor.hosts o WHERE o.id <> h.id AND unitvisor.host_is_overdue(o))
        OR EXISTS (SELECT 1 FROM unitvisor.spawn_jobs j
                   WHERE j.state = 'available' AND j.scheduled_at <= now() - heartbeat.waited)
        OR EXISTS (SELECT 1 FROM unitvisor.runs r
                   WHERE r.state = 'queued' AND r.start_deadline <= now() AND unitvisor.is_overdue(r));
END $$;

-- -- the claim -------------------------------------------------------------------------------------------

-- claim_jobs as in 013, with two changes:
-- * its query passes over the jobs of a key but the one key_head_jobs names (the key's head, when it may
--   start) on the job's row: 013 joined each to its run and asked concurrency_blocker, for every one, on
--   every claim. The check stays on the head (and again under the key's lock, as in 006).
-- * `busy` (the open attempts of the live hosts that can start units) is the sum of their counts in
--   host_open_attempts: one row per host, not one per open attempt of the fleet.
-- The rest is 013's, line for line.
CREATE OR REPLACE FUNCTION unitvisor.claim_jobs(
    host_id text, host_epoch bigint, batch integer, unit_format text,
    starve_after interval DEFAULT '5 minutes', spread_grace interval DEFAULT '1 second')
RETURNS TABLE (run_id uuid, attempt integer, unit_name text, claimed_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    me unitvisor.hosts;
    in_flight integer;
    memory_used bigint;
    free integer;
    capacity bigint;
    busy bigint;
    waiting bigint;
    share bigint;
    shared integer := 0;
    taken integer := 0;
    looked integer := 0;
    next_attempt integer;
    name text;
    enough bigint;
    refusals jsonb := '{}';
    accepted jsonb := '{}';
    contested boolean;
    heads bigint[];
    -- (A bound cursor, planned for its first rows: sql/009_claim_cost.sql.) Still one walk of
    -- spawn_jobs_available_idx in claim order, as 013's: a job of a key that is not its key's head is
    -- passed over on the job's own row (its concurrency_key column), before the join to its run and
    -- without a concurrency_blocker. (A merge of two streams, keyless jobs and heads, was tried: the
    -- planner sorted the whole queue for it, every claim of a burst.)
    jobs CURSOR FOR
        SELECT j.id, j.run_id, j.scheduled_at, r.state AS run_state, r.memory_max, r.concurrency_key,
               r.host_pin, jsonb_build_array(r.argv[1], r.run_user, r.environment, r.memory_max)::text AS kind,
               r AS run
        FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
        WHERE j.state = 'available' AND j.scheduled_at <= now()
          AND (heads IS NULL OR j.concurrency_key IS NULL OR j.id = ANY (heads))
          AND (r.state <> 'queued' OR ((r.host_pin IS NULL OR r.host_pin = me.id)
                                       AND (r.concurrency_key IS NULL OR unitvisor.concurrency_blocker(r) IS NULL)
                                       AND (r.start_deadline IS NULL OR NOT unitvisor.is_overdue(r))))
        ORDER BY j.priority DESC, j.scheduled_at, j.id
        ;
BEGIN
    PERFORM unitvisor.check_fence(claim_jobs.host_id, claim_jobs.host_epoch);
    SELECT * INTO me FROM unitvisor.hosts h WHERE h.id = claim_jobs.host_id;
    IF me.state <> 'active' OR NOT me.can_start OR NOT unitvisor.host_is_live(me) THEN
        RETURN;
    END IF;
    SELECT count(*), coalesce(sum(r.memory_max), 0) INTO in_flight, memory_used
    FROM unitvisor.attempts a JOIN unitvisor.runs r ON r.id = a.run_id
    WHERE a.host_id = claim_jobs.host_id AND a.outcome IS NULL;
    free := least(claim_jobs.batch, me.max_runs - in_flight);
    IF free <= 0 THEN
        RETURN;
    END IF;
    SELECT coalesce(sum(h.max_runs), 0) INTO capacity FROM unitvisor.hosts h
    WHERE unitvisor.host_is_live(h) AND h.can_start;
    IF capacity > me.max_runs THEN
        enough := least(capacity, ceil((free + in_flight)::numeric * capacity / me.max_runs)::bigint);
        -- busy and waiting in one statement, from one snapshot (009).
        SELECT (SELECT coalesce(sum(c.open), 0) FROM unitvisor.hosts h
                JOIN unitvisor.host_open_attempts c ON c.host_id = h.id
                WHERE unitvisor.host_is_live(h) AND h.can_start),
               (SELECT count(*) FROM (
                    SELECT 1 FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
                    WHERE j.state = 'available' AND j.scheduled_at <= now() AND r.state = 'queued'
                      AND (r.host_pin IS NULL OR r.host_pin = me.id)
                      AND (r.start_deadline IS NULL OR r.start_deadline > now())
                    LIMIT greatest(enough, 0)) w)
        INTO busy, waiting;
        share := ceil((busy + waiting)::numeric * me.max_runs / capacity)::bigint - in_flight;
    ELSE
        share := free;  -- no other live host: nothing to share
    END IF;
    heads := unitvisor.key_head_jobs();
    FOR job IN jobs LOOP
        IF job.run_state = 'queued' THEN
            IF refusals ? job.kind THEN
                CONTINUE WHEN (refusals ->> job.kind)::boolean;
            ELSIF unitvisor.host_refusal(me, job.run) IS NOT NULL THEN
                refusals := unitvisor.claim_memo(refusals, job.kind, true);
                CONTINUE;
            ELSE
                refusals := unitvisor.claim_memo(refusals, job.kind, false);
            END IF;
        END IF;
        looked := looked + 1;
        IF job.run_state <> 'queued' THEN
            PERFORM 1 FROM unitvisor.spawn_jobs j WHERE j.id = job.id AND j.state = 'available'
                FOR UPDATE SKIP LOCKED;
            CONTINUE WHEN NOT FOUND;  -- another claim has it
            UPDATE unitvisor.spawn_jobs j SET state = 'discarded', claimed_by = claim_jobs.host_id,
                claimed_at = now(), error = 'run is already ' || job.run_state
            WHERE j.id = job.id;
            CONTINUE;
        END IF;
        EXIT WHEN taken >= free OR looked > 4 * claim_jobs.batch;
        IF share >= free OR job.host_pin IS NOT NULL THEN
            contested := false;
        ELSIF accepted ? job.kind THEN
            contested := (accepted ->> job.kind)::boolean;
        ELSE
            contested := unitvisor.also_accepted(me, job.run);
            accepted := unitvisor.claim_memo(accepted, job.kind, contested);
        END IF;
        IF contested AND shared >= share AND job.scheduled_at > now() - claim_jobs.spread_grace THEN
            CONTINUE;  -- another host's share, for now
        END IF;
        IF me.memory_budget IS NOT NULL AND memory_used + coalesce(job.memory_max, 0) > me.memory_budget THEN
            EXIT WHEN job.scheduled_at < now() - claim_jobs.starve_after;  -- it reserves the host
            CONTINUE;  -- backfill: a smaller run behind it may fit
        END IF;
        IF job.concurrency_key IS NOT NULL THEN
            -- The key's lock, then the decision again from a snapshot taken after it (006).
            CONTINUE WHEN NOT pg_try_advisory_xact_lock(hashtextextended('unitvisor-concurrency-key:' || job.concurrency_key, 0));
            CONTINUE WHEN (SELECT unitvisor.concurrency_blocker(r) FROM unitvisor.runs r WHERE r.id = job.run_id) IS NOT NULL;
        END IF;
        PERFORM 1 FROM unitvisor.spawn_jobs j WHERE j.id = job.id AND j.state = 'available' FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;  -- another claim has it, or took it since this loop's query began
        UPDATE unitvisor.spawn_jobs j SET state = 'claimed', claimed_by = claim_jobs.host_id, claimed_at = now()
        WHERE j.id = job.id;
        SELECT coalesce(max(a.attempt), 0) + 1 INTO next_attempt FROM unitvisor.attempts a WHERE a.run_id = job.run_id;
        name := format(claim_jobs.unit_format, job.run_id, next_attempt);
        UPDATE unitvisor.runs r SET state = 'starting', updated_at = now() WHERE r.id = job.run_id;
        DELETE FROM unitvisor.run_waits w WHERE w.run_id = job.run_id;
        INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
        VALUES (job.run_id, next_attempt, claim_jobs.host_id, 'starting', 'claimed by host ' || claim_jobs.host_id);
        INSERT INTO unitvisor.attempts AS a (run_id, attempt, host_id, unit_name)
        VALUES (job.run_id, next_attempt, claim_jobs.host_id, name)
        RETURNING a.run_id, a.attempt, a.unit_name, a.claimed_at
        INTO claim_jobs.run_id, claim_jobs.attempt, claim_jobs.unit_name, claim_jobs.claimed_at;
        RETURN NEXT;
        taken := taken + 1;
        shared := shared + contested::integer;
        memory_used := memory_used + coalesce(job.memory_max, 0);
    END LOOP;
END $$;

-- -- the submitter's wake trigger ------------------------------------------------------------------------

-- notify_spawn_targets as in 011, each live host's free slots from host_open_attempts (one row per host)
-- instead of a count of the fleet's open attempts grouped by host, in the submitter's COMMIT.
CREATE OR REPLACE FUNCTION unitvisor.notify_spawn_targets() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    wanted bigint := coalesce(nullif(current_setting('unitvisor.spawn_unpinned', true), '')::bigint, 0);
    pins text[] := ARRAY(SELECT jsonb_array_elements_text(
        coalesce(nullif(current_setting('unitvisor.spawn_pins', true), ''), '[]')::jsonb));
    kinds jsonb := coalesce(nullif(current_setting('unitvisor.spawn_kinds', true), ''), '[]')::jsonb;
    targets text[] := '{}';
    room text[];
    payload text;
BEGIN
    IF wanted = 0 AND cardinality(pins) = 0 THEN
        RETURN NULL;  -- done by an earlier event of this commit, or a statement that inserted no available job
    END IF;
    PERFORM set_config('unitvisor.spawn_unpinned', '', true), set_config('unitvisor.spawn_pins', '', true),
            set_config('unitvisor.spawn_kinds', '', true);
    IF wanted > 0 THEN
        WITH live AS (
            SELECT h.id, h.max_runs, h.max_runs - coalesce(c.open, 0) AS free
            FROM unitvisor.hosts h
            LEFT JOIN unitvisor.host_open_attempts c ON c.host_id = h.id
            WHERE unitvisor.host_is_live(h) AND h.can_start),
        fit AS (
            SELECT l.id, l.free,
                   least(l.free, ceil(wanted::numeric * l.max_runs / (SELECT sum(max_runs) FROM live))::bigint) AS takes
            FROM live l WHERE l.free > 0),
        ranked AS (
            SELECT f.id, sum(f.takes) OVER w - f.takes AS before, row_number() OVER w AS n
            FROM fit f WINDOW w AS (ORDER BY f.free DESC, f.id))
        SELECT coalesce(array_agg(id) FILTER (WHERE before < wanted OR n <= 2), '{}'), coalesce(array_agg(id), '{}')
        INTO targets, room FROM ranked;
        -- Every kind accepted by one of them, or every host with room. Not asked when they are every host
        -- with room already (011).
        IF cardinality(targets) > 0 AND cardinality(targets) < cardinality(room) AND (jsonb_array_length(kinds) > 32 OR EXISTS (
                SELECT 1 FROM jsonb_array_elements(kinds) AS e(k)
                WHERE NOT EXISTS (SELECT 1 FROM unitvisor.hosts h
                                  WHERE h.id = ANY (targets)
                                    AND unitvisor.host_refusal(h, jsonb_populate_record(NULL::unitvisor.runs, e.k)) IS NULL))) THEN
            targets := room;
        END IF;
    END IF;
    targets := ARRAY(SELECT DISTINCT t FROM unnest(targets || pins) AS t ORDER BY t);
    payload := json_build_object('hosts', targets)::text;
    PERFORM pg_notify('unitvisor_spawn', CASE WHEN octet_length(payload) > 7000 THEN '' ELSE payload END);
    RETURN NULL;
END $$;
