-- unitvisor schema: the fleet's promises under operator actions and a hostile host role (issue 21).
--
-- * A host id is held through a restart (register_host). Another instance (another machine with the
--   same [host] id, or this machine after a reboot) may take the id only while the host has no open
--   attempt, or once the host has been silent for its own host_dead_after, whatever its state. Until
--   now a host that stopped cleanly was anyone's at once: a clone took the id during a plain
--   `systemctl restart`, settled the real host's running attempts (they ran again), and the real
--   daemon was then the one refused, its units running on unsupervised.
-- * The database decides "dead" from its own clock (declare_dead_hosts). How long the declarer has
--   been connected is the age of its own registration (hosts.started_at, stamped by now() at every
--   register_host, which a daemon calls after every connect); the caller's connected_for can only
--   lower it. A host role could pass any number before.
-- * Only an attempt's own host, or a live peer recording the documented `lost` of a dead host's
--   attempt, settles it (record_outcome). Until now any host role could record `success exit:0` for
--   every open attempt of a dead host.
-- * A host that is not live (silent past its own host_dead_after, so that any peer may declare it dead
--   any moment) claims nothing (claim_jobs). A dead or fenced host was refused already (check_fence).
-- * A per-run submission sequence (runs.seq) orders the runs of one concurrency key: runs submitted in
--   one transaction share created_at = now(), and the tie went to their random ids.
-- * An attempt's times are the database's clock (record_outcome, mark_started): a host's readings are
--   moved by the host's clock offset, measured at the moment it records, and kept within the attempt's
--   claim and the moment of recording, so that a duration is never negative nor longer than it could be.
--
-- Expand only: one column (nullable, with a default), one sequence, one index, one helper, one new
-- overload of record_outcome; every function 0.5.x calls keeps its name, arguments and result, so that
-- 0.5.x daemons keep working (their outcomes' times without a clock reading are only kept within
-- bounds). What 0.5.x does that this refuses, it never does: it settles a dead host's attempts only as
-- `lost` (or `cancelled` when a cancel was requested) by the run's own policy, in the declaring
-- transaction, which this lets a live declarer do.

-- -- the submission sequence ---------------------------------------------------------------------

-- Every run submitted from here on takes the next number at its INSERT, so that runs of one
-- transaction are numbered in the order submit_run was called. Runs that are still live get numbers in
-- their created_at order, below every new one (ties keep going to the id, as before: which was first is
-- not recorded anywhere). Finished runs keep NULL: no claim looks at their order any more, and numbering
-- them would rewrite the whole table under this migration's lock (millions of rows of history, with
-- every writer of the fleet waiting). A finished run that is resumed keeps NULL, and its place: a NULL
-- was submitted before every number (concurrency_blocker below).
CREATE SEQUENCE unitvisor.run_seq AS bigint;
ALTER TABLE unitvisor.runs ADD COLUMN seq bigint;
UPDATE unitvisor.runs r SET seq = o.n
FROM (SELECT l.id, row_number() OVER (ORDER BY l.created_at, l.id) AS n FROM unitvisor.runs l
      WHERE l.state IN ('queued', 'starting', 'running')) o
WHERE r.id = o.id;
SELECT setval('unitvisor.run_seq', coalesce(max(seq), 0) + 1, false) FROM unitvisor.runs;
ALTER SEQUENCE unitvisor.run_seq OWNED BY unitvisor.runs.seq;
ALTER TABLE unitvisor.runs ALTER COLUMN seq SET DEFAULT nextval('unitvisor.run_seq');
-- The blocker's look-up of the queued run of the same key submitted just before: a backward range scan
-- that stops at the first row (006's runs_queued_key_idx still serves the runs numbered NULL).
CREATE INDEX runs_queued_key_seq_idx ON unitvisor.runs (concurrency_key, seq)
    WHERE state = 'queued' AND concurrency_key IS NOT NULL;

-- concurrency_blocker as in 006, in submission order by seq: a run of its key that is starting or
-- running, else the queued run of its key submitted just before it. Runs numbered NULL (submitted
-- before this migration) come before every numbered run, and among themselves by created_at, then id.
CREATE OR REPLACE FUNCTION unitvisor.concurrency_blocker(r unitvisor.runs) RETURNS uuid
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN r.concurrency_key IS NOT NULL THEN coalesce(
        (SELECT k.id FROM unitvisor.runs k
         WHERE k.concurrency_key = r.concurrency_key AND k.state IN ('starting', 'running') AND k.id <> r.id
         LIMIT 1),
        (SELECT k.id FROM unitvisor.runs k
         WHERE k.concurrency_key = r.concurrency_key AND k.state = 'queued' AND k.seq < r.seq
         ORDER BY k.seq DESC LIMIT 1),
        (SELECT k.id FROM unitvisor.runs k
         WHERE k.concurrency_key = r.concurrency_key AND k.state = 'queued' AND k.seq IS NULL AND k.id <> r.id
           AND (r.seq IS NOT NULL OR (k.created_at, k.id) < (r.created_at, r.id))
         ORDER BY k.created_at DESC, k.id DESC LIMIT 1)) END
$$;

-- runs_with_labels as in 012, newest first by submission: runs of one transaction share created_at.
CREATE OR REPLACE FUNCTION unitvisor.runs_with_labels(labels jsonb, max_rows integer DEFAULT 100)
RETURNS TABLE (id uuid, state text, created_at timestamptz, finished_at timestamptz, attempts integer,
               attempt integer, host_id text, outcome text, exit_status text, reason text,
               cancel_requested boolean, wait_reason text, labels jsonb)
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT s.* FROM (SELECT r.id AS run_id, r.created_at AS run_created_at, r.seq AS run_seq FROM unitvisor.runs r
                     WHERE r.labels @> runs_with_labels.labels
                     ORDER BY r.created_at DESC, r.seq DESC NULLS LAST, r.id
                     LIMIT unitvisor.max_rows_bound(runs_with_labels.max_rows)) m
    CROSS JOIN LATERAL unitvisor.run_status(m.run_id) s
    ORDER BY m.run_created_at DESC, m.run_seq DESC NULLS LAST, m.run_id
$$;

-- -- who may act for the fleet -------------------------------------------------------------------

-- A host that may declare others dead and settle their attempts: not fenced (check_fence says that),
-- active or draining, and heard from within its own host_dead_after by the database's clock. One that
-- is itself silent that long may be declared dead by a peer at any moment: it must not be the one
-- deciding about others. declare_dead_hosts and record_outcome ask this one function, in the same
-- transaction (the same now()), so that a host allowed to declare is allowed to settle what it declared.
CREATE FUNCTION unitvisor.host_acts_for_fleet(h unitvisor.hosts) RETURNS boolean
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT h.state IN ('active', 'draining')
       AND h.heartbeat_at >= now() - make_interval(secs => coalesce(h.dead_after_sec, 60))
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.host_acts_for_fleet(unitvisor.hosts) FROM PUBLIC;

-- -- register_host ---------------------------------------------------------------------------------

-- register_host as in 004, with the rule of the head of this file. Another instance is refused while
-- the host has been heard from within its own host_dead_after and either is active or draining (a live
-- daemon, maybe reconnecting) or has an attempt open (its daemon stopped, or is restarting: its runs go
-- on, and only its own instance may adopt them; a peer settles them only once it is declared dead,
-- after the same silence). The same machine in the same boot (a restart, a reconnect) takes it back at
-- once, as before. What a refused daemon is told says when it may try with success: the moment is the
-- database's, fixed by the last heartbeat, so the message stays the same while it waits.
CREATE OR REPLACE FUNCTION unitvisor.register_host(
    host_id text, host_name text, host_instance text, max_runs integer, memory_budget bigint,
    host_version text, host_boot_id text, allowed_executables text[], executable_patterns text[],
    run_user text, allowed_users text[], can_start boolean, cannot_start_reason text,
    poll_interval_sec double precision, dead_after_sec double precision)
RETURNS TABLE (registered boolean, state text, epoch bigint, detail text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    old unitvisor.hosts;
    new_epoch bigint;
    new_state text;
    open_attempts bigint;
    who text := format('%s (instance %s, backend pid %s)', register_host.host_name, register_host.host_instance,
                       pg_backend_pid());
BEGIN
    PERFORM unitvisor.require_host(register_host.host_id);
    IF NOT pg_try_advisory_lock(unitvisor.host_lock_key(register_host.host_id)) THEN
        UPDATE unitvisor.hosts h SET conflict_at = now(), conflict_detail = 'refused a second daemon: ' || who
        WHERE h.id = register_host.host_id;
        RETURN QUERY SELECT false, NULL::text, NULL::bigint,
            format('host id %s is held by another live daemon (its database session holds the host lock)',
                   register_host.host_id);
        RETURN;
    END IF;
    SELECT * INTO old FROM unitvisor.hosts h WHERE h.id = register_host.host_id FOR UPDATE;
    -- (A NULL instance was registered by a version-1 daemon, which recorded none: the usual case is
    -- this machine's own daemon before an upgrade, so it is not held against it.)
    IF FOUND AND old.instance IS NOT NULL AND old.instance <> register_host.host_instance
            AND old.heartbeat_at >= now() - make_interval(secs => coalesce(old.dead_after_sec, 60)) THEN
        SELECT count(*) INTO open_attempts FROM unitvisor.attempts a
        WHERE a.host_id = register_host.host_id AND a.outcome IS NULL;
        IF old.state IN ('active', 'draining') OR open_attempts > 0 THEN
            -- Held: let its instance have it back (or its silence run out).
            PERFORM pg_advisory_unlock(unitvisor.host_lock_key(register_host.host_id));
            UPDATE unitvisor.hosts h SET conflict_at = now(), conflict_detail = 'refused a second daemon: ' || who
            WHERE h.id = register_host.host_id;
            RETURN QUERY SELECT false, NULL::text, NULL::bigint, format(
                'host id %s is held by instance %s (another machine with this id, or this machine before a '
                'reboot), %s with %s attempt(s) open, last heard from at %s; another instance may take it once '
                'it has been silent for its host_dead_after (%s s), at %s',
                register_host.host_id, old.instance, old.state, open_attempts,
                to_char(old.heartbeat_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'),
                coalesce(old.dead_after_sec, 60),
                to_char((old.heartbeat_at + make_interval(secs => coalesce(old.dead_after_sec, 60)))
                        AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'));
            RETURN;
        END IF;
    END IF;
    IF NOT FOUND THEN
        INSERT INTO unitvisor.hosts (id, name, max_runs, memory_budget, version, boot_id, instance, can_start,
            cannot_start_reason, allowed_executables, executable_patterns, run_user, allowed_users,
            poll_interval_sec, dead_after_sec)
        VALUES (register_host.host_id, register_host.host_name, register_host.max_runs, register_host.memory_budget,
            register_host.host_version, register_host.host_boot_id, register_host.host_instance,
            register_host.can_start, register_host.cannot_start_reason, register_host.allowed_executables,
            register_host.executable_patterns, register_host.run_user, register_host.allowed_users,
            register_host.poll_interval_sec, register_host.dead_after_sec)
        RETURNING hosts.epoch INTO new_epoch;
        RETURN QUERY SELECT true, 'active'::text, new_epoch, 'registered'::text;
        RETURN;
    END IF;
    -- Same machine (a restart, a reconnect): same epoch, its attempts are its own. A dead host, or
    -- another instance taking over the id: a new epoch, so that the old owner's writes fail.
    new_epoch := CASE WHEN old.state = 'dead' OR old.instance IS DISTINCT FROM register_host.host_instance
                      THEN nextval('unitvisor.host_epochs') ELSE old.epoch END;
    new_state := CASE WHEN old.state = 'draining' OR (old.state = 'dead' AND old.drained_before_death)
                      THEN 'draining' ELSE 'active' END;
    -- started_at = now(): the start of this registration, which declare_dead_hosts measures the
    -- declarer's connection by (a daemon registers after every connect).
    UPDATE unitvisor.hosts h SET name = register_host.host_name, max_runs = register_host.max_runs,
        memory_budget = register_host.memory_budget, version = register_host.host_version,
        boot_id = register_host.host_boot_id, instance = register_host.host_instance,
        can_start = register_host.can_start, cannot_start_reason = register_host.cannot_start_reason,
        allowed_executables = register_host.allowed_executables,
        executable_patterns = register_host.executable_patterns, run_user = register_host.run_user,
        allowed_users = register_host.allowed_users, poll_interval_sec = register_host.poll_interval_sec,
        dead_after_sec = register_host.dead_after_sec, epoch = new_epoch, started_at = now(),
        heartbeat_at = now(), dead_at = NULL, dead_reason = NULL, drained_before_death = false, state = new_state
    WHERE h.id = register_host.host_id;
    RETURN QUERY SELECT true, new_state, new_epoch,
        CASE WHEN old.state = 'dead' THEN format('rejoined after being declared dead (%s)', old.dead_reason)
             WHEN new_epoch <> old.epoch THEN format('took over the id from instance %s', old.instance)
             ELSE 'registered' END;
END $$;

-- -- declare_dead_hosts ------------------------------------------------------------------------------

-- declare_dead_hosts as in 002, deciding from the database's own facts. The declarer has been connected
-- for as long as its registration is old (hosts.started_at); connected_for, the caller's own measure
-- (0.5.x daemons pass it), may only make that shorter. A declarer that does not act for the fleet
-- (host_acts_for_fleet: draining or active, and heard from) declares nothing: it could not settle the
-- attempts of what it declared (record_outcome asks the same).
CREATE OR REPLACE FUNCTION unitvisor.declare_dead_hosts(declarer text, declarer_epoch bigint,
                                                        connected_for double precision)
RETURNS TABLE (host_id text, silent_sec double precision, dead_after_sec double precision)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    me unitvisor.hosts;
    connected double precision;
BEGIN
    PERFORM unitvisor.check_fence(declare_dead_hosts.declarer, declare_dead_hosts.declarer_epoch);
    SELECT * INTO me FROM unitvisor.hosts h WHERE h.id = declare_dead_hosts.declarer;
    IF NOT unitvisor.host_acts_for_fleet(me) THEN
        RETURN;
    END IF;
    connected := least(extract(epoch FROM now() - me.started_at)::double precision,
                       coalesce(declare_dead_hosts.connected_for, 0));
    IF NOT pg_try_advisory_xact_lock(hashtextextended('unitvisor-fleet-upkeep', 0)) THEN
        RETURN;
    END IF;
    RETURN QUERY
    UPDATE unitvisor.hosts h SET state = 'dead', epoch = nextval('unitvisor.host_epochs'), dead_at = now(),
        drained_before_death = (h.state = 'draining'),
        dead_reason = format('silent for %s s (its host_dead_after is %s s); declared dead by host %s',
                             round(extract(epoch FROM now() - h.heartbeat_at)::numeric),
                             coalesce(h.dead_after_sec, 60), declare_dead_hosts.declarer)
    WHERE h.id <> declare_dead_hosts.declarer AND unitvisor.host_is_overdue(h)
      AND coalesce(h.dead_after_sec, 60) <= connected
    RETURNING h.id, extract(epoch FROM now() - h.heartbeat_at)::double precision,
              coalesce(h.dead_after_sec, 60);
END $$;

-- -- the claim ---------------------------------------------------------------------------------------

-- claim_jobs as in 012, claiming nothing for a host that is not live (host_is_live: active, and heard
-- from within its own host_dead_after). check_fence already refuses a host declared dead or whose id
-- was taken over; a host silent that long but not declared yet may be declared dead by any peer at the
-- next moment, its new attempts settled `lost` and started again elsewhere: it takes nothing until its
-- heartbeat is renewed (the daemon's next probe). The rest is 012's, line for line.
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
    -- (A bound cursor, planned for its first rows: sql/009_claim_cost.sql.)
    jobs CURSOR FOR
        SELECT j.id, j.run_id, j.scheduled_at, r.state AS run_state, r.memory_max, r.concurrency_key,
               r.host_pin, jsonb_build_array(r.argv[1], r.run_user, r.environment, r.memory_max)::text AS kind,
               r AS run
        FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
        WHERE j.state = 'available' AND j.scheduled_at <= now()
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
        SELECT (SELECT count(*) FROM unitvisor.attempts a JOIN unitvisor.hosts h ON h.id = a.host_id
                WHERE a.outcome IS NULL AND unitvisor.host_is_live(h) AND h.can_start),
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

-- -- an attempt's times --------------------------------------------------------------------------

-- A host's reading of its own clock, on the database's: an attempt's start is stamped by the database
-- (mark_started's now()) and its end read by the host (systemd's exit time), so a host 30 s behind
-- showed a 5 s run as -25 s. Chosen: every time stored is the database's clock, the one clock all hosts
-- share, and a host's reading is moved by `offset`, the host's clock offset measured when it records
-- (the database's statement_timestamp() minus the host's clock at the call), then kept within
-- [earliest, latest]: no attempt starts before it was claimed or ends before it started, and nothing
-- ends after it is recorded. Chosen over now() at record time, which would stretch a run by however
-- long its daemon was down when it ended (issue 12: systemd's reading is the run's real end). An offset
-- within a second is the measurement's own noise (the trip of the statement), not a clock's: it is
-- not applied, and systemd's microseconds are kept as read. A NULL offset (a 0.5.x daemon, which sends
-- no clock) moves nothing; the bounds alone keep such a duration sane (never negative, never past the
-- recording), if shorter than the run was on a host whose clock is behind.
CREATE FUNCTION unitvisor.host_time_on_db_clock(reading timestamptz, "offset" interval, earliest timestamptz,
                                                latest timestamptz) RETURNS timestamptz
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    -- (greatest and least skip NULLs: a NULL reading must stay NULL, "not read", not become a bound.)
    SELECT CASE WHEN reading IS NOT NULL THEN
        greatest(earliest, least(latest, reading + CASE WHEN abs(extract(epoch FROM "offset")) > 1
                                                       THEN "offset" ELSE interval '0' END)) END
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.host_time_on_db_clock(timestamptz, interval, timestamptz, timestamptz)
    FROM PUBLIC;

-- mark_started as in 004, a start read by the host (adoption: systemd's own start time) kept within its
-- claim and now (host_time_on_db_clock, without an offset: the call carries no clock).
CREATE OR REPLACE FUNCTION unitvisor.mark_started(run_id uuid, attempt integer, host_id text, host_epoch bigint,
                                                  invocation_id text, started_at timestamptz, reason text)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.check_fence(mark_started.host_id, mark_started.host_epoch);
    WITH started AS (
        UPDATE unitvisor.attempts a
        SET started_at = coalesce(a.started_at, unitvisor.host_time_on_db_clock(
                mark_started.started_at, NULL, a.claimed_at, now()), now()),
            invocation_id = coalesce(a.invocation_id, mark_started.invocation_id)
        WHERE a.run_id = mark_started.run_id AND a.attempt = mark_started.attempt AND a.outcome IS NULL
          AND a.host_id = mark_started.host_id
        RETURNING a.run_id),
    moved AS (
        UPDATE unitvisor.runs r SET state = 'running', updated_at = now()
        WHERE r.id IN (SELECT s.run_id FROM started s) AND r.state = 'starting' RETURNING r.id)
    INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
    SELECT m.id, mark_started.attempt, mark_started.host_id, 'running', mark_started.reason FROM moved m;
END $$;

-- -- record_outcome ------------------------------------------------------------------------------

-- record_outcome as in 007, with the host's clock (host_clock: its reading when it sent the call), and
-- two rules more:
-- * Times: the database's clock (host_time_on_db_clock above); started_at and ended_at are the host's
--   readings, moved by its offset and bounded by the claim and the moment of recording.
-- * Who settles: the attempt's own host; or a peer, only for an attempt of a host declared `dead`, only
--   while the peer acts for the fleet (host_acts_for_fleet: it could have declared it), and only with
--   what the declaration documents (docs/fleet.md, Dead hosts): the outcome `lost` with no exit status,
--   the run moved on by its own policy (queued for a retry while it has attempts left and `lost` is in
--   its retry_on, failed otherwise); or `cancelled`, when a cancel was requested. Nobody saw how such
--   an attempt ended, so anything else (`success exit:0`, say) would be history invented by the peer:
--   it is refused with SQLSTATE 42501, the whole transaction with it. An attempt of a host that is not
--   dead stays false, changing nothing, as before.
CREATE FUNCTION unitvisor.record_outcome(
    run_id uuid, attempt integer, host_id text, host_epoch bigint, outcome text, exit_status text,
    reason text, next_state text, retry_delay interval, invocation_id text, started_at timestamptz,
    ended_at timestamptz, cpu_usage_nsec bigint, memory_peak_bytes bigint, io_read_bytes bigint,
    io_write_bytes bigint, host_clock timestamptz) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    latest integer;
    state_after text := record_outcome.next_state;
    delay interval := record_outcome.retry_delay;
    detail text;
    target unitvisor.attempts;
    run unitvisor.runs;
    writer unitvisor.hosts;
    policy_state text;
    clock_offset interval := statement_timestamp() - record_outcome.host_clock;
    start_time timestamptz;
BEGIN
    PERFORM unitvisor.check_fence(record_outcome.host_id, record_outcome.host_epoch);
    IF state_after NOT IN ('queued', 'succeeded', 'failed', 'cancelled') OR (state_after = 'queued') <> (delay IS NOT NULL) THEN
        RAISE EXCEPTION 'an outcome moves its run to succeeded, failed or cancelled, or to queued with a retry delay'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Checked here, before the UPDATE, so that the error names the arguments.
    IF least(record_outcome.cpu_usage_nsec, record_outcome.memory_peak_bytes, record_outcome.io_read_bytes,
             record_outcome.io_write_bytes) < 0 THEN
        RAISE EXCEPTION 'cpu_usage_nsec, memory_peak_bytes, io_read_bytes and io_write_bytes: must be NULL (not measured) or at least 0'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'attempts',
                  CONSTRAINT = 'attempts_accounting_valid';
    END IF;
    SELECT * INTO target FROM unitvisor.attempts a
    WHERE a.run_id = record_outcome.run_id AND a.attempt = record_outcome.attempt AND a.outcome IS NULL
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF target.host_id <> record_outcome.host_id THEN
        IF NOT EXISTS (SELECT 1 FROM unitvisor.hosts h WHERE h.id = target.host_id AND h.state = 'dead') THEN
            RETURN false;  -- another host's, and that host is not dead: not this one's to settle
        END IF;
        SELECT * INTO writer FROM unitvisor.hosts h WHERE h.id = record_outcome.host_id;
        SELECT * INTO run FROM unitvisor.runs r WHERE r.id = record_outcome.run_id;
        IF NOT unitvisor.host_acts_for_fleet(writer) THEN
            RAISE EXCEPTION 'host % may not settle attempt % of run % of dead host %: it is not live itself (%, heard from % s ago)',
                record_outcome.host_id, record_outcome.attempt, record_outcome.run_id, target.host_id, writer.state,
                round(extract(epoch FROM now() - writer.heartbeat_at)::numeric)
                USING ERRCODE = 'insufficient_privilege',
                      HINT = 'only a live host settles the attempts of a host declared dead';
        END IF;
        policy_state := CASE WHEN record_outcome.attempt < run.max_attempts
                                  AND (run.retry_on IS NULL OR 'lost' = ANY (run.retry_on))
                             THEN 'queued' ELSE 'failed' END;
        IF record_outcome.exit_status IS NOT NULL
                OR NOT ((record_outcome.outcome = 'lost'
                         AND (state_after = policy_state
                              OR (run.cancel_requested_at IS NOT NULL AND state_after = 'cancelled')))
                        OR (record_outcome.outcome = 'cancelled' AND state_after = 'cancelled'
                            AND run.cancel_requested_at IS NOT NULL)) THEN
            RAISE EXCEPTION 'host % may not settle attempt % of run % of dead host % as % (%) moving the run to %: a peer records only lost, with no exit status, the run moved on by its own policy (here %), or cancelled when a cancel was requested',
                record_outcome.host_id, record_outcome.attempt, record_outcome.run_id, target.host_id,
                record_outcome.outcome, coalesce(record_outcome.exit_status, 'no exit status'), state_after,
                policy_state
                USING ERRCODE = 'insufficient_privilege',
                      HINT = 'how the attempt of a dead host ended is not known: docs/fleet.md, Dead hosts';
        END IF;
    END IF;
    -- A unit seen only once it had ended (adopted after a crash) did start.
    start_time := CASE WHEN record_outcome.invocation_id IS NULL AND record_outcome.started_at IS NULL
                       THEN target.started_at
                       ELSE coalesce(target.started_at,
                                     unitvisor.host_time_on_db_clock(record_outcome.started_at, clock_offset,
                                                                     target.claimed_at, statement_timestamp()),
                                     now()) END;
    UPDATE unitvisor.attempts a SET outcome = record_outcome.outcome, exit_status = record_outcome.exit_status,
        reason = record_outcome.reason,
        ended_at = coalesce(unitvisor.host_time_on_db_clock(record_outcome.ended_at, clock_offset,
                                                            coalesce(start_time, a.claimed_at), statement_timestamp()),
                            greatest(now(), start_time)),
        invocation_id = coalesce(a.invocation_id, record_outcome.invocation_id),
        started_at = start_time,
        cpu_usage_nsec = record_outcome.cpu_usage_nsec, memory_peak_bytes = record_outcome.memory_peak_bytes,
        io_read_bytes = record_outcome.io_read_bytes, io_write_bytes = record_outcome.io_write_bytes
    WHERE a.run_id = record_outcome.run_id AND a.attempt = record_outcome.attempt;
    SELECT max(a.attempt) INTO latest FROM unitvisor.attempts a WHERE a.run_id = record_outcome.run_id;
    IF latest <> record_outcome.attempt THEN
        RETURN true;  -- an older attempt settled late; the run follows its newest attempt
    END IF;
    detail := format('attempt %s: %s (%s)', record_outcome.attempt, record_outcome.outcome, record_outcome.reason);
    IF delay IS NOT NULL AND (SELECT r.cancel_requested_at IS NOT NULL FROM unitvisor.runs r
                              WHERE r.id = record_outcome.run_id FOR UPDATE) THEN
        -- Cancelled while this outcome was on its way: the operator's word ends the run.
        delay := NULL;
        state_after := 'cancelled';
        detail := detail || '; no retry, a cancel was requested';
    END IF;
    IF delay IS NOT NULL THEN
        INSERT INTO unitvisor.spawn_jobs (run_id, priority, scheduled_at)
        SELECT r.id, r.priority, now() + delay FROM unitvisor.runs r WHERE r.id = record_outcome.run_id;
        -- round() of a double rounds half to even, as Python's format did before this moved here
        detail := detail || format('; retry in %ss', round(extract(epoch FROM delay)::double precision));
    END IF;
    UPDATE unitvisor.runs r SET state = state_after, updated_at = now(),
        finished_at = CASE WHEN state_after IN ('succeeded', 'failed', 'cancelled') THEN now() END
    WHERE r.id = record_outcome.run_id;
    INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
    VALUES (record_outcome.run_id, record_outcome.attempt, record_outcome.host_id, state_after, detail);
    RETURN true;
END $$;

REVOKE EXECUTE ON FUNCTION unitvisor.record_outcome(uuid, integer, text, bigint, text, text, text, text, interval,
    text, timestamptz, timestamptz, bigint, bigint, bigint, bigint, timestamptz) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.record_outcome(uuid, integer, text, bigint, text, text, text, text, interval,
    text, timestamptz, timestamptz, bigint, bigint, bigint, bigint, timestamptz) TO unitvisor_host;

-- The 16-argument form (0.4.0 to 0.5.x daemons): the same outcome, no clock reading. Replaced in place,
-- so that its grants stay; the 12-argument form (007) reaches it, and so this one body.
CREATE OR REPLACE FUNCTION unitvisor.record_outcome(
    run_id uuid, attempt integer, host_id text, host_epoch bigint, outcome text, exit_status text,
    reason text, next_state text, retry_delay interval, invocation_id text, started_at timestamptz,
    ended_at timestamptz, cpu_usage_nsec bigint, memory_peak_bytes bigint, io_read_bytes bigint,
    io_write_bytes bigint) RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT unitvisor.record_outcome($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16,
                                    NULL::timestamptz)
$$;
