-- unitvisor schema, version 4: three kinds of database role (README, "Roles: who may do what").
--
-- Until now one role owned everything, so whoever read one host's DSN could act as any host, rewrite
-- queued runs and history, read every run's environment, or drop the schema. From here on:
--
-- * unitvisor_admin     owns the schema and every object in it; runs migrations, drains and forgets
--                       hosts, binds host roles (`unitvisor hosts add`), and may act as any host. The
--                       role that migrates (and the schema's and database's owners) become members,
--                       so a single-role deployment, and the previous release's daemons, keep working.
-- * unitvisor_submitter for control planes: submits, cancels, resumes and reads runs, through
--                       functions only; writes no table directly.
-- * unitvisor_host      every host's own login role is a member, and is bound to one host id in
--                       unitvisor.host_roles. It writes nothing directly either: every write is a
--                       SECURITY DEFINER function that checks, against session_user, that the caller
--                       is the host it writes for. It reads runs unpinned or pinned to itself (an
--                       environment may hold what other hosts must not see), not the others.
--
-- Expand only: no column or function the previous release calls changes shape. register_host keeps its
-- name and signature (it becomes a checking wrapper); check_fence keeps its signature and gains the
-- identity check, which covers every host write that carries a fence.
--
-- Applied by the login role that migrates, which must be able to create roles (a superuser, or a role
-- with CREATEROLE). Later migrations run under SET ROLE unitvisor_admin (store.migrate), so that what
-- they create is the admin's.

-- -- the roles --------------------------------------------------------------------------------------

-- Roles are the cluster's, not the database's: another database of the same cluster may be migrating
-- at this very moment. Whichever commits second gets duplicate_object (or unique_violation on
-- pg_authid's index when both were inside CREATE ROLE at once), which only means the role exists.
DO $$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['unitvisor_admin', 'unitvisor_submitter', 'unitvisor_host'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.rolname = role_name) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;  -- created meanwhile by a migrate in another database
            END;
        END IF;
    END LOOP;
END $$;

-- Who keeps working as before: the role migrating now, the schema's owner until now (the one role of
-- a single-role deployment, whose 0.2.0 daemons and CLIs must keep working), and the database's owner
-- (who may drop the whole database anyway; README's Install makes it the admin's login role).
-- Superusers are members of everything already.
DO $$
DECLARE
    who text;
BEGIN
    FOR who IN
        SELECT DISTINCT r.rolname FROM pg_catalog.pg_roles r
        WHERE r.oid IN (
            (SELECT r2.oid FROM pg_catalog.pg_roles r2 WHERE r2.rolname = current_user),
            (SELECT n.nspowner FROM pg_catalog.pg_namespace n WHERE n.nspname = 'unitvisor'),
            (SELECT d.datdba FROM pg_catalog.pg_database d WHERE d.datname = current_database()))
          AND NOT r.rolsuper AND r.rolname <> 'unitvisor_admin'
          AND NOT pg_catalog.pg_has_role(r.oid, 'unitvisor_admin', 'MEMBER')
    LOOP
        BEGIN
            EXECUTE format('GRANT unitvisor_admin TO %I', who);
        EXCEPTION WHEN unique_violation THEN
            NULL;  -- granted meanwhile by a migrate in another database
        END;
    END LOOP;
END $$;

-- -- host id bindings -----------------------------------------------------------------------------

-- Which login role is which host. Readable by the admin only: which role names exist, and which host
-- each is, is nobody else's business. One role per host id and one host id per role.
CREATE TABLE unitvisor.host_roles (
    role_name  text PRIMARY KEY,
    host_id    text NOT NULL UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- The host id the session's login role is bound to, or NULL. session_user, not current_user: inside a
-- SECURITY DEFINER function current_user is the function's owner, and a host role cannot SET ROLE or
-- SET SESSION AUTHORIZATION its way into another login role.
CREATE FUNCTION unitvisor.my_host_id() RETURNS text
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT b.host_id FROM unitvisor.host_roles b WHERE b.role_name = session_user::text
$$;

-- Whether the session may act as host_id: the role bound to it, or any member of unitvisor_admin
-- (a superuser is a member of every role).
CREATE FUNCTION unitvisor.acts_as(host_id text) RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT pg_has_role(session_user, 'unitvisor_admin', 'MEMBER')
        OR EXISTS (SELECT 1 FROM unitvisor.host_roles b
                   WHERE b.role_name = session_user::text AND b.host_id = acts_as.host_id)
$$;

-- The refusal every host write starts with. SQLSTATE 42501 (insufficient_privilege), as PostgreSQL's
-- own refusals, so that a client tells "not allowed" from "fenced" (UV001).
CREATE FUNCTION unitvisor.require_host(host_id text) RETURNS void
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT unitvisor.acts_as(require_host.host_id) THEN
        RAISE EXCEPTION 'role % may not act as host %', session_user, require_host.host_id
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'a host role acts only as the host id it is bound to (unitvisor hosts add); '
                         'any other host needs unitvisor_admin';
    END IF;
END $$;

-- What kind of role the session has, for `unitvisor doctor` and for people: admin, submitter, host
-- (with the host id it is bound to) or unbound (none of the three, or a host role bound to nothing).
CREATE FUNCTION unitvisor.whoami(OUT kind text, OUT host_id text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN pg_has_role(session_user, 'unitvisor_admin', 'MEMBER') THEN 'admin'
                WHEN b.host_id IS NOT NULL THEN 'host'
                WHEN pg_has_role(session_user, 'unitvisor_submitter', 'MEMBER') THEN 'submitter'
                ELSE 'unbound' END,
           b.host_id
    FROM (SELECT unitvisor.my_host_id() AS host_id) b
$$;

-- -- identity on the existing paths ---------------------------------------------------------------

-- check_fence, as in 002, first checking that the caller is the host it writes for. Every host write
-- that carries a fence calls it (claim_jobs, declare_dead_hosts, register_host_environment, and the
-- functions below), so none of them can be made as another host.
CREATE OR REPLACE FUNCTION unitvisor.check_fence(host_id text, host_epoch bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    current unitvisor.hosts;
BEGIN
    PERFORM unitvisor.require_host(check_fence.host_id);
    SELECT * INTO current FROM unitvisor.hosts h WHERE h.id = check_fence.host_id FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'host % is fenced: its row is gone', check_fence.host_id
            USING ERRCODE = 'UV001', HINT = 'the daemon registers again';
    END IF;
    IF current.epoch <> check_fence.host_epoch OR current.state = 'dead' THEN
        RAISE EXCEPTION 'host % is fenced: epoch % is over (now %, %)', check_fence.host_id,
            check_fence.host_epoch, current.epoch, current.state
            USING ERRCODE = 'UV001', HINT = 'the daemon registers again';
    END IF;
    RETURN true;
END $$;

-- register_host takes no fence (it makes one): as in 002, with the identity check first. The same name
-- and signature, which the previous release calls. (A wrapper around a renamed 002 function cannot
-- work: its body names its own arguments register_host.*.)
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
            AND old.state IN ('active', 'draining')
            AND old.heartbeat_at >= now() - make_interval(secs => coalesce(old.dead_after_sec, 60)) THEN
        -- Another machine held it moments ago (it may be reconnecting): let it have it back.
        PERFORM pg_advisory_unlock(unitvisor.host_lock_key(register_host.host_id));
        UPDATE unitvisor.hosts h SET conflict_at = now(), conflict_detail = 'refused a second daemon: ' || who
        WHERE h.id = register_host.host_id;
        RETURN QUERY SELECT false, NULL::text, NULL::bigint,
            format('host id %s is in use by instance %s, heard from %s s ago', register_host.host_id,
                   old.instance, round(extract(epoch FROM now() - old.heartbeat_at)::numeric, 1));
        RETURN;
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
    -- another machine taking over a silent id: a new epoch, so that the old owner's writes fail.
    new_epoch := CASE WHEN old.state = 'dead' OR old.instance IS DISTINCT FROM register_host.host_instance
                      THEN nextval('unitvisor.host_epochs') ELSE old.epoch END;
    new_state := CASE WHEN old.state = 'draining' OR (old.state = 'dead' AND old.drained_before_death)
                      THEN 'draining' ELSE 'active' END;
    UPDATE unitvisor.hosts h SET name = register_host.host_name, max_runs = register_host.max_runs,
        memory_budget = register_host.memory_budget, version = register_host.host_version,
        boot_id = register_host.host_boot_id, instance = register_host.host_instance,
        can_start = register_host.can_start, cannot_start_reason = register_host.cannot_start_reason,
        allowed_executables = register_host.allowed_executables,
        executable_patterns = register_host.executable_patterns, run_user = register_host.run_user,
        allowed_users = register_host.allowed_users, poll_interval_sec = register_host.poll_interval_sec,
        dead_after_sec = register_host.dead_after_sec, epoch = new_epoch, started_at = now(),
        heartbeat_at = now(), dead_at = NULL, dead_reason = NULL, drained_before_death = false, state = new_state
    WHERE h.id = register_host.host_id;
    RETURN QUERY SELECT true, new_state, new_epoch,
        CASE WHEN old.state = 'dead' THEN format('rejoined after being declared dead (%s)', old.dead_reason)
             WHEN new_epoch <> old.epoch THEN format('took over the id from instance %s', old.instance)
             ELSE 'registered' END;
END $$;

-- The functions that write for a host and call check_fence, and the fleet's upkeep: they run as their
-- owner (unitvisor_admin), with a search_path nobody can plant a function in.
ALTER FUNCTION unitvisor.claim_jobs(text, bigint, integer, text, interval, interval)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION unitvisor.declare_dead_hosts(text, bigint, double precision)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION unitvisor.register_host_environment(text, bigint, text[], text[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
-- explain_waiting writes only run_waits and 'waiting' events, from facts it reads itself.
ALTER FUNCTION unitvisor.explain_waiting(interval, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
-- submit_run: the control plane's one way to create a run.
ALTER FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer, bigint,
    integer, text, integer, integer, integer, text[], boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;

-- -- the daemon's writes, as functions --------------------------------------------------------------
--
-- What store.py wrote with direct statements until 0.2.0 (which still does, as an admin member). Each
-- is the same statement as before, behind the identity check.

-- The heartbeat and the fallback poll (store.probe). No row: fenced (its row is gone, its epoch is
-- over, or it is dead).
CREATE FUNCTION unitvisor.heartbeat(host_id text, host_epoch bigint, waited interval)
RETURNS TABLE (host_state text, claimable boolean, cancels boolean, upkeep boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.require_host(heartbeat.host_id);
    RETURN QUERY
    UPDATE unitvisor.hosts h SET heartbeat_at = now()
    WHERE h.id = heartbeat.host_id AND h.epoch = heartbeat.host_epoch AND h.state <> 'dead'
    RETURNING h.state,
        EXISTS (SELECT 1 FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
                WHERE j.state = 'available' AND j.scheduled_at <= now()
                  AND (r.state <> 'queued' OR unitvisor.host_refusal(h, r) IS NULL)),
        EXISTS (SELECT 1 FROM unitvisor.attempts a JOIN unitvisor.runs r ON r.id = a.run_id
                WHERE a.host_id = heartbeat.host_id AND a.outcome IS NULL AND r.cancel_requested_at IS NOT NULL),
        EXISTS (SELECT 1 FROM unitvisor.hosts o WHERE o.id <> h.id AND unitvisor.host_is_overdue(o))
        OR EXISTS (SELECT 1 FROM unitvisor.spawn_jobs j
                   WHERE j.state = 'available' AND j.scheduled_at <= now() - heartbeat.waited);
END $$;

-- A daemon's clean stop (store.mark_host_stopped).
CREATE FUNCTION unitvisor.mark_host_stopped(host_id text, host_epoch bigint) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.require_host(mark_host_stopped.host_id);
    UPDATE unitvisor.hosts h SET state = 'stopped', heartbeat_at = now()
    WHERE h.id = mark_host_stopped.host_id AND h.epoch = mark_host_stopped.host_epoch AND h.state = 'active';
END $$;

-- The unit exists: the run is running (store.mark_started). Only the attempt's own host, only while
-- it has no outcome; the event is written once, when the run moves to running.
CREATE FUNCTION unitvisor.mark_started(run_id uuid, attempt integer, host_id text, host_epoch bigint,
                                       invocation_id text, started_at timestamptz, reason text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.check_fence(mark_started.host_id, mark_started.host_epoch);
    WITH started AS (
        UPDATE unitvisor.attempts a
        SET started_at = coalesce(a.started_at, mark_started.started_at, now()),
            invocation_id = coalesce(a.invocation_id, mark_started.invocation_id)
        WHERE a.run_id = mark_started.run_id AND a.attempt = mark_started.attempt AND a.outcome IS NULL
          AND a.host_id = mark_started.host_id
        RETURNING a.run_id),
    moved AS (
        UPDATE unitvisor.runs r SET state = 'running', updated_at = now()
        WHERE r.id IN (SELECT s.run_id FROM started s) AND r.state = 'starting' RETURNING r.id)
    INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
    SELECT m.id, mark_started.attempt, mark_started.host_id, 'running', mark_started.reason FROM moved m;
END $$;

-- An attempt's outcome and its run's next state, in the caller's transaction (store.record_outcome):
-- its own attempt, or one of a host declared dead that it takes over; never one that has an outcome
-- (history is append-only). A retry (retry_delay) queues a new spawn job; a cancel requested meanwhile
-- wins over the retry. Returns false, changing nothing, when the attempt is not open or not its own.
CREATE FUNCTION unitvisor.record_outcome(
    run_id uuid, attempt integer, host_id text, host_epoch bigint, outcome text, exit_status text,
    reason text, next_state text, retry_delay interval, invocation_id text, started_at timestamptz,
    ended_at timestamptz) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    latest integer;
    state_after text := record_outcome.next_state;
    delay interval := record_outcome.retry_delay;
    detail text;
BEGIN
    PERFORM unitvisor.check_fence(record_outcome.host_id, record_outcome.host_epoch);
    IF state_after NOT IN ('queued', 'succeeded', 'failed', 'cancelled') OR (state_after = 'queued') <> (delay IS NOT NULL) THEN
        RAISE EXCEPTION 'an outcome moves its run to succeeded, failed or cancelled, or to queued with a retry delay'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE unitvisor.attempts a SET outcome = record_outcome.outcome, exit_status = record_outcome.exit_status,
        reason = record_outcome.reason, ended_at = coalesce(record_outcome.ended_at, now()),
        invocation_id = coalesce(a.invocation_id, record_outcome.invocation_id),
        -- a unit seen only once it had ended (adopted after a crash) did start
        started_at = CASE WHEN record_outcome.invocation_id IS NULL AND record_outcome.started_at IS NULL
                          THEN a.started_at ELSE coalesce(a.started_at, record_outcome.started_at, now()) END
    WHERE a.run_id = record_outcome.run_id AND a.attempt = record_outcome.attempt AND a.outcome IS NULL
      -- its own attempt, or one of a host declared dead that it is taking over
      AND (a.host_id = record_outcome.host_id
           OR EXISTS (SELECT 1 FROM unitvisor.hosts h WHERE h.id = a.host_id AND h.state = 'dead'));
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    SELECT max(a.attempt) INTO latest FROM unitvisor.attempts a WHERE a.run_id = record_outcome.run_id;
    IF latest <> record_outcome.attempt THEN
        RETURN true;  -- an older attempt settled late; the run follows its newest attempt
    END IF;
    detail := format('attempt %s: %s (%s)', record_outcome.attempt, record_outcome.outcome, record_outcome.reason);
    IF delay IS NOT NULL AND (SELECT r.cancel_requested_at IS NOT NULL FROM unitvisor.runs r
                              WHERE r.id = record_outcome.run_id FOR UPDATE) THEN
        -- Cancelled while this outcome was on its way: the operator's word ends the run.
        delay := NULL;
        state_after := 'cancelled';
        detail := detail || '; no retry, a cancel was requested';
    END IF;
    IF delay IS NOT NULL THEN
        INSERT INTO unitvisor.spawn_jobs (run_id, priority, scheduled_at)
        SELECT r.id, r.priority, now() + delay FROM unitvisor.runs r WHERE r.id = record_outcome.run_id;
        -- round() of a double rounds half to even, as Python's format did before this moved here
        detail := detail || format('; retry in %ss', round(extract(epoch FROM delay)::double precision));
    END IF;
    UPDATE unitvisor.runs r SET state = state_after, updated_at = now(),
        finished_at = CASE WHEN state_after IN ('succeeded', 'failed', 'cancelled') THEN now() END
    WHERE r.id = record_outcome.run_id;
    INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
    VALUES (record_outcome.run_id, record_outcome.attempt, record_outcome.host_id, state_after, detail);
    RETURN true;
END $$;

-- An event about an attempt that changes no state (a stop on its way), by the attempt's own host or
-- one taking over a dead host's. False: no such attempt of its own.
CREATE FUNCTION unitvisor.record_event(run_id uuid, attempt integer, host_id text, host_epoch bigint,
                                       state text, reason text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.check_fence(record_event.host_id, record_event.host_epoch);
    INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
    SELECT a.run_id, a.attempt, record_event.host_id, record_event.state, record_event.reason
    FROM unitvisor.attempts a
    WHERE a.run_id = record_event.run_id AND a.attempt = record_event.attempt
      AND (a.host_id = record_event.host_id
           OR EXISTS (SELECT 1 FROM unitvisor.hosts h WHERE h.id = a.host_id AND h.state = 'dead'));
    RETURN FOUND;
END $$;

-- -- an operator's requests, as functions ----------------------------------------------------------
--
-- The CLI (store.cancel_run, store.resume_run) and any control plane call these, so they cannot
-- disagree on what a cancel or a resume does.

-- Ask for a run to be cancelled. A queued run is cancelled at once (its job removed); a starting or
-- running one is marked, and its daemon (woken on the channel unitvisor_cancel) stops its unit.
-- state: the run's state after it (NULL: no such run); changed: whether anything changed.
CREATE FUNCTION unitvisor.cancel_run(run_id uuid, OUT state text, OUT changed boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    -- The job first, then the run: the claim locks in the same order, so the two cannot deadlock, and
    -- a job being claimed right now makes this wait and then see the run starting.
    DELETE FROM unitvisor.spawn_jobs j WHERE j.run_id = cancel_run.run_id AND j.state = 'available';
    UPDATE unitvisor.runs r SET
        cancel_requested_at = coalesce(r.cancel_requested_at, now()), updated_at = now(),
        state = CASE WHEN r.state = 'queued' THEN 'cancelled' ELSE r.state END,
        finished_at = CASE WHEN r.state = 'queued' THEN now() ELSE r.finished_at END
    WHERE r.id = cancel_run.run_id AND r.state IN ('queued', 'starting', 'running')
    RETURNING r.state INTO cancel_run.state;
    IF NOT FOUND THEN
        SELECT r.state INTO cancel_run.state FROM unitvisor.runs r WHERE r.id = cancel_run.run_id;
        changed := false;
        RETURN;
    END IF;
    IF cancel_run.state = 'cancelled' THEN
        -- A retry's job committed while this waited for the run's row lock (its outcome was being
        -- recorded): the run is cancelled now, so that job may never start it.
        DELETE FROM unitvisor.spawn_jobs j WHERE j.run_id = cancel_run.run_id AND j.state = 'available';
    END IF;
    INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
    VALUES (cancel_run.run_id, NULL, NULL, cancel_run.state,
            CASE WHEN cancel_run.state = 'cancelled' THEN 'cancelled while queued' ELSE 'cancel requested' END);
    PERFORM pg_notify('unitvisor_cancel', cancel_run.run_id::text);
    changed := true;
END $$;

-- Reopen a failed or cancelled run: back to queued with a new spawn job. The next attempt is numbered
-- after the last, and runs with the command and limits the row has now. Refused (changed = false) for
-- a run that is queued, starting, running or succeeded.
CREATE FUNCTION unitvisor.resume_run(run_id uuid, OUT state text, OUT changed boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    run_priority integer;
BEGIN
    UPDATE unitvisor.runs r SET state = 'queued', cancel_requested_at = NULL, finished_at = NULL, updated_at = now()
    WHERE r.id = resume_run.run_id AND r.state IN ('failed', 'cancelled')
    RETURNING r.priority INTO run_priority;
    IF NOT FOUND THEN
        SELECT r.state INTO resume_run.state FROM unitvisor.runs r WHERE r.id = resume_run.run_id;
        changed := false;
        RETURN;
    END IF;
    -- A job left behind by an older race is the job this run needs: keep it, never fail on it.
    INSERT INTO unitvisor.spawn_jobs AS j (run_id, priority) VALUES (resume_run.run_id, run_priority)
    ON CONFLICT (run_id) WHERE state = 'available' DO NOTHING;
    INSERT INTO unitvisor.run_events (run_id, state, reason)
    VALUES (resume_run.run_id, 'queued', 'resumed by an operator');
    resume_run.state := 'queued';
    changed := true;
END $$;

-- -- ownership ---------------------------------------------------------------------------------------

-- Everything in the schema becomes the admin's: ownership is what lets a role drop or alter an object,
-- so the login roles that merely belong to unitvisor_admin stop holding it themselves. Sequences that
-- belong to an identity column move with their table.
DO $$
DECLARE
    obj record;
BEGIN
    EXECUTE 'ALTER SCHEMA unitvisor OWNER TO unitvisor_admin';
    FOR obj IN
        SELECT c.oid::regclass::text AS name, c.relkind FROM pg_catalog.pg_class c
        WHERE c.relnamespace = 'unitvisor'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
          AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_depend d
                          WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid AND d.deptype IN ('a', 'i'))
    LOOP
        EXECUTE format('ALTER %s %s OWNER TO unitvisor_admin',
                       CASE obj.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW'
                                        WHEN 'm' THEN 'MATERIALIZED VIEW' WHEN 'f' THEN 'FOREIGN TABLE'
                                        ELSE 'TABLE' END, obj.name);
    END LOOP;
    FOR obj IN SELECT p.oid::regprocedure::text AS name FROM pg_catalog.pg_proc p
               WHERE p.pronamespace = 'unitvisor'::regnamespace LOOP
        EXECUTE format('ALTER ROUTINE %s OWNER TO unitvisor_admin', obj.name);
    END LOOP;
END $$;

-- -- privileges --------------------------------------------------------------------------------------

-- Functions are executable by PUBLIC unless revoked: revoke it from every one, now and for every
-- function the admin creates later (later migrations run as unitvisor_admin), then grant per role.
REVOKE ALL ON SCHEMA unitvisor FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA unitvisor FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA unitvisor FROM PUBLIC;
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA unitvisor FROM PUBLIC;
ALTER DEFAULT PRIVILEGES FOR ROLE unitvisor_admin REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;

GRANT USAGE ON SCHEMA unitvisor TO unitvisor_submitter, unitvisor_host;

-- Both read the schema's version (every command checks it), runs (a host: only those it may see, by
-- the policy below), their attempts, events and why they wait, and the hosts. Nobody but the admin
-- reads host_roles, or writes any table directly.
GRANT SELECT ON unitvisor.schema_migrations, unitvisor.runs, unitvisor.attempts, unitvisor.run_events,
    unitvisor.run_waits, unitvisor.hosts TO unitvisor_submitter, unitvisor_host;
GRANT SELECT ON unitvisor.spawn_jobs TO unitvisor_submitter;

GRANT EXECUTE ON FUNCTION unitvisor.whoami(), unitvisor.my_host_id() TO unitvisor_submitter, unitvisor_host;
GRANT EXECUTE ON FUNCTION
    unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer, bigint, integer, text,
                         integer, integer, integer, text[], boolean),
    unitvisor.cancel_run(uuid), unitvisor.resume_run(uuid)
    TO unitvisor_submitter;
GRANT EXECUTE ON FUNCTION
    unitvisor.register_host(text, text, text, integer, bigint, text, text, text[], text[], text, text[], boolean,
                            text, double precision, double precision),
    unitvisor.register_host_environment(text, bigint, text[], text[]),
    unitvisor.claim_jobs(text, bigint, integer, text, interval, interval),
    unitvisor.declare_dead_hosts(text, bigint, double precision),
    unitvisor.explain_waiting(interval, integer),
    unitvisor.heartbeat(text, bigint, interval),
    unitvisor.mark_host_stopped(text, bigint),
    unitvisor.mark_started(uuid, integer, text, bigint, text, timestamptz, text),
    unitvisor.record_outcome(uuid, integer, text, bigint, text, text, text, text, interval, text, timestamptz,
                             timestamptz),
    unitvisor.record_event(uuid, integer, text, bigint, text, text)
    TO unitvisor_host;

-- A host sees the runs it may run or settle: unpinned ones, those pinned to it, those it has an attempt
-- of, and those with an open attempt of a host declared dead (which it takes over). Not a run pinned to
-- another host: its environment is that host's business. The admin (the owner) and the submitter see
-- every row. my_host_id() in a sub-select is evaluated once per statement, not once per row.
ALTER TABLE unitvisor.runs ENABLE ROW LEVEL SECURITY;
CREATE POLICY runs_submitter_reads ON unitvisor.runs FOR SELECT TO unitvisor_submitter USING (true);
CREATE POLICY runs_host_reads ON unitvisor.runs FOR SELECT TO unitvisor_host USING (
    host_pin IS NULL
    OR host_pin = (SELECT unitvisor.my_host_id())
    OR EXISTS (SELECT 1 FROM unitvisor.attempts a
               WHERE a.run_id = runs.id
                 AND (a.host_id = (SELECT unitvisor.my_host_id())
                      OR (a.outcome IS NULL
                          AND EXISTS (SELECT 1 FROM unitvisor.hosts h WHERE h.id = a.host_id AND h.state = 'dead')))));
