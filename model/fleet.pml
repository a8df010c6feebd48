/*
 * unitvisor's fleet protocol: claim, epoch, heartbeat, takeover, self-fence (issue 21, item 3).
 *
 * Checked by spin in safety mode (model/verify, `make model`). docs/fleet.md, "The model", maps every
 * variable and step below to the SQL function or the Python that implements it: change one, change the
 * other. What is abstracted away is listed there too.
 *
 * The world: one run with at most MAXA attempts; three machines: A (m 0) and B (m 1) hold host ids 0
 * and 1, C (m 2) is a clone of A (another instance with host id 0: a cloned machine id, a reused
 * [host] id). Each machine has a daemon (crashes, stops cleanly, restarts at any step, loses its
 * connection and re-registers), the run units systemd keeps for it (they outlive the daemon), and a
 * fence watcher (a process of its own, not the daemon) that stops the machine's units once its lease
 * has expired. The database executes each request atomically (one transaction); a request or its reply
 * may be lost, and one request per machine may outlive the connection that sent it and commit later.
 *
 * Time is not a clock but an order of events (clock-free): for each host id, `passed[k]` counts the
 * heartbeat commits of k whose lease window is over. A lease renewed from commit g is valid while
 * passed < g. The database may call k overdue (silent for longer than host_dead_after) only once every
 * lease window of k is over AND every fence watcher of k has stopped the units it had to stop: the
 * timing rule of docs/fleet.md (the lease, measured from before the heartbeat was sent, plus stop_grace
 * plus the watcher's period, ends before host_dead_after measured from the heartbeat's commit) becomes
 * an enabling condition. With SELF_FENCE 0 there is no watcher, and nothing to wait for.
 *
 * Properties, asserted where the quantity grows:
 *   live_copies <= 1        at most one live copy of the run (stop_runs_when_cut_off is on)
 *   attempt_starts[a] <= 1  an attempt's unit is started at most once, on any machine
 *   attempt_settles[a] <= 1 a settled attempt is never settled again
 *   drained_claims == 0     a host the operator drained claims nothing until undrained (schema 24)
 *   quiet_declared == 0     a host stopped cleanly with nothing open is never declared dead (schema 24)
 */

/* -- the protocol's switches (1: as fixed in this release; the mutants turn one off) ------------- */
#ifndef EPOCH_CHECK
#define EPOCH_CHECK 1        /* check_fence and the heartbeat compare the caller's epoch */
#endif
#ifndef SELF_FENCE
#define SELF_FENCE 1         /* the fence watcher stops a machine's units once its lease expired */
#endif
#ifndef HOLD_ID
#define HOLD_ID 1            /* another instance takes a host id only with nothing open, or once silent */
#endif
#ifndef TAKEOVER
#define TAKEOVER 1           /* another instance taking a silent id with open attempts: 1 settles them
                                lost in the same transaction, 2 is refused until a peer declared the host
                                dead, 0 leaves them open (its reconcile would start them again) */
#endif
#ifndef START_NEEDS_LEASE
#define START_NEEDS_LEASE 1  /* a unit starts only while its machine's lease is valid */
#endif
#ifndef CLAIM_NEEDS_LIVE
#define CLAIM_NEEDS_LIVE 1   /* claim_jobs refuses a host the database already counts as silent */
#endif
#ifndef OUTCOME_ONCE
#define OUTCOME_ONCE 1       /* record_outcome changes only an attempt with no outcome */
#endif
#ifndef ASIDE_HB
#define ASIDE_HB 1           /* a busy loop's heartbeat is sent by a thread on a connection of its own */
#endif
#ifndef STOP_DRAINING
#define STOP_DRAINING 1      /* mark_host_stopped stops a draining host too (schema 24); 0: only an active
                                one, as before 24, so a drained host that stopped stayed draining */
#endif
#ifndef KEEP_DRAIN
#define KEEP_DRAIN 1         /* a draining host's clean stop keeps the drain (left_draining) for its next
                                registration */
#endif

/* -- bounds (the state space) ------------------------------------------------------------------ */
#ifndef MAXA
#define MAXA 2               /* attempts of the run: the only retried outcome here is LOST, so this
                                is its max_lost_attempts (schema 27: a lost attempt does not count
                                against max_attempts), or its max_attempts with count_lost */
#endif
#ifndef STAMPS
#define STAMPS 3             /* commits that stamp a host's heartbeat_at, per host id */
#endif
#ifndef DOWNS
#define DOWNS 1              /* crashes and clean stops of A's daemon (B, the peer, and C stay up) */
#endif
#ifndef CLONE
#define CLONE 1              /* C, a second instance of host id 0, takes part */
#endif
#ifndef LOSSES
#define LOSSES 2             /* answers lost and requests delayed past their connection, in all */
#endif
#ifndef DRAINS
#define DRAINS 1             /* the operator's drains and undrains of host id 0 (unitvisor drain, undrain) */
#endif

#define NM 3                 /* machines: 0 A, 1 B, 2 C (clone of A) */
#define NH 2                 /* host ids */
#define HID(m) ((m) == 1 -> 1 : 0)

/* host states (unitvisor.hosts.state) */
#define NONE 0
#define ACTIVE 1
#define STOPPED 2
#define DEAD 3
#define DRAINING 4
#define LIVE_STATE(s) ((s) == ACTIVE || (s) == DRAINING)

/* the run's state: queued, starting/running, finished */
#define QUEUED 0
#define INFLIGHT 1
#define FINISHED 2

/* an attempt's outcome */
#define OPEN 0
#define SUCCESS 1
#define LOST 2

/* a unit on a machine */
#define GONE 0               /* not loaded (never started, or released) */
#define RUN_COVERED 1        /* running; started while the machine's lease was valid */
#define RUN_UNCOVERED 2      /* running; started with the lease expired (only with START_NEEDS_LEASE 0) */
#define ENDED_SELF 3         /* ended by itself, outcome not yet recorded */
#define ENDED_STOPPED 4      /* stopped by the fence watcher or as stale */
#define REFUSED 5            /* created, its start refused by the lease check: ended, the command never ran */
#define RUNNING(s) ((s) == RUN_COVERED || (s) == RUN_UNCOVERED)
#define ENDED(s) ((s) == ENDED_SELF || (s) == ENDED_STOPPED || (s) == REFUSED)

/* requests (each one transaction) and replies */
#define REG 1                /* unitvisor.register_host */
#define HB 2                 /* unitvisor.heartbeat */
#define CLAIM 3              /* unitvisor.claim_jobs */
#define MARK 4               /* unitvisor.mark_started */
#define REC 5                /* unitvisor.record_outcome */
#define DECL 6               /* unitvisor.declare_dead_hosts + the lost outcomes, one transaction */
#define STOP 7               /* unitvisor.mark_host_stopped */

#define R_OK 1
#define R_REFUSED 2          /* register_host: the id is held */
#define R_FENCED 3           /* SQLSTATE UV001 */

/* -- the database ------------------------------------------------------------------------------ */
byte hstate[NH];
bit left_draining[NH];       /* stopped (or then declared dead) while draining: comes back draining; the
                                code's drained_before_death is the same bit for a host draining at its death */
byte hepoch[NH];
byte hinst[NH];              /* the machine (instance) that holds the id */
byte stamps[NH];             /* heartbeat generations: commits that stamped heartbeat_at */
bit overdue[NH];             /* heartbeat_at older than host_dead_after (host_is_overdue's clock half) */
byte epochs;                 /* the sequence unitvisor.host_epochs */

byte run_state;              /* QUEUED */
byte attempts;               /* attempts made */
byte a_host[MAXA + 1];
byte a_outcome[MAXA + 1];
bit a_started[MAXA + 1];

/* -- time: lease windows that are over, per host id --------------------------------------------- */
byte passed[NH];

/* -- the machines ------------------------------------------------------------------------------ */
bit up[NM];
byte ep[NM];                 /* the daemon's fence epoch; 0: not registered */
byte todo[NM];               /* an attempt the daemon is about to start (a claim's reply, a reconcile) */
byte lease[NM];              /* the heartbeat generation the lease file was renewed from */
byte downs[NM];
byte losses;
byte drains;                 /* the operator's drains and undrains so far */
byte unit[NM * (MAXA + 1)];  /* unit[m * (MAXA + 1) + a] */
#define U(m, a) unit[(m) * (MAXA + 1) + (a)]

/* a request that outlived the connection that sent it: it may still commit, later, or never */
byte stale[NM];
byte stale_arg[NM];
byte stale_ep[NM];

/* -- ghosts (the properties) ------------------------------------------------------------------- */
byte live_copies;
bit drain_wanted[NH];        /* the operator drained k (set_host_state took it) and has not undrained it */
byte drained_claims;         /* claims by a host the operator drained: must stay 0 */
bit quiet_stop[NH];          /* k's daemon stopped cleanly (mark_host_stopped committed in its epoch) and
                                k has not registered since */
byte quiet_declared;         /* such a host declared dead with nothing open: must stay 0 */
byte attempt_starts[MAXA + 1];
byte attempt_settles[MAXA + 1];

#define OPEN_OF(a, k) ((a) <= attempts && a_outcome[a] == OPEN && a_host[a] == (k))
#define HAS_OPEN(k) (OPEN_OF(1, k) || OPEN_OF(2, k))
#define LEASE_VALID(m) (lease[m] > passed[HID(m)])
/* check_fence (sql/004_roles.sql): the row exists, is not dead, and has the caller's epoch */
#define FENCE_OK(k, e) (hstate[k] != NONE && hstate[k] != DEAD && (!EPOCH_CHECK || hepoch[k] == (e)))
/* a machine of host id k still has a unit its watcher must stop before k may be called overdue */
#define COVERED(m) (U(m, 1) == RUN_COVERED || U(m, 2) == RUN_COVERED)
#define WATCHERS_DONE(k) (!SELF_FENCE || ((k) == 1 -> !COVERED(1) : (!COVERED(0) && !COVERED(2))))

/* An attempt's outcome and its run's next state (record_outcome; fleet.takeover_outcome). */
inline settle(sa, so) {
    attempt_settles[sa]++;
    printf("settle attempt %d outcome %d\n", sa, so);
    assert(attempt_settles[sa] <= 1);
    a_outcome[sa] = so;
    if
    /* failure_verdict: a lost attempt retried while the run has had fewer than MAXA lost ones (every
       attempt that reaches here again was retried after a LOST), by the database whatever was proposed */
    :: sa == attempts && so == LOST && attempts < MAXA -> run_state = QUEUED  /* retried: sa new spawn job */
    :: sa == attempts && !(so == LOST && attempts < MAXA) -> run_state = FINISHED
    :: sa != attempts -> skip                       /* an older attempt settled late */
    fi
}

inline settle_open_of(sk) {
    if
    :: OPEN_OF(1, sk) -> settle(1, LOST)
    :: else -> skip
    fi;
    if
    :: OPEN_OF(2, sk) -> settle(2, LOST)
    :: else -> skip
    fi
}

/* heartbeat_at = now(): a new heartbeat generation, the host is not silent */
inline stamp(tk) {
    stamps[tk]++;
    overdue[tk] = 0
}

inline new_epoch(nk) {
    epochs++;
    hepoch[nk] = epochs
}

/* register_host's new state (schema 24): draining if it was, or if it stopped or died draining */
inline come_back(ck) {
    if
    :: hstate[ck] == DRAINING || ((hstate[ck] == STOPPED || hstate[ck] == DEAD) && left_draining[ck]) ->
        hstate[ck] = DRAINING
    :: else -> hstate[ck] = ACTIVE
    fi;
    left_draining[ck] = 0;
    quiet_stop[ck] = 0
}

/* unitvisor.set_host_state (schemas 21, 24), by the operator: a live host's state; a stopped one's drain
   kept for its next registration; a dead (or unknown) one is left alone */
inline operator_sets(ok, drain) {
    if
    :: LIVE_STATE(hstate[ok]) -> hstate[ok] = (drain -> DRAINING : ACTIVE); drain_wanted[ok] = drain
    :: hstate[ok] == STOPPED -> left_draining[ok] = drain; drain_wanted[ok] = drain
    :: else -> skip
    fi;
    printf("operator sets id%d drain %d\n", ok, drain)
}

/* unitvisor.register_host (sql/004_roles.sql, as fixed in this release) */
inline db_register() {
    if
    :: hstate[k] == NONE ->
        new_epoch(k); hinst[k] = m; hstate[k] = ACTIVE; quiet_stop[k] = 0; stamp(k); r = R_OK
    :: hstate[k] != NONE && hinst[k] == m ->
        /* the same instance (a restart, a reconnect): the same epoch, unless it was declared dead */
        if
        :: hstate[k] == DEAD -> new_epoch(k)
        :: else -> skip
        fi;
        come_back(k); stamp(k); r = R_OK
    :: hstate[k] != NONE && hinst[k] != m ->
        /* another instance */
        if
        :: ((HOLD_ID && hstate[k] != DEAD
             && ((!overdue[k] && (LIVE_STATE(hstate[k]) || HAS_OPEN(k))) || (TAKEOVER == 2 && HAS_OPEN(k))))
            || (!HOLD_ID && LIVE_STATE(hstate[k]) && !overdue[k])) ->
            r = R_REFUSED
        :: else ->
            if
            :: TAKEOVER == 1 && hstate[k] != DEAD -> settle_open_of(k)
            :: else -> skip
            fi;
            new_epoch(k); hinst[k] = m; come_back(k); stamp(k); r = R_OK
        fi
    fi;
    printf("register m%d id%d -> %d epoch %d\n", m, k, r, hepoch[k]);
    if
    :: r == R_OK -> r_arg = hepoch[k]; r_gen = stamps[k]
    :: else -> skip
    fi
}

/* One request (kind, arg, with epoch e) of machine m, committed in one transaction; its answer in
   r, r_arg (the epoch of REG, the attempt of CLAIM) and r_gen (the stamp of REG and HB). */
inline db_commit() {
    k = HID(m);
    r = R_OK; r_arg = 0; r_gen = 0;
    if
    :: kind == REG -> db_register()
    :: kind == HB ->
        /* unitvisor.heartbeat: UPDATE ... WHERE epoch = $epoch AND state <> 'dead' */
        if
        :: FENCE_OK(k, e) -> stamp(k); r_gen = stamps[k]
        :: else -> r = R_FENCED
        fi
    :: kind == CLAIM ->
        /* unitvisor.claim_jobs: check_fence, then only an active host, a queued run, attempts left */
        if
        :: FENCE_OK(k, e) ->
            r_arg = 0;
            if
            :: (hstate[k] == ACTIVE && (!CLAIM_NEEDS_LIVE || !overdue[k]) && run_state == QUEUED
                && attempts < MAXA) ->
                attempts++; a_host[attempts] = k; a_outcome[attempts] = OPEN; a_started[attempts] = 0;
                run_state = INFLIGHT; r_arg = attempts;
                if
                :: drain_wanted[k] -> drained_claims++
                :: else -> skip
                fi;
                assert(drained_claims == 0);
                printf("claim m%d attempt %d\n", m, attempts)
            :: else -> skip
            fi
        :: else -> r = R_FENCED
        fi
    :: kind == MARK ->
        /* unitvisor.mark_started: only its own open attempt */
        if
        :: FENCE_OK(k, e) ->
            if
            :: a_outcome[arg] == OPEN && a_host[arg] == k -> a_started[arg] = 1
            :: else -> skip
            fi
        :: else -> r = R_FENCED
        fi
    :: kind == REC ->
        /* unitvisor.record_outcome: its own attempt, not settled yet; arg: attempt * 4 + outcome */
        if
        :: FENCE_OK(k, e) ->
            if
            :: (!OUTCOME_ONCE || a_outcome[arg / 4] == OPEN) && a_host[arg / 4] == k && arg / 4 <= attempts ->
                settle(arg / 4, arg % 4)
            :: else -> skip
            fi
        :: else -> r = R_FENCED
        fi
    :: kind == DECL ->
        /* declare_dead_hosts (host_is_overdue) and, in the same transaction, the lost outcomes
           (Reconciler.take_over_dead_hosts) */
        if
        :: FENCE_OK(k, e) ->
            if
            :: overdue[1 - k] && (LIVE_STATE(hstate[1 - k]) || (hstate[1 - k] == STOPPED && HAS_OPEN(1 - k))) ->
                printf("m%d declares id%d dead\n", m, 1 - k);
                if
                :: quiet_stop[1 - k] && !HAS_OPEN(1 - k) -> quiet_declared++
                :: else -> skip
                fi;
                assert(quiet_declared == 0);
                if
                :: hstate[1 - k] == DRAINING -> left_draining[1 - k] = 1
                :: else -> skip
                fi;
                hstate[1 - k] = DEAD; new_epoch(1 - k); settle_open_of(1 - k)
            :: else -> skip
            fi
        :: else -> r = R_FENCED
        fi
    :: kind == STOP ->
        /* unitvisor.mark_host_stopped (schema 24: a draining host too, keeping its drain) */
        if
        :: hepoch[k] == e && (hstate[k] == ACTIVE || (STOP_DRAINING && hstate[k] == DRAINING)) ->
            left_draining[k] = (KEEP_DRAIN && hstate[k] == DRAINING);
            hstate[k] = STOPPED; quiet_stop[k] = 1; stamp(k); printf("m%d stopped\n", m)
        :: hepoch[k] == e && !STOP_DRAINING && hstate[k] == DRAINING ->
            quiet_stop[k] = 1; printf("m%d stopped, left draining\n", m)  /* the UPDATE matched no row */
        :: else -> skip
        fi
    fi
}

/* A request that would stamp heartbeat_at past the bound is dropped (as if lost): the bound on runs. */
#define STAMP_BOUND(k) ((k) == 0 -> STAMPS : 1)
#define STAMPS_LEFT (!(kind == REG || kind == HB || kind == STOP) || stamps[HID(m)] < STAMP_BOUND(HID(m)))

/* Time, the units' own ends, the fence watchers, and requests that outlived their connection. */
#define UNIT_ENDS(m, a) :: atomic { RUNNING(U(m, a)) -> U(m, a) = ENDED_SELF; live_copies-- }
#define WATCHER_STOPS(m, a) if :: RUNNING(U(m, a)) -> U(m, a) = ENDED_STOPPED; live_copies-- :: else -> skip fi
#define WATCHER(m) :: atomic { !LEASE_VALID(m) && (RUNNING(U(m, 1)) || RUNNING(U(m, 2))) -> \
                                WATCHER_STOPS(m, 1); WATCHER_STOPS(m, 2); printf("watcher m%d stops\n", m) }
#define STALE(mm) :: atomic { stale[mm] -> m = mm; kind = stale[m]; arg = stale_arg[m]; e = stale_ep[m]; \
                               if :: STAMPS_LEFT -> db_commit() :: else -> skip fi; \
                               stale[m] = 0; stale_arg[m] = 0; stale_ep[m] = 0; \
                               m = 0; k = 0; kind = 0; arg = 0; e = 0; r = 0; r_arg = 0; r_gen = 0 }
proctype World() {
    byte m, k, kind, arg, e, r, r_arg, r_gen;
end:
    do
    /* A lease window of host id k is over (cut_off_after since a heartbeat was sent). */
    :: atomic { passed[0] < stamps[0] -> passed[0]++ }
    /* host_dead_after since k's last stamp, by the database's clock: after every lease window of k is
       over and every watcher of k had stop_grace to stop its units. */
    :: atomic { !overdue[0] && hstate[0] != NONE && passed[0] == stamps[0] && WATCHERS_DONE(0) -> overdue[0] = 1; printf("id0 overdue\n") }
    /* The operator drains or undrains host id 0 (unitvisor drain / undrain: set_host_state). */
    :: atomic { drains < DRAINS && !drain_wanted[0] -> drains++; operator_sets(0, 1) }
    :: atomic { drains < DRAINS && drain_wanted[0] -> drains++; operator_sets(0, 0) }
    /* A run's process ends by itself. */
    UNIT_ENDS(0, 1)
    UNIT_ENDS(0, 2)
    UNIT_ENDS(1, 1)
    UNIT_ENDS(1, 2)
    UNIT_ENDS(2, 1)
    UNIT_ENDS(2, 2)
#if SELF_FENCE
    /* The fence watcher of machine m: its lease is over, so it stops every unit of the machine. */
    WATCHER(0)
    WATCHER(1)
    WATCHER(2)
#endif
    /* A request sent on a connection since dropped commits now (or is lost: the slot empties). */
    STALE(0)
    STALE(1)
    STALE(2)
    od
}

/* The connection is gone (a crash, a lost reply, the stall breaker): register again on a new one. */
inline drop_connection() {
    ep[m] = 0; todo[m] = 0
}

/* One request of this daemon, one transaction: committed and answered; committed with the answer lost;
   or still on its way when the connection is dropped (it may commit later: World's STALE), or lost. */
inline rpc(rkind, rarg) {
    kind = rkind; arg = rarg; e = ep[m];
    if
    :: STAMPS_LEFT -> db_commit(); answer()
    :: STAMPS_LEFT && m != 1 && losses < LOSSES -> losses++; db_commit(); drop_connection()
    :: !stale[m] && m != 1 && losses < LOSSES -> losses++; stale[m] = kind; stale_arg[m] = arg; stale_ep[m] = e; drop_connection()
    :: else -> drop_connection()                           /* lost, or past the bound on stamps */
    fi;
    k = HID(m); kind = 0; arg = 0; e = 0; r = 0; r_arg = 0; r_gen = 0
}

/* The daemon acts on an answer. */
inline answer() {
    if
    :: r == R_FENCED -> drop_connection()                /* Daemon._guard: register again */
    :: r == R_OK && kind == REG -> ep[m] = r_arg; renew()  /* registered: its epoch; the lease */
    :: r == R_OK && kind == HB -> renew()                  /* the lease, renewed after the commit */
    :: r == R_OK && kind == CLAIM -> todo[m] = r_arg
    :: else -> skip                                        /* host-id-conflict (tried again), done */
    fi
}

/* The lease file, written after a committed heartbeat, valid from before it was sent. */
inline renew() {
    if
    :: lease[m] < r_gen -> lease[m] = r_gen
    :: else -> skip
    fi
}

/* Start attempt ua's unit (Reconciler.start): an existing unit is adopted, never started twice. */
inline start_unit(ua) {
    if
    :: U(m, ua) != GONE -> rpc(MARK, ua)
    :: U(m, ua) == GONE && (LEASE_VALID(m) || !START_NEEDS_LEASE) ->
        assert(live_copies == 0);
        assert(attempt_starts[ua] == 0);
        attempt_starts[ua]++;
        printf("m%d starts attempt %d\n", m, ua);
        live_copies++;
        if
        :: LEASE_VALID(m) -> U(m, ua) = RUN_COVERED
        :: else -> U(m, ua) = RUN_UNCOVERED
        fi;
        rpc(MARK, ua)
    :: else ->
        /* the lease is over: the unit is created, its ExecCondition= refuses, the command never runs;
           the reconcile pass settles the attempt LOST (reconciler.decide, fence.refused_start_outcome) */
        U(m, ua) = REFUSED;
        rpc(MARK, ua)
    fi
}

/* One open attempt ra of this host, as the reconcile pass decides it (reconciler.decide). */
inline reconcile(ra) {
    if
    :: ENDED(U(m, ra)) -> rpc(REC, ra * 4 + (U(m, ra) == ENDED_SELF -> SUCCESS : LOST))
    :: RUNNING(U(m, ra)) && !a_started[ra] -> rpc(MARK, ra)          /* adopted */
    :: U(m, ra) == GONE && !a_started[ra] -> todo[m] = ra             /* claimed, no unit yet: start */
    :: U(m, ra) == GONE && a_started[ra] -> rpc(REC, ra * 4 + LOST)  /* gone, no outcome */
    fi
}

#define IDLE (up[m] && ep[m] && !todo[m])
/* the reconcile pass on one attempt a of this host (store.open_attempts reads; no fence), or on a unit
   whose attempt is settled: stop-stale while it runs, release once it ended */
#define RECONCILE(a) \
    :: atomic { IDLE && OPEN_OF(a, k) && !(RUNNING(U(m, a)) && a_started[a]) -> reconcile(a) } \
    :: atomic { IDLE && a <= attempts && a_outcome[a] != OPEN && RUNNING(U(m, a)) -> \
                U(m, a) = ENDED_STOPPED; live_copies-- } \
    :: atomic { IDLE && a <= attempts && a_outcome[a] != OPEN && ENDED(U(m, a)) -> U(m, a) = GONE }

proctype Daemon(byte m) {
    byte k = HID(m), kind, arg, e, r, r_arg, r_gen, a;
end:
    do
    /* register (after every connect) */
    :: atomic { up[m] && !ep[m] -> rpc(REG, 0) }
    /* heartbeat (store.probe), every poll interval */
    :: atomic { IDLE && stamps[k] < STAMP_BOUND(k) -> rpc(HB, 0) }
    /* claim (store.claim) */
    :: atomic { IDLE && run_state == QUEUED -> rpc(CLAIM, 0) }
    /* start what was claimed or found unstarted */
    :: atomic { up[m] && ep[m] && todo[m] -> a = todo[m]; todo[m] = 0; start_unit(a); a = 0 }
    RECONCILE(1)
    RECONCILE(2)
#if ASIDE_HB
    /* the heartbeat sent aside (supervisor/heartbeat.py, schema 19's renew_heartbeat): while the loop
       is busy (here: a claimed batch not started yet, when IDLE is false), a thread sends the heartbeat
       alone on a connection of its own. Committed or not, answered or not, it never drops the loop's
       connection; a fenced answer is left to the loop's next request. */
    :: atomic { up[m] && ep[m] && todo[m] && stamps[k] < STAMP_BOUND(k) ->
                kind = HB; arg = 0; e = ep[m];
                if
                :: db_commit();
                   if :: r == R_OK -> renew() :: true -> skip fi   /* the answer, or its loss */
                :: skip                                             /* lost before it committed */
                fi;
                k = HID(m); kind = 0; arg = 0; e = 0; r = 0; r_arg = 0; r_gen = 0 }
#endif
    /* fleet upkeep: declare silent hosts dead (schema 19's guards and cap only hold declarations back:
       each pass they let through is one this step already allows) */
    :: atomic { IDLE && overdue[1 - k] -> rpc(DECL, 0) }
    /* a crash: the units keep running, the lease file stays */
    :: atomic { m == 0 && up[m] && downs[m] < DOWNS -> downs[m]++; drop_connection(); up[m] = 0; printf("m%d crashes\n", m) }
    /* a clean stop (systemctl stop): mark_host_stopped, then exit */
    :: atomic { m == 0 && IDLE && downs[m] < DOWNS -> downs[m]++; rpc(STOP, 0); drop_connection(); up[m] = 0 }
    /* systemd restarts it */
    :: atomic { !up[m] -> up[m] = 1 }
    od
}

init {
    atomic {
        run_state = QUEUED;
        up[0] = 1; up[1] = 1;
        run World();
        run Daemon(0);
        run Daemon(1);
#if CLONE
        up[2] = 1;
        run Daemon(2)
#endif
    }
}
