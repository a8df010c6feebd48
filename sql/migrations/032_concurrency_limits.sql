-- unitvisor schema 32 (issue 25, item 2): concurrency limits beyond one run per key.
--
-- Per key: submit_run(..., concurrency_key => 'k', concurrency_limit => N) lets N runs of the key be
-- live (starting or running) at once, across all hosts, started in submission order (the key's head
-- first, as since 006/013: a run starts only when every run of its key submitted before it has). The
-- default, 1, is the one-at-a-time key of before. Runs of one key that ask for different limits: a run
-- starts only while fewer runs of its key are live than the smallest limit among its own and those of
-- the key's live runs. So no live run ever has more runs of its key beside it than its own limit
-- allows, whichever was submitted first (a run that asked for one at a time is alone while it runs).
-- concurrency_blocker says it (the live run with the tightest limit, once the key is full), under the
-- key's advisory lock in the claim as before; runs_one_live_per_key_idx stays the last line of
-- defence for the runs of limit 1. A key starts at most one run per claim (its head's job is the one
-- key_head_jobs gives the claim), so a burst of a key with a limit of 20 fills it over a few claims.
--
-- Named limits on label selectors: unitvisor.set_limit('batch', '{"team": "batch"}', 20) lets at most
-- 20 runs whose labels hold team=batch be live at once in the fleet; drop_limit('batch') removes it;
-- limit_status() lists them with their live count (`unitvisor limits`, and the daemon's metrics). The
-- claim decides in claim_limits, for a run it is about to take: per limit the run falls under, in
-- name order, the limit's transaction-level advisory lock (tried, never waited for: another claim
-- holding it decides for the limit now, and this one passes the run over), then a count of the
-- limit's live runs from a snapshot taken after the lock (at most max_live index entries of the live
-- runs' labels, runs_live_labels_idx). A lock, not a counter row: nothing to keep in step with every
-- way a run stops being live (outcomes, takeovers, cancels), and nothing written per claim. A limit
-- found full is remembered for the rest of that claim, so its other runs cost no second count. The
-- claim's cost grows with the limits a claimed run falls under, never with hosts or open attempts.
-- A run held back says so in its wait reason (explain_waiting: "limit batch: 20 of 20 live"), and
-- an expired one in its last event (waited_for).
--
-- Also: the runs behind a held key head said "waits for run X (queued)"; they now say "(queued, held
-- by ROLE)" (key_blocker_text, which explain_waiting and waited_for call).
--
-- Expand only, for 0.8.0 daemons and CLIs: one new column with a default (0.8.0 reads rows by
-- explicit column lists; its runs get 1, as before), a new table and functions, and submit_run one
-- more argument, last and defaulted (DROP and CREATE: the signature changes; grants again).
-- run_argument_problem takes the new argument too (DROP and CREATE), and the trigger checks the
-- column. concurrency_blocker, waited_for, explain_waiting and claim_jobs keep their signatures
-- (replaced in place).

-- -- columns and indexes ------------------------------------------------------------------------------

ALTER TABLE unitvisor.runs
    -- How many runs of its concurrency_key may be live at once, this one among them (032).
    ADD COLUMN concurrency_limit integer NOT NULL DEFAULT 1;

DROP INDEX unitvisor.runs_one_live_per_key_idx;
-- The live runs of a key with their limits (concurrency_blocker): since 032 a key may have several.
CREATE INDEX runs_live_key_idx ON unitvisor.runs (concurrency_key, concurrency_limit)
    WHERE state IN ('starting', 'running') AND concurrency_key IS NOT NULL;
-- The last line of defence of "one live run per key" for the runs that ask for it (concurrency_limit
-- 1, the default): whatever the claim's lock and checks miss, such a run never shares its key while
-- it is live. (A key's runs with larger limits are held to them by the claim alone, under the key's lock.)
CREATE UNIQUE INDEX runs_one_live_per_key_idx ON unitvisor.runs (concurrency_key)
    WHERE state IN ('starting', 'running') AND concurrency_key IS NOT NULL AND concurrency_limit = 1;
-- A named limit's count of its live runs (claim_limits, limit_status): containment among live runs
-- only, so that a count reads the live runs that match, never the history.
CREATE INDEX runs_live_labels_idx ON unitvisor.runs USING gin (labels jsonb_path_ops)
    WHERE state IN ('starting', 'running');

-- -- named limits -------------------------------------------------------------------------------------

-- Named fleet-wide limits (032): at most max_live runs whose labels hold every pair of selector are live
-- (starting or running) at once, across all hosts. Written only by set_limit and drop_limit, which
-- check every argument (limit_argument_problem); a claim counts each limit's live runs under the
-- limit's lock (claim_limits), so there is no counter here to drift.
CREATE TABLE unitvisor.limits (
    name     text PRIMARY KEY,
    selector jsonb NOT NULL,
    max_live integer NOT NULL,
    set_at   timestamptz NOT NULL DEFAULT now(),
    set_by   text NOT NULL DEFAULT session_user
);

-- -- argument checks: concurrency_limit -------------------------------------------------------------

DROP FUNCTION unitvisor.run_argument_problem(text[], jsonb, text, text, bigint, bigint, integer, integer, integer,
    bigint, integer, integer, integer, text[], jsonb, text, text, timestamptz, timestamptz, text, integer, integer, text,
    text[], boolean, integer);
CREATE FUNCTION unitvisor.run_argument_problem(
    argv text[], environment jsonb, working_directory text, run_user text, memory_max bigint,
    memory_high bigint, cpu_quota_percent integer, tasks_max integer, io_weight integer,
    runtime_max_sec bigint, max_attempts integer, retry_backoff_sec integer, retry_backoff_max_sec integer,
    retry_on text[], labels jsonb, idempotency_key text, concurrency_key text, not_before timestamptz,
    start_deadline timestamptz, stop_signal text, stop_timeout integer, warn_before integer,
    warn_signal text, fail_on text[], count_lost boolean, max_lost_attempts integer,
    -- 032; defaulted (NULL passes), so that a submit_run of another migration that passes the 26
    -- arguments before it still finds this function (the column's trigger checks the row all the same).
    concurrency_limit integer DEFAULT NULL,
    OUT constraint_name text, OUT message text, OUT hint text)
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    -- Memory: below 1 MiB nothing starts at all; the upper end is what the kernel and systemd accept.
    memory_min CONSTANT bigint := 1048576;
    memory_top CONSTANT bigint := 4611686018427387904;
    backoff_top CONSTANT integer := 604800;
    problem text;
    bound record;
BEGIN
    -- argv[0] must be absolute: a bare name would be looked up in systemd's PATH, and the host
    -- allowlist could not say which binary it allowed. One dimension, indexed from 1: an array like
    -- '[2:3]={sh,-c}' has no argv[1] to check.
    IF cardinality(argv) < 1 OR array_ndims(argv) <> 1 OR array_lower(argv, 1) <> 1 THEN
        constraint_name := 'runs_argv_valid';
        message := 'argv: must be a one-dimensional array of at least one element, indexed from 1';
    ELSIF array_position(argv, NULL) IS NOT NULL THEN
        constraint_name := 'runs_argv_valid';
        message := format('argv: element %s is NULL (every element must be text)', array_position(argv, NULL));
    ELSIF argv[1] NOT LIKE '/%' THEN
        constraint_name := 'runs_argv_valid';
        message := 'argv: the first element must be an absolute path (starting with /)';
        hint := 'a bare program name would be looked up in systemd''s PATH; give its full path';
    END IF;
    IF message IS NOT NULL THEN
        RETURN;
    END IF;

    problem := unitvisor.environment_problem(environment);
    IF problem IS NOT NULL THEN
        constraint_name := 'runs_environment_valid';
        message := problem;
    ELSIF working_directory NOT LIKE '/%' OR strpos(working_directory, E'\n') > 0 THEN
        constraint_name := 'runs_working_directory_valid';
        message := 'working_directory: must be an absolute path (starting with /) without a newline';
    ELSIF run_user !~ '^[a-z_][a-z0-9_-]{0,31}$' THEN
        constraint_name := 'runs_run_user_valid';
        message := 'run_user: is not a user name (lower-case letters, digits, _ and -, not starting with a digit or -, 1 to 32 characters)';
    END IF;
    IF message IS NOT NULL THEN
        RETURN;
    END IF;

    -- The numbers, echoed with their bounds: the upper ends are what the kernel and systemd accept. A
    -- value outside a bound is a typo, and refusing it at insert time is kinder than a unit that fails
    -- to start.
    SELECT b.argument, b.value, b.low, b.high, b.unit, b.constraint_name INTO bound
    FROM (VALUES (1, 'memory_max', memory_max, memory_min, memory_top, ' bytes', 'runs_memory_max_valid'),
                 (2, 'memory_high', memory_high, memory_min, memory_top, ' bytes', 'runs_memory_high_valid'),
                 (3, 'cpu_quota_percent', cpu_quota_percent::bigint, 1, 100000, ' percent of one CPU', 'runs_cpu_quota_valid'),
                 (4, 'tasks_max', tasks_max, 1, 4194304, ' tasks', 'runs_tasks_max_valid'),
                 (5, 'io_weight', io_weight, 1, 10000, '', 'runs_io_weight_valid'),
                 (6, 'runtime_max_sec', runtime_max_sec, 1, 315360000, ' seconds', 'runs_runtime_max_valid'),
                 (7, 'max_attempts', max_attempts, 1, 1000, '', 'runs_max_attempts_valid'),
                 (8, 'retry_backoff_sec', retry_backoff_sec, 0, 86400, ' seconds', 'runs_backoff_valid'))
         AS b(place, argument, value, low, high, unit, constraint_name)
    WHERE b.value NOT BETWEEN b.low AND b.high
    ORDER BY b.place LIMIT 1;
    IF FOUND THEN
        constraint_name := bound.constraint_name;
        message := format('%s: %s is out of range (%s to %s%s)', bound.argument, bound.value, bound.low, bound.high,
                          bound.unit);
    -- memory_high: never above memory_max (systemd would take a MemoryHigh= above MemoryMax= and never
    -- reach it: the run would be killed before it is throttled, which is not what its submitter asked for).
    ELSIF memory_high > memory_max THEN
        constraint_name := 'runs_memory_high_valid';
        message := format('memory_high: %s is above memory_max (%s): a run is throttled at memory_high before it is killed at memory_max',
                          memory_high, memory_max);
    ELSIF retry_backoff_max_sec NOT BETWEEN retry_backoff_sec AND backoff_top THEN
        constraint_name := 'runs_backoff_valid';
        message := format('retry_backoff_max_sec: %s is out of range (retry_backoff_sec, here %s, to %s seconds)',
                          retry_backoff_max_sec, retry_backoff_sec, backoff_top);
    -- Outcomes, and since 027 exit statuses and signals (failure_rules_problem, with fail_on's).
    ELSIF unitvisor.failure_rules_problem('retry_on', retry_on) IS NOT NULL THEN
        constraint_name := 'runs_retry_on_valid';
        message := unitvisor.failure_rules_problem('retry_on', retry_on);

    ELSIF NOT unitvisor.labels_are_valid(labels) THEN
        constraint_name := 'runs_labels_valid';
        message := 'labels: must be a JSON object of at most 64 key -> string pairs; a key is 1 to 63 letters, digits, ".", "_", "-" and "/", starting and ending with a letter or digit; a value is at most 255 characters, without control characters';
    -- The caller's own strings: bounded, one line.
    ELSIF length(idempotency_key) NOT BETWEEN 1 AND 255 OR idempotency_key ~ '[[:cntrl:]]' THEN
        constraint_name := 'runs_idempotency_key_valid';
        message := 'idempotency_key: must be 1 to 255 characters without control characters (or NULL: none)';
    ELSIF length(concurrency_key) NOT BETWEEN 1 AND 255 OR concurrency_key ~ '[[:cntrl:]]' THEN
        constraint_name := 'runs_concurrency_key_valid';
        message := 'concurrency_key: must be 1 to 255 characters without control characters (or NULL: none)';
    -- 'infinity' is no time: a not_before of infinity would never start, a deadline of infinity is none.
    ELSIF NOT isfinite(not_before) THEN
        constraint_name := 'runs_not_before_valid';
        message := 'not_before: must be a finite time (or NULL: as soon as possible)';
    ELSIF NOT isfinite(start_deadline) THEN
        constraint_name := 'runs_start_deadline_valid';
        message := 'start_deadline: must be a finite time (or NULL: none)';
    ELSIF start_deadline <= not_before THEN
        constraint_name := 'runs_start_deadline_valid';
        message := 'start_deadline: must be later than not_before (a run cannot have to start before it may)';
    END IF;
    IF message IS NOT NULL THEN
        RETURN;
    END IF;

    -- Graceful stop (schema 026): how the run is stopped (a cancel, runtime_max_sec) and warned before
    -- runtime_max_sec ends it. A signal is a name from a fixed list (stop_signal_names), never a
    -- number or anything else: it becomes the unit's KillSignal= and a KillUnit call.
    IF unitvisor.signal_short_name(stop_signal) <> ALL (unitvisor.stop_signal_names()) THEN
        constraint_name := 'runs_stop_signal_valid';
        message := 'stop_signal: must be one of ' || array_to_string(unitvisor.stop_signal_names(), ', ')
                   || ' (with or without SIG, any case)';
    -- An hour at most: a stop that takes longer is a run that will not stop.
    ELSIF stop_timeout NOT BETWEEN 1 AND 3600 THEN
        constraint_name := 'runs_stop_timeout_valid';
        message := format('stop_timeout: %s is out of range (1 to 3600 seconds)', stop_timeout);
    -- Its upper bound is runtime_max_sec's (below).
    ELSIF warn_before < 1 THEN
        constraint_name := 'runs_warn_before_valid';
        message := format('warn_before: %s is out of range (at least 1 second, and less than runtime_max_sec)', warn_before);
    ELSIF warn_before IS NOT NULL AND runtime_max_sec IS NULL THEN
        constraint_name := 'runs_warn_before_valid';
        message := 'warn_before: needs runtime_max_sec (the warning is sent that long before runtime_max_sec ends the run)';
    ELSIF warn_before >= runtime_max_sec THEN
        constraint_name := 'runs_warn_before_valid';
        message := format('warn_before: %s is not less than runtime_max_sec (%s): the warning would come before the run starts',
                          warn_before, runtime_max_sec);
    -- KILL is no warning: it would end the run warn_before early.
    ELSIF unitvisor.signal_short_name(warn_signal) <> ALL (unitvisor.stop_signal_names())
          OR unitvisor.signal_short_name(warn_signal) = 'KILL' THEN
        constraint_name := 'runs_warn_signal_valid';
        message := 'warn_signal: must be one of ' || array_to_string(array_remove(unitvisor.stop_signal_names(), 'KILL'), ', ')
                   || ' (with or without SIG, any case)';
    ELSIF warn_signal IS NOT NULL AND warn_before IS NULL THEN
        constraint_name := 'runs_warn_signal_valid';
        message := 'warn_signal: needs warn_before (when to send it)';
    END IF;
    IF message IS NOT NULL THEN
        RETURN;
    END IF;
    -- Failure rules (027): fail_on names exit statuses and signals only (an outcome kind that must not
    -- be retried is one retry_on leaves out), and no code may be in both lists: which of the two wins
    -- would be a rule to remember, and either answer surprises whoever wrote the other list.
    -- count_lost needs no check (the column's NOT NULL refuses a NULL).
    IF cardinality(fail_on) > 64 THEN
        constraint_name := 'runs_fail_on_valid';
        message := format('fail_on: %s elements, over the limit of 64', cardinality(fail_on));
    ELSIF unitvisor.failure_rules_problem('fail_on', fail_on) IS NOT NULL THEN
        constraint_name := 'runs_fail_on_valid';
        message := unitvisor.failure_rules_problem('fail_on', fail_on);
    ELSIF fail_on && retry_on THEN
        constraint_name := 'runs_fail_on_valid';
        message := format('fail_on: %s is in retry_on too (a code either ends the run at once or retries it)',
                          (SELECT f FROM unnest(fail_on) f WHERE f = ANY (retry_on) LIMIT 1));
    ELSIF max_lost_attempts NOT BETWEEN 1 AND 1000 THEN
        constraint_name := 'runs_max_lost_attempts_valid';
        message := format('max_lost_attempts: %s is out of range (1 to 1000)', max_lost_attempts);
    END IF;
    IF message IS NOT NULL THEN
        RETURN;
    END IF;
    -- Concurrency limits (032): how many runs of its concurrency_key may be live at once, this one among
    -- them. More than one needs a key: without one, there is nothing to count the others by.
    IF concurrency_limit NOT BETWEEN 1 AND 10000 THEN
        constraint_name := 'runs_concurrency_limit_valid';
        message := format('concurrency_limit: %s is out of range (1 to 10000)', concurrency_limit);
    ELSIF concurrency_limit > 1 AND concurrency_key IS NULL THEN
        constraint_name := 'runs_concurrency_limit_valid';
        message := 'concurrency_limit: needs concurrency_key (the limit counts the live runs of one key)';
    END IF;
END $$;

CREATE OR REPLACE FUNCTION unitvisor.refuse_invalid_arguments() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    problem record;
BEGIN
    problem := unitvisor.run_argument_problem(NEW.argv, NEW.environment, NEW.working_directory, NEW.run_user,
        NEW.memory_max, NEW.memory_high, NEW.cpu_quota_percent, NEW.tasks_max, NEW.io_weight, NEW.runtime_max_sec,
        NEW.max_attempts, NEW.retry_backoff_sec, NEW.retry_backoff_max_sec, NEW.retry_on, NEW.labels,
        NEW.idempotency_key, NEW.concurrency_key, NEW.not_before, NEW.start_deadline, NEW.stop_signal,
        NEW.stop_timeout, NEW.warn_before, NEW.warn_signal, NEW.fail_on, NEW.count_lost, NEW.max_lost_attempts,
        NEW.concurrency_limit);
    IF problem.hint IS NOT NULL THEN
        RAISE EXCEPTION '%', problem.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs',
                  CONSTRAINT = problem.constraint_name, HINT = problem.hint;
    ELSIF problem.message IS NOT NULL THEN
        RAISE EXCEPTION '%', problem.message
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'runs', CONSTRAINT = problem.constraint_name;
    END IF;
    RETURN NEW;
END $$;

DROP TRIGGER runs_arguments_valid ON unitvisor.runs;
CREATE TRIGGER runs_arguments_valid
    BEFORE INSERT OR UPDATE OF argv, environment, working_directory, run_user, memory_max, memory_high,
        cpu_quota_percent, tasks_max, io_weight, runtime_max_sec, max_attempts, retry_backoff_sec,
        retry_backoff_max_sec, retry_on, labels, idempotency_key, concurrency_key, not_before, start_deadline,
        stop_signal, stop_timeout, warn_before, warn_signal, fail_on, count_lost, max_lost_attempts,
        concurrency_limit
    ON unitvisor.runs
    FOR EACH ROW EXECUTE FUNCTION unitvisor.refuse_invalid_arguments();

-- -- the key's limit ---------------------------------------------------------------------------------

-- concurrency_blocker as in 013, a key's live runs counted against the smallest limit among r's own and
-- theirs (the header): the live run with that limit once the key is full, else the queued run of its
-- key submitted just before it, as before. With every limit 1, what it was.
CREATE OR REPLACE FUNCTION unitvisor.concurrency_blocker(r unitvisor.runs) RETURNS uuid
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN r.concurrency_key IS NOT NULL THEN coalesce(
        (SELECT l.id FROM (
             SELECT k.id, k.seq, k.concurrency_limit, count(*) OVER () AS live, min(k.concurrency_limit) OVER () AS tightest
             FROM unitvisor.runs k
             WHERE k.concurrency_key = r.concurrency_key AND k.state IN ('starting', 'running') AND k.id <> r.id) l
         WHERE l.live >= least(r.concurrency_limit, l.tightest)
         ORDER BY l.concurrency_limit, l.seq NULLS FIRST, l.id LIMIT 1),
        (SELECT k.id FROM unitvisor.runs k
         WHERE k.concurrency_key = r.concurrency_key AND k.state = 'queued' AND k.seq < r.seq
         ORDER BY k.seq DESC LIMIT 1),
        (SELECT k.id FROM unitvisor.runs k
         WHERE k.concurrency_key = r.concurrency_key AND k.state = 'queued' AND k.seq IS NULL AND k.id <> r.id
           AND (r.seq IS NOT NULL OR (k.created_at, k.id) < (r.created_at, r.id))
         ORDER BY k.created_at DESC, k.id DESC LIMIT 1)) END
$$;

-- concurrency_blocker's run in words, for a wait reason (NULL: r waits for no run of its key): its
-- state, a held run's hold (a run behind a held head waits for its release), and with a limit above
-- one how many of the key's runs are live.
CREATE FUNCTION unitvisor.key_blocker_text(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT format('run %s (%s) with the same concurrency key', b.id,
                  CASE WHEN b.state = 'queued' AND b.held_at IS NOT NULL THEN 'queued, held by ' || b.held_by
                       ELSE b.state END)
           || CASE WHEN b.state IN ('starting', 'running') AND least(r.concurrency_limit, b.concurrency_limit) > 1
                   THEN format(', %s of %s live',
                               (SELECT count(*) FROM unitvisor.runs k
                                WHERE k.concurrency_key = r.concurrency_key AND k.state IN ('starting', 'running')),
                               least(r.concurrency_limit, b.concurrency_limit))
                   ELSE '' END
    FROM unitvisor.runs b WHERE r.concurrency_key IS NOT NULL AND b.id = unitvisor.concurrency_blocker(r)
$$;

-- Every check of a named limit's arguments (set_limit): the first refused, in a message that names it;
-- NULL when all pass.
CREATE FUNCTION unitvisor.limit_argument_problem(name text, selector jsonb, max_live integer) RETURNS text
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE
        WHEN name IS NULL OR name !~ '^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$' THEN
            'name: must be 1 to 63 letters, digits, ".", "_" and "-", starting and ending with a letter or digit'
        WHEN selector IS NULL OR NOT unitvisor.labels_are_valid(selector) THEN
            'selector: must be a JSON object of labels as a run''s (at most 64 key -> string pairs); '
            || 'a run falls under the limit when its labels hold every pair ({}: every run)'
        WHEN max_live IS NULL OR max_live NOT BETWEEN 0 AND 1000000 THEN
            format('max_live: %s is out of range (0 to 1000000; 0 lets no run of the limit start)',
                   coalesce(max_live::text, 'NULL'))
        END
$$;

-- Create or change a named limit: at most max_live runs whose labels hold every pair of selector are
-- live at once in the fleet. A limit lowered below its live count stops nothing: its runs finish, and
-- no new one starts until fewer than max_live are live. created: false when the limit existed (changed).
CREATE FUNCTION unitvisor.set_limit(name text, selector jsonb, max_live integer) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    problem text := unitvisor.limit_argument_problem(set_limit.name, set_limit.selector, set_limit.max_live);
    created boolean;
BEGIN
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION '%', problem
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'limits',
                  CONSTRAINT = 'limits_' || split_part(problem, ':', 1) || '_valid';
    END IF;
    INSERT INTO unitvisor.limits AS l (name, selector, max_live)
    VALUES (set_limit.name, set_limit.selector, set_limit.max_live)
    ON CONFLICT ON CONSTRAINT limits_pkey DO UPDATE
        SET selector = excluded.selector, max_live = excluded.max_live, set_at = now(), set_by = session_user
    RETURNING (l.xmax::text = '0') INTO created;
    RETURN created;
END $$;

-- Drop a named limit: its runs are held back by it no more. False: there was no such limit.
CREATE FUNCTION unitvisor.drop_limit(name text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    DELETE FROM unitvisor.limits l WHERE l.name = drop_limit.name;
    RETURN FOUND;
END $$;

-- Every named limit with its live runs now, by name: the CLI's `unitvisor limits` and the daemon's
-- metrics. Counted over every run (a host's role sees only some: SECURITY DEFINER), and only the count.
CREATE FUNCTION unitvisor.limit_status()
RETURNS TABLE (name text, selector jsonb, max_live integer, live bigint, set_at timestamptz, set_by text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT l.name, l.selector, l.max_live,
           (SELECT count(*) FROM unitvisor.runs x WHERE x.state IN ('starting', 'running') AND x.labels @> l.selector),
           l.set_at, l.set_by
    FROM unitvisor.limits l ORDER BY l.name
$$;

-- The first named limit (by name) that holds r back now, in words ("limit batch: 20 of 20 live"), or
-- NULL: for wait reasons (explain_waiting) and an expired run's (waited_for).
CREATE FUNCTION unitvisor.limit_text(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT format('limit %s: %s of %s live', s.name, s.live, s.max_live)
    FROM (SELECT l.name, l.max_live,
                 (SELECT count(*) FROM unitvisor.runs x
                  WHERE x.state IN ('starting', 'running') AND x.labels @> l.selector AND x.id <> r.id) AS live
          FROM unitvisor.limits l WHERE r.labels @> l.selector) s
    WHERE s.live >= s.max_live ORDER BY s.name LIMIT 1
$$;

-- The claim's decision on the named limits r falls under: NULL when each has room for it, else the name
-- of the first (by name) that has none, or whose lock another claim holds (that claim decides for the
-- limit now: this one passes r over). Each limit's transaction-level advisory lock, then its count from
-- a snapshot taken after it (READ COMMITTED, a VOLATILE function: each statement sees every claim of
-- the limit that committed, and none is in progress), as the claim does for a concurrency key (006).
-- The locks are tried in name order and never waited for, so two claims cannot deadlock on them. Cost:
-- a look at the limits table, and per limit of the run at most max_live index entries of live runs,
-- for a run about to be claimed only; nothing when no limit matches.
CREATE FUNCTION unitvisor.claim_limits(r unitvisor.runs) RETURNS text
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    lim record;
BEGIN
    FOR lim IN SELECT l.name, l.selector, l.max_live FROM unitvisor.limits l
               WHERE r.labels @> l.selector ORDER BY l.name LOOP
        IF NOT pg_try_advisory_xact_lock(hashtextextended('unitvisor-limit:' || lim.name, 0)) THEN
            RETURN lim.name;
        END IF;
        IF (SELECT count(*) FROM (SELECT 1 FROM unitvisor.runs x
                                  WHERE x.state IN ('starting', 'running') AND x.labels @> lim.selector
                                  LIMIT lim.max_live) c) >= lim.max_live THEN
            RETURN lim.name;
        END IF;
    END LOOP;
    RETURN NULL;
END $$;

-- -- wait reasons --------------------------------------------------------------------------------------

-- waited_for as in 030, the key's blocker in key_blocker_text's words (a held head says so), then a
-- named limit's.
CREATE OR REPLACE FUNCTION unitvisor.waited_for(r unitvisor.runs) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(
        'its release: ' || unitvisor.held_text(r),
        unitvisor.key_blocker_text(r),
        unitvisor.limit_text(r),
        unitvisor.fleet_refusal(r),
        (SELECT format('%s attempt(s), none of which started; the last: %s', count(*),
                       (SELECT coalesce(l.outcome, 'open') || coalesce(' (' || l.reason || ')', '')
                        FROM unitvisor.attempts l WHERE l.run_id = r.id ORDER BY l.attempt DESC LIMIT 1))
         FROM unitvisor.attempts a WHERE a.run_id = r.id HAVING count(*) > 0),
        'a host to claim it')
$$;

-- explain_waiting as in 020, the key's blocker in key_blocker_text's words, and a named limit's.
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
               jsonb_build_array(r.argv[1], r.run_user, r.environment, r.memory_max, r.host_pin) AS kind,
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

-- -- the claim ---------------------------------------------------------------------------------------

-- claim_jobs as in 020, and the named limits: a run about to be claimed is passed over when a limit it
-- falls under is full (claim_limits, after the key's check), and the limit is remembered as full for
-- the rest of the claim. Nothing else changes.
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
               r.host_pin, jsonb_build_array(r.argv[1], r.run_user, r.environment, r.memory_max)::text AS kind,
               r AS run
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
            EXIT WHEN job.scheduled_at < now() - claim_jobs.starve_after;  -- it reserves the host
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
        VALUES (job.run_id, next_attempt, claim_jobs.host_id, 'starting', 'claimed by host ' || claim_jobs.host_id);
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

-- -- submit_run: concurrency_limit --------------------------------------------------------------------
--
-- As in 030, with concurrency_limit last and defaulted. DROP and CREATE (the signature changes), then
-- the grants again, as 030 did.
DROP FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz,
    timestamptz, bigint, text, integer, integer, text, text[], boolean, integer, boolean);
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
    concurrency_limit     integer DEFAULT 1
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
            held_at, held_by, concurrency_limit)
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
            submit_run.concurrency_limit)
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
    timestamptz, bigint, text, integer, integer, text, text[], boolean, integer, boolean, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.submit_run(text[], jsonb, text, text, bigint, integer, integer, integer,
    bigint, integer, text, integer, integer, integer, text[], boolean, text, jsonb, text, timestamptz,
    timestamptz, bigint, text, integer, integer, text, text[], boolean, integer, boolean, integer) TO unitvisor_submitter;

-- -- grants -------------------------------------------------------------------------------------------

REVOKE ALL ON unitvisor.limits FROM PUBLIC;
-- A control plane reads and sets limits, as it does schedules (a limit is its policy on its runs);
-- the daemons read them through limit_status (their metrics).
GRANT SELECT ON unitvisor.limits TO unitvisor_submitter;
REVOKE EXECUTE ON FUNCTION
    unitvisor.run_argument_problem(text[], jsonb, text, text, bigint, bigint, integer, integer, integer,
        bigint, integer, integer, integer, text[], jsonb, text, text, timestamptz, timestamptz, text, integer,
        integer, text, text[], boolean, integer, integer),
    unitvisor.key_blocker_text(unitvisor.runs),
    unitvisor.limit_argument_problem(text, jsonb, integer),
    unitvisor.set_limit(text, jsonb, integer),
    unitvisor.drop_limit(text),
    unitvisor.limit_status(),
    unitvisor.limit_text(unitvisor.runs),
    unitvisor.claim_limits(unitvisor.runs)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.limit_status() TO unitvisor_submitter, unitvisor_host;
GRANT EXECUTE ON FUNCTION unitvisor.set_limit(text, jsonb, integer), unitvisor.drop_limit(text)
    TO unitvisor_submitter;
