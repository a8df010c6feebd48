-- unitvisor schema: a host named in a submit's notification is told on a channel of its own (issue 23: a
-- single submit claimed within 10 ms at every size).
--
-- Every daemon LISTENs on unitvisor_spawn, and PostgreSQL sends every notification on a channel to the
-- client of every session that listens on it: a submit that names two hosts of 300 woke all 300 daemons,
-- each to read the payload and drop it. bench.scale saw what that costs the two named (docs/benchmarks.md,
-- "0.11.0 with 048"): the 300 daemons heard each single submit over 25 to 30 ms, in no order, and a named
-- daemon heard it anywhere in that spread, or heard it first and then waited for the others' turns to
-- claim; 14 ms p50 from the commit to the claim, against 2 ms at 100 hosts.
--
-- A daemon of this release also LISTENs on unitvisor.host_wake_channel(its id) and says so in its
-- registration's transaction (register_wake_channel). A notification that names at most 16 hosts goes to
-- the channel of each that listens there, and to unitvisor_spawn for the others only (a daemon of 0.11.0,
-- whose registration voids the mark), naming those alone. More named (a burst names every host with room):
-- one notification on unitvisor_spawn, as before, since each notification sent is an entry of the server's
-- queue that every listening session of the database reads (PostgreSQL signals every listener of a
-- database at each notifying commit, whatever the channel: that part of the fan-out stays; docs/fleet.md).
-- A notification that names nobody is no longer sent: every daemon dropped it.

ALTER TABLE unitvisor.hosts ADD COLUMN wake_channel_at timestamptz;

-- The channel on which a host's daemon is told of jobs that name it alone (048): a function of its id, at
-- most 48 bytes whatever the id (a channel name is at most 63; a host id up to 255 characters).
CREATE FUNCTION unitvisor.host_wake_channel(host_id text) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT 'unitvisor_spawn_' || left(encode(sha256(convert_to(host_wake_channel.host_id, 'UTF8')), 'hex'), 32)
$$;

-- What a daemon of this release registers right after register_host, in the same transaction, having sent
-- LISTEN on the channel it returns there too (store.register_wake_channel): from that commit on, a
-- notification that names this host alone goes to that channel (notify_spawn_targets).
CREATE FUNCTION unitvisor.register_wake_channel(host_id text, host_epoch bigint) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM unitvisor.check_fence(register_wake_channel.host_id, register_wake_channel.host_epoch);
    UPDATE unitvisor.hosts h SET wake_channel_at = now() WHERE h.id = register_wake_channel.host_id;
    RETURN unitvisor.host_wake_channel(register_wake_channel.host_id);
END $$;

-- notify_spawn_targets as in 011, each live host's free slots from host_open_attempts (one row per host)
-- instead of a count of the fleet's open attempts grouped by host, in the submitter's COMMIT (020); since
-- 038, kinds of run that every live host with room refuses wake nobody; since 048, a host named among
-- at most 16 is told on its own channel when it listens there, and a notification naming nobody is
-- not sent.
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
    alone text;
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
    IF cardinality(targets) <= 16 THEN
        -- Few named (a trickle of submits, a pin): each that listens on its own channel is told there, so
        -- that no other daemon wakes for it; the rest (daemons of 0.11.0) on unitvisor_spawn. More named
        -- (a burst names every host with room): one notification for all, as each one sent is an entry of
        -- the server's queue that every listening session of the database reads.
        FOR alone IN SELECT h.id FROM unitvisor.hosts h
                     WHERE h.id = ANY (targets) AND h.wake_channel_at >= h.started_at LOOP
            PERFORM pg_notify(unitvisor.host_wake_channel(alone), '');
            targets := array_remove(targets, alone);
        END LOOP;
    END IF;
    IF cardinality(targets) = 0 THEN
        RETURN NULL;  -- every daemon would drop a notification that names nobody
    END IF;
    payload := json_build_object('hosts', targets)::text;
    PERFORM pg_notify('unitvisor_spawn', CASE WHEN octet_length(payload) > 7000 THEN '' ELSE payload END);
    RETURN NULL;
END $$;

REVOKE EXECUTE ON FUNCTION unitvisor.host_wake_channel(text), unitvisor.register_wake_channel(text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.register_wake_channel(text, bigint) TO unitvisor_host;
