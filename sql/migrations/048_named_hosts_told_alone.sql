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
--
-- A cancel or a freeze request of a run was told to every daemon on unitvisor_cancel, and every daemon
-- read its own requests (two statements: its cancelled attempts, its freeze requests): 2,000 statements
-- for one cancel on 1,000 hosts. Now the host that holds the run's open attempt is told alone on its
-- channel (payload 'cancel') when it listens there (notify_request); the cancel of a queued run, done at
-- once, is told to nobody.

ALTER TABLE unitvisor.hosts ADD COLUMN wake_channel_at timestamptz;

-- The channel on which a host's daemon is told of jobs that name it alone (048): a function of its id, at
-- most 48 bytes whatever the id (a channel name is at most 63; a host id up to 255 characters).
CREATE FUNCTION unitvisor.host_wake_channel(host_id text) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT 'unitvisor_spawn_' || left(encode(sha256(convert_to(host_wake_channel.host_id, 'UTF8')), 'hex'), 32)
$$;

-- The channel a host's daemon listens on alone (048), or NULL: a daemon of 0.11.0, or a mark from before the
-- host's last registration (wake_channel_at is void before started_at, as labels_at). What
-- notify_spawn_targets and notify_request both ask.
CREATE FUNCTION unitvisor.own_channel(h unitvisor.hosts) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE WHEN h.wake_channel_at >= h.started_at THEN unitvisor.host_wake_channel(h.id) END
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
    channel text;
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
        FOR alone, channel IN SELECT h.id, unitvisor.own_channel(h) FROM unitvisor.hosts h
                              WHERE h.id = ANY (targets) LOOP
            CONTINUE WHEN channel IS NULL;
            PERFORM pg_notify(channel, '');
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

-- The requests: cancel_run and request_freeze as they were, each telling its run's host by notify_request.
-- Tell the daemon that holds a run's open attempt of a cancel or a freeze request (048): on its own
-- channel (host_wake_channel, payload 'cancel') when it listens there, else every daemon on
-- unitvisor_cancel, as before, each then reading its own requests.
CREATE FUNCTION unitvisor.notify_request(run_id uuid, host_id text) RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    channel text := (SELECT unitvisor.own_channel(h) FROM unitvisor.hosts h WHERE h.id = notify_request.host_id);
BEGIN
    IF channel IS NOT NULL THEN
        PERFORM pg_notify(channel, 'cancel');
    ELSE
        PERFORM pg_notify('unitvisor_cancel', notify_request.run_id::text);
    END IF;
END $$;

CREATE OR REPLACE FUNCTION unitvisor.cancel_run(run_id uuid, OUT state text, OUT changed boolean)
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
    IF cancel_run.state <> 'cancelled' THEN  -- (048) a queued run's cancel is done: no daemon acts on it
        PERFORM unitvisor.notify_request(cancel_run.run_id, (
            SELECT a.host_id FROM unitvisor.attempts a WHERE a.run_id = cancel_run.run_id AND a.outcome IS NULL
            ORDER BY a.attempt DESC LIMIT 1));
    END IF;
    changed := true;
END $$;

CREATE OR REPLACE FUNCTION unitvisor.request_freeze(run_id uuid, wanted text, OUT state text, OUT changed boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    open unitvisor.attempts;
    verb text := CASE WHEN wanted = 'frozen' THEN 'freeze' ELSE 'thaw' END;
BEGIN
    SELECT r.state INTO request_freeze.state FROM unitvisor.runs r WHERE r.id = request_freeze.run_id FOR UPDATE;
    IF NOT FOUND THEN
        changed := false;
        RETURN;
    END IF;
    SELECT * INTO open FROM unitvisor.attempts a
    WHERE a.run_id = request_freeze.run_id AND a.outcome IS NULL ORDER BY a.attempt DESC LIMIT 1 FOR UPDATE;
    IF request_freeze.state <> 'running' OR open.run_id IS NULL THEN
        RAISE EXCEPTION '%: run % is %; only a running run can be %', verb, request_freeze.run_id,
            request_freeze.state, wanted
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = CASE WHEN request_freeze.state = 'queued' AND wanted = 'frozen'
                              THEN 'hold a queued run instead (unitvisor.hold_run)'
                              ELSE 'only a running run has processes to freeze or thaw' END;
    END IF;
    IF (CASE WHEN unitvisor.freeze_pending(open) THEN open.freeze_wanted
             ELSE coalesce(open.freeze_state, 'thawed') END) = wanted THEN
        changed := false;
        RETURN;
    END IF;
    UPDATE unitvisor.attempts a SET freeze_wanted = wanted, freeze_requested_at = now(),
        freeze_requested_by = session_user
    WHERE a.run_id = open.run_id AND a.attempt = open.attempt;
    INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
    VALUES (open.run_id, open.attempt, open.host_id, 'running', verb || ' requested by ' || session_user);
    PERFORM unitvisor.notify_request(request_freeze.run_id, open.host_id);
    changed := true;
END $$;

REVOKE EXECUTE ON FUNCTION unitvisor.host_wake_channel(text), unitvisor.own_channel(unitvisor.hosts),
                           unitvisor.register_wake_channel(text, bigint), unitvisor.notify_request(uuid, text)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.register_wake_channel(text, bigint) TO unitvisor_host;
