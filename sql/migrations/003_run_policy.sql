-- unitvisor schema, version 3: what a host refuses to let a run change, and a run without network.
--
-- Expand only, for the previous release (0.2.0), which reads runs, attempts and hosts by explicit
-- column lists: a new column does not change what it reads. (0.1.0 read runs and attempts with
-- SELECT *, so a release that adds a column to them needs every host on 0.2.0 first: README, Upgrade.)

-- A run that asks for no network at all: its unit gets PrivateNetwork=yes (loopback only). Every
-- host can do that, so it is no reason to refuse a run.
ALTER TABLE unitvisor.runs ADD COLUMN private_network boolean NOT NULL DEFAULT false;

-- The environment names a host refuses (supervisor/envpolicy.py: names that change what an allowed
-- program runs) and those it opens anyway ([runs] allowed_environment), as anchored regular
-- expressions registered by its daemon. NULL: a daemon of 0.2.0, which refused no name.
ALTER TABLE unitvisor.hosts
    ADD COLUMN environment_denied text[],
    ADD COLUMN environment_allowed text[];

-- The first of r's environment names that host h refuses, or NULL. An environment that is not an
-- object (a row written around runs_environment_valid) has no names here: the daemon claims it and
-- refuses it with a reason, where an error would abort every claim of the host.
CREATE FUNCTION unitvisor.refused_environment_name(h unitvisor.hosts, r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT min(e.name)
    FROM jsonb_object_keys(CASE WHEN jsonb_typeof(r.environment) = 'object' THEN r.environment ELSE '{}' END)
        AS e(name)
    WHERE e.name ~ ANY (h.environment_denied) AND NOT e.name ~ ANY (coalesce(h.environment_allowed, '{}'))
$$;

-- As in 002, with the environment's names: still the one function the claim, the probe and the
-- explanation of a waiting run ask, so a host never claims a run it would refuse to start.
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
    END
$$;

-- The environment policy, registered by the daemon right after register_host in the same
-- transaction (a separate function so that register_host keeps the signature 0.2.0 calls).
CREATE FUNCTION unitvisor.register_host_environment(host_id text, host_epoch bigint,
    environment_denied text[], environment_allowed text[]) RETURNS void
LANGUAGE sql AS $$
    UPDATE unitvisor.hosts h SET environment_denied = register_host_environment.environment_denied,
        environment_allowed = register_host_environment.environment_allowed
    WHERE h.id = register_host_environment.host_id
      AND unitvisor.check_fence(register_host_environment.host_id, register_host_environment.host_epoch)
$$;

-- submit_run gains private_network, last and defaulted, so that every call written for version 1
-- (positional or named) still means what it meant.
DROP FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer, bigint,
    integer, text, integer, integer, integer, text[]);
CREATE FUNCTION unitvisor.submit_run(
    argv                  text[],
    environment           jsonb   DEFAULT '{}'::jsonb,
    working_directory     text    DEFAULT NULL,
    run_user              text    DEFAULT NULL,
    memory_max            bigint  DEFAULT NULL,
    cpu_quota_percent     integer DEFAULT NULL,
    tasks_max             integer DEFAULT NULL,
    io_weight             integer DEFAULT NULL,
    runtime_max_sec       bigint  DEFAULT NULL,
    max_attempts          integer DEFAULT 1,
    host_pin              text    DEFAULT NULL,
    priority              integer DEFAULT 0,
    retry_backoff_sec     integer DEFAULT 10,
    retry_backoff_max_sec integer DEFAULT 600,
    retry_on              text[]  DEFAULT NULL,
    private_network       boolean DEFAULT false
) RETURNS uuid LANGUAGE plpgsql AS $$
DECLARE
    new_id uuid;
BEGIN
    INSERT INTO unitvisor.runs (argv, environment, working_directory, run_user, memory_max,
        cpu_quota_percent, tasks_max, io_weight, runtime_max_sec, max_attempts, host_pin, priority,
        retry_backoff_sec, retry_backoff_max_sec, retry_on, private_network)
    VALUES (submit_run.argv, coalesce(submit_run.environment, '{}'::jsonb), submit_run.working_directory,
        submit_run.run_user, submit_run.memory_max, submit_run.cpu_quota_percent, submit_run.tasks_max,
        submit_run.io_weight, submit_run.runtime_max_sec, submit_run.max_attempts, submit_run.host_pin,
        submit_run.priority, submit_run.retry_backoff_sec, submit_run.retry_backoff_max_sec,
        submit_run.retry_on, coalesce(submit_run.private_network, false))
    RETURNING id INTO new_id;
    INSERT INTO unitvisor.spawn_jobs (run_id, priority) VALUES (new_id, submit_run.priority);
    INSERT INTO unitvisor.run_events (run_id, state, reason) VALUES (new_id, 'queued', 'submitted');
    RETURN new_id;
END $$;
