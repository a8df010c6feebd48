-- unitvisor schema: the check every host call starts with, in PL/pgSQL, so that a session plans it once
-- (issue 23, point 4: the idle fleet's cost per host, and what a backlog adds to it).
--
-- acts_as (013) was a SQL function with SECURITY DEFINER and a SET, which PostgreSQL (before 18) never
-- inlines and whose plan it keeps no longer than the statement that called it: 037's lesson, missed for
-- the one function that every host call reaches, through require_host (the heartbeat, the claim,
-- check_fence ...). Each transaction planned its statement again. Measured on a throwaway PostgreSQL 15
-- (one host, 3,000 heartbeats, one a transaction, track_functions = pl): require_host took 55 us of a
-- heartbeat's 140 us idle, and 64 of 206 us with 1,000 runs that no host accepts queued. In PL/pgSQL the
-- same statement is planned at a session's first call and kept: require_host 8 us, a heartbeat 78 us idle
-- and 134 us with the backlog. Nothing else changes: the same statement, the same SECURITY DEFINER and
-- search_path, the same result.

CREATE OR REPLACE FUNCTION unitvisor.acts_as(host_id text) RETURNS boolean
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RETURN pg_has_role(session_user, 'unitvisor_admin', 'MEMBER')
        OR EXISTS (SELECT 1 FROM unitvisor.host_roles b
                   WHERE b.role_name = session_user::text AND b.host_id = acts_as.host_id);
END $$;
