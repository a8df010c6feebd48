-- unitvisor schema: why no live host accepts a run, now, for whoever may see the run (issue 24).
--
-- `show`, `runs` and `submit` say at once why a run waits when no live host accepts it, instead of
-- after explain_waiting's two poll intervals. They asked fleet_refusal, which only the admin may call
-- (EXECUTE is revoked from PUBLIC since 004, and it calls host_refusal and the environment's and
-- pressure's checks, each revoked too): the submitter, the role that submits, got nothing, and neither
-- did a host's role on a host. Granting all of them would open the building blocks one by one; this is
-- one function, as its owner, that says only the reason, only for runs the caller may see (the rule
-- of next_attempt_at: a host role by host_may_see, the submitter and the admin every run), and for at
-- most 1,000 of them a call (a person's list, not a scan).
--
-- Expand only: a new function, nothing replaced; 0.7.0 CLIs and daemons do not call it.

-- The queued runs among run_ids that no live host accepts now, each with fleet_refusal's reason; a run
-- some live host accepts, not queued, unknown or not visible to the caller is left out.
CREATE FUNCTION unitvisor.refusals_now(run_ids uuid[])
RETURNS TABLE (run_id uuid, reason text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT w.id, w.reason FROM (
        SELECT r.id, unitvisor.fleet_refusal(r) AS reason
        FROM unitvisor.runs r
        WHERE r.id = ANY(refusals_now.run_ids[1:1000]) AND r.state = 'queued'
          AND (pg_has_role(session_user, 'unitvisor_admin', 'MEMBER')
               OR pg_has_role(session_user, 'unitvisor_submitter', 'MEMBER')
               OR unitvisor.host_may_see(r.host_pin, r.id, unitvisor.my_host_id()))
    ) w
    WHERE w.reason IS NOT NULL
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.refusals_now(uuid[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.refusals_now(uuid[]) TO unitvisor_submitter, unitvisor_host;
