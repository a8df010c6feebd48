-- unitvisor schema: a claim waits up to 10 s for one of the fleet's claim slots, not the session's
-- lock_timeout of 5 s (issue 23: a burst claimed in a second).
--
-- 046 let a claim that had waited the session's lock_timeout walk without a slot, so that a claim never
-- fails for want of one. In bench.scale's burst of 10,000 runs on 300 hosts most claims waited that long:
-- take_claim_slot's wait was 3.6 s on average over 775 claims, and those that gave up walked together,
-- the many claims at once that the slots are there to prevent. Waiting was not cheap for the host either
-- before 049: the waiting claim held its host's row, and the heartbeat waited behind it. Since 049 it holds
-- nothing, and a longer wait costs the host only its loop's time, which the aside heartbeat covers. With
-- a 10 to 12 s wait the burst's claims all began within 2.6 to 3 s p99 instead of 11 to 13 s, and the
-- server spent about a fifth less CPU on it (docs/benchmarks.md, "0.11.0 with 049 and 050"). 10 s leaves a
-- claim at least 5 s of its statement_timeout (15 s) for the walk, whose own lock waits keep the
-- session's lock_timeout (the SET clause holds for this function's call alone); a claim that began late
-- (a loaded server) waits less, so that it never fails on its statement_timeout while it waits (at 1,000
-- hosts with a plain 10 s, 1,702 claims of a burst failed on a statement timeout, some of them in this
-- wait; 1,142 before 050).

-- take_claim_slot as in 046, waiting as said.
CREATE OR REPLACE FUNCTION unitvisor.take_claim_slot() RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp SET lock_timeout = '10s' AS $$
DECLARE
    setting text := current_setting('unitvisor.claim_slots', true);
    slots integer := CASE WHEN setting ~ '^\s*-?[0-9]{1,9}\s*$' THEN setting::integer ELSE 4 END;
    first integer;
    -- 050: at most the SET clause's lock_timeout (10 s), and never so long that the claim's statement_timeout
    -- would end it: 5 s of it are left for the walk.
    statement_ms double precision := extract(epoch FROM current_setting('statement_timeout')::interval) * 1000;
    wait_ms double precision := extract(epoch FROM current_setting('lock_timeout')::interval) * 1000;
BEGIN
    IF slots <= 0 THEN
        RETURN;
    END IF;
    first := floor(random() * slots)::integer;
    FOR i IN 0 .. slots - 1 LOOP
        IF pg_try_advisory_xact_lock(hashtextextended('unitvisor-claim-slot:' || (first + i) % slots, 0)) THEN
            RETURN;
        END IF;
    END LOOP;
    IF statement_ms > 0 THEN
        wait_ms := least(wait_ms, statement_ms - 5000
                                  - extract(epoch FROM clock_timestamp() - statement_timestamp()) * 1000);
    END IF;
    IF wait_ms < 1 THEN
        RETURN;  -- no time left to wait: walk without one
    END IF;
    -- Local to this call: the SET clause restores the session's lock_timeout for the walk.
    PERFORM set_config('lock_timeout', ceil(wait_ms)::bigint || 'ms', true);
    BEGIN
        PERFORM pg_advisory_xact_lock(hashtextextended('unitvisor-claim-slot:' || first, 0));
    EXCEPTION WHEN lock_not_available THEN
        NULL;  -- waited its time: walk without one
    END;
END $$;
