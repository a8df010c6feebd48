-- unitvisor schema: schedules (issue 25, item 7): a run submitted by cron expression, once per due time
-- across the whole fleet.
--
-- * cron_parse / cron_next: a 5-field cron expression checked and evaluated in SQL, the one place the
--   next due time is computed (the daemons and the CLI only read what it says), with the rule for the
--   days clocks change written down once (cron_local_instant).
-- * submit_run_spec: a jsonb whose keys are submit_run's argument names, mapped onto a submit_run call;
--   an unknown key is refused by name. It reads submit_run's own signature, so that an argument added to
--   submit_run needs no line here (River's spec function, issue 26, is meant to call it too).
-- * schedules, create_schedule, drop_schedule, pause_schedule: what a control plane calls.
-- * submit_due_schedules: the fleet upkeep's step that submits each due run, with the schedule's row
--   locked (FOR UPDATE SKIP LOCKED) and its next due time moved on in the same transaction, and an
--   idempotency key made of (schedule, due time), so that one due time makes one run whoever calls it,
--   however many hosts do at once, and after a failover.
-- * heartbeat: its upkeep flag also says when a schedule is due (same arguments and result columns).
--
-- Expand only, for 0.8.0 daemons and CLIs: a table, a type and functions added, heartbeat replaced in
-- place. A 0.8.0 daemon submits no schedule (it never calls submit_due_schedules); its heartbeat's
-- upkeep flag may now be set for a due schedule, which makes it take the upkeep's turn and do 0.8.0's
-- upkeep, as for any other flag. Schedules are submitted once the first daemon of this release runs.

-- A cron expression's five fields, as sets: what cron_next walks.
CREATE TYPE unitvisor.cron_fields AS (
    minutes integer[],
    hours integer[],
    days integer[],
    months integer[],
    weekdays integer[],   -- 0 (Sunday) to 6; a 7 is stored as 0
    any_day boolean,      -- the day-of-month field starts with '*'
    any_weekday boolean   -- the day-of-week field starts with '*'
);

-- One field of a cron expression as the sorted set of values it names; raises 22023 with a message
-- that starts with `cron:` and names the field. An item is `*`, a value, or a range `a-b`, each
-- optionally with a step `/n` (`a/n` is `a-<max>/n`); items are separated by commas; values are numbers
-- or, where `names` is given, names (the first three letters, any case: JAN, mon).
CREATE FUNCTION unitvisor.cron_field(field text, what text, lo integer, hi integer, names text[] DEFAULT NULL,
                                     names_from integer DEFAULT 0)
RETURNS integer[] LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    item text;
    parts text[];
    bounds text[];
    first_value integer;
    last_value integer;
    step integer;
    found integer[] := '{}';
    allowed text := format('%s to %s', lo, hi) || CASE WHEN names IS NOT NULL
        THEN format(' or %s to %s', upper(names[1]), upper(names[array_length(names, 1)])) ELSE '' END;
BEGIN
    FOREACH item IN ARRAY string_to_array(lower(field), ',') LOOP
        parts := regexp_match(item, '^(\*|[a-z0-9]+(?:-[a-z0-9]+)?)(?:/([0-9]{1,4}))?$');
        IF parts IS NULL THEN
            RAISE EXCEPTION 'cron: the % field has "%", which is not *, a value or a range a-b, with an optional /step',
                what, left(item, 40) USING ERRCODE = 'invalid_parameter_value';
        END IF;
        step := coalesce(parts[2]::integer, 1);
        IF step < 1 OR step > hi - lo + 1 THEN
            RAISE EXCEPTION 'cron: the % field has the step /%, out of range (1 to %)', what, step, hi - lo + 1
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF parts[1] = '*' THEN
            first_value := lo;
            last_value := hi;
        ELSE
            bounds := string_to_array(parts[1], '-');
            FOR i IN 1 .. array_length(bounds, 1) LOOP
                IF bounds[i] ~ '^[0-9]{1,4}$' THEN
                    last_value := bounds[i]::integer;
                ELSE
                    last_value := array_position(names, bounds[i]) - 1 + names_from;
                    IF last_value IS NULL THEN
                        RAISE EXCEPTION 'cron: the % field has "%", which is neither a number nor a name (%)',
                            what, bounds[i], allowed USING ERRCODE = 'invalid_parameter_value';
                    END IF;
                END IF;
                IF last_value < lo OR last_value > hi THEN
                    RAISE EXCEPTION 'cron: the % field has %, out of range (%)', what, last_value, allowed
                        USING ERRCODE = 'invalid_parameter_value';
                END IF;
                IF i = 1 THEN
                    first_value := last_value;
                END IF;
            END LOOP;
            IF array_length(bounds, 1) = 1 THEN
                last_value := CASE WHEN parts[2] IS NULL THEN first_value ELSE hi END;
            ELSIF first_value > last_value THEN
                RAISE EXCEPTION 'cron: the % field has the range %-%, which goes backwards (a range does not wrap)',
                    what, first_value, last_value USING ERRCODE = 'invalid_parameter_value';
            END IF;
        END IF;
        found := found || ARRAY(SELECT generate_series(first_value, last_value, step));
    END LOOP;
    RETURN ARRAY(SELECT DISTINCT v FROM unnest(found) v ORDER BY v);
END $$;

-- A cron expression: five fields separated by blanks (minute 0-59, hour 0-23, day of month 1-31, month
-- 1-12 or JAN-DEC, day of week 0-7 or SUN-SAT, 0 and 7 both Sunday), or one of @yearly (@annually),
-- @monthly, @weekly, @daily (@midnight), @hourly. No seconds field, no L, W, # or ?. As in Vixie cron and
-- cronie, when both day fields are restricted (neither starts with '*') a day matches either of them;
-- otherwise it must match both. Raises 22023 with a message that starts with `cron:`.
CREATE FUNCTION unitvisor.cron_parse(cron text) RETURNS unitvisor.cron_fields
LANGUAGE plpgsql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    expanded text;
    f text[];
    parsed unitvisor.cron_fields;
BEGIN
    IF cron IS NULL THEN
        RAISE EXCEPTION 'cron: must not be NULL' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    expanded := CASE lower(btrim(cron))
        WHEN '@yearly' THEN '0 0 1 1 *' WHEN '@annually' THEN '0 0 1 1 *' WHEN '@monthly' THEN '0 0 1 * *'
        WHEN '@weekly' THEN '0 0 * * 0' WHEN '@daily' THEN '0 0 * * *' WHEN '@midnight' THEN '0 0 * * *'
        WHEN '@hourly' THEN '0 * * * *' ELSE btrim(cron) END;
    f := regexp_split_to_array(expanded, '[ \t]+');
    IF length(cron) > 200 OR expanded = '' OR array_length(f, 1) <> 5 THEN
        RAISE EXCEPTION 'cron: must have 5 fields (minute hour day-of-month month day-of-week), or be @hourly, '
                        '@daily, @weekly, @monthly or @yearly; it has %', CASE WHEN length(cron) > 200
            THEN 'over 200 characters' ELSE format('%s field(s)', coalesce(array_length(f, 1), 0) * (expanded <> '')::integer) END
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    parsed.minutes := unitvisor.cron_field(f[1], 'minute', 0, 59);
    parsed.hours := unitvisor.cron_field(f[2], 'hour', 0, 23);
    parsed.days := unitvisor.cron_field(f[3], 'day-of-month', 1, 31);
    parsed.months := unitvisor.cron_field(f[4], 'month', 1, 12,
        ARRAY['jan', 'feb', 'mar', 'apr', 'may', 'jun', 'jul', 'aug', 'sep', 'oct', 'nov', 'dec'], 1);
    parsed.weekdays := ARRAY(SELECT DISTINCT d % 7 FROM unnest(unitvisor.cron_field(f[5], 'day-of-week', 0, 7,
        ARRAY['sun', 'mon', 'tue', 'wed', 'thu', 'fri', 'sat'], 0)) d ORDER BY 1);
    parsed.any_day := f[3] LIKE '*%';
    parsed.any_weekday := f[5] LIKE '*%';
    RETURN parsed;
END $$;

-- The instant a schedule's local (wall-clock) time stands for, in `timezone`: the rule for the days
-- clocks change, written once.
-- * A local time that occurs twice (clocks go back: 02:30 on the last Sunday of October in Europe/Berlin)
--   is due once, at its first occurrence (the summer-time one). cronie and Vixie cron do the same for a
--   job at a fixed time ("jobs that fall into the repeated time will not be re-run"); unlike them, a
--   job of every N minutes is not run again through the repeated hour either.
-- * A local time that does not exist that day (clocks go forward: 02:30 on the last Sunday of March in
--   Europe/Berlin) is due at the end of the gap, the first instant after it (03:00 summer time), so that
--   a daily 02:30 job still runs that day, as cronie runs such jobs "soon after the change"; several
--   times in one gap make one instant, so one run (robfig/cron, which Kubernetes' CronJob uses, skips
--   them instead).
-- PostgreSQL's own `AT TIME ZONE` is not that rule: it takes the second occurrence of a repeated time,
-- and moves a missing one forward by the gap's length (02:30 to 03:30).
CREATE FUNCTION unitvisor.cron_local_instant(local_time timestamp, timezone text) RETURNS timestamptz
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    guess timestamptz := local_time AT TIME ZONE timezone;
    earliest timestamptz;
    later timestamp := local_time;
BEGIN
    -- The offsets in force a day either side: a local time is one of these instants, if any.
    SELECT min(c.instant) INTO earliest FROM (
        SELECT (local_time - ((t AT TIME ZONE timezone) - (t AT TIME ZONE 'UTC'))) AT TIME ZONE 'UTC' AS instant
        FROM unnest(ARRAY[guess - interval '1 day', guess, guess + interval '1 day']) t
    ) c WHERE (c.instant AT TIME ZONE timezone) = local_time;
    IF earliest IS NOT NULL THEN
        RETURN earliest;
    END IF;
    -- In a gap: the first whole minute after it (gaps are whole minutes since 1970 everywhere).
    FOR i IN 1 .. 1440 LOOP
        later := later + interval '1 minute';
        IF ((later AT TIME ZONE timezone) AT TIME ZONE timezone) = later THEN
            RETURN later AT TIME ZONE timezone;
        END IF;
    END LOOP;
    RETURN guess;
END $$;

-- The first due time of `fields` strictly after `after`, in `timezone` (cron_local_instant's rule on the
-- days clocks change); NULL when none comes within 10 years (`0 0 30 2 *`).
CREATE FUNCTION unitvisor.cron_next(fields unitvisor.cron_fields, timezone text, after timestamptz)
RETURNS timestamptz LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    l timestamp := date_trunc('minute', after AT TIME ZONE timezone) + interval '1 minute';
    give_up timestamp := l + interval '10 years';
    next_value integer;
    instant timestamptz;
BEGIN
    IF fields IS NULL OR after IS NULL OR timezone IS NULL THEN
        RETURN NULL;
    END IF;
    -- Each step moves l to the next local time that could match; bounded by give_up (at most 120
    -- months, 3,653 days, 24 hours a day and one minute step per matching hour).
    WHILE l < give_up LOOP
        IF NOT extract(month FROM l)::integer = ANY (fields.months) THEN
            l := date_trunc('month', l) + interval '1 month';
            CONTINUE;
        END IF;
        IF NOT (CASE WHEN fields.any_day OR fields.any_weekday
                     THEN extract(day FROM l)::integer = ANY (fields.days)
                          AND extract(dow FROM l)::integer = ANY (fields.weekdays)
                     ELSE extract(day FROM l)::integer = ANY (fields.days)
                          OR extract(dow FROM l)::integer = ANY (fields.weekdays) END) THEN
            l := date_trunc('day', l) + interval '1 day';
            CONTINUE;
        END IF;
        IF NOT extract(hour FROM l)::integer = ANY (fields.hours) THEN
            SELECT min(h) INTO next_value FROM unnest(fields.hours) h WHERE h > extract(hour FROM l);
            l := date_trunc('day', l) + CASE WHEN next_value IS NULL THEN interval '1 day'
                                             ELSE make_interval(hours => next_value) END;
            CONTINUE;
        END IF;
        SELECT min(m) INTO next_value FROM unnest(fields.minutes) m WHERE m >= extract(minute FROM l);
        IF next_value IS NULL THEN
            l := date_trunc('hour', l) + interval '1 hour';
            CONTINUE;
        END IF;
        l := date_trunc('hour', l) + make_interval(mins => next_value);
        instant := unitvisor.cron_local_instant(l, timezone);
        -- A repeated local time already passed at its first occurrence, or a gap's end already due.
        IF instant > after THEN
            RETURN instant;
        END IF;
        l := l + interval '1 minute';
    END LOOP;
    RETURN NULL;
END $$;

-- The same, from the expression's text: what a control plane or a person asks
-- (`SELECT unitvisor.cron_next('30 2 * * *', 'Europe/Berlin', now())`).
-- Its owner's rights: the helpers it calls are nobody's API.
CREATE FUNCTION unitvisor.cron_next(cron text, timezone text, after timestamptz) RETURNS timestamptz
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT unitvisor.cron_next(unitvisor.cron_parse(cron), timezone, after)
$$;

-- submit_run called with a jsonb's keys as its named arguments ('{"argv": ["/bin/true"], "max_attempts":
-- 3}'), returning the run's id. A key that is not one of submit_run's argument names is refused by name,
-- and so is a value that is not of its argument's type; submit_run then checks each argument as it does
-- any call's. The names and types are read from submit_run's signature in pg_proc, so an argument added
-- to submit_run (at the end, defaulted, as every one is) is accepted here with no change: a key left out
-- gets submit_run's default, a JSON null is SQL NULL, a JSON array is a SQL array, a JSON object is
-- passed as jsonb where the argument is jsonb, and any other value is its text cast to the argument's type.
-- Invoker's rights: the caller needs EXECUTE on submit_run (the submitter has it).
CREATE FUNCTION unitvisor.submit_run_spec(spec jsonb) RETURNS uuid
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    target record;
    key text;
    value jsonb;
    pos integer;
    arg_type oid;
    expr text;
    args text[] := '{}';
    new_id uuid;
BEGIN
    IF spec IS NULL OR jsonb_typeof(spec) <> 'object' THEN
        RAISE EXCEPTION 'spec: must be a JSON object of submit_run''s argument names' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The one submit_run (each migration that changes it drops the one before).
    SELECT p.proargnames AS names, p.proargtypes::oid[] AS types, p.pronargs - p.pronargdefaults AS required
    INTO STRICT target FROM pg_proc p
    WHERE p.pronamespace = 'unitvisor'::regnamespace AND p.proname = 'submit_run';
    FOR i IN 1 .. target.required LOOP
        IF NOT spec ? target.names[i] THEN
            RAISE EXCEPTION '%: required (the spec has no key "%")', target.names[i], target.names[i]
                USING ERRCODE = 'not_null_violation';
        END IF;
    END LOOP;
    FOR key, value IN SELECT e.key, e.value FROM jsonb_each(spec) e ORDER BY e.key LOOP
        pos := array_position(target.names, key);
        IF pos IS NULL THEN
            RAISE EXCEPTION 'spec: unknown key %, not one of submit_run''s arguments (docs/sql-api.md)',
                quote_literal(left(key, 64)) USING ERRCODE = 'invalid_parameter_value';
        END IF;
        arg_type := (SELECT t FROM unnest(target.types) WITH ORDINALITY u(t, n) WHERE u.n = pos);
        IF jsonb_typeof(value) = 'null' THEN
            expr := 'NULL';
        ELSIF arg_type = 'jsonb'::regtype THEN
            expr := quote_literal(value::text);
        ELSIF (SELECT t.typcategory = 'A' FROM pg_type t WHERE t.oid = arg_type) THEN
            IF jsonb_typeof(value) <> 'array'
               OR EXISTS (SELECT 1 FROM jsonb_array_elements(value) x WHERE jsonb_typeof(x) IN ('array', 'object')) THEN
                RAISE EXCEPTION '%: must be a JSON array of strings or numbers', key USING ERRCODE = 'invalid_parameter_value';
            END IF;
            expr := quote_literal(ARRAY(SELECT jsonb_array_elements_text(value))::text);
        ELSIF jsonb_typeof(value) IN ('array', 'object') THEN
            RAISE EXCEPTION '%: must be a JSON string, number or boolean, not an %', key, jsonb_typeof(value)
                USING ERRCODE = 'invalid_parameter_value';
        ELSE
            expr := quote_literal(value #>> '{}');
        END IF;
        expr := format('%s::%s', expr, format_type(arg_type, NULL));
        -- The value's cast on its own, so that a refusal names the key (and never echoes the value).
        BEGIN
            EXECUTE 'SELECT ' || expr;
        EXCEPTION WHEN data_exception THEN
            RAISE EXCEPTION '%: not a valid % (as a JSON %)', key, format_type(arg_type, NULL), jsonb_typeof(value)
                USING ERRCODE = 'invalid_parameter_value';
        END;
        args := args || format('%I => %s', key, expr);
    END LOOP;
    EXECUTE format('SELECT unitvisor.submit_run(%s)', array_to_string(args, ', ')) INTO new_id;
    RETURN new_id;
END $$;

-- A schedule: `run` (submit_run_spec's keys) submitted at each due time of `cron` in `timezone`.
-- next_due is cron_next's answer, moved on by each submit_due_schedules pass that reaches it; last_*
-- say what the last pass that reached a due time did; submitted, skipped and missed count due times.
CREATE TABLE unitvisor.schedules (
    name text PRIMARY KEY CONSTRAINT schedules_name_valid CHECK (name ~ '^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$'),
    cron text NOT NULL,
    timezone text NOT NULL,
    run jsonb NOT NULL,
    overlap text NOT NULL DEFAULT 'skip' CONSTRAINT schedules_overlap_valid CHECK (overlap IN ('skip', 'queue', 'allow')),
    catch_up text NOT NULL DEFAULT 'none' CONSTRAINT schedules_catch_up_valid CHECK (catch_up IN ('none', 'one')),
    paused boolean NOT NULL DEFAULT false,
    next_due timestamptz,
    last_due timestamptz,
    last_run_id uuid,
    last_result text,
    last_at timestamptz,
    submitted bigint NOT NULL DEFAULT 0,
    skipped bigint NOT NULL DEFAULT 0,
    missed bigint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    created_by text NOT NULL DEFAULT session_user
);
-- What the heartbeat's upkeep flag and submit_due_schedules look for: due, not paused.
CREATE INDEX schedules_due ON unitvisor.schedules (next_due) WHERE NOT paused;

-- The labels and idempotency key a schedule's run is submitted with: the key is (schedule, due time), so
-- that a second submit for the same due time, by whatever path, returns the first's run.
CREATE FUNCTION unitvisor.schedule_run_spec(s unitvisor.schedules, due timestamptz) RETURNS jsonb
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT s.run
        || jsonb_build_object('labels', coalesce(s.run -> 'labels', '{}'::jsonb)
                                        || jsonb_build_object('unitvisor/schedule', s.name,
                                                              'unitvisor/due', to_char(due AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')),
                              'idempotency_key', format('unitvisor/schedule/%s/%s', s.name,
                                                        to_char(due AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')))
        -- queue: behind the schedule's previous run, through a concurrency key (the run's own, if it has one).
        || CASE WHEN s.overlap = 'queue' AND NOT s.run ? 'concurrency_key'
                THEN jsonb_build_object('concurrency_key', 'unitvisor/schedule/' || s.name) ELSE '{}'::jsonb END
$$;

-- Create a schedule; returns its first due time. Each argument is checked, in order, with an error
-- (SQLSTATE 22023, or submit_run's own for the run) whose message starts with the argument's name.
CREATE FUNCTION unitvisor.create_schedule(name text, cron text, timezone text, run jsonb,
                                          overlap text DEFAULT 'skip', catch_up text DEFAULT 'none')
RETURNS timestamptz
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    fields unitvisor.cron_fields;
    first_due timestamptz;
    trial unitvisor.schedules;
    refused_message text;
    refused_state text;
    refused_constraint text;
BEGIN
    IF create_schedule.name IS NULL OR create_schedule.name !~ '^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$' THEN
        RAISE EXCEPTION 'name: must be 1 to 63 of A-Z a-z 0-9 . _ -, starting and ending with a letter or digit'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    fields := unitvisor.cron_parse(create_schedule.cron);
    IF create_schedule.timezone IS NULL
       OR NOT EXISTS (SELECT 1 FROM pg_timezone_names z WHERE z.name = create_schedule.timezone) THEN
        RAISE EXCEPTION 'timezone: % is not a time zone name of pg_timezone_names (such as UTC or Europe/Berlin)',
            coalesce(quote_literal(left(create_schedule.timezone, 64)), 'NULL') USING ERRCODE = 'invalid_parameter_value';
    END IF;
    first_due := unitvisor.cron_next(fields, create_schedule.timezone, now());
    IF first_due IS NULL THEN
        RAISE EXCEPTION 'cron: matches no time in the next 10 years' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF create_schedule.run IS NULL OR jsonb_typeof(create_schedule.run) <> 'object' THEN
        RAISE EXCEPTION 'run: must be a JSON object of submit_run''s argument names' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The schedule sets the key itself; an absolute time would be the same for every run.
    IF create_schedule.run ?| ARRAY['idempotency_key', 'not_before', 'start_deadline'] THEN
        RAISE EXCEPTION 'run: may not have %: a schedule''s runs share every key of it (the schedule sets '
                        'idempotency_key itself, and an absolute time would be the same for each run)',
            (SELECT string_agg(k, ', ' ORDER BY k) FROM jsonb_object_keys(create_schedule.run) k
             WHERE k IN ('idempotency_key', 'not_before', 'start_deadline')) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF create_schedule.overlap IS NULL OR create_schedule.overlap NOT IN ('skip', 'queue', 'allow') THEN
        RAISE EXCEPTION 'overlap: must be skip, queue or allow' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF create_schedule.catch_up IS NULL OR create_schedule.catch_up NOT IN ('none', 'one') THEN
        RAISE EXCEPTION 'catch_up: must be none or one' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- The run as its first due time would submit it, submitted and rolled back (a subtransaction): every
    -- check submit_run makes, the labels the schedule adds included, made now rather than at 3 a.m.
    trial := ROW(create_schedule.name, create_schedule.cron, create_schedule.timezone, create_schedule.run,
                 create_schedule.overlap, create_schedule.catch_up, false, first_due, NULL, NULL, NULL, NULL,
                 0, 0, 0, now(), session_user)::unitvisor.schedules;
    BEGIN
        PERFORM unitvisor.submit_run_spec(unitvisor.schedule_run_spec(trial, first_due) - 'idempotency_key');
        RAISE EXCEPTION USING ERRCODE = 'UV028';
    EXCEPTION
        WHEN SQLSTATE 'UV028' THEN
            NULL;
        WHEN OTHERS THEN
            GET STACKED DIAGNOSTICS refused_message = MESSAGE_TEXT, refused_state = RETURNED_SQLSTATE,
                                    refused_constraint = CONSTRAINT_NAME;
            RAISE EXCEPTION 'run: %', refused_message USING ERRCODE = refused_state, CONSTRAINT = refused_constraint;
    END;
    BEGIN
        INSERT INTO unitvisor.schedules (name, cron, timezone, run, overlap, catch_up, next_due)
        VALUES (create_schedule.name, create_schedule.cron, create_schedule.timezone, create_schedule.run,
                create_schedule.overlap, create_schedule.catch_up, first_due);
    EXCEPTION WHEN unique_violation THEN
        RAISE EXCEPTION 'name: a schedule named % exists (drop_schedule it first)', create_schedule.name
            USING ERRCODE = 'unique_violation';
    END;
    RETURN first_due;
END $$;

-- Drop a schedule: true when there was one. Its runs already submitted are left as they are.
CREATE FUNCTION unitvisor.drop_schedule(name text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    DELETE FROM unitvisor.schedules s WHERE s.name = drop_schedule.name;
    RETURN FOUND;
END $$;

-- Pause (paused => true) or resume (false) a schedule; returns whether it was paused before (NULL: no
-- such schedule). A paused schedule submits nothing; resumed, its next due time is the first after now:
-- the times it was paused through are neither run nor counted as missed.
CREATE FUNCTION unitvisor.pause_schedule(name text, paused boolean DEFAULT true) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    before boolean;
BEGIN
    IF pause_schedule.paused IS NULL THEN
        RAISE EXCEPTION 'paused: must not be NULL' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT s.paused INTO before FROM unitvisor.schedules s WHERE s.name = pause_schedule.name FOR UPDATE;
    IF before IS DISTINCT FROM pause_schedule.paused AND before IS NOT NULL THEN
        UPDATE unitvisor.schedules s SET paused = pause_schedule.paused,
            next_due = CASE WHEN pause_schedule.paused THEN s.next_due
                            ELSE unitvisor.cron_next(s.cron, s.timezone, now()) END
        WHERE s.name = pause_schedule.name;
    END IF;
    RETURN before;
END $$;

-- The fleet upkeep's step (store.submit_due_schedules): each schedule due now, taken with its row locked
-- (SKIP LOCKED: a schedule another host is submitting right now is that host's), its run submitted and
-- its next due time moved past now in the same transaction. One statement, autocommit: a host that dies
-- in it submitted nothing and moved nothing, and the next host to ask does both. The idempotency key
-- (schedule_run_spec) makes even a second submit for one due time return the first's run.
--
-- At most max_schedules schedules a pass, and none begun after `budget` of it. The due times a pass
-- reaches: next_due and every later one up to now (at most 1,000 counted; past that, those of the last
-- minute). The latest is on time when it is at most a minute old (a fleet that is up reaches it within a
-- poll interval or two); every other is missed. An on-time due time is
-- submitted; missed ones are dropped (catch_up none), or make one run, for the latest of them, when
-- no due time is on time (catch_up one). overlap skip: nothing is submitted while the schedule's last
-- run is queued, starting or running (counted as skipped). A run submit_run refuses (a schedule made
-- before a check was added) is said in last_result, and the schedule moves on.
CREATE FUNCTION unitvisor.submit_due_schedules(host_id text, host_epoch bigint, max_schedules integer DEFAULT 100,
                                               budget interval DEFAULT '2 seconds')
RETURNS TABLE (schedule text, due timestamptz, run_id uuid, result text, missed integer)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    late_after constant interval := interval '1 minute';
    counted_max constant integer := 1000;
    -- A pass takes no further schedule once it has worked `budget` (2 seconds): the rest are still due,
    -- and the next pass (a poll interval later, by any host) takes them. So that a pass after a long
    -- outage, with many schedules each counting up to counted_max missed times (about 0.2 ms each),
    -- stays well inside the daemons' statement_timeout (15 s) instead of being cancelled, rolled back
    -- and started again for ever.
    started timestamptz := clock_timestamp();
    me unitvisor.hosts;
    s unitvisor.schedules;
    fields unitvisor.cron_fields;
    d timestamptz;
    latest timestamptz;
    reached integer;
    on_time boolean;
    new_run uuid;
    said text;
BEGIN
    PERFORM unitvisor.check_fence(submit_due_schedules.host_id, submit_due_schedules.host_epoch);
    SELECT * INTO me FROM unitvisor.hosts h WHERE h.id = submit_due_schedules.host_id;
    IF NOT unitvisor.host_acts_for_fleet(me) THEN
        RETURN;
    END IF;
    FOR s IN SELECT * FROM unitvisor.schedules x WHERE NOT x.paused AND x.next_due <= now()
             ORDER BY x.next_due, x.name LIMIT greatest(submit_due_schedules.max_schedules, 0)
             FOR UPDATE SKIP LOCKED LOOP
        EXIT WHEN clock_timestamp() - started > submit_due_schedules.budget;
        fields := unitvisor.cron_parse(s.cron);
        d := s.next_due;
        reached := 0;
        WHILE d IS NOT NULL AND d <= now() LOOP
            reached := reached + 1;
            latest := d;
            d := unitvisor.cron_next(fields, s.timezone,
                                     CASE WHEN reached < counted_max THEN d ELSE greatest(d, now() - late_after) END);
        END LOOP;
        on_time := latest >= now() - late_after;
        new_run := NULL;
        IF NOT on_time AND s.catch_up = 'none' THEN
            said := format('missed (%s due time(s), the latest %s old; catch_up none)', reached,
                           date_trunc('second', now() - latest));
        ELSIF s.overlap = 'skip' AND EXISTS (SELECT 1 FROM unitvisor.runs r WHERE r.id = s.last_run_id
                                                AND r.state IN ('queued', 'starting', 'running')) THEN
            said := format('skipped: run %s is still live (overlap skip)', s.last_run_id);
        ELSE
            BEGIN
                new_run := unitvisor.submit_run_spec(unitvisor.schedule_run_spec(s, latest));
                said := CASE WHEN on_time THEN 'submitted' ELSE format('submitted late, for %s missed due time(s) '
                                                                       '(catch_up one)', reached) END;
            EXCEPTION WHEN OTHERS THEN
                said := 'refused: ' || SQLERRM;
            END;
        END IF;
        UPDATE unitvisor.schedules x SET
            next_due = unitvisor.cron_next(fields, s.timezone, greatest(now(), latest)),
            last_due = latest, last_run_id = coalesce(new_run, x.last_run_id), last_result = said, last_at = now(),
            submitted = x.submitted + (new_run IS NOT NULL)::integer,
            skipped = x.skipped + (said LIKE 'skipped%')::integer,
            missed = x.missed + reached - on_time::integer
        WHERE x.name = s.name;
        schedule := s.name;
        due := latest;
        run_id := new_run;
        result := said;
        missed := reached - on_time::integer;
        RETURN NEXT;
    END LOOP;
END $$;

-- heartbeat as in 021, its upkeep flag also set while a schedule is due.
CREATE OR REPLACE FUNCTION unitvisor.heartbeat(host_id text, host_epoch bigint, waited interval)
RETURNS TABLE (host_state text, claimable boolean, cancels boolean, upkeep boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.require_host(heartbeat.host_id);
    RETURN QUERY
    UPDATE unitvisor.hosts h SET heartbeat_at = now()
    WHERE h.id = heartbeat.host_id AND h.epoch = heartbeat.host_epoch AND h.state <> 'dead'
    RETURNING h.state,
        unitvisor.host_has_work(h),
        EXISTS (SELECT 1 FROM unitvisor.attempts a JOIN unitvisor.runs r ON r.id = a.run_id
                WHERE a.host_id = heartbeat.host_id AND a.outcome IS NULL AND r.cancel_requested_at IS NOT NULL),
        EXISTS (SELECT 1 FROM unitvisor.hosts o WHERE o.id <> h.id AND unitvisor.host_is_overdue(o))
        OR EXISTS (SELECT 1 FROM unitvisor.spawn_jobs j
                   WHERE j.state = 'available' AND j.scheduled_at <= now() - heartbeat.waited)
        OR EXISTS (SELECT 1 FROM unitvisor.runs r
                   WHERE r.state = 'queued' AND r.start_deadline <= now() AND unitvisor.is_overdue(r))
        OR EXISTS (SELECT 1 FROM unitvisor.schedules s WHERE NOT s.paused AND s.next_due <= now());
END $$;

REVOKE ALL ON unitvisor.schedules FROM PUBLIC;
GRANT SELECT ON unitvisor.schedules TO unitvisor_submitter;
REVOKE EXECUTE ON FUNCTION
    unitvisor.cron_field(text, text, integer, integer, text[], integer),
    unitvisor.cron_parse(text),
    unitvisor.cron_local_instant(timestamp without time zone, text),
    unitvisor.cron_next(unitvisor.cron_fields, text, timestamp with time zone),
    unitvisor.cron_next(text, text, timestamp with time zone),
    unitvisor.submit_run_spec(jsonb),
    unitvisor.schedule_run_spec(unitvisor.schedules, timestamp with time zone),
    unitvisor.create_schedule(text, text, text, jsonb, text, text),
    unitvisor.drop_schedule(text),
    unitvisor.pause_schedule(text, boolean),
    unitvisor.submit_due_schedules(text, bigint, integer, interval)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.cron_next(text, text, timestamp with time zone)
    TO unitvisor_submitter, unitvisor_host;
GRANT EXECUTE ON FUNCTION
    unitvisor.submit_run_spec(jsonb),
    unitvisor.create_schedule(text, text, text, jsonb, text, text),
    unitvisor.drop_schedule(text),
    unitvisor.pause_schedule(text, boolean)
    TO unitvisor_submitter;
GRANT EXECUTE ON FUNCTION unitvisor.submit_due_schedules(text, bigint, integer, interval) TO unitvisor_host;
