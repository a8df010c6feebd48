-- unitvisor schema: a run gets no more than it needs (issue 21): environment names by an allowlist.
--
-- Expand only, for 0.5.x daemons and CLIs: two columns added to hosts (which every release reads by
-- explicit column lists), a function added, two replaced in place with the same names, arguments and
-- results (refused_environment_name, register_host_environment).

-- -- environment names: an allowlist --------------------------------------------------------------
--
-- Until now a host registered the names it refuses (environment_denied, supervisor/envpolicy.py) and
-- the refused ones it opens anyway (environment_allowed), and every other name passed: TAR_OPTIONS,
-- GIT_CONFIG_*, RSYNC_RSH, LUA_INIT, MAKEFLAGS, LESSOPEN, DOTNET_STARTUP_HOOKS, OPENSSL_CONF and the
-- like made an allowed program run the submitter's code. Now a 0.6 daemon registers the names its
-- [runs] allowed_environment opens: plain names (environment_names, compared with =) and patterns
-- (environment_patterns, anchored regexes from supervisor/globs.py). A name is allowed when it is one
-- of the plain names, or when a pattern matches it and it is not on the denylist (environment_denied,
-- still registered): a name that loads code (LD_*, PYTHON*, PATH, ...) is opened only by its exact name.
--
-- A host whose daemon registered no allowlist (environment_patterns NULL: a 0.5.x daemon, or any
-- before it) keeps today's rule, its denylist, until it is upgraded. Chosen over refusing such a host
-- every name outside a default set, because the README's Upgrade promises that the previous release
-- keeps working between `migrate` and each host's upgrade, and that daemon's own check (unitspec.py
-- of 0.5.x) refuses by its denylist too, so the claim and the start agree; the hole stays open on a
-- host only until it runs 0.6 (README, Upgrade, says to upgrade every host).
ALTER TABLE unitvisor.hosts
    ADD COLUMN environment_names text[],
    ADD COLUMN environment_patterns text[];

-- As in 003, the first of r's environment names that host h refuses, or NULL, by the rule above. Still
-- the one function host_refusal asks (the claim, the probe and the explanation of a waiting run).
CREATE OR REPLACE FUNCTION unitvisor.refused_environment_name(h unitvisor.hosts, r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT min(e.name)
    FROM jsonb_object_keys(CASE WHEN jsonb_typeof(r.environment) = 'object' THEN r.environment ELSE '{}' END)
        AS e(name)
    WHERE CASE WHEN h.environment_patterns IS NULL
        THEN e.name ~ ANY (h.environment_denied) AND NOT e.name ~ ANY (coalesce(h.environment_allowed, '{}'))
        ELSE NOT (e.name = ANY (coalesce(h.environment_names, '{}'))
                  OR (e.name ~ ANY (h.environment_patterns)
                      AND NOT e.name ~ ANY (coalesce(h.environment_denied, '{}'))))
    END
$$;

-- What a 0.6 daemon registers right after register_host, in the same transaction (store.register_host),
-- fenced like every host write. environment_allowed is cleared: the allowlist decides.
CREATE FUNCTION unitvisor.register_host_allowlist(host_id text, host_epoch bigint, environment_denied text[],
    environment_names text[], environment_patterns text[]) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    UPDATE unitvisor.hosts h SET environment_denied = register_host_allowlist.environment_denied,
        environment_allowed = NULL,
        environment_names = coalesce(register_host_allowlist.environment_names, '{}'),
        environment_patterns = coalesce(register_host_allowlist.environment_patterns, '{}')
    WHERE h.id = register_host_allowlist.host_id
      AND unitvisor.check_fence(register_host_allowlist.host_id, register_host_allowlist.host_epoch)
$$;
REVOKE EXECUTE ON FUNCTION unitvisor.register_host_allowlist(text, bigint, text[], text[], text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.register_host_allowlist(text, bigint, text[], text[], text[]) TO unitvisor_host;

-- As in 003 (what a 0.5.x daemon calls), and it also clears an allowlist a 0.6 daemon registered for
-- the same host id: after a downgrade the host is judged by the denylist its daemon enforces, never by
-- a list that daemon does not know.
CREATE OR REPLACE FUNCTION unitvisor.register_host_environment(host_id text, host_epoch bigint,
    environment_denied text[], environment_allowed text[]) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    UPDATE unitvisor.hosts h SET environment_denied = register_host_environment.environment_denied,
        environment_allowed = register_host_environment.environment_allowed,
        environment_names = NULL, environment_patterns = NULL
    WHERE h.id = register_host_environment.host_id
      AND unitvisor.check_fence(register_host_environment.host_id, register_host_environment.host_epoch)
$$;
