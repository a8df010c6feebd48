-- unitvisor schema, version 7: what an outcome records besides how the run ended (issue 13): what
-- systemd measured of the attempt, and the last lines of its output.
--
-- Expand only: attempts gains nullable columns (0.3.0 reads attempts by explicit column lists), and
-- record_outcome an overload with four more arguments. The 12-argument form that 0.3.0 daemons call
-- by position keeps its signature, grants and meaning; it now hands over to the new one with NULLs,
-- so that the outcome logic exists once. (Extra arguments with DEFAULTs on a second function of the same
-- name would make a 12-argument call ambiguous between the two, and dropping the old one would break
-- a 0.3.0 daemon's call for the length of the rolling upgrade's migration.)

-- NULL means "not measured": systemd does not have the figure for this unit on this host (its
-- version, the cgroup layout or a controller it may not use), or the outcome was recorded without
-- the unit (a host reboot, a dead host's attempts taken over, a daemon older than 0.4.0). No column
-- for tasks: systemd keeps only the live count (TasksCurrent), which is gone with the processes;
-- there is no peak to record. Bytes and nanoseconds as systemd reports them (uint64 on the bus; no
-- real figure reaches 2^63).
ALTER TABLE unitvisor.attempts
    ADD COLUMN cpu_usage_nsec bigint,
    ADD COLUMN memory_peak_bytes bigint,
    ADD COLUMN io_read_bytes bigint,
    ADD COLUMN io_write_bytes bigint,
    -- The last lines of the attempt's output (stdout, stderr and syslog of its processes, as journald
    -- stored them), cut by its host's [runs] output_tail_lines and output_tail_bytes; NULL when it
    -- kept none (off, not read yet, or never: a host that died first). The full output stays in
    -- journald. Written once, after the outcome (record_output_tails), never replaced.
    ADD COLUMN output_tail text,
    -- Both NOT VALID, validated by `unitvisor migrate` after this transaction commits (as in 005: the
    -- scan of attempts, about as big as runs, without this ALTER's ACCESS EXCLUSIVE lock).
    ADD CONSTRAINT attempts_accounting_valid CHECK (
        cpu_usage_nsec >= 0 AND memory_peak_bytes >= 0 AND io_read_bytes >= 0 AND io_write_bytes >= 0) NOT VALID,
    -- The bound of the config key (64 KiB), so that a row stays small whatever a host is configured with.
    ADD CONSTRAINT attempts_output_tail_valid CHECK (octet_length(output_tail) <= 65536) NOT VALID;

-- record_outcome with what systemd measured of the attempt; the outcome logic is the 12-argument
-- form's of 004 (see there), and the measurements are written with the outcome, in the same UPDATE,
-- or not at all (an attempt that already has an outcome is never changed).
CREATE FUNCTION unitvisor.record_outcome(
    run_id uuid, attempt integer, host_id text, host_epoch bigint, outcome text, exit_status text,
    reason text, next_state text, retry_delay interval, invocation_id text, started_at timestamptz,
    ended_at timestamptz, cpu_usage_nsec bigint, memory_peak_bytes bigint, io_read_bytes bigint,
    io_write_bytes bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    latest integer;
    state_after text := record_outcome.next_state;
    delay interval := record_outcome.retry_delay;
    detail text;
BEGIN
    PERFORM unitvisor.check_fence(record_outcome.host_id, record_outcome.host_epoch);
    IF state_after NOT IN ('queued', 'succeeded', 'failed', 'cancelled') OR (state_after = 'queued') <> (delay IS NOT NULL) THEN
        RAISE EXCEPTION 'an outcome moves its run to succeeded, failed or cancelled, or to queued with a retry delay'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Checked here, before the UPDATE, so that the error names the arguments.
    IF least(record_outcome.cpu_usage_nsec, record_outcome.memory_peak_bytes, record_outcome.io_read_bytes,
             record_outcome.io_write_bytes) < 0 THEN
        RAISE EXCEPTION 'cpu_usage_nsec, memory_peak_bytes, io_read_bytes and io_write_bytes: must be NULL (not measured) or at least 0'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'attempts',
                  CONSTRAINT = 'attempts_accounting_valid';
    END IF;
    UPDATE unitvisor.attempts a SET outcome = record_outcome.outcome, exit_status = record_outcome.exit_status,
        reason = record_outcome.reason, ended_at = coalesce(record_outcome.ended_at, now()),
        invocation_id = coalesce(a.invocation_id, record_outcome.invocation_id),
        -- a unit seen only once it had ended (adopted after a crash) did start
        started_at = CASE WHEN record_outcome.invocation_id IS NULL AND record_outcome.started_at IS NULL
                          THEN a.started_at ELSE coalesce(a.started_at, record_outcome.started_at, now()) END,
        cpu_usage_nsec = record_outcome.cpu_usage_nsec, memory_peak_bytes = record_outcome.memory_peak_bytes,
        io_read_bytes = record_outcome.io_read_bytes, io_write_bytes = record_outcome.io_write_bytes
    WHERE a.run_id = record_outcome.run_id AND a.attempt = record_outcome.attempt AND a.outcome IS NULL
      -- its own attempt, or one of a host declared dead that it is taking over
      AND (a.host_id = record_outcome.host_id
           OR EXISTS (SELECT 1 FROM unitvisor.hosts h WHERE h.id = a.host_id AND h.state = 'dead'));
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    SELECT max(a.attempt) INTO latest FROM unitvisor.attempts a WHERE a.run_id = record_outcome.run_id;
    IF latest <> record_outcome.attempt THEN
        RETURN true;  -- an older attempt settled late; the run follows its newest attempt
    END IF;
    detail := format('attempt %s: %s (%s)', record_outcome.attempt, record_outcome.outcome, record_outcome.reason);
    IF delay IS NOT NULL AND (SELECT r.cancel_requested_at IS NOT NULL FROM unitvisor.runs r
                              WHERE r.id = record_outcome.run_id FOR UPDATE) THEN
        -- Cancelled while this outcome was on its way: the operator's word ends the run.
        delay := NULL;
        state_after := 'cancelled';
        detail := detail || '; no retry, a cancel was requested';
    END IF;
    IF delay IS NOT NULL THEN
        INSERT INTO unitvisor.spawn_jobs (run_id, priority, scheduled_at)
        SELECT r.id, r.priority, now() + delay FROM unitvisor.runs r WHERE r.id = record_outcome.run_id;
        -- round() of a double rounds half to even, as Python's format did before this moved here
        detail := detail || format('; retry in %ss', round(extract(epoch FROM delay)::double precision));
    END IF;
    UPDATE unitvisor.runs r SET state = state_after, updated_at = now(),
        finished_at = CASE WHEN state_after IN ('succeeded', 'failed', 'cancelled') THEN now() END
    WHERE r.id = record_outcome.run_id;
    INSERT INTO unitvisor.run_events (run_id, attempt, host_id, state, reason)
    VALUES (record_outcome.run_id, record_outcome.attempt, record_outcome.host_id, state_after, detail);
    RETURN true;
END $$;

REVOKE EXECUTE ON FUNCTION unitvisor.record_outcome(uuid, integer, text, bigint, text, text, text, text, interval,
    text, timestamptz, timestamptz, bigint, bigint, bigint, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.record_outcome(uuid, integer, text, bigint, text, text, text, text, interval,
    text, timestamptz, timestamptz, bigint, bigint, bigint, bigint) TO unitvisor_host;

-- The 12-argument form (0.3.0 daemons): the same outcome, nothing measured. Replaced
-- in place, so that its grants stay; its body is the one above, reached with NULLs.
CREATE OR REPLACE FUNCTION unitvisor.record_outcome(
    run_id uuid, attempt integer, host_id text, host_epoch bigint, outcome text, exit_status text,
    reason text, next_state text, retry_delay interval, invocation_id text, started_at timestamptz,
    ended_at timestamptz) RETURNS boolean
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT unitvisor.record_outcome($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12,
                                    NULL::bigint, NULL::bigint, NULL::bigint, NULL::bigint)
$$;

-- The output tails of ended attempts of the calling host, in one statement: the daemon reads each
-- from its journal a moment after the outcome is recorded (journald takes in a run's last lines
-- asynchronously), off the loop that records outcomes, and writes those it has together. Only an
-- attempt of its own that has an outcome and no tail yet takes one: a tail is written once, never
-- replaced, so history stays append-only. Returns how many attempts took theirs.
CREATE FUNCTION unitvisor.record_output_tails(host_id text, host_epoch bigint, run_ids uuid[], attempts integer[],
                                              output_tails text[]) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    written integer;
BEGIN
    PERFORM unitvisor.check_fence(record_output_tails.host_id, record_output_tails.host_epoch);
    IF cardinality(record_output_tails.run_ids) IS DISTINCT FROM cardinality(record_output_tails.attempts)
            OR cardinality(record_output_tails.run_ids) IS DISTINCT FROM cardinality(record_output_tails.output_tails) THEN
        RAISE EXCEPTION 'run_ids, attempts and output_tails: must be arrays of the same length'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Checked here so that the error says which bound, and never echoes a tail (output may hold secrets).
    IF EXISTS (SELECT 1 FROM unnest(record_output_tails.output_tails) AS t(tail) WHERE octet_length(t.tail) > 65536) THEN
        RAISE EXCEPTION 'output_tails: a tail is more than the 65536 bytes an attempt keeps'
            USING ERRCODE = 'check_violation', SCHEMA = 'unitvisor', TABLE = 'attempts',
                  CONSTRAINT = 'attempts_output_tail_valid';
    END IF;
    UPDATE unitvisor.attempts a SET output_tail = t.tail
    FROM unnest(record_output_tails.run_ids, record_output_tails.attempts, record_output_tails.output_tails)
         AS t(run_id, attempt, tail)
    WHERE a.run_id = t.run_id AND a.attempt = t.attempt AND a.host_id = record_output_tails.host_id
      AND a.outcome IS NOT NULL AND a.output_tail IS NULL AND t.tail IS NOT NULL;
    GET DIAGNOSTICS written = ROW_COUNT;
    RETURN written;
END $$;

REVOKE EXECUTE ON FUNCTION unitvisor.record_output_tails(text, bigint, uuid[], integer[], text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION unitvisor.record_output_tails(text, bigint, uuid[], integer[], text[]) TO unitvisor_host;
