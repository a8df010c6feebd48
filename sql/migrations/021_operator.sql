-- unitvisor schema: the operator's day (issue 24). Two functions, both new, nothing replaced.
--
-- * set_host_state(host_id, state): drain or undrain a host. Until now `unitvisor drain` was an UPDATE
--   of hosts, which only the admin may make, so a host could not drain itself before its maintenance
--   without the admin's password on it. The function is SECURITY DEFINER and starts with require_host,
--   as every host write does: a host role drains and undrains only the host id it is bound to, the
--   admin any host. It takes no fence: a drain is the operator's decision, not the daemon's, and must
--   work whichever instance holds the id (or none: a stopped host is drained before it starts again).
-- * next_attempt_at(run_id): when a queued run's next attempt is due, while it waits out its retry
--   backoff. The due time is the spawn job's scheduled_at, and a host role reads no spawn job at all
--   (sql/014_host_reads.sql): this says that one time, of a run the caller may see, and nothing else.
--
-- Expand only: 0.7.0 daemons and CLIs call neither (a 0.7.0 CLI drains by the UPDATE, as the admin, as
-- before) and no table, column or other function changes.

-- The previous state (NULL: no such host). A dead host stays dead: it becomes active again only by
-- registering, as with 0.7.0's UPDATE; a stopped host takes the new state, which its next registration
-- keeps (register_host keeps a drain).
CREATE FUNCTION unitvisor.set_host_state(host_id text, state text) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    before text;
BEGIN
    PERFORM unitvisor.require_host(set_host_state.host_id);
    IF set_host_state.state IS NULL OR set_host_state.state NOT IN ('active', 'draining') THEN
        RAISE EXCEPTION 'a host''s state is set to active or draining, not %', coalesce(set_host_state.state, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT h.state INTO before FROM unitvisor.hosts h WHERE h.id = set_host_state.host_id FOR UPDATE;
    IF before IS NOT NULL AND before <> 'dead' AND before <> set_host_state.state THEN
        UPDATE unitvisor.hosts h SET state = set_host_state.state WHERE h.id = set_host_state.host_id;
    END IF;
    RETURN before;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.set_host_state(text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.set_host_state(text, text) TO unitvisor_host;

-- The due time of a queued run's next attempt while it is still ahead and the run has had an attempt
-- (a retry waiting out its backoff, or a resumed run not due yet); NULL otherwise, and for a run the
-- caller may not see: a host role sees by the rule of the policy on runs (host_may_see), the submitter
-- and the admin every run. As the owner, past spawn_jobs' privileges, so it says only this one time.
CREATE FUNCTION unitvisor.next_attempt_at(run_id uuid) RETURNS timestamptz
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT max(j.scheduled_at)
    FROM unitvisor.runs r JOIN unitvisor.spawn_jobs j ON j.run_id = r.id
    WHERE r.id = next_attempt_at.run_id AND r.state = 'queued' AND j.state = 'available'
      AND j.scheduled_at > now()
      AND EXISTS (SELECT 1 FROM unitvisor.attempts a WHERE a.run_id = r.id)
      AND (pg_has_role(session_user, 'unitvisor_admin', 'MEMBER')
           OR pg_has_role(session_user, 'unitvisor_submitter', 'MEMBER')
           OR unitvisor.host_may_see(r.host_pin, r.id, unitvisor.my_host_id()))
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.next_attempt_at(uuid) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.next_attempt_at(uuid) TO unitvisor_submitter, unitvisor_host;
