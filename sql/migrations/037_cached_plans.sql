-- unitvisor schema: the four functions a heartbeat, a claim and a waiting run's reason ask for each run or
-- host, in PL/pgSQL, so that each session plans them once (issue 23, point 4: runs that cannot start).
--
-- They were SQL functions. PostgreSQL (before 18) keeps no plan of a SQL function that it does not inline
-- beyond the one statement that called it: host_has_work (029) asks host_refusal and concurrency_blocker
-- from PL/pgSQL expressions, once a heartbeat, and each time the function's statement was planned again;
-- key_blocker_text plans concurrency_blocker again for every run explain_waiting explains. Measured on a
-- throwaway PostgreSQL 15 with 300 hosts (one session, every host's heartbeat in turn, then one
-- explain_waiting pass): a heartbeat with 1,000 runs that no host accepts queued took 1.02 ms, against
-- 0.55 idle, and one with 10,000 runs behind one key 1.66 ms; an explain_waiting pass over the key's
-- runs 417 ms, 0.48 ms a run in key_blocker_text. In PL/pgSQL the same statements are planned at a
-- session's first call and kept: 0.79 and 0.97 ms a heartbeat, 95 ms a pass. In bench.scale's fleet
-- (docs/benchmarks.md, issue 23) every heartbeat is a daemon's, six a minute a host: this was most of what
-- (S4) and (S5) added to the idle fleet's cost.
--
-- What it costs: host_refusal, a SQL function with no SET so that it could be inlined, is no longer
-- inlined where it was (fleet_refusal and also_accepted ask it per host, inside one statement; the
-- claim's own refusal is memoised per kind of run, 020). Measured the same way, an explain_waiting pass
-- over 1,000 refused runs of one kind and a claim of a burst cost no more than they did (92 against 95 ms a
-- pass; 8.5 against 9.0 ms a claimed run, 3,500 runs claimed by 300 hosts in turn). The bodies are the
-- same statements; concurrency_blocker and key_blocker_text return NULL for a run with no concurrency key
-- before any statement (the SQL versions' CASE said the same): explain_waiting asks key_blocker_text of
-- every run it explains, keyed or not, and without that early return a pass over 1,000 keyless runs took
-- 149 ms. Each now sets its search_path, as every PL/pgSQL function here does.

CREATE OR REPLACE FUNCTION unitvisor.host_refusal(h unitvisor.hosts, r unitvisor.runs) RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN CASE
        WHEN r.host_pin IS NOT NULL AND r.host_pin <> h.id THEN 'pinned to host ' || r.host_pin
        WHEN NOT h.can_start THEN 'cannot start units (' || coalesce(h.cannot_start_reason, 'unknown') || ')'
        -- Placement (033): every one of the run's host_labels among the host's labels, one containment
        -- on the two rows already read; the words name the pairs it lacks.
        WHEN NOT unitvisor.host_labels(h) @> coalesce(r.host_labels, '{}')
            THEN 'has no label ' || (SELECT string_agg(l.key || '=' || l.value, ', ' ORDER BY l.key)
                                     FROM jsonb_each_text(r.host_labels) AS l(key, value)
                                     WHERE NOT unitvisor.host_labels(h) @> jsonb_build_object(l.key, l.value))
        WHEN NOT EXISTS (SELECT 1 FROM unnest(h.executable_patterns) AS p(pattern) WHERE r.argv[1] ~ p.pattern)
            THEN 'executable ' || r.argv[1] || ' is not allowed'
        WHEN r.run_user IS NOT NULL AND r.run_user <> h.run_user AND NOT r.run_user = ANY (h.allowed_users)
            THEN 'user ' || r.run_user || ' is not allowed'
        WHEN unitvisor.refused_environment_name(h, r) IS NOT NULL
            THEN 'environment name ' || unitvisor.refused_environment_name(h, r) || ' is not allowed'
        WHEN r.memory_max IS NOT NULL AND h.memory_budget IS NOT NULL AND r.memory_max > h.memory_budget
            THEN 'memory_max ' || r.memory_max || ' bytes is over the memory budget'
        WHEN h.pressure_state = 'stopped' AND h.pressure_at >= h.started_at
            THEN 'claims nothing under ' || coalesce(h.pressure_resource, 'some') || ' pressure'
    END;
END $$;

CREATE OR REPLACE FUNCTION unitvisor.concurrency_blocker(r unitvisor.runs) RETURNS uuid
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF r.concurrency_key IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN coalesce(
        (SELECT l.id FROM (
             SELECT k.id, k.seq, k.concurrency_limit, count(*) OVER () AS live, min(k.concurrency_limit) OVER () AS tightest
             FROM unitvisor.runs k
             WHERE k.concurrency_key = r.concurrency_key AND k.state IN ('starting', 'running') AND k.id <> r.id) l
         WHERE l.live >= least(r.concurrency_limit, l.tightest)
         ORDER BY l.concurrency_limit, l.seq NULLS FIRST, l.id LIMIT 1),
        (SELECT k.id FROM unitvisor.runs k
         WHERE k.concurrency_key = r.concurrency_key AND k.state = 'queued' AND k.seq < r.seq
         ORDER BY k.seq DESC LIMIT 1),
        (SELECT k.id FROM unitvisor.runs k
         WHERE k.concurrency_key = r.concurrency_key AND k.state = 'queued' AND k.seq IS NULL AND k.id <> r.id
           AND (r.seq IS NOT NULL OR (k.created_at, k.id) < (r.created_at, r.id))
         ORDER BY k.created_at DESC, k.id DESC LIMIT 1));
END $$;

CREATE OR REPLACE FUNCTION unitvisor.key_blocker_text(r unitvisor.runs) RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF r.concurrency_key IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN (SELECT format('run %s (%s) with the same concurrency key', b.id,
                      CASE WHEN b.state = 'queued' AND b.held_at IS NOT NULL THEN 'queued, held by ' || b.held_by
                           ELSE b.state END)
               || CASE WHEN b.state IN ('starting', 'running') AND least(r.concurrency_limit, b.concurrency_limit) > 1
                       THEN format(', %s of %s live',
                                   (SELECT count(*) FROM unitvisor.runs k
                                    WHERE k.concurrency_key = r.concurrency_key AND k.state IN ('starting', 'running')),
                                   least(r.concurrency_limit, b.concurrency_limit))
                       ELSE '' END
        FROM unitvisor.runs b WHERE b.id = unitvisor.concurrency_blocker(r));
END $$;

CREATE OR REPLACE FUNCTION unitvisor.limit_text(r unitvisor.runs) RETURNS text
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN (SELECT format('limit %s: %s of %s live', s.name, s.live, s.max_live)
        FROM (SELECT l.name, l.max_live,
                     (SELECT count(*) FROM unitvisor.runs x
                      WHERE x.state IN ('starting', 'running') AND x.labels @> l.selector AND x.id <> r.id) AS live
              FROM unitvisor.limits l WHERE r.labels @> l.selector) s
        WHERE s.live >= s.max_live ORDER BY s.name LIMIT 1);
END $$;
