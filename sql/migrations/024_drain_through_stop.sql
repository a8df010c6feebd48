-- unitvisor schema: a drained host that stops stays drained, and is not declared dead (issue 24).
--
-- Before: mark_host_stopped stopped only an active host, so that a restart would keep a drain; a drained
-- host whose daemon stopped (the README's retirement, or maintenance) stayed 'draining', and a live peer
-- declared it dead once it had been silent for its host_dead_after: the host-declared-dead alert fired
-- for a planned stop, and `hosts forget` had to read "draining and silent" as stopped. Now:
-- * hosts.left_draining: set by the clean stop of a draining host (and by a drain while it is stopped),
--   kept if it is declared dead later, cleared by its next registration. The state says whether the
--   host is live ('stopped' is not); the column says how it comes back.
-- * mark_host_stopped stops a draining host too: 'stopped' with left_draining. A stopped host is declared
--   dead only with an attempt still open (host_is_overdue, unchanged): its runs must be settled by
--   someone, drained or not; it then comes back draining all the same.
-- * register_host brings a host that left draining back 'draining' (it claims nothing until undrain).
-- * set_host_state on a stopped host changes left_draining, not the state: setting a silent host
--   'draining' or 'active' made it overdue (declared dead, with the alert). It says a stopped host's
--   previous state as `stopped` or `stopped (drained)`, the words `unitvisor hosts` shows.
-- * A host stopped while draining under the old functions (still 'draining', silent for two of its
--   poll intervals, and no session holds its host lock: no daemon is connected) is made 'stopped' with
--   left_draining here, as the new mark_host_stopped would have left it.
--
-- Expand only: a new column with a default, three functions replaced under their names and signatures.
-- 0.8.0 daemons call mark_host_stopped and register_host as before (what changes is what a drained host
-- becomes), and read neither column; a 0.8.0 CLI prints the new `before` as it is. drained_before_death
-- keeps its meaning (the host was draining when it was declared dead).

ALTER TABLE unitvisor.hosts
    ADD COLUMN left_draining boolean NOT NULL DEFAULT false;  -- stopped while draining: it comes back draining

-- A daemon's clean stop (store.mark_host_stopped): an active or a draining host becomes 'stopped', and a
-- draining one keeps its drain in left_draining. Its heartbeat is stamped, so that a stop is a fresh
-- sign of life (a host stopped with runs open is held for its host_dead_after from here).
CREATE OR REPLACE FUNCTION unitvisor.mark_host_stopped(host_id text, host_epoch bigint) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.require_host(mark_host_stopped.host_id);
    UPDATE unitvisor.hosts h SET state = 'stopped', heartbeat_at = now(), left_draining = (h.state = 'draining')
    WHERE h.id = mark_host_stopped.host_id AND h.epoch = mark_host_stopped.host_epoch
      AND h.state IN ('active', 'draining');
END $$;

-- The previous state (NULL: no such host). A dead host stays dead: it becomes active again only by
-- registering. A stopped host stays stopped (a silent host made 'active' or 'draining' would be overdue,
-- and declared dead); the drain is kept in left_draining for its next registration, and its previous
-- state is said as `stopped` or `stopped (drained)`.
CREATE OR REPLACE FUNCTION unitvisor.set_host_state(host_id text, state text) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    old unitvisor.hosts;
BEGIN
    PERFORM unitvisor.require_host(set_host_state.host_id);
    IF set_host_state.state IS NULL OR set_host_state.state NOT IN ('active', 'draining') THEN
        RAISE EXCEPTION 'a host''s state is set to active or draining, not %', coalesce(set_host_state.state, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO old FROM unitvisor.hosts h WHERE h.id = set_host_state.host_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF old.state = 'stopped' THEN
        UPDATE unitvisor.hosts h SET left_draining = (set_host_state.state = 'draining')
        WHERE h.id = set_host_state.host_id;
        RETURN CASE WHEN old.left_draining THEN 'stopped (drained)' ELSE 'stopped' END;
    END IF;
    IF old.state <> 'dead' AND old.state <> set_host_state.state THEN
        UPDATE unitvisor.hosts h SET state = set_host_state.state WHERE h.id = set_host_state.host_id;
    END IF;
    RETURN old.state;
END $$;

-- register_host as in 013, bringing a host that stopped or died while draining back draining (024).
-- Another instance is refused while the host has been heard from within its own host_dead_after and
-- either is active or draining (a live daemon, maybe reconnecting) or has an attempt open (its daemon
-- stopped, or is restarting: its runs go on, and only its own instance may adopt them; a peer settles
-- them only once it is declared dead, after the same silence). The same machine in the same boot (a restart, a reconnect) takes it back at
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
    -- A drain outlives a clean stop (left_draining) and a death (drained_before_death, or left_draining
    -- if it had stopped drained first): the host claims nothing until `undrain`.
    new_state := CASE WHEN old.state = 'draining' OR (old.state IN ('stopped', 'dead') AND old.left_draining)
                           OR (old.state = 'dead' AND old.drained_before_death)
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
        heartbeat_at = now(), dead_at = NULL, dead_reason = NULL, drained_before_death = false,
        left_draining = false, state = new_state
    WHERE h.id = register_host.host_id;
    RETURN QUERY SELECT true, new_state, new_epoch,
        CASE WHEN old.state = 'dead' THEN format('rejoined after being declared dead (%s)', old.dead_reason)
             WHEN new_epoch <> old.epoch THEN format('took over the id from instance %s', old.instance)
             ELSE 'registered' END;
END $$;

-- A draining host that stopped under the old mark_host_stopped: silent for two of its poll intervals (a
-- live daemon heartbeats every interval) and no session holds its host lock (a live daemon holds it on
-- its connection; the transaction-level try releases it at commit). A daemon reconnecting meanwhile
-- registers again, and register_host brings it back draining.
UPDATE unitvisor.hosts h SET state = 'stopped', left_draining = true
WHERE h.state = 'draining'
  AND h.heartbeat_at < now() - make_interval(secs => 2 * coalesce(h.poll_interval_sec, 10))
  AND pg_try_advisory_xact_lock(unitvisor.host_lock_key(h.id));
