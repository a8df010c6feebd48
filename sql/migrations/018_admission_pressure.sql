-- unitvisor schema: admission by pressure (issue 22, part 4). A daemon reads the PSI files of its
-- runs' slice and claims fewer runs, then none, while they stall (supervisor/pressure.py); it says so
-- in its host row, so that `unitvisor hosts` shows it and a run that no host takes says why.
--
-- Expand only, for 0.6.0 daemons and CLIs: four columns added to hosts (which every release reads by
-- explicit column lists), one function added, one replaced in place with the same name, arguments and
-- result (host_refusal). A host whose daemon never reported pressure (0.6.0 and before) has
-- pressure_state NULL and is judged as before.

ALTER TABLE unitvisor.hosts
    -- off (PSI cannot be read, or not watched), open, slowed (claiming fewer) or stopped (claiming
    -- none); NULL: never reported by this host's daemon.
    ADD COLUMN pressure_state text,
    -- The resource whose figure decided (memory, io or cpu); NULL when off.
    ADD COLUMN pressure_resource text,
    -- avg10 of `some`, in percent, by resource, as last reported, and why admission is off.
    ADD COLUMN pressure_figures jsonb,
    ADD COLUMN pressure_detail text,
    ADD COLUMN pressure_at timestamptz,
    ADD CONSTRAINT hosts_pressure_state_valid
        CHECK (pressure_state IS NULL OR pressure_state IN ('off', 'open', 'slowed', 'stopped'));

-- What a daemon reports when its admission changes (store.set_pressure), fenced like every host write.
-- Not part of the heartbeat: a host stops claiming within a second or two of its figure crossing the
-- line, not at its next poll interval, and an idle host, whose figures do not move, writes nothing.
CREATE FUNCTION unitvisor.set_host_pressure(host_id text, host_epoch bigint, state text, resource text,
    figures jsonb, detail text) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    UPDATE unitvisor.hosts h SET pressure_state = set_host_pressure.state,
        pressure_resource = set_host_pressure.resource, pressure_figures = set_host_pressure.figures,
        pressure_detail = set_host_pressure.detail, pressure_at = now()
    WHERE h.id = set_host_pressure.host_id
      AND unitvisor.check_fence(set_host_pressure.host_id, set_host_pressure.host_epoch)
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.set_host_pressure(text, bigint, text, text, jsonb, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.set_host_pressure(text, bigint, text, text, jsonb, text) TO unitvisor_host;

-- As in 003, with one more reason, last so that a run a host would refuse anyway names that first: a
-- host that claims nothing under pressure. Still the one function the claim, the probe (whose
-- `claimable` is then false, so a stopped host is not woken to claim nothing) and the explanation of
-- a waiting run ask, so the database refuses what the daemon would not claim, and a waiting run
-- says "no live host accepts it: claims nothing under memory pressure (web-1)". The words name the
-- resource and no figure: explain_waiting writes an event whenever a reason changes.
-- A report older than the host's registration (hosts.started_at, stamped at every registration) is
-- the previous daemon's: void, so that a daemon that died stopped, or one replaced by a 0.6.0 daemon
-- that reports nothing, does not keep its host closed.
CREATE OR REPLACE FUNCTION unitvisor.host_refusal(h unitvisor.hosts, r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN r.host_pin IS NOT NULL AND r.host_pin <> h.id THEN 'pinned to host ' || r.host_pin
        WHEN NOT h.can_start THEN 'cannot start units (' || coalesce(h.cannot_start_reason, 'unknown') || ')'
        WHEN NOT EXISTS (SELECT 1 FROM unnest(h.executable_patterns) AS p(pattern) WHERE r.argv[1] ~ p.pattern)
            THEN 'executable ' || r.argv[1] || ' is not allowed'
        WHEN r.run_user IS NOT NULL AND r.run_user <> h.run_user AND NOT r.run_user = ANY (h.allowed_users)
            THEN 'user ' || r.run_user || ' is not allowed'
        WHEN unitvisor.refused_environment_name(h, r) IS NOT NULL
            THEN 'environment name ' || unitvisor.refused_environment_name(h, r) || ' is not allowed'
        WHEN r.memory_max IS NOT NULL AND h.memory_budget IS NOT NULL AND r.memory_max > h.memory_budget
            THEN 'memory_max ' || r.memory_max || ' bytes is over the memory budget'
        WHEN h.pressure_state = 'stopped' AND h.pressure_at >= h.started_at
            THEN 'claims nothing under ' || coalesce(h.pressure_resource, 'some') || ' pressure'
    END
$$;
