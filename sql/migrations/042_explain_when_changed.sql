-- unitvisor schema: the fleet upkeep explains why runs wait again only when something that could change a
-- reason has changed (issue 23, point 4: 1,000 runs that no host accepts, and 10,000 behind one key, add
-- at most 5% to the idle fleet's server CPU at 300 hosts).
--
-- Before: every poll interval, the daemon with the fleet upkeep's turn explained up to 1,000 waiting runs
-- (explain_waiting: a fleet_refusal per kind, over every live host, and the key's and the limits' words
-- per run), and a backlog longer than that batch by batch, round and round; the reasons came out the same
-- each time and were not written again, but computing them was what (S4) and (S5) cost besides the
-- heartbeat's walk (041): 47 ms a pass over 1,000 refused runs and 92 ms over 1,000 of 10,000 behind a key,
-- in bench.scale at 300 hosts (docs/benchmarks.md, "0.11.0 with 040"), 0.8 and 1.8 ms of server CPU per
-- host per minute against 8.1 idle.
--
-- Now a pass that would start a round over the waiting runs (the first batch: explained_at is NULL) first
-- reads a mark of what the reasons are read from (wait_mark), and does nothing when the last round started
-- from the same mark and its time has not passed (explained_until). The mark, as 041's for one host but for
-- the fleet: the newest spawn job's id and the newest run event's id (every change of a run's state writes
-- one, the key's blocker's words and a limit's live count among them; and so does a round that changed a
-- reason, so a round that changed something is followed by one more, which changes nothing), the named
-- limits, and per host what fleet_refusal reads of it (whether it is live, its state and dead reason, its
-- silence while it is not live, and what host_refusal reads: host_refusal_inputs). explained_until is
-- the earliest time a waiting job comes to have waited min_wait (the clock alone makes it one to explain),
-- and at most 15 min_waits (30 poll intervals: 5 minutes by default) after the round started, for what a
-- mark can miss (041: a transaction that commits behind a later one's id).
--
-- What it costs: a reason that changes without a new row, a run event or a host changing (none is known)
-- is written up to 5 minutes later. The explanation is the operator's (`unitvisor show`, run_waits), not
-- the claim's: no run waits longer for it.

ALTER TABLE unitvisor.fleet_upkeep ADD COLUMN explained_mark text, ADD COLUMN explained_until timestamptz;

-- What the waiting runs' reasons are read from, but the clock (see above). One walk of the host rows: made
-- by the daemon with the upkeep's turn, once a poll interval, and only while runs wait.
CREATE FUNCTION unitvisor.wait_mark() RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN format('%s/%s/%s', unitvisor.queue_mark(),
                  (SELECT hashtextextended(string_agg(l::text, ',' ORDER BY l.name), 0) FROM unitvisor.limits l),
                  (SELECT hashtextextended(string_agg(
                              row(h.id, unitvisor.host_is_live(h), h.dead_reason,
                                  CASE WHEN NOT unitvisor.host_is_live(h) THEN h.heartbeat_at END,
                                  unitvisor.host_refusal_inputs(h))::text, ',' ORDER BY h.id), 0)
                   FROM unitvisor.hosts h));
END $$;
REVOKE EXECUTE ON FUNCTION unitvisor.wait_mark() FROM PUBLIC;

-- explain_waiting as in 033, but for the mark at the start of a round (above). The rest is 033's, line
-- for line.
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
    mark text;
BEGIN
    SELECT u.explained_at, u.explained_job INTO after_at, after_job FROM unitvisor.fleet_upkeep u;
    IF after_at IS NULL THEN
        -- A pass over the waiting runs would start: not when its last one started from the same mark.
        mark := unitvisor.wait_mark() || '/' || explain_waiting.min_wait;  -- a daemon's own min_wait: its own round
        IF (SELECT u.explained_mark = mark AND now() < u.explained_until FROM unitvisor.fleet_upkeep u) THEN
            RETURN 0;
        END IF;
        UPDATE unitvisor.fleet_upkeep u SET explained_mark = mark,
            explained_until = least(now() + 15 * explain_waiting.min_wait, unitvisor.next_due(explain_waiting.min_wait));
    END IF;
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
