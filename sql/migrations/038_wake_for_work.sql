-- unitvisor schema: a submit wakes hosts only for work one of them could start now (issue 23: a big
-- burst, or runs that cannot start, must not make live hosts look dead).
--
-- Two answers the wake trigger (010) did not have:
--
-- * Whether any host accepts the run. notify_spawn_targets (as in 020) asks whether the hosts it names
--   accept every kind of unpinned run the transaction added, and names every live host with room when
--   one kind is refused by them. It never asked whether any host accepts the kind at all, and 011 does
--   not ask when the hosts named are every host with room already. So 1,000 runs of an executable that
--   no allowlist names (a rollout whose new path is not allowed yet) woke every daemon of the fleet:
--   with 1,000 hosts the list outgrows the payload, and the empty payload that means "everyone" sent a
--   thousand claims for nothing at once. bench.scale saw them in its quiet (S4) window at 1,000 hosts,
--   1.8 s each, and 5 live hosts whose heartbeats they starved declared dead (docs/benchmarks.md, "0.11.0
--   with 037"). Now each kind is accepted by a host named, or else by another live host with room, or by
--   none; a kind the named refuse and another host accepts names every host with room, as before, and
--   when every kind is refused by every host with room, the notification names nobody (but the pinned
--   hosts).
-- * Whether the run can start now. note_spawn_jobs (as in 033) counted every available job: a job not due
--   yet (not_before, a retry's backoff) and a run behind its concurrency key woke hosts whose claim could
--   not take it. bench.scale's (S5), 10,000 runs behind one key, woke all 1,000 daemons to claim nothing
--   (1.6 s each), and in a run with the first answer alone 5 live hosts were declared dead in that storm
--   (bench/results/scale-0.11.0-wake.json). Now only jobs that are due, and of
--   a key only as many of its new runs as it has room for (its limit less its live runs and the queued
--   runs ahead), are counted; the others wake nobody.
--
-- Nothing is lost by waking nobody: no host could claim those runs now, and every host's heartbeat finds
-- them (host_has_work) once one could, within a poll interval (an allowlist widened, a host back, a key
-- freed, a not_before reached); a host whose run ends claims again at once, as before.
--
-- What it costs, in the submitter's COMMIT: 011's reason still holds for one or two hosts with room, all
-- named (a host alone, issue 14's latency bench): the question is not asked, and waking them for nothing
-- costs at most two claims. With more, it is asked even when all are named: once per kind when the
-- first host asked accepts it (a burst that needs every host: one call, where 011 made none), and once per
-- kind and host with room when nobody does. Measured on a throwaway PostgreSQL with 1,000 hosts (the
-- deferred trigger fired by SET CONSTRAINTS ALL IMMEDIATE, p50 of 20): one run the first two hosts accept
-- 3.1 ms (2.9 with 020); one run that no host accepts 19.6 ms (3.1, which then woke all 1,000 daemons);
-- 1,000 runs accepted everywhere 10.1 ms (9.2), refused everywhere 33 ms (9.3, and every daemon woken).
-- One host_refusal is about 16 µs: a kind no host accepts adds about 5 ms at 300 hosts. note_spawn_jobs
-- counts, for each key an inserting statement names, its live runs and those ahead, each count stopping
-- at the key's limit: a single submit, keyed or not, 1.41 ms p50 from the client (1.33 to 1.41 with 033).
-- It reads the statement's runs by their key, once: one statement of 1,000, 2,000 and 4,000 submit_run
-- calls took 0.68, 1.34 and 2.75 s, where 033's form took 0.71, 1.76 and 4.88 s (it grew faster than the
-- runs; not analysed further).
--
-- Both replaced whole (CREATE OR REPLACE, same names, no arguments, same triggers), as 011, 020 and 033
-- did.

CREATE OR REPLACE FUNCTION unitvisor.note_spawn_jobs() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    unpinned bigint;
    pins jsonb;
    kinds jsonb;
    noted jsonb;
BEGIN
    -- The jobs a host could claim now (038): due, and without a concurrency key or among the first of their
    -- key's new runs, as many as the key has room for: its limit less its live runs and the queued runs
    -- ahead of them, which start first (concurrency_blocker). Each count stops at the limit: what a
    -- submit costs does not grow with a key's backlog.
    WITH fresh AS MATERIALIZED (
        SELECT r.id, r.host_pin, r.concurrency_key, r.seq, coalesce(r.concurrency_limit, 1) AS key_limit,
               r.argv[1] AS argv0, r.run_user,
               r.environment, r.memory_max, r.host_labels,
               row_number() OVER (PARTITION BY r.concurrency_key ORDER BY r.seq NULLS FIRST, r.created_at, r.id) AS place
        FROM new_jobs j JOIN unitvisor.runs r ON r.id = j.run_id
        WHERE j.state = 'available' AND j.scheduled_at <= now()),
    keys AS (
        SELECT k.concurrency_key,
               k.key_limit
               - (SELECT count(*) FROM (SELECT 1 FROM unitvisor.runs r
                                        WHERE r.concurrency_key = k.concurrency_key AND r.state IN ('starting', 'running')
                                        LIMIT k.key_limit) live)
               - (SELECT count(*) FROM (SELECT 1 FROM unitvisor.runs r
                                        WHERE r.concurrency_key = k.concurrency_key AND r.state = 'queued'
                                          AND (r.seq < k.first_seq OR r.seq IS NULL)
                                        LIMIT k.key_limit) ahead) AS room
        FROM (SELECT f.concurrency_key, min(f.seq) AS first_seq, min(f.key_limit) AS key_limit
              FROM fresh f WHERE f.concurrency_key IS NOT NULL GROUP BY f.concurrency_key) k),
    startable AS MATERIALIZED (
        SELECT f.* FROM fresh f LEFT JOIN keys k ON k.concurrency_key = f.concurrency_key
        WHERE f.concurrency_key IS NULL OR f.place <= k.room)
    SELECT (SELECT count(*) FROM startable s WHERE s.host_pin IS NULL),
           (SELECT coalesce(jsonb_agg(DISTINCT s.host_pin), '[]') FROM startable s WHERE s.host_pin IS NOT NULL),
           (SELECT coalesce(jsonb_agg(x.k), '[]') FROM (
                -- The environment's names only, each with an empty value: host_refusal reads the names,
                -- and the values (which may be secrets) must not go into the session's settings, where
                -- the submitter's current_setting, pg_settings and any error context would show them.
                SELECT DISTINCT jsonb_build_object('argv', ARRAY[s.argv0], 'run_user', s.run_user,
                                                   'environment', (SELECT coalesce(jsonb_object_agg(e.name, ''), '{}')
                                                                   FROM jsonb_object_keys(
                                                                       CASE WHEN jsonb_typeof(s.environment) = 'object'
                                                                            THEN s.environment ELSE '{}' END) AS e(name)),
                                                   'memory_max', s.memory_max,
                                                   -- 033: host_refusal reads them; fewer of them is accepted
                                                   -- by more hosts, as @> below assumes.
                                                   'host_labels', s.host_labels) AS k
                FROM startable s WHERE s.host_pin IS NULL
                LIMIT 33) x)
    INTO unpinned, pins, kinds;
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

CREATE OR REPLACE FUNCTION unitvisor.notify_spawn_targets() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    wanted bigint := coalesce(nullif(current_setting('unitvisor.spawn_unpinned', true), '')::bigint, 0);
    pins text[] := ARRAY(SELECT jsonb_array_elements_text(
        coalesce(nullif(current_setting('unitvisor.spawn_pins', true), ''), '[]')::jsonb));
    kinds jsonb := coalesce(nullif(current_setting('unitvisor.spawn_kinds', true), ''), '[]')::jsonb;
    targets text[] := '{}';
    room text[];
    kind unitvisor.runs;
    widen boolean;
    nobody boolean;
    payload text;
BEGIN
    IF wanted = 0 AND cardinality(pins) = 0 THEN
        RETURN NULL;  -- done by an earlier event of this commit, or a statement that inserted no available job
    END IF;
    PERFORM set_config('unitvisor.spawn_unpinned', '', true), set_config('unitvisor.spawn_pins', '', true),
            set_config('unitvisor.spawn_kinds', '', true);
    IF wanted > 0 THEN
        WITH live AS (
            SELECT h.id, h.max_runs, h.max_runs - coalesce(c.open, 0) AS free
            FROM unitvisor.hosts h
            LEFT JOIN unitvisor.host_open_attempts c ON c.host_id = h.id
            WHERE unitvisor.host_is_live(h) AND h.can_start),
        fit AS (
            SELECT l.id, l.free,
                   least(l.free, ceil(wanted::numeric * l.max_runs / (SELECT sum(max_runs) FROM live))::bigint) AS takes
            FROM live l WHERE l.free > 0),
        ranked AS (
            SELECT f.id, sum(f.takes) OVER w - f.takes AS before, row_number() OVER w AS n
            FROM fit f WINDOW w AS (ORDER BY f.free DESC, f.id))
        SELECT coalesce(array_agg(id) FILTER (WHERE before < wanted OR n <= 2), '{}'), coalesce(array_agg(id), '{}')
        INTO targets, room FROM ranked;
        IF cardinality(targets) > 0 AND jsonb_array_length(kinds) > 32 THEN
            targets := room;  -- more kinds than noted (note_spawn_jobs keeps 33): every host with room, unasked
        ELSIF cardinality(targets) > 0 AND (cardinality(targets) < cardinality(room) OR cardinality(room) > 2) THEN
            -- Each kind: accepted by a host named, else by another host with room, else by none. One kind the
            -- named refuse and another accepts names every host with room (010); kinds that every host with
            -- room refuses name nobody (038). Not asked of one or two hosts with room, all named (011): waking
            -- them for nothing costs less than asking, on the latency of every submit.
            widen := false;
            nobody := jsonb_array_length(kinds) > 0;
            -- One row per kind, read once (in FROM: `(f()).*` in a select list calls f once a column):
            -- host_refusal is then asked with the same record per host.
            FOR kind IN SELECT r.* FROM jsonb_array_elements(kinds) AS e(k),
                                        jsonb_populate_record(NULL::unitvisor.runs, e.k) AS r LOOP
                IF EXISTS (SELECT 1 FROM unitvisor.hosts h
                           WHERE h.id = ANY (targets) AND unitvisor.host_refusal(h, kind) IS NULL) THEN
                    nobody := false;
                ELSIF EXISTS (SELECT 1 FROM unitvisor.hosts h
                              WHERE h.id = ANY (room) AND NOT h.id = ANY (targets)
                                AND unitvisor.host_refusal(h, kind) IS NULL) THEN
                    widen := true;
                    EXIT;
                END IF;
            END LOOP;
            IF widen THEN
                targets := room;
            ELSIF nobody THEN
                targets := '{}';
            END IF;
        END IF;
    END IF;
    targets := ARRAY(SELECT DISTINCT t FROM unnest(targets || pins) AS t ORDER BY t);
    payload := json_build_object('hosts', targets)::text;
    PERFORM pg_notify('unitvisor_spawn', CASE WHEN octet_length(payload) > 7000 THEN '' ELSE payload END);
    RETURN NULL;
END $$;
