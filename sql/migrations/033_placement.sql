-- unitvisor schema 33 (issue 25, item 4): placement. Where a run may go by labels of the hosts, and a
-- retry that prefers another host than the one its attempt failed on.
--
-- Host labels: a daemon registers its [host] labels (register_host_labels, in the transaction of its
-- register_host, as the environment allowlist is registered). They hold while that registration does:
-- hosts.labels_at not before hosts.started_at (host_labels), as a pressure report holds, so that after
-- a downgrade a daemon that registers none leaves its host with none, never with stale ones.
--
-- A run's host_labels (submit_run, last and defaulted): every pair must be among the host's labels.
-- host_refusal says so ('has no label zone=a'), one jsonb containment (@>) of two rows it has read
-- already: the claim, the heartbeat's probe, the wake-up of hosts, explain_waiting and refusals_now
-- (submit's warning) all ask host_refusal, so a run no live host matches waits and says why. The
-- kinds the claim, the probe and explain_waiting group runs by include host_labels (run_kind only when
-- a run has some, so that every job queued before keeps its kind).
--
-- avoid_failed_host (submit_run, last and defaulted): NULL (the default) avoids the host of a lost
-- attempt only (the host died or rebooted under it), true the host of any failed attempt (not success
-- or cancelled), false none. The host is read once, when the retry's spawn job is inserted
-- (describe_spawn_job: the run's last attempt), into spawn_jobs.avoid_host. The claim of that host
-- passes the job over while another live host would accept the run (also_accepted, which the claim
-- asks anyway for its fair share, once per kind), for avoid_failed_host_grace() (60 s) after the job
-- is due. "Prefers", never "refuses": every other host may take it at once; when the failed host is
-- the only live one that accepts the run it takes it at once (a fleet of one loses nothing), and when
-- others accept it but none takes it (they are full) it takes it 60 s late. Its event says which. Not a
-- refusal in host_refusal: a run that only its failed host accepts is not one "no live host accepts".
--
-- Expand only, for 0.9.0 daemons and CLIs: new columns (nullable, or NOT NULL with a constant default:
-- no table rewrite), new functions, submit_run two more arguments, last and defaulted (DROP and CREATE:
-- the signature changes; grants again). host_refusal, run_kind, note_spawn_jobs, describe_spawn_job,
-- claim_jobs and explain_waiting keep their signatures and results (replaced in place). A 0.9.0 daemon
-- registers no labels: its host has none, and accepts only runs without host_labels.

-- -- columns ------------------------------------------------------------------------------------------

ALTER TABLE unitvisor.runs
    -- Labels every host that runs it must have ('{}': any host), and whether a retry prefers another
    -- host than its last attempt's (NULL: after a lost attempt only; avoids_host).
    ADD COLUMN host_labels jsonb NOT NULL DEFAULT '{}'::jsonb,
    ADD COLUMN avoid_failed_host boolean;

ALTER TABLE unitvisor.hosts
    -- Its daemon's [host] labels, and when it registered them (host_labels: void before started_at).
    ADD COLUMN labels jsonb,
    ADD COLUMN labels_at timestamptz;

ALTER TABLE unitvisor.spawn_jobs
    -- The host this job's run should not go back to for a while (describe_spawn_job); NULL: none.
    ADD COLUMN avoid_host text;

-- -- functions ----------------------------------------------------------------------------------------

-- A host's labels while its current registration holds, '{}' otherwise (none registered, or registered
-- by its previous daemon). Inlined (sql, no SET): host_refusal calls it per host.
CREATE FUNCTION unitvisor.host_labels(h unitvisor.hosts) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN h.labels_at >= h.started_at THEN coalesce(h.labels, '{}'::jsonb) ELSE '{}'::jsonb END
$$;

-- Whether a run's retry avoids the host of a last attempt that ended with `outcome` (avoid_failed_host:
-- NULL for lost only, true for every failure, false never).
CREATE FUNCTION unitvisor.avoids_host(avoid_failed_host boolean, outcome text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN avoid_failed_host IS NULL THEN outcome = 'lost'
                WHEN avoid_failed_host THEN outcome NOT IN ('success', 'cancelled')
                ELSE false END
$$;

-- How long the host a retry avoids passes it over, after the retry is due, while another live host
-- accepts it: longer than two poll intervals (every other live host has had its chance to claim it,
-- and a woken one claims at once), short enough that a run whose other hosts are full loses a minute.
CREATE FUNCTION unitvisor.avoid_failed_host_grace() RETURNS interval
LANGUAGE sql IMMUTABLE AS $$ SELECT interval '60 seconds' $$;

-- The check of placement's arguments, beside run_argument_problem (which it does not change): the first
-- refused, as the constraint it is named by and its message; two NULLs when they pass. avoid_failed_host
-- is any boolean, or NULL.
CREATE FUNCTION unitvisor.placement_problem(host_labels jsonb, OUT constraint_name text, OUT message text)
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF host_labels IS NULL OR NOT unitvisor.labels_are_valid(host_labels) THEN
        constraint_name := 'runs_host_labels_valid';
        message := 'host_labels: must be a JSON object of at most 64 key -> string pairs, each as a label (a key of 1 to 63 letters, digits, ".", "_", "-" and "/", starting and ending with a letter or digit; a value of at most 255 characters, without control characters)';
    END IF;
END $$;

-- placement_problem for a row written another way (an admin's UPDATE), as refuse_invalid_arguments.
CREATE FUNCTION unitvisor.refuse_invalid_placement() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    problem record;
BEGIN
    problem := unitvisor.placement_problem(NEW.host_labels);
    IF problem.message IS NOT NULL THEN
        RAISE EXCEPTION '%', problem.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = problem.constraint_name;
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER runs_placement_valid BEFORE INSERT OR UPDATE OF host_labels ON unitvisor.runs
    FOR EACH ROW EXECUTE FUNCTION unitvisor.refuse_invalid_placement();

-- What a daemon of this release registers right after register_host, in the same transaction
-- (store.register_host), fenced like every host write: its [host] labels, checked as a run's labels are.
CREATE FUNCTION unitvisor.register_host_labels(host_id text, host_epoch bigint, labels jsonb) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.check_fence(register_host_labels.host_id, register_host_labels.host_epoch);
    IF register_host_labels.labels IS NULL OR NOT unitvisor.labels_are_valid(register_host_labels.labels) THEN
        RAISE EXCEPTION 'labels: must be a JSON object of at most 64 key -> string pairs, each as a run''s label'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE unitvisor.hosts h SET labels = register_host_labels.labels, labels_at = now()
    WHERE h.id = register_host_labels.host_id;
END $$;

-- -- placement in the decisions that read a run's kind ------------------------------------------------

-- host_refusal as in 018, and the run's host_labels (after can_start): every pair among the host's.
CREATE OR REPLACE FUNCTION unitvisor.host_refusal(h unitvisor.hosts, r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN r.host_pin IS NOT NULL AND r.host_pin <> h.id THEN 'pinned to host ' || r.host_pin
        WHEN NOT h.can_start THEN 'cannot start units (' || coalesce(h.cannot_start_reason, 'unknown') || ')'
        -- Placement (033): every one of the run's host_labels among the host's labels, one containment
        -- on the two rows already read; the words name the pairs it lacks.
        WHEN NOT unitvisor.host_labels(h) @> coalesce(r.host_labels, '{}')
            THEN 'has no label ' || (SELECT string_agg(l.key || '=' || l.value, ', ' ORDER BY l.key)
                                     FROM jsonb_each_text(r.host_labels) AS l(key, value)
                                     WHERE NOT unitvisor.host_labels(h) @> jsonb_build_object(l.key, l.value))
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


-- run_kind as in 020, with host_labels when the run has some.
CREATE OR REPLACE FUNCTION unitvisor.run_kind(r unitvisor.runs) RETURNS text
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT md5((jsonb_build_array(
        r.argv[1], r.run_user, r.memory_max, r.host_pin,
        CASE WHEN jsonb_typeof(r.environment) = 'object'
             THEN (SELECT coalesce(jsonb_agg(e.name ORDER BY e.name), '[]') FROM jsonb_object_keys(r.environment) AS e(name))
             ELSE r.environment END)
        -- host_labels (033) only when the run has some: a run without keeps the kind it had before.
        || CASE WHEN coalesce(r.host_labels, '{}') = '{}' THEN '[]'::jsonb ELSE jsonb_build_array(r.host_labels) END)::text)
$$;


-- note_spawn_jobs as in 010, each kind with its host_labels (notify_spawn_targets asks host_refusal of it).
CREATE OR REPLACE FUNCTION unitvisor.note_spawn_jobs() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    unpinned bigint;
    pins jsonb;
    kinds jsonb;
    noted jsonb;
BEGIN
    SELECT count(*) FILTER (WHERE r.host_pin IS NULL),
           coalesce(jsonb_agg(DISTINCT r.host_pin) FILTER (WHERE r.host_pin IS NOT NULL), '[]')
    INTO unpinned, pins
    FROM new_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
    WHERE j.state = 'available';
    IF unpinned = 0 AND pins = '[]' THEN
        RETURN NULL;
    END IF;
    PERFORM set_config('unitvisor.spawn_unpinned',
        (unpinned + coalesce(nullif(current_setting('unitvisor.spawn_unpinned', true), '')::bigint, 0))::text, true);
    noted := coalesce(nullif(current_setting('unitvisor.spawn_pins', true), ''), '[]')::jsonb;
    IF NOT noted @> pins THEN  -- the common case, the same pins again, costs this test only
        SELECT jsonb_agg(DISTINCT p) INTO pins FROM (
            SELECT jsonb_array_elements(pins) AS p UNION SELECT jsonb_array_elements(noted)) x;
        PERFORM set_config('unitvisor.spawn_pins', pins::text, true);
    END IF;
    IF unpinned > 0 THEN
        SELECT coalesce(jsonb_agg(k), '[]') INTO kinds FROM (
            -- The environment's names only, each with an empty value: host_refusal reads the names,
            -- and the values (which may be secrets) must not go into the session's settings, where
            -- the submitter's current_setting, pg_settings and any error context would show them.
            SELECT DISTINCT jsonb_build_object('argv', ARRAY[r.argv[1]], 'run_user', r.run_user,
                                               'environment', (SELECT coalesce(jsonb_object_agg(e.name, ''), '{}')
                                                               FROM jsonb_object_keys(
                                                                   CASE WHEN jsonb_typeof(r.environment) = 'object'
                                                                        THEN r.environment ELSE '{}' END) AS e(name)),
                                               'memory_max', r.memory_max,
                                               -- 033: host_refusal reads them; fewer of them is accepted
                                               -- by more hosts, as @> below assumes.
                                               'host_labels', r.host_labels) AS k
            FROM new_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
            WHERE j.state = 'available' AND r.host_pin IS NULL
            LIMIT 33) x;
        noted := coalesce(nullif(current_setting('unitvisor.spawn_kinds', true), ''), '[]')::jsonb;
        -- A kind that one already noted contains (same argv[0], user and memory_max, environment names
        -- a superset) is accepted wherever that one is: host_refusal refuses on the names it finds.
        IF NOT noted @> kinds THEN
            SELECT jsonb_agg(k) INTO kinds FROM (
                SELECT k FROM (SELECT jsonb_array_elements(noted) AS k UNION SELECT jsonb_array_elements(kinds)) u
                LIMIT 33) x;
            PERFORM set_config('unitvisor.spawn_kinds', kinds::text, true);
        END IF;
    END IF;
    RETURN NULL;
END $$;


-- describe_spawn_job as in 020, and the host the job's run should not go back to (avoid_host).
CREATE OR REPLACE FUNCTION unitvisor.describe_spawn_job() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    run unitvisor.runs;
BEGIN
    SELECT * INTO run FROM unitvisor.runs r WHERE r.id = NEW.run_id;
    NEW.concurrency_key := run.concurrency_key;
    NEW.kind := unitvisor.run_kind(run);
    -- 033: the host the run's last attempt failed on, when its avoid_failed_host says to prefer another.
    -- Read here, once per job (one probe of the attempts' key), so that the claim reads it on the job's row.
    NEW.avoid_host := (SELECT CASE WHEN unitvisor.avoids_host(run.avoid_failed_host, a.outcome) THEN a.host_id END
                       FROM unitvisor.attempts a WHERE a.run_id = NEW.run_id ORDER BY a.attempt DESC LIMIT 1);
    RETURN NEW;
END $$;


-- claim_jobs as in 020, with host_labels in its kinds, a job passed over by the host it avoids while
-- another live host accepts it (until avoid_failed_host_grace after it is due), and the claim's event
-- saying why that host took it after all.
CREATE OR REPLACE FUNCTION unitvisor.claim_jobs(
    host_id text, host_epoch bigint, batch integer, unit_format text,
    starve_after interval DEFAULT '5 minutes', spread_grace interval DEFAULT '1 second')
RETURNS TABLE (run_id uuid, attempt integer, unit_name text, claimed_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    me unitvisor.hosts;
    in_flight integer;
    memory_used bigint;
    free integer;
    capacity bigint;
    busy bigint;
    waiting bigint;
    share bigint;
    shared integer := 0;
    taken integer := 0;
    looked integer := 0;
    next_attempt integer;
    name text;
    enough bigint;
    refusals jsonb := '{}';
    accepted jsonb := '{}';
    contested boolean;
    heads bigint[];
    -- 032: the selectors of the named limits this claim found full (or being decided by another claim).
    saturated jsonb[] := '{}';
    full_limit text;
    -- (A bound cursor, planned for its first rows: sql/009_claim_cost.sql.) Still one walk of
    -- spawn_jobs_available_idx in claim order, as 013's: a job of a key that is not its key's head is
    -- passed over on the job's own row (its concurrency_key column), before the join to its run and
    -- without a concurrency_blocker. (A merge of two streams, keyless jobs and heads, was tried: the
    -- planner sorted the whole queue for it, every claim of a burst.)
    jobs CURSOR FOR
        SELECT j.id, j.run_id, j.scheduled_at, r.state AS run_state, r.memory_max, r.concurrency_key,
               -- The memos' key: every column host_refusal and also_accepted read, host_pin too (as
               -- explain_waiting's kind and run_kind). Both memos are read for pinned runs (the avoid path
               -- below; a pinned run's refusal here), and no other host accepts a run pinned to this one:
               -- without host_pin an unpinned run's answer would stand for a pinned one's of the same
               -- command, and the reverse (a pinned-to-me retry passed over for the grace with a false
               -- event, or an unpinned retry taken at once on its failed host).
               r.host_pin, jsonb_build_array(r.argv[1], r.run_user, r.environment, r.memory_max, r.host_pin,
                                             r.host_labels)::text AS kind,
               r AS run, j.avoid_host
        FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
        WHERE j.state = 'available' AND j.scheduled_at <= now()
          AND (heads IS NULL OR j.concurrency_key IS NULL OR j.id = ANY (heads))
          AND (r.state <> 'queued' OR ((r.host_pin IS NULL OR r.host_pin = me.id)
                                       AND (r.concurrency_key IS NULL OR unitvisor.concurrency_blocker(r) IS NULL)
                                       AND (r.start_deadline IS NULL OR NOT unitvisor.is_overdue(r))))
        ORDER BY j.priority DESC, j.scheduled_at, j.id
        ;
BEGIN
    PERFORM unitvisor.check_fence(claim_jobs.host_id, claim_jobs.host_epoch);
    SELECT * INTO me FROM unitvisor.hosts h WHERE h.id = claim_jobs.host_id;
    IF me.state <> 'active' OR NOT me.can_start OR NOT unitvisor.host_is_live(me) THEN
        RETURN;
    END IF;
    SELECT count(*), coalesce(sum(r.memory_max), 0) INTO in_flight, memory_used
    FROM unitvisor.attempts a JOIN unitvisor.runs r ON r.id = a.run_id
    WHERE a.host_id = claim_jobs.host_id AND a.outcome IS NULL;
    free := least(claim_jobs.batch, me.max_runs - in_flight);
    IF free <= 0 THEN
        RETURN;
    END IF;
    SELECT coalesce(sum(h.max_runs), 0) INTO capacity FROM unitvisor.hosts h
    WHERE unitvisor.host_is_live(h) AND h.can_start;
    IF capacity > me.max_runs THEN
        enough := least(capacity, ceil((free + in_flight)::numeric * capacity / me.max_runs)::bigint);
        -- busy and waiting in one statement, from one snapshot (009).
        SELECT (SELECT coalesce(sum(c.open), 0) FROM unitvisor.hosts h
                JOIN unitvisor.host_open_attempts c ON c.host_id = h.id
                WHERE unitvisor.host_is_live(h) AND h.can_start),
               (SELECT count(*) FROM (
                    SELECT 1 FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
                    WHERE j.state = 'available' AND j.scheduled_at <= now() AND r.state = 'queued'
                      AND (r.host_pin IS NULL OR r.host_pin = me.id)
                      AND (r.start_deadline IS NULL OR r.start_deadline > now())
                    LIMIT greatest(enough, 0)) w)
        INTO busy, waiting;
        share := ceil((busy + waiting)::numeric * me.max_runs / capacity)::bigint - in_flight;
    ELSE
        share := free;  -- no other live host: nothing to share
    END IF;
    heads := unitvisor.key_head_jobs();
    FOR job IN jobs LOOP
        IF job.run_state = 'queued' THEN
            IF refusals ? job.kind THEN
                CONTINUE WHEN (refusals ->> job.kind)::boolean;
            ELSIF unitvisor.host_refusal(me, job.run) IS NOT NULL THEN
                refusals := unitvisor.claim_memo(refusals, job.kind, true);
                CONTINUE;
            ELSE
                refusals := unitvisor.claim_memo(refusals, job.kind, false);
            END IF;
            -- 033: the host its last attempt failed on passes it over while another live host would take
            -- it, for avoid_failed_host_grace after it is due (also_accepted, remembered per kind as below).
            IF job.avoid_host = me.id AND job.scheduled_at > now() - unitvisor.avoid_failed_host_grace() THEN
                IF NOT accepted ? job.kind THEN
                    accepted := unitvisor.claim_memo(accepted, job.kind, unitvisor.also_accepted(me, job.run));
                END IF;
                CONTINUE WHEN coalesce((accepted ->> job.kind)::boolean, unitvisor.also_accepted(me, job.run));
            END IF;
        END IF;
        -- A named limit found full by this claim (032): its runs are passed over without counting again.
        CONTINUE WHEN job.run_state = 'queued' AND (job.run).labels @> ANY (saturated);
        looked := looked + 1;
        IF job.run_state <> 'queued' THEN
            PERFORM 1 FROM unitvisor.spawn_jobs j WHERE j.id = job.id AND j.state = 'available'
                FOR UPDATE SKIP LOCKED;
            CONTINUE WHEN NOT FOUND;  -- another claim has it
            UPDATE unitvisor.spawn_jobs j SET state = 'discarded', claimed_by = claim_jobs.host_id,
                claimed_at = now(), error = 'run is already ' || job.run_state
            WHERE j.id = job.id;
            CONTINUE;
        END IF;
        EXIT WHEN taken >= free OR looked > 4 * claim_jobs.batch;
        IF share >= free OR job.host_pin IS NOT NULL THEN
            contested := false;
        ELSIF accepted ? job.kind THEN
            contested := (accepted ->> job.kind)::boolean;
        ELSE
            contested := unitvisor.also_accepted(me, job.run);
            accepted := unitvisor.claim_memo(accepted, job.kind, contested);
        END IF;
        IF contested AND shared >= share AND job.scheduled_at > now() - claim_jobs.spread_grace THEN
            CONTINUE;  -- another host's share, for now
        END IF;
        IF me.memory_budget IS NOT NULL AND memory_used + coalesce(job.memory_max, 0) > me.memory_budget THEN
            -- A starved run reserves the host only if it could start once memory is free: under a full
            -- named limit (max_live 0 used as a pause, say) it could not, and the host would run under
            -- capacity for as long as the limit stays full. So its limits are asked first (claim_limits:
            -- a limit it finds not full stays locked until this claim's transaction ends, which is now).
            IF job.scheduled_at < now() - claim_jobs.starve_after THEN
                full_limit := unitvisor.claim_limits(job.run);
                EXIT WHEN full_limit IS NULL;  -- it reserves the host
                saturated := saturated || (SELECT l.selector FROM unitvisor.limits l WHERE l.name = full_limit);
            END IF;
            CONTINUE;  -- backfill: a smaller run behind it may fit
        END IF;
        IF job.concurrency_key IS NOT NULL THEN
            -- The key's lock, then the decision again from a snapshot taken after it (006).
            CONTINUE WHEN NOT pg_try_advisory_xact_lock(hashtextextended('unitvisor-concurrency-key:' || job.concurrency_key, 0));
            CONTINUE WHEN (SELECT unitvisor.concurrency_blocker(r) FROM unitvisor.runs r WHERE r.id = job.run_id) IS NOT NULL;
        END IF;
        -- The named limits the run falls under (032), each under its lock (claim_limits).
        full_limit := unitvisor.claim_limits(job.run);
        IF full_limit IS NOT NULL THEN
            saturated := saturated || (SELECT l.selector FROM unitvisor.limits l WHERE l.name = full_limit);
            CONTINUE;
        END IF;
        PERFORM 1 FROM unitvisor.spawn_jobs j WHERE j.id = job.id AND j.state = 'available' FOR UPDATE SKIP LOCKED;
        CONTINUE WHEN NOT FOUND;  -- another claim has it, or took it since this loop's query began
        UPDATE unitvisor.spawn_jobs j SET state = 'claimed', claimed_by = claim_jobs.host_id, claimed_at = now()
        WHERE j.id = job.id;
        SELECT coalesce(max(a.attempt), 0) + 1 INTO next_attempt FROM unitvisor.attempts a WHERE a.run_id = job.run_id;
        name := format(claim_jobs.unit_format, job.run_id, next_attempt);
        UPDATE unitvisor.runs r SET state = 'starting', updated_at = now() WHERE r.id = job.run_id;
        DELETE FROM unitvisor.run_waits w WHERE w.run_id = job.run_id;
        INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
        VALUES (job.run_id, next_attempt, claim_jobs.host_id, 'starting', 'claimed by host ' || claim_jobs.host_id
                || CASE WHEN job.avoid_host IS DISTINCT FROM claim_jobs.host_id THEN ''
                        WHEN job.scheduled_at > now() - unitvisor.avoid_failed_host_grace()
                        THEN ', where its last attempt failed: no other live host accepts it'
                        ELSE format(', where its last attempt failed: no other host took it within %s s of its retry',
                                    extract(epoch FROM unitvisor.avoid_failed_host_grace())::integer) END);
        INSERT INTO unitvisor.attempts AS a (run_id, attempt, host_id, unit_name)
        VALUES (job.run_id, next_attempt, claim_jobs.host_id, name)
        RETURNING a.run_id, a.attempt, a.unit_name, a.claimed_at
        INTO claim_jobs.run_id, claim_jobs.attempt, claim_jobs.unit_name, claim_jobs.claimed_at;
        RETURN NEXT;
        taken := taken + 1;
        shared := shared + contested::integer;
        memory_used := memory_used + coalesce(job.memory_max, 0);
    END LOOP;
END $$;


-- explain_waiting as in 019, with host_labels in its kinds.
CREATE OR REPLACE FUNCTION unitvisor.explain_waiting(min_wait interval, max_runs integer DEFAULT 1000)
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    refusals_per_pass constant integer := 10000;
    after_at timestamptz;
    after_job bigint;
    max_kinds integer;
    candidates integer;
    cut boolean;
    last_at timestamptz;
    last_job bigint;
    written integer;
BEGIN
    SELECT u.explained_at, u.explained_job INTO after_at, after_job FROM unitvisor.fleet_upkeep u;
    SELECT greatest(1, refusals_per_pass / greatest(count(*), 1))::integer INTO max_kinds
    FROM unitvisor.hosts h WHERE unitvisor.host_is_live(h);
    WITH candidate AS MATERIALIZED (
        SELECT j.id AS job_id, j.scheduled_at, r AS run,
               jsonb_build_array(r.argv[1], r.run_user, r.environment, r.memory_max, r.host_pin, r.host_labels) AS kind,
               row_number() OVER (ORDER BY j.scheduled_at, j.id) AS pos
        FROM unitvisor.spawn_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
        WHERE j.state = 'available' AND j.scheduled_at <= now() - explain_waiting.min_wait AND r.state = 'queued'
          AND (after_at IS NULL OR (j.scheduled_at, j.id) > (after_at, after_job))
        ORDER BY j.scheduled_at, j.id LIMIT explain_waiting.max_runs
    ),
    -- Where the first kind past max_kinds first appears: the pass stops just before it.
    cutoff AS (
        SELECT f.first FROM (SELECT min(c.pos) AS first FROM candidate c GROUP BY c.kind) f
        ORDER BY f.first OFFSET max_kinds LIMIT 1
    ),
    due AS MATERIALIZED (
        SELECT c.* FROM candidate c WHERE c.pos < coalesce((SELECT cutoff.first FROM cutoff), c.pos + 1)
    ),
    kinds AS MATERIALIZED (
        SELECT k.kind, unitvisor.fleet_refusal(k.run) AS refused
        FROM (SELECT DISTINCT ON (d.kind) d.kind, d.run FROM due d ORDER BY d.kind) k
    ),
    waiting AS MATERIALIZED (
        SELECT (d.run).id AS id, nullif(concat_ws('; ', 'waits for ' || unitvisor.key_blocker_text(d.run),
                                                  unitvisor.limit_text(d.run), k.refused), '') AS reason
        FROM due d JOIN kinds k ON k.kind = d.kind
    ),
    -- A reason that appears or changes; ON CONFLICT sees a concurrent pass's committed row, so two
    -- passes at once write one event.
    changed AS (
        INSERT INTO unitvisor.run_waits AS x (run_id, reason)
        SELECT w.id, w.reason FROM waiting w WHERE w.reason IS NOT NULL
        ON CONFLICT (run_id) DO UPDATE SET reason = excluded.reason WHERE x.reason IS DISTINCT FROM excluded.reason
        RETURNING x.run_id AS id, x.reason
    ),
    cleared AS (
        DELETE FROM unitvisor.run_waits x USING waiting w WHERE x.run_id = w.id AND w.reason IS NULL
        RETURNING 1
    ),
    events AS (
        INSERT INTO unitvisor.run_events (run_id, state, reason)
        SELECT c.id, 'queued', 'waiting: ' || c.reason FROM changed c
        RETURNING 1
    ),
    last AS (
        SELECT d.scheduled_at, d.job_id FROM due d ORDER BY d.pos DESC LIMIT 1
    )
    SELECT (SELECT count(*) FROM events)::integer, (SELECT count(*) FROM candidate)::integer,
           EXISTS (SELECT 1 FROM cutoff), (SELECT last.scheduled_at FROM last), (SELECT last.job_id FROM last)
    INTO written, candidates, cut, last_at, last_job;
    -- A pass that was neither cut nor full reached the end: the next one starts from the beginning.
    IF NOT cut AND candidates < explain_waiting.max_runs THEN
        last_at := NULL;
        last_job := NULL;
    END IF;
    UPDATE unitvisor.fleet_upkeep u SET explained_at = last_at, explained_job = last_job
    WHERE u.explained_at IS DISTINCT FROM last_at OR u.explained_job IS DISTINCT FROM last_job;
    RETURN written;
END $$;


-- -- submit_run: placement ----------------------------------------------------------------------------
--
-- As in 032, with host_labels and avoid_failed_host last and defaulted. DROP and CREATE (the signature
-- changes), then the grants again.
DROP FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz,
    timestamptz, bigint, text, integer, integer, text, text[], boolean, integer, boolean, integer);
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
    private_network       boolean DEFAULT false,
    idempotency_key       text    DEFAULT NULL,
    labels                jsonb   DEFAULT '{}'::jsonb,
    concurrency_key       text    DEFAULT NULL,
    not_before            timestamptz DEFAULT NULL,
    start_deadline        timestamptz DEFAULT NULL,
    memory_high           bigint  DEFAULT NULL,
    stop_signal           text    DEFAULT NULL,
    stop_timeout          integer DEFAULT NULL,
    warn_before           integer DEFAULT NULL,
    warn_signal           text    DEFAULT NULL,
    -- Failure rules (027).
    fail_on               text[]  DEFAULT NULL,
    count_lost            boolean DEFAULT false,
    max_lost_attempts     integer DEFAULT 3,
    -- 030: hold (held at once: queued, never claimed until release_run).
    hold                  boolean DEFAULT false,
    -- 032: how many runs of its concurrency_key may be live at once (1: one at a time, as before).
    concurrency_limit     integer DEFAULT 1,
    -- 033: placement. Labels every host that runs it must have ([host] labels), and whether a retry
    -- prefers another host than the one its last attempt failed on (NULL: after a lost attempt only).
    host_labels           jsonb   DEFAULT '{}'::jsonb,
    avoid_failed_host     boolean DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
-- Bare names in the statements are runs' columns (ON CONFLICT's idempotency_key); the arguments are
-- always written submit_run.<name>.
#variable_conflict use_column
DECLARE
    new_id uuid;
    env jsonb := coalesce(submit_run.environment, '{}'::jsonb);
    run_labels jsonb := coalesce(submit_run.labels, '{}'::jsonb);
    -- Kept short (TERM, not sigterm); a warning's signal is USR1 unless named (Slurm's --signal's).
    run_stop_signal text := unitvisor.signal_short_name(submit_run.stop_signal);
    run_warn_signal text := unitvisor.signal_short_name(
        CASE WHEN submit_run.warn_before IS NULL THEN submit_run.warn_signal
             ELSE coalesce(submit_run.warn_signal, 'USR1') END);
    -- Failure rules (027): signal names in one spelling, as attempts record them.
    retry_rules text[] := unitvisor.normalised_failure_rules(submit_run.retry_on);
    fail_rules text[] := unitvisor.normalised_failure_rules(submit_run.fail_on);
    problem record;
    placement record;
    refused_constraint text;
    refused_state text;
    refused_column text;
BEGIN
    -- Every argument's check, written once (run_argument_problem, which the table's trigger runs_arguments_valid
    -- calls too): the first refused argument, in an error that names it and the constraint it breaks.
    problem := unitvisor.run_argument_problem(submit_run.argv, env, submit_run.working_directory,
        submit_run.run_user, submit_run.memory_max, submit_run.memory_high, submit_run.cpu_quota_percent,
        submit_run.tasks_max, submit_run.io_weight, submit_run.runtime_max_sec, submit_run.max_attempts,
        submit_run.retry_backoff_sec, submit_run.retry_backoff_max_sec, retry_rules, run_labels,
        submit_run.idempotency_key, submit_run.concurrency_key, submit_run.not_before, submit_run.start_deadline,
        run_stop_signal, submit_run.stop_timeout, submit_run.warn_before, run_warn_signal,
        fail_rules, submit_run.count_lost, submit_run.max_lost_attempts,
        submit_run.concurrency_limit);
    IF problem.hint IS NOT NULL THEN
        RAISE EXCEPTION '%', problem.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs',
                  CONSTRAINT = problem.constraint_name, HINT = problem.hint;
    ELSIF problem.message IS NOT NULL THEN
        RAISE EXCEPTION '%', problem.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = problem.constraint_name;
    END IF;
    -- Placement's own check (033), beside run_argument_problem's: the table's trigger runs_placement_valid asks it too.
    placement := unitvisor.placement_problem(coalesce(submit_run.host_labels, '{}'::jsonb));
    IF placement.message IS NOT NULL THEN
        RAISE EXCEPTION '%', placement.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = placement.constraint_name;
    END IF;

    -- Sizes, once every argument has its form (so that a name it echoes is a valid name): one helper
    -- holds every bound, so that a later submit_run calls it instead of repeating them.
    PERFORM unitvisor.check_run_sizes(submit_run.argv, env, submit_run.working_directory, submit_run.host_pin,
                                      retry_rules);

    -- A retried submit: the run its key made, whatever the other arguments say now (as Stripe's and
    -- River's idempotency keys: the key names the request, the first one wins). Nothing is written.
    IF submit_run.idempotency_key IS NOT NULL THEN
        SELECT r.id INTO new_id FROM unitvisor.runs r WHERE r.idempotency_key = submit_run.idempotency_key;
        IF FOUND THEN
            RETURN new_id;
        END IF;
    END IF;

    -- Checked after the look-up: a retried submit must find its run even once its deadline has passed.
    -- now() is the database's clock (the transaction's start), not the caller's.
    IF submit_run.start_deadline <= now() THEN
        RAISE EXCEPTION 'start_deadline: must be in the future (it is not after the database''s now())'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs',
                  CONSTRAINT = 'runs_start_deadline_valid';
    END IF;

    -- A constraint this function did not foresee (one added later) must not leak the row either:
    -- caught, and raised again with its name but without the DETAIL that holds the row.
    BEGIN
        INSERT INTO unitvisor.runs (argv, environment, working_directory, run_user, memory_max,
            cpu_quota_percent, tasks_max, io_weight, runtime_max_sec, max_attempts, host_pin, priority,
            retry_backoff_sec, retry_backoff_max_sec, retry_on, private_network, idempotency_key, labels,
            concurrency_key, not_before, start_deadline, memory_high,
            stop_signal, stop_timeout, warn_before, warn_signal, fail_on, count_lost, max_lost_attempts,
            held_at, held_by, concurrency_limit, host_labels, avoid_failed_host)
        VALUES (submit_run.argv, env, submit_run.working_directory,
            submit_run.run_user, submit_run.memory_max, submit_run.cpu_quota_percent, submit_run.tasks_max,
            submit_run.io_weight, submit_run.runtime_max_sec, submit_run.max_attempts, submit_run.host_pin,
            submit_run.priority, submit_run.retry_backoff_sec, submit_run.retry_backoff_max_sec,
            retry_rules, coalesce(submit_run.private_network, false), submit_run.idempotency_key,
            run_labels, submit_run.concurrency_key, submit_run.not_before, submit_run.start_deadline,
            submit_run.memory_high,
            run_stop_signal, submit_run.stop_timeout, submit_run.warn_before, run_warn_signal,
            fail_rules, submit_run.count_lost, submit_run.max_lost_attempts,
            CASE WHEN submit_run.hold THEN now() END, CASE WHEN submit_run.hold THEN session_user END,
            submit_run.concurrency_limit, coalesce(submit_run.host_labels, '{}'::jsonb),
            submit_run.avoid_failed_host)
        -- Another submit with the same key committed since the look-up above (this waited for it):
        -- insert nothing, and return its run below.
        ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING id INTO new_id;
        IF new_id IS NULL THEN
            SELECT r.id INTO STRICT new_id FROM unitvisor.runs r WHERE r.idempotency_key = submit_run.idempotency_key;
            RETURN new_id;
        END IF;
        -- not_before: the first job is not due before it (the claim takes only due jobs). A held run
        -- gets none: release_run makes it (a held run holds no job, so no claim ever looks at it).
        IF NOT coalesce(submit_run.hold, false) THEN
            INSERT INTO unitvisor.spawn_jobs (run_id, priority, scheduled_at)
            VALUES (new_id, submit_run.priority, greatest(now(), submit_run.not_before));
        END IF;
        INSERT INTO unitvisor.run_events (run_id, state, reason)
        VALUES (new_id, 'queued', CASE WHEN coalesce(submit_run.hold, false) THEN 'submitted, held by ' || session_user
                                       ELSE 'submitted' END);
    EXCEPTION WHEN integrity_constraint_violation THEN
        GET STACKED DIAGNOSTICS refused_constraint = CONSTRAINT_NAME, refused_state = RETURNED_SQLSTATE,
                                refused_column = COLUMN_NAME;
        -- An explicit NULL for an argument whose column has none (max_attempts, priority, the backoffs, argv):
        -- the column's NOT NULL refused it; the argument is named, as every other refusal names its own.
        IF refused_state = '23502' AND refused_column <> '' THEN
            RAISE EXCEPTION '%: must not be NULL (leave it out for its default)', refused_column
                USING ERRCODE = 'not_null_violation', SCHEMA = 'unitvisor', TABLE = 'runs', COLUMN = refused_column;
        END IF;
        RAISE EXCEPTION 'the run was refused by constraint %', coalesce(nullif(refused_constraint, ''), '(unnamed)')
            USING ERRCODE = refused_state, CONSTRAINT = coalesce(refused_constraint, '');
    END;
    RETURN new_id;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz,
    timestamptz, bigint, text, integer, integer, text, text[], boolean, integer, boolean, integer, jsonb, boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz,
    timestamptz, bigint, text, integer, integer, text, text[], boolean, integer, boolean, integer, jsonb, boolean) TO unitvisor_submitter;

-- -- grants -------------------------------------------------------------------------------------------

REVOKE EXECUTE ON FUNCTION unitvisor.host_labels(unitvisor.hosts), unitvisor.avoids_host(boolean, text),
    unitvisor.avoid_failed_host_grace(), unitvisor.placement_problem(jsonb), unitvisor.refuse_invalid_placement(),
    unitvisor.register_host_labels(text, bigint, jsonb) FROM PUBLIC;
-- host_labels for reading (`unitvisor hosts`, as a host's role too, and a control plane's own queries);
-- avoids_host and avoid_failed_host_grace are called by SECURITY DEFINER functions only.
GRANT EXECUTE ON FUNCTION unitvisor.host_labels(unitvisor.hosts) TO unitvisor_submitter, unitvisor_host;
GRANT EXECUTE ON FUNCTION unitvisor.register_host_labels(text, bigint, jsonb) TO unitvisor_host;
