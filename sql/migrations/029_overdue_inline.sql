-- unitvisor schema: the heartbeat's look for a silent host costs no function call per host (issue 23,
-- point 4: the idle fleet's server CPU per host grew with the fleet).
--
-- Before: every heartbeat asked `EXISTS (SELECT 1 FROM hosts o WHERE o.id <> h.id AND
-- host_is_overdue(o))`, to say whether the fleet upkeep has a silent host to declare dead. When no host
-- is silent (an idle fleet: always) that walks every host row, and host_is_overdue, a SQL function whose
-- body held a subquery (the open attempts of a stopped host), cannot be inlined by the planner: it ran as
-- a function call of its own, with its own executor start and end, for every other host, on every
-- heartbeat of every host. Measured on a throwaway database (docs/benchmarks.md, issue 23's idle cost):
-- one heartbeat took 1.4 ms with 100 hosts, 8.5 ms with 300 and 22 ms with 1,000 on the loaded 2-core
-- machine, against 0.3-0.6 ms without the look; so the fleet's idle server CPU per host per minute grew
-- with the number of hosts (6.2 ms at 100, 12.4 ms at 300 in bench.scale).
--
-- Now host_is_overdue has no subquery: the open attempts of a stopped host are asked by a function of
-- their own (host_has_open_attempt), which runs only for a stopped host silent past its host_dead_after.
-- The planner then inlines host_is_overdue wherever it is called (the heartbeat, declare_dead,
-- declare_dead_hosts) and the look at a host row is a few comparisons of its columns. The answer is the
-- same for every row (tests/integration/test_fleet_sql.py and test_fleet_upkeep.py); what is left is the
-- walk over the host rows' pages, a few hundred buffers at 1,000 hosts
-- (tests/integration/test_heartbeat_cost.py counts the function calls).
--
-- Expand only: the same function names, arguments and results; a 0.8.0 daemon calls the same heartbeat.

-- Whether the host has an attempt that no outcome settled yet.
CREATE FUNCTION unitvisor.host_has_open_attempt(host_id text) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM unitvisor.attempts a
                   WHERE a.host_id = host_has_open_attempt.host_id AND a.outcome IS NULL)
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.host_has_open_attempt(text) FROM PUBLIC;

-- host_is_overdue as in 002, its open-attempt question moved into host_has_open_attempt: a SQL function
-- without a subquery (and without SET, SECURITY DEFINER or STRICT) is inlined by the planner.
CREATE OR REPLACE FUNCTION unitvisor.host_is_overdue(h unitvisor.hosts) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT h.heartbeat_at < now() - make_interval(secs => coalesce(h.dead_after_sec, 60))
       AND (h.state IN ('active', 'draining')
            OR (h.state = 'stopped' AND unitvisor.host_has_open_attempt(h.id)))
$$;
