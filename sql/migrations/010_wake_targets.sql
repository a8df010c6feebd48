-- unitvisor schema: a new spawn job wakes the hosts that could claim it, not every daemon (issue 14).
--
-- Until now every statement that inserted spawn jobs sent NOTIFY unitvisor_spawn with an empty payload,
-- and every daemon of the fleet answered with a claim: one submit, 300 claim statements on a fleet of
-- 300 hosts, 299 of which found nothing to take. Now the payload names the hosts that should claim
-- (docs/sql-api.md, "Notifications"):
--
--   {"hosts": ["<host id>", ...]}   those hosts, and only they, should claim;
--   ''                               every host should (as before).
--
-- The targets are computed once per transaction, at its commit (a deferred constraint trigger: its first
-- event does the work, the others find nothing left to do), from what each inserting statement noted in
-- transaction-local settings (a statement trigger with a transition table: a 1,000-row insert notes its
-- rows once). Once per transaction, because a control plane that submits 1,000 runs with 1,000
-- submit_run calls in one transaction makes 1,000 inserting statements: a NOTIFY for each would be
-- 1,000 different payloads (PostgreSQL folds only identical ones), each delivered to every daemon that
-- listens. The targets of the transaction's new available jobs:
-- * a pinned run's pin;
-- * for the unpinned runs, live hosts that can start units and have free slots, most free slots first,
--   until their shares of the transaction's unpinned runs cover them: a host takes at most
--   least(free, ceil(wanted * max_runs / capacity)) of a burst within spread_grace (claim_jobs' fair
--   share), so waking hosts whose free slots alone cover the burst would leave most of it to wait out
--   spread_grace. Two at least, so that one slow host does not hold a single run back;
-- * every distinct kind of unpinned run (argv[0], user, environment, memory_max: what host_refusal
--   looks at besides the pin) must be accepted by one of them (host_refusal); when one is not, or there
--   are more than 32 kinds to check, every live host with room is named instead;
-- * when the list would not fit in a payload comfortably (over 7,000 bytes), the payload is '' (every
--   host).
-- When no host could claim now (no pin, and no live host has a free slot) the list is empty,
-- {"hosts": []}: the notification is still sent (a control plane that listens hears of every
-- transaction that added jobs, and a 0.3.0 daemon claims on it as before), and it wakes no daemon of
-- this release. A daemon claims again when one of its runs ends, and every daemon polls (the probe,
-- every poll_interval), which also covers a hint that was lost or went to a host that then could not
-- claim.
--
-- Hosts of 0.3.0 treat any notification on the channel as a hint to claim, whatever its payload: during
-- a rolling upgrade they are woken as the list says, or more often (they ignore the list), never less.
--
-- SECURITY DEFINER: the triggers fire in the submitter's session, and a submitter may not read hosts or
-- attempts (004). Trigger functions cannot be called directly, so there is no grant to make.

-- What one inserting statement adds to its transaction's notes: the number of unpinned runs
-- (unitvisor.spawn_unpinned), the pins (unitvisor.spawn_pins, a JSON array), and the kinds of unpinned
-- run (unitvisor.spawn_kinds, a JSON array of what host_refusal reads, at most 33: more means "mixed").
CREATE FUNCTION unitvisor.note_spawn_jobs() RETURNS trigger
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
                                               'memory_max', r.memory_max) AS k
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
REVOKE EXECUTE ON FUNCTION unitvisor.note_spawn_jobs() FROM PUBLIC;

-- At commit: the targets of what the transaction's statements noted, one NOTIFY, and the notes cleared
-- (so that the trigger's other events, and a SET CONSTRAINTS ... IMMEDIATE before more inserts, find
-- nothing, or only what came after).
CREATE FUNCTION unitvisor.notify_spawn_targets() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    wanted bigint := coalesce(nullif(current_setting('unitvisor.spawn_unpinned', true), '')::bigint, 0);
    pins text[] := ARRAY(SELECT jsonb_array_elements_text(
        coalesce(nullif(current_setting('unitvisor.spawn_pins', true), ''), '[]')::jsonb));
    kinds jsonb := coalesce(nullif(current_setting('unitvisor.spawn_kinds', true), ''), '[]')::jsonb;
    targets text[] := '{}';
    room text[];
    payload text;
BEGIN
    IF wanted = 0 AND cardinality(pins) = 0 THEN
        RETURN NULL;  -- done by an earlier event of this commit, or a statement that inserted no available job
    END IF;
    PERFORM set_config('unitvisor.spawn_unpinned', '', true), set_config('unitvisor.spawn_pins', '', true),
            set_config('unitvisor.spawn_kinds', '', true);
    IF wanted > 0 THEN
        WITH live AS (
            SELECT h.id, h.max_runs, h.max_runs - coalesce(o.open, 0) AS free
            FROM unitvisor.hosts h
            LEFT JOIN (SELECT a.host_id, count(*) AS open FROM unitvisor.attempts a WHERE a.outcome IS NULL
                       GROUP BY a.host_id) o ON o.host_id = h.id
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
        -- Every kind accepted by one of them, or every host with room.
        IF cardinality(targets) > 0 AND (jsonb_array_length(kinds) > 32 OR EXISTS (
                SELECT 1 FROM jsonb_array_elements(kinds) AS e(k)
                WHERE NOT EXISTS (SELECT 1 FROM unitvisor.hosts h
                                  WHERE h.id = ANY (targets)
                                    AND unitvisor.host_refusal(h, jsonb_populate_record(NULL::unitvisor.runs, e.k)) IS NULL))) THEN
            targets := room;
        END IF;
    END IF;
    targets := ARRAY(SELECT DISTINCT t FROM unnest(targets || pins) AS t ORDER BY t);
    payload := json_build_object('hosts', targets)::text;
    PERFORM pg_notify('unitvisor_spawn', CASE WHEN octet_length(payload) > 7000 THEN '' ELSE payload END);
    RETURN NULL;
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.notify_spawn_targets() FROM PUBLIC;

DROP TRIGGER spawn_jobs_notify ON unitvisor.spawn_jobs;
CREATE TRIGGER spawn_jobs_note AFTER INSERT ON unitvisor.spawn_jobs
    REFERENCING NEW TABLE AS new_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION unitvisor.note_spawn_jobs();
CREATE CONSTRAINT TRIGGER spawn_jobs_notify AFTER INSERT ON unitvisor.spawn_jobs
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION unitvisor.notify_spawn_targets();
