-- unitvisor schema: a host reads nothing of a run it may not see (issue 21).
--
-- 004 put row-level security on runs only. attempts (with output_tail since 007), run_events and
-- run_waits were granted whole to unitvisor_host: a host read the output tail of a run pinned to
-- another host (a secret printed by that run), and the states, exit statuses and unit names of every
-- run. From here on every table that holds or reveals a run answers a host role only for the runs it
-- may see, by one rule:
--
-- * unitvisor.host_may_see(host_pin, run_id, me) is the rule, as 004 wrote it inline in the policy on
--   runs: unpinned, pinned to the host, a run it has an attempt of, or one with an open attempt of a host
--   declared dead (which it takes over). The policy on runs calls it, and so does every definer function
--   below that must answer for a run a host may not read (unit_owners).
-- * attempts, run_events and run_waits follow their run: a host reads a row of them exactly when it
--   reads the run (their policies ask runs, under runs' own policy). No second copy of the rule to keep
--   in step.
-- * spawn_jobs stays unreadable to hosts (004 never granted it); host_roles stays the admin's.
--
-- Why the rule's attempt half is a SECURITY DEFINER function (host_holds_run): the policy on attempts
-- reads runs, so the policy on runs may not read attempts itself (PostgreSQL refuses the cycle as
-- "infinite recursion detected in policy"). The function reads attempts as their owner, past the policy,
-- and answers only "does this session's host hold this run", a fact about the caller.
--
-- Why host_may_see is plain LANGUAGE sql without SET search_path or SECURITY DEFINER: so that the planner
-- inlines it into the policy, and a run unpinned or pinned to the host costs two comparisons, as 004's
-- inline expression did; host_holds_run is called only for runs pinned to another host. Being inlined,
-- it is parsed with the caller's search_path: every name and operator in it is schema-qualified.
--
-- The submitter reads every row (a policy USING true); the admin and its members own the tables and
-- are not subject to the policies; SECURITY DEFINER functions (the daemon's writes, the claim, pruning)
-- run as the owner and see every row as before.
--
-- Reads that a host's daemon needs beyond its own runs go through definer functions that say no more
-- than the daemon needs:
--
-- * unit_owners(unit_names): who holds the attempt behind each unit name found on this machine. A unit
--   whose run the host may not see (a changed [host] id, a restored image) is still reported, as open
--   on another host (host_id NULL) or as ended (outcome 'ended'): "never ours to stop" must not turn
--   into "no attempt owns it, stop it" (reconciler.decide_orphan). Its host, outcome and exit status
--   stay hidden. Asking needs the unit's name, which carries the run id.
-- * host_in_flight(host_id): how many attempts a host has open, for `unitvisor hosts` (a count, no run).
--
-- What a host role still learns of runs it may not see, by PostgreSQL's design: LISTEN needs no
-- privilege, so any session of the database hears unitvisor_run_finished ({"run_id", "state"}) and
-- unitvisor_cancel (a run id). Neither carries an environment, an output, a unit or an exit status.
--
-- Expand only: tables and columns unchanged, runs_host_reads keeps its name (ALTER POLICY), new functions
-- under new names. Daemons and CLIs of 0.5.x read the same statements; as a host role they now get only
-- the rows of runs they may see, which is all they ask for except unit_owners' query (see above) and the
-- in-flight count of `unitvisor hosts`, which for such a CLI counts only runs it may see.

-- -- the rule ----------------------------------------------------------------------------------------

-- Whether the session's host has an attempt of this run, or a host declared dead left one of its
-- attempts open (the live hosts settle it as lost, so they must read it). As the owner: past the policy
-- on attempts, which itself asks runs.
CREATE FUNCTION unitvisor.host_holds_run(run_id uuid) RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (SELECT 1 FROM unitvisor.attempts a
                   WHERE a.run_id = host_holds_run.run_id
                     AND (a.host_id = unitvisor.my_host_id()
                          OR (a.outcome IS NULL
                              AND EXISTS (SELECT 1 FROM unitvisor.hosts h
                                          WHERE h.id = a.host_id AND h.state = 'dead'))))
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.host_holds_run(uuid) FROM PUBLIC;

-- The rule. `me` is the session's host id (unitvisor.my_host_id()), passed in so that a policy computes
-- it once per statement (a sub-select there), not once per row; it decides only the pin comparison, so a
-- caller passing another id learns nothing it could not read anyway. Inlined (see above): no sub-select,
-- no SET, qualified operators.
CREATE FUNCTION unitvisor.host_may_see(host_pin text, run_id uuid, me text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT host_pin IS NULL OR host_pin OPERATOR(pg_catalog.=) me OR unitvisor.host_holds_run(run_id)
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.host_may_see(text, uuid, text) FROM PUBLIC;

-- A policy's functions run with the privileges of the role that queries.
GRANT EXECUTE ON FUNCTION unitvisor.host_holds_run(uuid), unitvisor.host_may_see(text, uuid, text)
    TO unitvisor_host;

-- -- the policies ------------------------------------------------------------------------------------

ALTER POLICY runs_host_reads ON unitvisor.runs
    USING (unitvisor.host_may_see(host_pin, id, (SELECT unitvisor.my_host_id())));

-- A row of these is visible to a host exactly when its run is: the sub-select reads runs under the
-- policy above.
ALTER TABLE unitvisor.attempts ENABLE ROW LEVEL SECURITY;
CREATE POLICY attempts_submitter_reads ON unitvisor.attempts FOR SELECT TO unitvisor_submitter USING (true);
CREATE POLICY attempts_host_reads ON unitvisor.attempts FOR SELECT TO unitvisor_host
    USING (EXISTS (SELECT 1 FROM unitvisor.runs r WHERE r.id = attempts.run_id));

ALTER TABLE unitvisor.run_events ENABLE ROW LEVEL SECURITY;
CREATE POLICY run_events_submitter_reads ON unitvisor.run_events FOR SELECT TO unitvisor_submitter USING (true);
CREATE POLICY run_events_host_reads ON unitvisor.run_events FOR SELECT TO unitvisor_host
    USING (EXISTS (SELECT 1 FROM unitvisor.runs r WHERE r.id = run_events.run_id));

ALTER TABLE unitvisor.run_waits ENABLE ROW LEVEL SECURITY;
CREATE POLICY run_waits_submitter_reads ON unitvisor.run_waits FOR SELECT TO unitvisor_submitter USING (true);
CREATE POLICY run_waits_host_reads ON unitvisor.run_waits FOR SELECT TO unitvisor_host
    USING (EXISTS (SELECT 1 FROM unitvisor.runs r WHERE r.id = run_waits.run_id));

-- spawn_jobs: read by the submitter (every row, as before) and by nobody else but the admin. Under a
-- policy too, so that a grant to unitvisor_host added by mistake later shows no row.
ALTER TABLE unitvisor.spawn_jobs ENABLE ROW LEVEL SECURITY;
CREATE POLICY spawn_jobs_submitter_reads ON unitvisor.spawn_jobs FOR SELECT TO unitvisor_submitter USING (true);

-- -- what a daemon reads beyond its runs ---------------------------------------------------------------

-- The attempt behind each of these unit names (names without one are absent), as store.unit_owners read
-- it from attempts until now; for a run the caller may not see, only "open on another host" (host_id
-- NULL, outcome NULL) or "ended" (host_id NULL, outcome 'ended').
CREATE FUNCTION unitvisor.unit_owners(unit_names text[])
RETURNS TABLE (unit_name text, host_id text, outcome text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT a.unit_name,
           CASE WHEN v.visible THEN a.host_id END,
           CASE WHEN v.visible THEN a.outcome WHEN a.outcome IS NOT NULL THEN 'ended' END
    FROM unitvisor.attempts a
    JOIN unitvisor.runs r ON r.id = a.run_id
    CROSS JOIN LATERAL (SELECT pg_has_role(session_user, 'unitvisor_admin', 'MEMBER')
                               OR unitvisor.host_may_see(r.host_pin, r.id, unitvisor.my_host_id()) AS visible) v
    WHERE a.unit_name = ANY(unit_owners.unit_names)
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.unit_owners(text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.unit_owners(text[]) TO unitvisor_host;

-- How many attempts a host has open, whichever runs they are of: `unitvisor hosts` with a host's DSN
-- would otherwise count only those of runs it may see.
CREATE FUNCTION unitvisor.host_in_flight(host_id text) RETURNS bigint
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT count(*) FROM unitvisor.attempts a WHERE a.host_id = host_in_flight.host_id AND a.outcome IS NULL
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.host_in_flight(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.host_in_flight(text) TO unitvisor_submitter, unitvisor_host;
