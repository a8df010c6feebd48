-- unitvisor schema: the submitter's commit does not ask host_refusal when its answer cannot matter
-- (issue 14, latency).
--
-- notify_spawn_targets as in 010, with one test less on the way to the NOTIFY. 010 checks that every
-- kind of unpinned run the transaction added is accepted by one of the hosts it names, and names every
-- live host with room when one is not. When the hosts it names are every live host with room already,
-- that check cannot change the list, and it is the costliest part of the trigger: host_refusal on each
-- kind and named host, through jsonb_populate_record. This is the common case of a host alone (a single
-- daemon, issue 14's latency bench) and of a burst that needs every host. The trigger runs inside the
-- submitter's COMMIT, before the commit itself and its NOTIFY, so what it costs is latency of every
-- submit: measured with bench/claim_latency.py (docs/benchmarks.md, "The claim statement and the
-- submitter's commit, one run at a time"), a single submit's COMMIT with one host went from 0.63 ms p50
-- with 010 to 0.33 ms (0.11 ms before 010). With 300 hosts it is unchanged (about 1 ms): two are named,
-- and the question is asked.
--
-- Replaced whole (CREATE OR REPLACE, same name, no arguments, same trigger): the trigger of 010 calls it
-- by name and picks up the new body.

CREATE OR REPLACE FUNCTION unitvisor.notify_spawn_targets() RETURNS trigger
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
        -- Every kind accepted by one of them, or every host with room. Not asked when they are every host
        -- with room already (one live host, or a burst that needs them all): the answer could not
        -- change them.
        IF cardinality(targets) > 0 AND cardinality(targets) < cardinality(room) AND (jsonb_array_length(kinds) > 32 OR EXISTS (
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
