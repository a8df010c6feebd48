-- unitvisor schema, version 2: a fleet of hosts on one database.
--
-- What a host may run is registered in its row, so that the claim (and the explanation of why a run
-- waits) is decided by the database from the same facts for every host; every write a host makes
-- carries its (host id, epoch), which the database checks, so that a host that was declared dead
-- cannot record, claim or start anything for what was taken over. See docs/fleet.md.
--
-- Expand only: every column added here has a default, and nothing a version-1 daemon reads or
-- writes changed shape, so version-1 daemons keep working against this schema.

-- -- hosts: capability, ownership, fencing ------------------------------------------------------

-- Every epoch any host ever gets comes from here, so none is ever given twice: a host forgotten and
-- registered again does not make its first life's fence valid again.
CREATE SEQUENCE unitvisor.host_epochs;

ALTER TABLE unitvisor.hosts
    -- Bumped whenever ownership of the host id changes hands: declared dead, or registered by a
    -- different machine (instance). A write carrying an older epoch is refused (check_fence).
    ADD COLUMN epoch bigint NOT NULL DEFAULT nextval('unitvisor.host_epochs'),
    -- Which machine and boot holds this id now (a hash of machine id and boot id): a restart on the
    -- same machine keeps the epoch, another machine with the same id is a conflict.
    ADD COLUMN instance text,
    -- What this host may run, as its daemon registered it (the claim filters on these).
    ADD COLUMN can_start boolean NOT NULL DEFAULT true,
    ADD COLUMN cannot_start_reason text,
    ADD COLUMN allowed_executables text[] NOT NULL DEFAULT '{}',  -- the globs, for people
    ADD COLUMN executable_patterns text[] NOT NULL DEFAULT '{}',  -- the same, as anchored regexes
    ADD COLUMN run_user text NOT NULL DEFAULT '',                 -- '' is a DynamicUser per run
    ADD COLUMN allowed_users text[] NOT NULL DEFAULT '{}',
    -- Timing the host runs with: others declare it dead by its own host_dead_after, which its
    -- stop_runs_when_cut_off timing was computed from.
    ADD COLUMN poll_interval_sec double precision,
    ADD COLUMN dead_after_sec double precision,
    ADD COLUMN dead_at timestamptz,
    ADD COLUMN drained_before_death boolean NOT NULL DEFAULT false,  -- it comes back draining
    ADD COLUMN dead_reason text,
    -- The last time a second daemon tried to use this id while it was held (a cloned machine id, a
    -- reused [host] id), and who it was.
    ADD COLUMN conflict_at timestamptz,
    ADD COLUMN conflict_detail text;

ALTER TABLE unitvisor.hosts DROP CONSTRAINT hosts_state_valid;
ALTER TABLE unitvisor.hosts ADD CONSTRAINT hosts_state_valid
    CHECK (state IN ('active', 'draining', 'stopped', 'dead'));

-- Why a queued run waits when no live host accepts it (no row: some live host would take it).
-- A table of its own, not a column of runs: version 0.1.0 reads runs and attempts with SELECT * into
-- dataclasses that refuse a field they do not know, so a column added to either breaks every 0.1.0
-- daemon and CLI still running during a rolling upgrade (tests/package/test_upgrade.py). Neither
-- table may gain a column until no 0.1.0 is left (tests/integration/test_migrations.py checks).
CREATE TABLE unitvisor.run_waits (
    run_id uuid PRIMARY KEY REFERENCES unitvisor.runs (id) ON DELETE CASCADE,
    reason text NOT NULL
);

-- A path that is not normalised ('/usr/bin/../x', '//x', '/x/./y', '/x/') can never pass a host's
-- allowlist, which compares normalised paths: refuse it at submit time instead of letting it wait.
-- A trigger on new argv values, not a CHECK constraint: PostgreSQL re-checks a CHECK on every update
-- of a row, even NOT VALID, so one such run submitted before this migration would make every later
-- update of it fail (its state, its outcome, a cancel). Those old rows are refused by a host instead.
CREATE FUNCTION unitvisor.refuse_unnormalised_argv0() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.argv[1] ~ '(//|/\./|/\.\./|/\.\.?$|./$)' THEN
        RAISE EXCEPTION 'argv[0] is not a normalised absolute path'
            USING ERRCODE = 'check_violation', CONSTRAINT = 'runs_argv0_normalised',
                  HINT = 'write it without //, /./, /../ or a trailing /';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER runs_argv0_normalised BEFORE INSERT OR UPDATE OF argv ON unitvisor.runs
    FOR EACH ROW EXECUTE FUNCTION unitvisor.refuse_unnormalised_argv0();

-- -- fencing --------------------------------------------------------------------------------------

-- The session-level advisory lock a live daemon holds on its host id (on its main connection): a
-- second daemon with the same id cannot take it. 64 bits of hash, so two distinct ids practically
-- never share a lock.
CREATE FUNCTION unitvisor.host_lock_key(host_id text) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$ SELECT hashtextextended('unitvisor-host:' || host_id, 0) $$;

-- Every write a host makes calls this first: it holds a share lock on the host's row for the rest of
-- the transaction, so a concurrent declaration of death (which updates the row) either waits for
-- the write to commit, or commits first and the write is refused. SQLSTATE UV001: fenced.
CREATE FUNCTION unitvisor.check_fence(host_id text, host_epoch bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    current unitvisor.hosts;
BEGIN
    SELECT * INTO current FROM unitvisor.hosts h WHERE h.id = check_fence.host_id FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'host % is fenced: its row is gone', check_fence.host_id
            USING ERRCODE = 'UV001', HINT = 'the daemon registers again';
    END IF;
    IF current.epoch <> check_fence.host_epoch OR current.state = 'dead' THEN
        RAISE EXCEPTION 'host % is fenced: epoch % is over (now %, %)', check_fence.host_id,
            check_fence.host_epoch, current.epoch, current.state
            USING ERRCODE = 'UV001', HINT = 'the daemon registers again';
    END IF;
    RETURN true;
END $$;

-- A host is live while it is active and has been heard from within its own host_dead_after (whether
-- it can start units is host_refusal's to say, so that a waiting run names the reason).
CREATE FUNCTION unitvisor.host_is_live(h unitvisor.hosts) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT h.state = 'active' AND h.heartbeat_at >= now() - make_interval(secs => coalesce(h.dead_after_sec, 60))
$$;

-- A host to declare dead: silent for longer than its own host_dead_after, and either active or
-- draining, or stopped with an attempt still open (a host that stopped cleanly with nothing open
-- stays 'stopped'). The heartbeat's probe and declare_dead_hosts both ask this one function.
CREATE FUNCTION unitvisor.host_is_overdue(h unitvisor.hosts) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT h.heartbeat_at < now() - make_interval(secs => coalesce(h.dead_after_sec, 60))
       AND (h.state IN ('active', 'draining')
            OR (h.state = 'stopped' AND EXISTS (SELECT 1 FROM unitvisor.attempts a
                                                WHERE a.host_id = h.id AND a.outcome IS NULL)))
$$;

-- Why host h would not run run r, or NULL when it would. The claim, the probe and the explanation of
-- a waiting run all ask this one function, so they cannot disagree.
CREATE FUNCTION unitvisor.host_refusal(h unitvisor.hosts, r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN r.host_pin IS NOT NULL AND r.host_pin <> h.id THEN 'pinned to host ' || r.host_pin
        WHEN NOT h.can_start THEN 'cannot start units (' || coalesce(h.cannot_start_reason, 'unknown') || ')'
        WHEN NOT EXISTS (SELECT 1 FROM unnest(h.executable_patterns) AS p(pattern) WHERE r.argv[1] ~ p.pattern)
            THEN 'executable ' || r.argv[1] || ' is not allowed'
        WHEN r.run_user IS NOT NULL AND r.run_user <> h.run_user AND NOT r.run_user = ANY (h.allowed_users)
            THEN 'user ' || r.run_user || ' is not allowed'
        WHEN r.memory_max IS NOT NULL AND h.memory_budget IS NOT NULL AND r.memory_max > h.memory_budget
            THEN 'memory_max ' || r.memory_max || ' bytes is over the memory budget'
    END
$$;

-- Whether another live host that can start units would also run r: only such runs are shared out.
CREATE FUNCTION unitvisor.also_accepted(me unitvisor.hosts, r unitvisor.runs) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM unitvisor.hosts h
                   WHERE h.id <> me.id AND h.can_start AND unitvisor.host_is_live(h)
                     AND unitvisor.host_refusal(h, r) IS NULL)
$$;

-- -- registration ---------------------------------------------------------------------------------

-- register_host: called by a daemon on its main connection after every (re)connect. It takes the
-- host id's lock for the session, and the host row for this instance, unless another live daemon
-- holds it: then it changes nothing but conflict_at/conflict_detail and returns registered = false.
CREATE FUNCTION unitvisor.register_host(
    host_id text, host_name text, host_instance text, max_runs integer, memory_budget bigint,
    host_version text, host_boot_id text, allowed_executables text[], executable_patterns text[],
    run_user text, allowed_users text[], can_start boolean, cannot_start_reason text,
    poll_interval_sec double precision, dead_after_sec double precision)
RETURNS TABLE (registered boolean, state text, epoch bigint, detail text)
LANGUAGE plpgsql AS $$
DECLARE
    old unitvisor.hosts;
    new_epoch bigint;
    new_state text;
    who text := format('%s (instance %s, backend pid %s)', register_host.host_name, register_host.host_instance,
                       pg_backend_pid());
BEGIN
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
            AND old.state IN ('active', 'draining')
            AND old.heartbeat_at >= now() - make_interval(secs => coalesce(old.dead_after_sec, 60)) THEN
        -- Another machine held it moments ago (it may be reconnecting): let it have it back.
        PERFORM pg_advisory_unlock(unitvisor.host_lock_key(register_host.host_id));
        UPDATE unitvisor.hosts h SET conflict_at = now(), conflict_detail = 'refused a second daemon: ' || who
        WHERE h.id = register_host.host_id;
        RETURN QUERY SELECT false, NULL::text, NULL::bigint,
            format('host id %s is in use by instance %s, heard from %s s ago', register_host.host_id,
                   old.instance, round(extract(epoch FROM now() - old.heartbeat_at)::numeric, 1));
        RETURN;
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
    -- another machine taking over a silent id: a new epoch, so that the old owner's writes fail.
    new_epoch := CASE WHEN old.state = 'dead' OR old.instance IS DISTINCT FROM register_host.host_instance
                      THEN nextval('unitvisor.host_epochs') ELSE old.epoch END;
    new_state := CASE WHEN old.state = 'draining' OR (old.state = 'dead' AND old.drained_before_death)
                      THEN 'draining' ELSE 'active' END;
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

-- -- the claim ------------------------------------------------------------------------------------

-- claim_jobs: one host claims spawn jobs it can run, in one transaction with the attempts it creates.
--
-- Order: priority, then when the job became due. Policies (docs/fleet.md):
-- * Only runs this host accepts (host_refusal): a run another host could run is never claimed and
--   failed here; it waits for that host.
-- * Backfill: a run whose memory does not fit the budget now is skipped and smaller ones behind it
--   are claimed. Starvation guard: once a run has been due for longer than starve_after, it reserves
--   the host: nothing behind it is claimed here until enough memory is free for it (its memory_max
--   is within the budget, or host_refusal would have excluded it, so it fits once runs end).
-- * Spread: of the jobs due for less than spread_grace that another live host would also take, a
--   host takes only its fair share, in proportion to its max_runs among the live hosts, of the
--   fleet's runs in flight plus those jobs; a job no other host would take is always taken, and jobs
--   due for longer are anyone's, so a share never leaves work waiting for long.
CREATE FUNCTION unitvisor.claim_jobs(
    host_id text, host_epoch bigint, batch integer, unit_format text,
    starve_after interval DEFAULT '5 minutes', spread_grace interval DEFAULT '1 second')
RETURNS TABLE (run_id uuid, attempt integer, unit_name text, claimed_at timestamptz)
LANGUAGE plpgsql AS $$
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
    job record;
    next_attempt integer;
    name text;
BEGIN
    PERFORM unitvisor.check_fence(claim_jobs.host_id, claim_jobs.host_epoch);
    SELECT * INTO me FROM unitvisor.hosts h WHERE h.id = claim_jobs.host_id;
    IF me.state <> 'active' OR NOT me.can_start THEN
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
    SELECT count(*) INTO busy FROM unitvisor.attempts a JOIN unitvisor.hosts h ON h.id = a.host_id
    WHERE a.outcome IS NULL AND unitvisor.host_is_live(h) AND h.can_start;
    IF capacity > me.max_runs THEN
        SELECT count(*) INTO waiting FROM (
            SELECT 1 FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
            WHERE j.state = 'available' AND j.scheduled_at <= now() AND r.state = 'queued'
              AND unitvisor.host_refusal(me, r) IS NULL AND unitvisor.also_accepted(me, r)
            LIMIT capacity) w;
        share := ceil((busy + waiting)::numeric * me.max_runs / capacity)::bigint - in_flight;
    ELSE
        share := free;  -- no other live host: nothing to share
    END IF;
    FOR job IN
        -- Stale jobs (their run is not queued) of any pin are discarded by whoever meets them, so
        -- that the probe's "claimable" and this loop agree.
        SELECT j.id, j.run_id, j.scheduled_at, r.state AS run_state, r.memory_max,
               share < free AND r.state = 'queued' AND unitvisor.also_accepted(me, r) AS contested
        FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
        WHERE j.state = 'available' AND j.scheduled_at <= now()
          AND (r.state <> 'queued' OR unitvisor.host_refusal(me, r) IS NULL)
        ORDER BY j.priority DESC, j.scheduled_at, j.id
        -- No FOR UPDATE here: the loop fetches rows ten at a time, and it would lock every job it
        -- fetched, those it skips for a share or for memory too, until the claim commits; a
        -- concurrent claim would skip them all. Each job is locked when it is discarded or claimed.
    LOOP
        looked := looked + 1;
        IF job.run_state <> 'queued' THEN
            -- A job whose run moved on (cancelled, or started by a job claimed before it): it can
            -- only ever start the run twice, so it is discarded, not claimed.
            PERFORM 1 FROM unitvisor.spawn_jobs j WHERE j.id = job.id AND j.state = 'available'
                FOR UPDATE SKIP LOCKED;
            CONTINUE WHEN NOT FOUND;  -- another claim has it
            UPDATE unitvisor.spawn_jobs j SET state = 'discarded', claimed_by = claim_jobs.host_id,
                claimed_at = now(), error = 'run is already ' || job.run_state
            WHERE j.id = job.id;
            CONTINUE;
        END IF;
        EXIT WHEN taken >= free OR looked > 4 * claim_jobs.batch;
        IF job.contested AND shared >= share AND job.scheduled_at > now() - claim_jobs.spread_grace THEN
            CONTINUE;  -- another host's share, for now
        END IF;
        IF me.memory_budget IS NOT NULL AND memory_used + coalesce(job.memory_max, 0) > me.memory_budget THEN
            EXIT WHEN job.scheduled_at < now() - claim_jobs.starve_after;  -- it reserves the host
            CONTINUE;  -- backfill: a smaller run behind it may fit
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
        shared := shared + job.contested::integer;
        memory_used := memory_used + coalesce(job.memory_max, 0);
    END LOOP;
END $$;

-- -- dead hosts -----------------------------------------------------------------------------------

-- declare_dead_hosts: one live daemon at a time (a transaction-level advisory lock; the others skip)
-- marks as dead every host silent for longer than its own host_dead_after, bumping its epoch so that
-- none of its writes is accepted any more, and returns them. The caller settles their open attempts
-- as lost in the same transaction. A host that stopped cleanly with nothing open stays 'stopped'.
--
-- connected_for: how long the declaring daemon has itself been connected without interruption. A
-- host is only declared dead by a daemon that has been connected for at least that host's
-- host_dead_after: after a database outage or failover every host's heartbeat is old, and the first
-- daemon back must not declare the others dead before they had their chance to reconnect.
CREATE FUNCTION unitvisor.declare_dead_hosts(declarer text, declarer_epoch bigint,
                                             connected_for double precision)
RETURNS TABLE (host_id text, silent_sec double precision, dead_after_sec double precision)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM unitvisor.check_fence(declare_dead_hosts.declarer, declare_dead_hosts.declarer_epoch);
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
      AND coalesce(h.dead_after_sec, 60) <= declare_dead_hosts.connected_for
    RETURNING h.id, extract(epoch FROM now() - h.heartbeat_at)::double precision,
              coalesce(h.dead_after_sec, 60);
END $$;

-- -- why a run waits ------------------------------------------------------------------------------

-- Why no live host accepts run r (the fleet's view), or NULL when one does.
CREATE FUNCTION unitvisor.fleet_refusal(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN EXISTS (SELECT 1 FROM unitvisor.hosts h
                     WHERE unitvisor.host_is_live(h) AND unitvisor.host_refusal(h, r) IS NULL) THEN NULL
        WHEN r.host_pin IS NOT NULL THEN (
            SELECT coalesce(
                (SELECT CASE
                    WHEN p.state = 'dead' THEN format('pinned to host %s, which is dead (%s)', p.id, p.dead_reason)
                    WHEN p.state <> 'active' THEN format('pinned to host %s, which is %s', p.id, p.state)
                    WHEN NOT unitvisor.host_is_live(p) THEN format(
                        'pinned to host %s, which has been silent since %s', p.id,
                        to_char(p.heartbeat_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'))
                    ELSE format('pinned to host %s, which does not accept it: %s', p.id,
                                unitvisor.host_refusal(p, r))
                 END FROM unitvisor.hosts p WHERE p.id = r.host_pin),
                format('pinned to host %s, which is not known (see unitvisor hosts)', r.host_pin)))
        WHEN NOT EXISTS (SELECT 1 FROM unitvisor.hosts h WHERE unitvisor.host_is_live(h))
            THEN 'no live host (every host is dead, stopped, draining or silent)'
        ELSE 'no live host accepts it: ' || (
            SELECT string_agg(reason, '; ' ORDER BY reason) FROM (
                SELECT format('%s (%s)', reason, string_agg(h.id, ', ' ORDER BY h.id)) AS reason
                FROM (SELECT h.id, unitvisor.host_refusal(h, r) AS reason
                      FROM unitvisor.hosts h WHERE unitvisor.host_is_live(h)) h
                GROUP BY h.reason) reasons)
    END
$$;

-- explain_waiting: for runs whose job has been due for longer than min_wait, store why they wait in
-- run_waits, and write an event when the reason appears or changes (not at every pass).
CREATE FUNCTION unitvisor.explain_waiting(min_wait interval, max_runs integer DEFAULT 1000)
RETURNS integer LANGUAGE sql AS $$
    WITH waiting AS (
        SELECT r.id, unitvisor.fleet_refusal(r) AS reason
        FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
        WHERE j.state = 'available' AND j.scheduled_at <= now() - explain_waiting.min_wait AND r.state = 'queued'
        ORDER BY j.scheduled_at LIMIT explain_waiting.max_runs
    ),
    -- A reason that appears or changes; ON CONFLICT sees a concurrent pass's committed row, so two
    -- passes at once write one event.
    changed AS (
        INSERT INTO unitvisor.run_waits AS x (run_id, reason)
        SELECT w.id, w.reason FROM waiting w WHERE w.reason IS NOT NULL
        ON CONFLICT (run_id) DO UPDATE SET reason = excluded.reason WHERE x.reason IS DISTINCT FROM excluded.reason
        RETURNING x.run_id AS id, x.reason
    ),
    cleared AS (
        DELETE FROM unitvisor.run_waits x USING waiting w WHERE x.run_id = w.id AND w.reason IS NULL
        RETURNING 1
    ),
    events AS (
        INSERT INTO unitvisor.run_events (run_id, state, reason)
        SELECT c.id, 'queued', 'waiting: ' || c.reason FROM changed c
        RETURNING 1
    )
    SELECT count(*)::integer FROM events
$$;
