-- unitvisor schema: no mass declaration when most of the fleet goes silent at once (issue 23, point 2),
-- and the operator's word for a host that is really down.
--
-- declare_dead (019) holds its declarations while the declarer is late, or while most of the other
-- live hosts are late: the database is behind, not the silent hosts. Its fleet-late guard counts only
-- the hosts not yet overdue, so that a rack that lost power is still declared by the hosts that are
-- left. But once most of the fleet is overdue at once the late hosts that are left are few, and the
-- guard no longer holds: bench.scale with 1,000 simulated hosts on an overloaded database (their
-- heartbeats refused by max_connections or timed out) had up to 893 hosts overdue at once, and the cap
-- alone paced the declarations: 275 live hosts declared dead, 5 a pass (docs/benchmarks.md, 0.8.0
-- measured). That many hosts silent at once is far more likely the database, or the network in front
-- of it, than that many machines dead; declaring them turns the database's trouble into the fleet's
-- (every run of theirs `lost` and taken again, every host fenced and registering anew).
--
-- So a fourth guard, 'fleet-silent': while more silent hosts than [fleet] max_dead_per_pass are
-- overdue at once, and they are more than half of the other hosts (active or draining, or stopped with
-- a run open), nobody is declared. Kubernetes' node lifecycle controller does the same in a zone whose
-- nodes are all unready ("full disruption": it stops evicting), and slows down past 55 % unready; here
-- a slower pace would still kill the live hosts of a long overload, only later. What it costs: a real
-- loss of most of a large fleet (a data centre's power) is not taken over by itself. Up to
-- max_dead_per_pass hosts are declared whatever their share, so a small fleet (two hosts, one dead;
-- four, three dead) is taken over as before, and a rack of a large fleet is too.
--
-- The operator who knows that a host is down says so: `unitvisor hosts confirm-down HOST`
-- (confirm_host_down, the database owner's: a host role may not, or one broken host could have the
-- fleet declared). A host confirmed down is declared as soon as it is overdue, by its own
-- host_dead_after as always (its self-fence counts on that time), whatever the fleet-wide guards say
-- (fleet-late, fleet-silent); the declarer's own lateness and the cap still hold, confirmed hosts
-- first. The confirmation ends when the host is heard from again (a heartbeat or a registration: it was
-- not down) and when it is declared.

-- And after a fleet-wide hold, a grace. When the fleet comes back from a mass silence, the hosts do
-- not all come back at once: in bench.scale's 1,000-host burst (docs/benchmarks.md, 0.11.0) the fleet-
-- silent guard held 761, then 713, then 602 silent hosts; at the next pass 175 were silent (fewer than
-- half), and the cap began declaring the longest silent, 5 a pass (silent for 239 to 277 s), while the
-- others came back (held: 170, then 153, then 29 two passes later): 20 live hosts declared dead in
-- all, each batch right after a fleet-wide hold (fleet-silent, or fleet-late). A host silent through a
-- disruption is no more likely dead than the hosts that came back. So every hold because something is
-- behind (declarer-late, fleet-late, fleet-silent) is recorded (fleet_upkeep.fleet_held_at), and a
-- host is declared only once it has been silent for its host_dead_after since the later of its last
-- heartbeat and the last such hold: after a disruption every silent host gets its full host_dead_after
-- again, as Kubernetes' node lifecycle controller resets every node's probe time when a zone leaves
-- full disruption, and Nomad gives every client failover_heartbeat_ttl after a leader election. Held
-- so, a pass says 'fleet-recovering'. Its cost: a host that really died during a disruption is
-- declared host_dead_after after the disruption ends, not at once. A host confirmed down is not held
-- by it.
--
-- A silent host heard from again before anyone declared it is a disruption too (hosts.returned_late_at):
-- with the grace above, the second 1,000-host run still had 21 live hosts declared, each silent for 61
-- to 165 s, unable to reach the overloaded database, after the guards had let go while others like them
-- were still coming back. A host that comes back after being silent past its host_dead_after proves
-- that silence is not death just now. What it costs: a fleet in which some silent host comes back at
-- least once every host_dead_after (a host that keeps losing its network) declares only the hosts
-- confirmed down; the pass says 'fleet-recovering' each time, and the metric counts it.

-- hosts before fleet_upkeep, the order in which the heartbeat locks them: the other order deadlocked
-- with a daemon's statement in test_migrate_big (fleet_upkeep held, hosts awaited); store.migrate now
-- tries a migration chosen to end a deadlock again, as one that timed out on a lock.
ALTER TABLE unitvisor.hosts ADD COLUMN down_confirmed_at timestamptz;
ALTER TABLE unitvisor.hosts ADD COLUMN down_confirmed_by text;
ALTER TABLE unitvisor.hosts ADD COLUMN returned_late_at timestamptz;

ALTER TABLE unitvisor.fleet_upkeep ADD COLUMN fleet_held_at timestamptz;

-- A host heard from is not down: its confirmation ends. A trigger with a WHEN clause, so that the
-- heartbeat of a host that nobody confirmed (every heartbeat, nearly always) calls no function.
CREATE FUNCTION unitvisor.end_down_confirmation() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.down_confirmed_at := NULL;
    NEW.down_confirmed_by := NULL;
    RETURN NEW;
END $$;

CREATE TRIGGER hosts_heard_from BEFORE UPDATE OF heartbeat_at ON unitvisor.hosts
    FOR EACH ROW WHEN (OLD.down_confirmed_at IS NOT NULL AND NEW.heartbeat_at > OLD.heartbeat_at)
    EXECUTE FUNCTION unitvisor.end_down_confirmation();

-- A silent host heard from again before anyone declared it (its heartbeat, or its daemon registering
-- again) proves that silence is not death just now: returned_late_at, which declare_dead takes as a
-- disruption, as it does its own holds. Written on the host's own row by the update that carries the
-- heartbeat, so that a fleet coming back at once does not queue on one shared row. A WHEN clause, so
-- that a heartbeat on time (every heartbeat, nearly always) calls no function.
CREATE FUNCTION unitvisor.note_late_return() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.returned_late_at := NEW.heartbeat_at;
    RETURN NEW;
END $$;

CREATE TRIGGER hosts_heard_late BEFORE UPDATE OF heartbeat_at ON unitvisor.hosts
    FOR EACH ROW WHEN (OLD.state IN ('active', 'draining') AND NEW.state IN ('active', 'draining')
                       AND OLD.heartbeat_at < NEW.heartbeat_at - make_interval(secs => coalesce(OLD.dead_after_sec, 60)))
    EXECUTE FUNCTION unitvisor.note_late_return();
REVOKE EXECUTE ON FUNCTION unitvisor.end_down_confirmation() FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION unitvisor.note_late_return() FROM PUBLIC;

-- The operator's word that a host is down (its machine is off, or gone): it is declared dead once it
-- is overdue, whatever the fleet-wide guards say. Returns the host's state; NULL when there is no such
-- host. A dead host needs none (it is declared already): its state is returned and nothing changes.
-- Granted to no role: the database owner's (as hosts add and hosts forget are).
CREATE FUNCTION unitvisor.confirm_host_down(host_id text) RETURNS text
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    found_state text;
BEGIN
    UPDATE unitvisor.hosts h SET down_confirmed_at = now(), down_confirmed_by = session_user
    WHERE h.id = confirm_host_down.host_id AND h.state <> 'dead';
    SELECT h.state INTO found_state FROM unitvisor.hosts h WHERE h.id = confirm_host_down.host_id;
    RETURN found_state;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.confirm_host_down(text) FROM PUBLIC;

-- declare_dead as in 019 (the same lock, the same hosts, the same reasons and rows), with the
-- fleet-silent guard, the grace after a fleet-wide hold and the operator's confirmations above. The
-- fleet-wide guards (fleet-late, fleet-silent) and the grace hold the hosts nobody confirmed down; the
-- declarer's own lateness holds all; the cap takes the confirmed first, then the longest silent.
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
    IF own_age > greatest(2 * coalesce(me.poll_interval_sec, 10), coalesce(me.dead_after_sec, 60) / 2) THEN
        UPDATE unitvisor.fleet_upkeep u SET fleet_held_at = now();  -- the database is behind: a disruption
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
