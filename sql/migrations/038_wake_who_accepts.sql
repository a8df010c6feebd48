-- unitvisor schema: a submit that no host accepts wakes nobody (issue 23: a big burst, or runs that
-- cannot start, must not make live hosts look dead).
--
-- notify_spawn_targets as in 020, with one more answer to its question. 010 asks whether the hosts it
-- names accept every kind of unpinned run the transaction added, and names every live host with room
-- when one kind is refused by them. It never asked whether any host accepts the kind at all, and 011 does
-- not ask when the hosts named are every host with room already. So 1,000 runs of an executable that no
-- allowlist names (a rollout whose new path is not allowed yet) woke every daemon of the fleet: with
-- 1,000 hosts the list outgrows the payload, and the empty payload that means "everyone" sent a thousand
-- claims for nothing at once. bench.scale saw them in its quiet (S4) window at 1,000 hosts, 1.8 s each,
-- and 5 live hosts whose heartbeats they starved declared dead (docs/benchmarks.md, "0.11.0 with 037").
--
-- Now each kind is accepted by a host named, or else by another live host with room, or by none; a kind
-- the named refuse and another host accepts names every host with room, as before, and when every kind
-- is refused by every host with room, the notification names nobody (but the pinned hosts): no daemon
-- could claim them, and each host's heartbeat finds them again if that changes (an allowlist widened, a
-- host back), within a poll interval.
--
-- What it costs, in the submitter's COMMIT: 011's reason still holds for one or two hosts with room, all
-- named (a host alone, issue 14's latency bench): the question is not asked, and waking them for nothing
-- costs at most two claims. With more, it is asked even when all are named: once per kind when the
-- first host asks accepts (a burst that needs every host: one call, where 011 made none), and once per
-- kind and host with room when nobody does. Measured on a throwaway PostgreSQL with 1,000 hosts (the
-- deferred trigger fired by SET CONSTRAINTS ALL IMMEDIATE, p50 of 20): one run the first two hosts accept
-- 3.1 ms (2.9 with 020); one run that no host accepts 19.6 ms (3.1, which then woke all 1,000 daemons);
-- 1,000 runs accepted everywhere 10.1 ms (9.2), refused everywhere 33 ms (9.3, and every daemon woken).
-- One host_refusal is about 16 µs: a kind no host accepts adds about 5 ms at 300 hosts.
--
-- Replaced whole (CREATE OR REPLACE, same name, no arguments, same trigger), as 011 and 020 did.

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
            -- One row per kind, read once: host_refusal is then asked with the same record per host.
            FOR kind IN SELECT (jsonb_populate_record(NULL::unitvisor.runs, e.k)).* FROM jsonb_array_elements(kinds) AS e(k) LOOP
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
