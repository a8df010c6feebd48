-- unitvisor schema: the fleet's upkeep done once, and no live host declared dead by a busy database
-- (issue 23, points 1 and 2).
--
-- Before: every daemon ran the fleet upkeep (declare_dead_hosts, expire_runs, explain_waiting) every
-- poll interval while anything was due for it, and explain_waiting asked every live host about every
-- waiting run, twice (fleet_refusal): 1,000 runs no host accepts cost 2.4-3.3 s of server time per pass
-- at 100 hosts, 8.9 s at 300, times one pass per host per poll interval. And a host was declared dead on
-- its heartbeat's age alone, so that a database slowed by a burst made live hosts look dead.
--
-- Now:
-- * fleet_upkeep_turn: one daemon of the fleet per interval gets the upkeep's turn (a lease row: the
--   moment of the last turn), the others skip it.
-- * fleet_refusal asks each live host once; explain_waiting computes it once per kind of run (what
--   host_refusal reads of a run) instead of once per run, takes at most about 10,000 refusals' worth of
--   kinds a pass, and goes on from where the last pass stopped.
-- * declare_dead: declare_dead_hosts with its guards: nobody is declared while the declarer's own
--   heartbeat is late, or while most of the other hosts are late too, and at most max_hosts at once.
-- * renew_heartbeat: the heartbeat alone, which a daemon sends on a connection of its own when its loop
--   is too busy to send its probe in time.
--
-- Expand only, for 0.7.x daemons and CLIs: one table added, functions added, two replaced in place with
-- the same names, arguments and results (fleet_refusal, explain_waiting). An older daemon keeps calling
-- declare_dead_hosts (unchanged: without the guards), expire_runs and explain_waiting every poll
-- interval, and works as before; the guards hold for the fleet once every host runs this release.

-- The fleet upkeep's lease: one row. turn_at is when a daemon last took the turn; explained_* is where
-- the last explain_waiting pass stopped (the key of the last job it looked at), so that a backlog
-- longer than one pass is explained a batch per pass, every run in turn, never the same batch for ever.
CREATE TABLE unitvisor.fleet_upkeep (
    id boolean PRIMARY KEY DEFAULT true CHECK (id),
    turn_at timestamptz NOT NULL DEFAULT '-infinity',
    turn_host text,
    explained_at timestamptz,
    explained_job bigint
);
INSERT INTO unitvisor.fleet_upkeep DEFAULT VALUES;

-- Whether the calling host does the fleet's upkeep now: true for the first live host that asks once
-- `every` has passed since the last turn, false for every other. A lease row, not an advisory lock: a
-- transaction-level advisory lock only keeps two passes from overlapping, so 300 daemons would still
-- make 300 passes an interval, one after the other; a session-level one would need a connection held
-- for it (and breaks under a transaction pooler). The row records when the last turn was, so the work
-- is done once an interval whoever asks, and a daemon that died while it had the turn costs nothing:
-- the next interval's turn goes to whoever asks first. SKIP LOCKED: a host that finds another taking the
-- turn right now does not wait for it. Autocommit: the turn is taken even if the upkeep then fails.
CREATE FUNCTION unitvisor.fleet_upkeep_turn(host_id text, host_epoch bigint, every interval) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    me unitvisor.hosts;
BEGIN
    PERFORM unitvisor.check_fence(fleet_upkeep_turn.host_id, fleet_upkeep_turn.host_epoch);
    SELECT * INTO me FROM unitvisor.hosts h WHERE h.id = fleet_upkeep_turn.host_id;
    IF NOT unitvisor.host_acts_for_fleet(me) THEN
        RETURN false;
    END IF;
    UPDATE unitvisor.fleet_upkeep u SET turn_at = now(), turn_host = fleet_upkeep_turn.host_id
    WHERE u.id IN (SELECT v.id FROM unitvisor.fleet_upkeep v
                   WHERE v.turn_at <= now() - fleet_upkeep_turn.every FOR UPDATE SKIP LOCKED);
    RETURN FOUND;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.fleet_upkeep_turn(text, bigint, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.fleet_upkeep_turn(text, bigint, interval) TO unitvisor_host;

-- fleet_refusal as in 002, asking each live host once (002 asked each twice: once whether it accepts
-- the run, once why not), and for a pinned run only the host it is pinned to (any other refuses it
-- anyway). The words are 002's.
CREATE OR REPLACE FUNCTION unitvisor.fleet_refusal(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE AS $$
    WITH live AS MATERIALIZED (
        SELECT h.id, unitvisor.host_refusal(h, r) AS reason
        FROM unitvisor.hosts h
        WHERE unitvisor.host_is_live(h) AND (r.host_pin IS NULL OR h.id = r.host_pin)
    )
    SELECT CASE
        WHEN EXISTS (SELECT 1 FROM live WHERE live.reason IS NULL) THEN NULL
        WHEN r.host_pin IS NOT NULL THEN (
            SELECT coalesce(
                (SELECT CASE
                    WHEN p.state = 'dead' THEN format('pinned to host %s, which is dead (%s)', p.id, p.dead_reason)
                    WHEN p.state <> 'active' THEN format('pinned to host %s, which is %s', p.id, p.state)
                    WHEN NOT unitvisor.host_is_live(p) THEN format(
                        'pinned to host %s, which has been silent since %s', p.id,
                        to_char(p.heartbeat_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS "UTC"'))
                    ELSE format('pinned to host %s, which does not accept it: %s', p.id,
                                (SELECT live.reason FROM live WHERE live.id = p.id))
                 END FROM unitvisor.hosts p WHERE p.id = r.host_pin),
                format('pinned to host %s, which is not known (see unitvisor hosts)', r.host_pin)))
        WHEN NOT EXISTS (SELECT 1 FROM live)
            THEN 'no live host (every host is dead, stopped, draining or silent)'
        ELSE 'no live host accepts it: ' || (
            SELECT string_agg(reasons.reason, '; ' ORDER BY reasons.reason) FROM (
                SELECT format('%s (%s)', live.reason, string_agg(live.id, ', ' ORDER BY live.id)) AS reason
                FROM live GROUP BY live.reason) reasons)
    END
$$;

-- explain_waiting as in 012 (the same reasons, events and result), with three changes:
-- * fleet_refusal is computed once per kind of run, not once per run: two runs with the same argv[0],
--   user, environment, memory_max and pin are refused by the same hosts for the same reasons
--   (host_refusal reads nothing else of a run). 1,000 runs of one rollout cost one fleet_refusal.
-- * A pass is bounded by its cost, not only by its runs: it takes the due jobs in order from where the
--   last pass stopped (fleet_upkeep.explained_*), at most max_runs of them, and stops before the kind
--   that would take it over REFUSALS_PER_PASS (10,000) host_refusal calls (kinds x live hosts; one kind at
--   least). 1,000 runs of 1,000 different kinds on 300 hosts are explained 33 kinds a pass, instead of
--   one pass of 300,000 refusals that outlives the statement_timeout, is rolled back, and so never ends.
--   A pass that reaches the end of the queue makes the next one start from the beginning.
-- * plpgsql, to keep that place; the work is still one statement.
CREATE OR REPLACE FUNCTION unitvisor.explain_waiting(min_wait interval, max_runs integer DEFAULT 1000)
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    refusals_per_pass constant integer := 10000;
    after_at timestamptz;
    after_job bigint;
    max_kinds integer;
    candidates integer;
    cut boolean;
    last_at timestamptz;
    last_job bigint;
    written integer;
BEGIN
    SELECT u.explained_at, u.explained_job INTO after_at, after_job FROM unitvisor.fleet_upkeep u;
    SELECT greatest(1, refusals_per_pass / greatest(count(*), 1))::integer INTO max_kinds
    FROM unitvisor.hosts h WHERE unitvisor.host_is_live(h);
    WITH candidate AS MATERIALIZED (
        SELECT j.id AS job_id, j.scheduled_at, r AS run,
               jsonb_build_array(r.argv[1], r.run_user, r.environment, r.memory_max, r.host_pin) AS kind,
               row_number() OVER (ORDER BY j.scheduled_at, j.id) AS pos
        FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
        WHERE j.state = 'available' AND j.scheduled_at <= now() - explain_waiting.min_wait AND r.state = 'queued'
          AND (after_at IS NULL OR (j.scheduled_at, j.id) > (after_at, after_job))
        ORDER BY j.scheduled_at, j.id LIMIT explain_waiting.max_runs
    ),
    -- Where the first kind past max_kinds first appears: the pass stops just before it.
    cutoff AS (
        SELECT f.first FROM (SELECT min(c.pos) AS first FROM candidate c GROUP BY c.kind) f
        ORDER BY f.first OFFSET max_kinds LIMIT 1
    ),
    due AS MATERIALIZED (
        SELECT c.* FROM candidate c WHERE c.pos < coalesce((SELECT cutoff.first FROM cutoff), c.pos + 1)
    ),
    kinds AS MATERIALIZED (
        SELECT k.kind, unitvisor.fleet_refusal(k.run) AS refused
        FROM (SELECT DISTINCT ON (d.kind) d.kind, d.run FROM due d ORDER BY d.kind) k
    ),
    waiting AS MATERIALIZED (
        SELECT (d.run).id AS id, nullif(concat_ws('; ', (
                   SELECT 'waits for run ' || b.id || ' (' || b.state || ') with the same concurrency key'
                   FROM unitvisor.runs b WHERE (d.run).concurrency_key IS NOT NULL
                                           AND b.id = unitvisor.concurrency_blocker(d.run)), k.refused), '') AS reason
        FROM due d JOIN kinds k ON k.kind = d.kind
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
    ),
    last AS (
        SELECT d.scheduled_at, d.job_id FROM due d ORDER BY d.pos DESC LIMIT 1
    )
    SELECT (SELECT count(*) FROM events)::integer, (SELECT count(*) FROM candidate)::integer,
           EXISTS (SELECT 1 FROM cutoff), (SELECT last.scheduled_at FROM last), (SELECT last.job_id FROM last)
    INTO written, candidates, cut, last_at, last_job;
    -- A pass that was neither cut nor full reached the end: the next one starts from the beginning.
    IF NOT cut AND candidates < explain_waiting.max_runs THEN
        last_at := NULL;
        last_job := NULL;
    END IF;
    UPDATE unitvisor.fleet_upkeep u SET explained_at = last_at, explained_job = last_job
    WHERE u.explained_at IS DISTINCT FROM last_at OR u.explained_job IS DISTINCT FROM last_job;
    RETURN written;
END $$;

-- declare_dead_hosts as in 013 (the same lock, the same hosts, the same reasons), with the guards that
-- tell a silent host from a database or a fleet that is behind (docs/fleet.md, Dead hosts). A host is
-- late when its heartbeat is older than two of its poll intervals and half its host_dead_after (by the
-- database's clock): a loop that keeps time, or whose thread sends the heartbeat aside, is never that
-- late (at most 1.5 poll intervals and a statement), and half of host_dead_after keeps the fast test
-- settings (1 s polls) from calling a loaded machine's ordinary delays late.
-- * the declarer's own heartbeat is late: the database, or this daemon, is behind; a host it would
--   declare may be as slow as itself;
-- * most of the other hosts are late: more than half, and at least two, of the active and draining
--   hosts that are neither the declarer nor overdue: the database is behind, not the silent hosts;
-- * at most max_hosts are declared at once, the longest silent first; the rest wait for the next pass.
-- Held declarations are said in held (how many) and held_why ('declarer-late', 'fleet-late', 'cap')
-- with held_detail, on every row; a pass that declares nobody but held some returns one row whose
-- host_id is NULL. The caller settles the declared hosts' open attempts in the same transaction.
CREATE FUNCTION unitvisor.declare_dead(declarer text, declarer_epoch bigint, connected_for double precision,
                                       max_hosts integer)
RETURNS TABLE (host_id text, silent_sec double precision, dead_after_sec double precision,
               held integer, held_why text, held_detail text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    me unitvisor.hosts;
    connected double precision;
    own_age double precision;
    overdue integer;
    others integer;
    late integer;
BEGIN
    PERFORM unitvisor.check_fence(declare_dead.declarer, declare_dead.declarer_epoch);
    SELECT * INTO me FROM unitvisor.hosts h WHERE h.id = declare_dead.declarer;
    IF NOT unitvisor.host_acts_for_fleet(me) THEN
        RETURN;
    END IF;
    connected := least(extract(epoch FROM now() - me.started_at)::double precision,
                       coalesce(declare_dead.connected_for, 0));
    -- The lock declare_dead_hosts takes: a 0.7 daemon's declaration and this one never overlap.
    IF NOT pg_try_advisory_xact_lock(hashtextextended('unitvisor-fleet-upkeep', 0)) THEN
        RETURN;
    END IF;
    SELECT count(*) INTO overdue FROM unitvisor.hosts h
    WHERE h.id <> declare_dead.declarer AND unitvisor.host_is_overdue(h)
      AND coalesce(h.dead_after_sec, 60) <= connected;
    IF overdue = 0 THEN
        RETURN;
    END IF;
    own_age := extract(epoch FROM clock_timestamp() - me.heartbeat_at)::double precision;
    IF own_age > greatest(2 * coalesce(me.poll_interval_sec, 10), coalesce(me.dead_after_sec, 60) / 2) THEN
        RETURN QUERY SELECT NULL::text, NULL::double precision, NULL::double precision, overdue, 'declarer-late',
            format('this host''s own heartbeat is %s s old (over two of its poll intervals and half its '
                   'host_dead_after): the database or this daemon is behind', round(own_age::numeric));
        RETURN;
    END IF;
    SELECT count(*), count(*) FILTER (WHERE h.heartbeat_at < now() - make_interval(secs => greatest(
                                          2 * coalesce(h.poll_interval_sec, 10), coalesce(h.dead_after_sec, 60) / 2)))
    INTO others, late
    FROM unitvisor.hosts h
    WHERE h.id <> declare_dead.declarer AND h.state IN ('active', 'draining') AND NOT unitvisor.host_is_overdue(h);
    IF late * 2 > others AND late >= 2 THEN
        RETURN QUERY SELECT NULL::text, NULL::double precision, NULL::double precision, overdue, 'fleet-late',
            format('%s of the %s other live hosts are late too: the database is behind, not the %s silent '
                   'host(s)', late, others, overdue);
        RETURN;
    END IF;
    RETURN QUERY
    WITH chosen AS (
        SELECT h.id FROM unitvisor.hosts h
        WHERE h.id <> declare_dead.declarer AND unitvisor.host_is_overdue(h)
          AND coalesce(h.dead_after_sec, 60) <= connected
        ORDER BY h.heartbeat_at, h.id LIMIT greatest(declare_dead.max_hosts, 0)
        FOR UPDATE
    ),
    declared AS (
        UPDATE unitvisor.hosts h SET state = 'dead', epoch = nextval('unitvisor.host_epochs'), dead_at = now(),
            drained_before_death = (h.state = 'draining'),
            dead_reason = format('silent for %s s (its host_dead_after is %s s); declared dead by host %s',
                                 round(extract(epoch FROM now() - h.heartbeat_at)::numeric),
                                 coalesce(h.dead_after_sec, 60), declare_dead.declarer)
        FROM chosen WHERE h.id = chosen.id
        RETURNING h.id, extract(epoch FROM now() - h.heartbeat_at)::double precision AS silent,
                  coalesce(h.dead_after_sec, 60)::double precision AS dead_after
    ),
    summary AS (
        SELECT greatest(overdue - count(*), 0)::integer AS held FROM declared
    )
    SELECT d.id, d.silent, d.dead_after, s.held,
           CASE WHEN s.held > 0 THEN 'cap' END,
           CASE WHEN s.held > 0 THEN format('%s more silent host(s) wait for the next pass ([fleet] '
                                            'max_dead_per_pass is %s)', s.held, declare_dead.max_hosts) END
    FROM summary s LEFT JOIN declared d ON true;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.declare_dead(text, bigint, double precision, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.declare_dead(text, bigint, double precision, integer) TO unitvisor_host;

-- The heartbeat alone, as heartbeat (012) renews it: the same row, the same epoch check (a host whose
-- epoch is over renews nothing and gets NULL), the same caller check. A daemon sends it on a connection
-- of its own when its loop has not sent its probe in time (busy with a claim, a reconcile pass or the
-- upkeep on a slow database), so that its own work never makes it look dead (issue 23).
CREATE FUNCTION unitvisor.renew_heartbeat(host_id text, host_epoch bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    renewed text;
BEGIN
    PERFORM unitvisor.require_host(renew_heartbeat.host_id);
    UPDATE unitvisor.hosts h SET heartbeat_at = now()
    WHERE h.id = renew_heartbeat.host_id AND h.epoch = renew_heartbeat.host_epoch AND h.state <> 'dead'
    RETURNING h.state INTO renewed;
    RETURN renewed;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.renew_heartbeat(text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.renew_heartbeat(text, bigint) TO unitvisor_host;
