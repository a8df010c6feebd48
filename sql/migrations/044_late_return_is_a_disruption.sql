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

-- As 036's, late where it said overdue: declare_dead's late, by the host's own settings (OLD's: what it
-- was silent under).
DROP TRIGGER hosts_heard_late ON unitvisor.hosts;
CREATE TRIGGER hosts_heard_late BEFORE UPDATE OF heartbeat_at ON unitvisor.hosts
    FOR EACH ROW WHEN (OLD.state IN ('active', 'draining') AND NEW.state IN ('active', 'draining')
                       AND OLD.heartbeat_at < NEW.heartbeat_at - make_interval(secs => greatest(
                           2 * coalesce(OLD.poll_interval_sec, 10), coalesce(OLD.dead_after_sec, 60) / 2)))
    EXECUTE FUNCTION unitvisor.note_late_return();
