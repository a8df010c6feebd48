-- unitvisor schema: a host heard from again after being late, not only after being overdue, is a
-- disruption of the fleet (issue 23, point 2: a busy database never kills a live host).
--
-- 036 made a silent host heard from again (returned_late_at) a disruption: every other silent host gets
-- its host_dead_after again from then. But it counted only a host that had been silent past its own
-- host_dead_after, one that the next pass could already have declared. In bench.scale's 1,000 hosts and a
-- burst of 10,000 runs (docs/benchmarks.md, "0.11.0 with 043") the simulated daemons dropped connections
-- that gave no answer for 20 s, and then could not connect again in time (1,873 "connection timeout
-- expired" in the server's log). The guards held up to 419 silent hosts; but once a minute had passed in
-- which no host came back from more than 60 s of silence, the cap declared the 5 longest silent of the 14
-- still out. A storm of reconnections lets hosts through one at a time, after spells of every length: the
-- hosts that came back within that minute from 30 or 50 s of silence were evidence that the database
-- could not be reached, and nothing counted them.

-- Now a host counts as returned late once its heartbeat was late, in declare_dead's sense: older than two
-- of its poll intervals and half its host_dead_after (30 s by default). A daemon's heartbeat is never that
-- late while it can reach the database: its loop heartbeats every poll interval, and once the loop is 1.5
-- intervals behind a thread sends the heartbeat on a connection of its own (schema 19). So a return from
-- that late means that neither of its connections got through for at least half a host_dead_after: the
-- database, or the network in front of it, refused or dropped this host, and may be doing the same to the
-- silent ones.
--
-- What it costs: a host that really died is declared host_dead_after after the last host that came back
-- from being late, where 036 counted only returns from being overdue. A single host late by 30 s (a
-- network blip, a daemon restart that took that long) defers the declaration of a dead one by up to a
-- host_dead_after; a fleet in which some host comes back late at least once every host_dead_after
-- declares only the hosts confirmed down (`unitvisor hosts confirm-down`), as 036 says of its returns.

-- When a host is late (declare_dead's guards, and a return that is a disruption): its heartbeat older than
-- this many seconds, two of its poll intervals and half its host_dead_after. A SQL function with no SET, so
-- that it is inlined where it is read (a trigger's WHEN clause among them).
CREATE FUNCTION unitvisor.host_late_sec(h unitvisor.hosts) RETURNS double precision
LANGUAGE sql IMMUTABLE AS $$
    SELECT greatest(2 * coalesce(h.poll_interval_sec, 10), coalesce(h.dead_after_sec, 60) / 2)
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.host_late_sec(unitvisor.hosts) FROM PUBLIC;

-- declare_dead as in 036, its two readings of "late" from host_late_sec (the same expression).
CREATE OR REPLACE FUNCTION unitvisor.declare_dead(declarer text, declarer_epoch bigint,
                                                  connected_for double precision, max_hosts integer)
RETURNS TABLE (host_id text, silent_sec double precision, dead_after_sec double precision,
               held integer, held_why text, held_detail text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    me unitvisor.hosts;
    connected double precision;
    own_age double precision;
    overdue integer;
    confirmed integer;
    others integer;
    late integer;
    fleet_why text;
    fleet_detail text;
    held_at timestamptz;
    in_grace integer;
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
    -- The fleet's last disruption: its last hold, or a silent host heard from again (returned_late_at).
    SELECT greatest(u.fleet_held_at, (SELECT max(h.returned_late_at) FROM unitvisor.hosts h))
    INTO held_at FROM unitvisor.fleet_upkeep u;
    -- The silent hosts; those confirmed down; those within their host_dead_after of the last hold.
    SELECT count(*), count(*) FILTER (WHERE h.down_confirmed_at IS NOT NULL),
           count(*) FILTER (WHERE h.down_confirmed_at IS NULL
                              AND held_at > now() - make_interval(secs => coalesce(h.dead_after_sec, 60)))
    INTO overdue, confirmed, in_grace
    FROM unitvisor.hosts h
    WHERE h.id <> declare_dead.declarer AND unitvisor.host_is_overdue(h)
      AND coalesce(h.dead_after_sec, 60) <= connected;
    IF overdue = 0 THEN
        RETURN;
    END IF;
    own_age := extract(epoch FROM clock_timestamp() - me.heartbeat_at)::double precision;
    IF own_age > unitvisor.host_late_sec(me) THEN
        UPDATE unitvisor.fleet_upkeep u SET fleet_held_at = now();  -- the database is behind: a disruption
        RETURN QUERY SELECT NULL::text, NULL::double precision, NULL::double precision, overdue, 'declarer-late',
            format('this host''s own heartbeat is %s s old (over two of its poll intervals and half its '
                   'host_dead_after): the database or this daemon is behind', round(own_age::numeric));
        RETURN;
    END IF;
    SELECT count(*), count(*) FILTER (WHERE h.heartbeat_at < now() - make_interval(secs => unitvisor.host_late_sec(h)))
    INTO others, late
    FROM unitvisor.hosts h
    WHERE h.id <> declare_dead.declarer AND h.state IN ('active', 'draining') AND NOT unitvisor.host_is_overdue(h);
    IF late * 2 > others AND late >= 2 THEN
        fleet_why := 'fleet-late';
        fleet_detail := format('%s of the %s other live hosts are late too: the database is behind, not the %s '
                               'silent host(s)', late, others, overdue - confirmed);
    ELSIF overdue > declare_dead.max_hosts AND overdue > others THEN
        fleet_why := 'fleet-silent';
        fleet_detail := format('%s of the %s other hosts are silent at once, more than half of them and more than '
                               '[fleet] max_dead_per_pass (%s): the database or its network is more likely behind '
                               'than that many hosts down; `unitvisor hosts confirm-down HOST` has a host that is '
                               'really down declared', overdue - confirmed, overdue + others, declare_dead.max_hosts);
    END IF;
    IF fleet_why IS NOT NULL THEN
        -- (held_at keeps the previous hold: this pass's own reason, fleet_why, comes before the grace's)
        UPDATE unitvisor.fleet_upkeep u SET fleet_held_at = now();
    END IF;
    RETURN QUERY
    WITH chosen AS (
        SELECT h.id FROM unitvisor.hosts h
        WHERE h.id <> declare_dead.declarer AND unitvisor.host_is_overdue(h)
          AND coalesce(h.dead_after_sec, 60) <= connected
          AND (h.down_confirmed_at IS NOT NULL
               OR (fleet_why IS NULL AND (held_at IS NULL
                                          OR held_at <= now() - make_interval(secs => coalesce(h.dead_after_sec, 60)))))
        ORDER BY h.down_confirmed_at IS NULL, h.heartbeat_at, h.id LIMIT greatest(declare_dead.max_hosts, 0)
        FOR UPDATE
    ),
    declared AS (
        UPDATE unitvisor.hosts h SET state = 'dead', epoch = nextval('unitvisor.host_epochs'), dead_at = now(),
            drained_before_death = (h.state = 'draining'),
            dead_reason = format('silent for %s s (its host_dead_after is %s s); declared dead by host %s%s',
                                 round(extract(epoch FROM now() - h.heartbeat_at)::numeric),
                                 coalesce(h.dead_after_sec, 60), declare_dead.declarer,
                                 CASE WHEN h.down_confirmed_at IS NOT NULL
                                      THEN format(', confirmed down by %s', h.down_confirmed_by) ELSE '' END),
            down_confirmed_at = NULL, down_confirmed_by = NULL
        FROM chosen WHERE h.id = chosen.id
        RETURNING h.id, extract(epoch FROM now() - h.heartbeat_at)::double precision AS silent,
                  coalesce(h.dead_after_sec, 60)::double precision AS dead_after
    ),
    summary AS (
        SELECT greatest(overdue - count(*), 0)::integer AS held,
               -- the fleet-wide guard when it held any host nobody confirmed, else the cap
               CASE WHEN fleet_why IS NOT NULL AND overdue > confirmed THEN fleet_why
                    WHEN in_grace > 0 THEN 'fleet-recovering'
                    WHEN overdue > count(*) THEN 'cap' END AS why
        FROM declared
    )
    SELECT d.id, d.silent, d.dead_after, s.held, s.why,
           CASE s.why WHEN 'cap' THEN format('%s more silent host(s) wait for the next pass ([fleet] '
                                             'max_dead_per_pass is %s)', s.held, declare_dead.max_hosts)
                      WHEN 'fleet-recovering' THEN format(
                          '%s silent host(s) get their host_dead_after again from the fleet''s last disruption (a '
                          'fleet-wide hold, or a silent host heard from again, %s s ago): hosts come back from one '
                          'over some time',
                          in_grace, round(extract(epoch FROM now() - held_at)::numeric))
                      ELSE fleet_detail END
    FROM summary s LEFT JOIN declared d ON true;
END $$;

-- As 036's trigger, late where it said overdue: declare_dead's late, by the host's own settings (OLD's: what
-- it was silent under).
DROP TRIGGER hosts_heard_late ON unitvisor.hosts;
CREATE TRIGGER hosts_heard_late BEFORE UPDATE OF heartbeat_at ON unitvisor.hosts
    FOR EACH ROW WHEN (OLD.state IN ('active', 'draining') AND NEW.state IN ('active', 'draining')
                       AND OLD.heartbeat_at < NEW.heartbeat_at - make_interval(secs => unitvisor.host_late_sec(OLD)))
    EXECUTE FUNCTION unitvisor.note_late_return();
