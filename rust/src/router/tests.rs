use super::*;
use crate::kv::KvCacheManager;
use crate::kv::{CacheConfig, KvEventKind};

const BS: usize = 4;

fn router(n: usize, policy: RoutingPolicy) -> Router {
    let mut cfg = RouterConfig::new(n, BS, policy);
    cfg.pending_ttl = 0.0;
    cfg.affinity_weight = 0.0;
    Router::new(cfg).unwrap()
}

/// A replica's cache: a manager with events on.
fn replica() -> KvCacheManager {
    let mut cfg = CacheConfig::new(BS, 64, 0);
    cfg.watermark = 0.0;
    let mut m = KvCacheManager::new(cfg).unwrap();
    m.set_kv_events(true);
    m
}

/// Runs a prompt through `m` (allocate, register, free) under `key`, and hands its events
/// to the router as batch `seq` of `replica`.
fn serve(r: &mut Router, m: &mut KvCacheManager, replica: usize, seq: u64, p: &[u32], key: u64) {
    let s = seq + 1000;
    m.allocate_prompt(s, p, None, key, false).unwrap().unwrap();
    m.cache_full_blocks(s, p, p.len(), key).unwrap();
    m.free(s).unwrap();
    let b = m.kv_events_mut().drain();
    let got = r
        .apply_batch(replica, seq, &b.kinds, &b.starts, &b.hashes)
        .unwrap();
    assert_eq!(got, Applied::Applied);
}

fn turn(history: &[u32], extra: u32) -> Vec<u32> {
    let mut t = history.to_vec();
    t.extend((0..9).map(|i| extra * 100 + i));
    t
}

#[test]
fn a_conversations_later_turns_go_to_the_replica_holding_its_prefix() {
    let mut r = router(2, RoutingPolicy::CacheAware);
    let mut caches = [replica(), replica()];
    let mut seqs = [0u64; 2];
    // Two conversations, each served where the router sends it.
    let mut convs = [turn(&[], 1), turn(&[], 2)];
    let mut home = [usize::MAX; 2];
    for step in 0..4 {
        for (c, conv) in convs.iter_mut().enumerate() {
            let d = r.route(conv, 0, None, 0, 0.0).unwrap();
            if step == 0 {
                home[c] = d.replica;
            } else {
                assert_eq!(d.replica, home[c], "turn {step} of conversation {c}");
                assert!(d.matched_blocks > 0);
            }
            let rep = d.replica;
            serve(&mut r, &mut caches[rep], rep, seqs[rep], conv, 0);
            seqs[rep] += 1;
            r.finish(d.ticket).unwrap();
            *conv = turn(conv, 10 + step as u32);
        }
    }
    assert_ne!(home[0], home[1], "new prefixes spread over idle replicas");
}

#[test]
fn the_lora_salt_keeps_an_adapters_prefix_apart() {
    let mut r = router(2, RoutingPolicy::CacheAware);
    let mut m = replica();
    let p = turn(&[], 3);
    serve(&mut r, &mut m, 1, 0, &p, salted_key(0, 5));
    assert_eq!(r.route(&p, 5, None, 0, 0.0).unwrap().matched_blocks, 2);
    assert_eq!(r.route(&p, 0, None, 0, 0.0).unwrap().matched_blocks, 0);
}

#[test]
fn an_index_rebuilt_from_a_snapshot_after_a_lost_batch_matches_the_cache() {
    let mut r = router(1, RoutingPolicy::CacheAware);
    let mut m = replica();
    serve(&mut r, &mut m, 0, 0, &turn(&[], 1), 0);
    // Batch 1 is lost on the way; batch 2 shows the gap.
    let s = 77;
    let p = turn(&[], 2);
    m.allocate_prompt(s, &p, None, 0, false).unwrap().unwrap();
    m.cache_full_blocks(s, &p, p.len(), 0).unwrap();
    let _lost = m.kv_events_mut().drain();
    m.reset_prefix_cache();
    let b = m.kv_events_mut().drain();
    let got = r.apply_batch(0, 2, &b.kinds, &b.starts, &b.hashes).unwrap();
    assert_eq!(got, Applied::Gap { expected: 1 });
    m.cache_full_blocks(s, &p, p.len(), 0).unwrap();
    r.apply_snapshot(0, 2, &m.registered_hashes()).unwrap();
    let mut ours = r.index().replica_hashes(0).unwrap();
    let mut theirs = m.registered_hashes();
    ours.sort_unstable();
    theirs.sort_unstable();
    assert_eq!(ours, theirs);
    assert_eq!(r.index().next_seq(0).unwrap(), 3);
}

#[test]
fn least_loaded_takes_the_replica_with_fewest_in_flight() {
    let mut r = router(3, RoutingPolicy::LeastLoaded);
    let p = [1, 2, 3];
    let picks: Vec<_> = (0..3)
        .map(|_| r.route(&p, 0, None, 0, 0.0).unwrap())
        .collect();
    let replicas: Vec<_> = picks.iter().map(|d| d.replica).collect();
    assert_eq!(replicas, vec![0, 1, 2]);
    r.finish(picks[1].ticket).unwrap();
    assert_eq!(r.route(&p, 0, None, 0, 0.0).unwrap().replica, 1);
}

#[test]
fn round_robin_cycles_over_live_replicas_only() {
    let mut r = router(3, RoutingPolicy::RoundRobin);
    r.set_alive(1, false).unwrap();
    let picks: Vec<_> = (0..4)
        .map(|_| r.route(&[1], 0, None, 0, 0.0).unwrap().replica)
        .collect();
    assert_eq!(picks, vec![0, 2, 0, 2]);
}

#[test]
fn a_session_sticks_and_moves_only_when_its_replica_leaves() {
    let mut r = router(4, RoutingPolicy::Session);
    let first = r.route(&[1], 0, Some("user-7"), 0, 0.0).unwrap().replica;
    for _ in 0..5 {
        assert_eq!(
            r.route(&[2], 0, Some("user-7"), 0, 0.0).unwrap().replica,
            first
        );
    }
    let others: Vec<_> = (0..20)
        .map(|i| {
            let k = format!("s{i}");
            (
                k.clone(),
                r.route(&[1], 0, Some(&k), 0, 0.0).unwrap().replica,
            )
        })
        .collect();
    r.set_alive(first, false).unwrap();
    let moved = r.route(&[1], 0, Some("user-7"), 0, 0.0).unwrap().replica;
    assert_ne!(moved, first);
    for (k, was) in others.into_iter().filter(|(_, was)| *was != first) {
        assert_eq!(r.route(&[1], 0, Some(&k), 0, 0.0).unwrap().replica, was);
    }
}

#[test]
fn cache_aware_falls_back_to_least_loaded_beyond_the_imbalance_bound() {
    let mut r = router(2, RoutingPolicy::CacheAware);
    let mut m = replica();
    let p = turn(&[], 4);
    serve(&mut r, &mut m, 0, 0, &p, 0);
    r.set_load(0, 20, 10, 0.5).unwrap();
    assert_eq!(
        r.route(&p, 0, None, 0, 0.0).unwrap().replica,
        0,
        "within bound"
    );
    r.set_load(0, 60, 10, 0.5).unwrap();
    assert_eq!(
        r.route(&p, 0, None, 0, 0.0).unwrap().replica,
        1,
        "beyond bound"
    );
}

#[test]
fn a_routed_prompt_draws_its_burst_before_its_events_arrive() {
    let mut cfg = RouterConfig::new(2, BS, RoutingPolicy::CacheAware);
    cfg.pending_ttl = 5.0;
    cfg.affinity_weight = 0.0;
    let mut r = Router::new(cfg).unwrap();
    let p = turn(&[], 5);
    let first = r.route(&p, 0, None, 0, 0.0).unwrap().replica;
    assert_eq!(r.route(&p, 0, None, 0, 1.0).unwrap().replica, first);
    // After the time-to-live the guess is gone: the idle replica takes it.
    assert_ne!(r.route(&p, 0, None, 0, 10.0).unwrap().replica, first);
}

#[test]
fn excluded_and_dead_replicas_are_never_picked_and_none_left_is_an_error() {
    let mut r = router(2, RoutingPolicy::CacheAware);
    assert_eq!(r.route(&[1], 0, None, 0b01, 0.0).unwrap().replica, 1);
    r.set_alive(1, false).unwrap();
    assert!(r.route(&[1], 0, None, 0b01, 0.0).is_err());
}

#[test]
fn unknown_policy_and_bad_knobs_are_refused_by_name() {
    let e = RoutingPolicy::parse("random").unwrap_err().to_string();
    assert!(e.contains("cache_aware") && e.contains("random"), "{e}");
    let mut cfg = RouterConfig::new(2, BS, RoutingPolicy::CacheAware);
    cfg.balance_rel_threshold = 0.5;
    assert!(Router::new(cfg)
        .unwrap_err()
        .to_string()
        .contains("balance_rel"));
    let mut cfg = RouterConfig::new(2, BS, RoutingPolicy::CacheAware);
    cfg.token_weight = 2.0;
    assert!(Router::new(cfg)
        .unwrap_err()
        .to_string()
        .contains("token_weight"));
    let mut cfg = RouterConfig::new(2, BS, RoutingPolicy::CacheAware);
    cfg.affinity_weight = -0.1;
    assert!(Router::new(cfg)
        .unwrap_err()
        .to_string()
        .contains("affinity_weight"));
    let mut cfg = RouterConfig::new(2, BS, RoutingPolicy::CacheAware);
    cfg.divert_ratio = 0.5;
    assert!(Router::new(cfg)
        .unwrap_err()
        .to_string()
        .contains("divert_ratio"));
    let _ = KvEventKind::Stored;
}

#[test]
fn a_routed_prompts_uncached_tokens_count_on_its_replica_until_it_finishes() {
    let mut r = router(2, RoutingPolicy::CacheAware);
    let mut m = replica();
    let p = turn(&[], 6); // 9 tokens: 2 reusable blocks of 4
    serve(&mut r, &mut m, 1, 0, &p, 0);
    let hit = r.route(&p, 0, None, 0, 0.0).unwrap();
    assert_eq!(
        (hit.replica, hit.matched_blocks, hit.uncached_tokens),
        (1, 2, 1)
    );
    let cold = r.route(&turn(&[], 7), 0, None, 0, 0.0).unwrap();
    assert_eq!((cold.replica, cold.uncached_tokens), (0, 9));
    assert_eq!(r.load(0).unwrap().uncached_tokens, 9);
    assert_eq!(r.load(1).unwrap().uncached_tokens, 1);
    r.finish(hit.ticket).unwrap();
    r.finish(cold.ticket).unwrap();
    assert_eq!(r.load(0).unwrap().uncached_tokens, 0);
    assert_eq!(r.load(1).unwrap().uncached_tokens, 0);
}

#[test]
fn a_replica_leaving_rotation_drops_its_uncached_tokens() {
    let mut r = router(2, RoutingPolicy::RoundRobin);
    let d = r.route(&turn(&[], 6), 0, None, 0, 0.0).unwrap();
    assert_eq!(r.load(d.replica).unwrap().uncached_tokens, 9);
    r.set_alive(d.replica, false).unwrap();
    assert_eq!(r.load(d.replica).unwrap().uncached_tokens, 0);
}

#[test]
fn with_a_token_weight_cache_aware_leaves_a_hit_behind_a_long_prefill_queue() {
    let pick = |token_weight: f64| {
        let mut cfg = RouterConfig::new(2, BS, RoutingPolicy::CacheAware);
        cfg.pending_ttl = 0.0;
        cfg.token_weight = token_weight;
        cfg.divert_ratio = 0.0;
        let mut r = Router::new(cfg).unwrap();
        let mut m = replica();
        let p = turn(&[], 8);
        serve(&mut r, &mut m, 1, 0, &p, 0);
        // a long cold prompt already under way on replica 1 (replica 0 excluded)
        let long: Vec<u32> = (0..400).map(|i| 5000 + i).collect();
        r.route(&long, 0, None, 0b01, 0.0).unwrap();
        r.route(&p, 0, None, 0, 0.0).unwrap().replica
    };
    assert_eq!(pick(0.0), 1, "without the token cost the hit wins");
    assert_eq!(
        pick(1.0),
        0,
        "400 queued prefill tokens outweigh a 2-block hit"
    );
}

#[test]
fn a_prefix_no_replica_holds_goes_back_where_it_was_last_routed() {
    let pick = |affinity_weight: f64| {
        let mut cfg = RouterConfig::new(2, BS, RoutingPolicy::CacheAware);
        cfg.affinity_weight = affinity_weight;
        let mut r = Router::new(cfg).unwrap();
        let p = turn(&[], 21);
        let first = r.route(&p, 0, None, 0, 0.0).unwrap();
        r.finish(first.ticket).unwrap(); // ended; its blocks evicted since (no event held them)
        let again = r.route(&p, 0, None, 0, 1.0).unwrap();
        assert_eq!(again.matched_blocks, 0, "the index knows it is not cached");
        (first.replica, again.replica)
    };
    let (first, again) = pick(0.5);
    assert_eq!(
        again, first,
        "kept where it went: the prefixes stay partitioned"
    );
    let (first, again) = pick(0.0);
    assert_ne!(again, first, "without affinity: the next replica in turn");
}

#[test]
fn affinity_gives_way_to_a_replica_that_holds_the_prefix() {
    let mut cfg = RouterConfig::new(2, BS, RoutingPolicy::CacheAware);
    cfg.pending_ttl = 0.0;
    let mut r = Router::new(cfg).unwrap();
    let mut m = replica();
    let p = turn(&[], 22);
    let d = r.route(&p, 0, None, 0b10, 0.0).unwrap(); // routed to 0 ...
    r.finish(d.ticket).unwrap();
    serve(&mut r, &mut m, 1, 0, &p, 0); // ... but replica 1 holds it
    assert_eq!(r.route(&p, 0, None, 0, 1.0).unwrap().replica, 1);
}

/// A cache-aware router with the default pending bound.
fn pending_router(n: usize) -> Router {
    Router::new(RouterConfig::new(n, BS, RoutingPolicy::CacheAware)).unwrap()
}

#[test]
fn a_burst_follows_its_first_request_however_long_that_one_waits_for_its_prefill() {
    let mut r = pending_router(2);
    let p = turn(&[], 11);
    let first = r.route(&p, 0, None, 0, 0.0).unwrap();
    // no events yet (its prefill is queued): the blocks are still pending there
    let later = r.route(&p, 0, None, 0, 20.0).unwrap();
    assert_eq!((later.replica, later.matched_blocks), (first.replica, 2));
}

#[test]
fn an_eviction_after_the_request_ended_is_seen_at_once() {
    let mut r = pending_router(2);
    let mut m = replica();
    let p = turn(&[], 12);
    let d = r.route(&p, 0, None, 0, 0.0).unwrap();
    serve(&mut r, &mut m, d.replica, 0, &p, 0);
    r.finish(d.ticket).unwrap();
    m.reset_prefix_cache();
    let b = m.kv_events_mut().drain();
    r.apply_batch(d.replica, 1, &b.kinds, &b.starts, &b.hashes)
        .unwrap();
    assert_eq!(r.route(&p, 0, None, 0, 0.1).unwrap().matched_blocks, 0);
}

#[test]
fn a_request_that_ends_without_events_stops_its_blocks_counting() {
    let mut r = pending_router(2);
    let p = turn(&[], 13);
    let d = r.route(&p, 0, None, 0, 0.0).unwrap();
    assert_eq!(r.num_pending(d.replica, 0.0), 2);
    r.finish(d.ticket).unwrap(); // failed before its prefill: no event will come
    assert_eq!(r.num_pending(d.replica, 0.0), 0);
    assert_eq!(r.route(&p, 0, None, 0, 0.1).unwrap().matched_blocks, 0);
}

#[test]
fn finishing_one_of_two_requests_sharing_a_prefix_keeps_it_pending_for_the_other() {
    let mut r = pending_router(2);
    let p = turn(&[], 14);
    let a = r.route(&p, 0, None, 0, 0.0).unwrap();
    let b = r.route(&p, 0, None, 0, 0.0).unwrap();
    assert_eq!(a.replica, b.replica);
    r.finish(a.ticket).unwrap();
    assert_eq!(r.num_pending(b.replica, 0.0), 2);
    r.finish(b.ticket).unwrap();
    assert_eq!(r.num_pending(b.replica, 0.0), 0);
}

#[test]
fn a_waiting_requests_blocks_evicted_before_its_prefill_still_count_on_its_replica() {
    let mut r = pending_router(2);
    let mut m = replica();
    let p = turn(&[], 15);
    serve(&mut r, &mut m, 1, 0, &p, 0);
    let waiting = r.route(&p, 0, None, 0, 0.0).unwrap();
    assert_eq!(waiting.replica, 1);
    // evicted while it waits: its prefill will compute them there again
    m.reset_prefix_cache();
    let b = m.kv_events_mut().drain();
    r.apply_batch(1, 1, &b.kinds, &b.starts, &b.hashes).unwrap();
    let next = r.route(&p, 0, None, 0, 0.1).unwrap();
    assert_eq!((next.replica, next.matched_blocks), (1, 2));
}

#[test]
fn a_requests_pending_blocks_end_at_its_bound_and_it_still_counts_as_load() {
    let mut cfg = RouterConfig::new(1, BS, RoutingPolicy::CacheAware);
    cfg.pending_ttl = 5.0;
    let mut r = Router::new(cfg).unwrap();
    r.route(&turn(&[], 16), 0, None, 0, 0.0).unwrap();
    r.expire_pending(6.0);
    assert_eq!(r.num_pending(0, 0.0), 0);
    assert_eq!(r.load(0).unwrap().in_flight, 1);
}

#[test]
fn finish_ignores_an_ended_ticket_and_refuses_one_never_issued() {
    let mut r = pending_router(1);
    let d = r.route(&[1, 2, 3], 0, None, 0, 0.0).unwrap();
    r.finish(d.ticket).unwrap();
    r.finish(d.ticket).unwrap();
    assert_eq!(r.num_in_flight(), 0);
    let e = r.finish(d.ticket + 1).unwrap_err().to_string();
    assert!(e.contains("never issued"), "{e}");
}

#[test]
fn a_late_finish_for_a_replica_taken_out_of_rotation_leaves_its_new_load_alone() {
    let mut r = router(1, RoutingPolicy::LeastLoaded);
    let old = r.route(&turn(&[], 17), 0, None, 0, 0.0).unwrap();
    r.set_alive(0, false).unwrap();
    r.set_alive(0, true).unwrap();
    let new = r.route(&turn(&[], 18), 0, None, 0, 0.0).unwrap();
    r.finish(old.ticket).unwrap();
    let l = r.load(0).unwrap();
    assert_eq!(
        (l.in_flight, l.uncached_tokens),
        (1, new.uncached_tokens as u64)
    );
}

#[test]
fn where_blocks_were_routed_is_forgotten_after_two_full_generations() {
    let mut cfg = RouterConfig::new(2, BS, RoutingPolicy::CacheAware);
    cfg.pending_ttl = 0.0;
    let mut r = Router::new(cfg).unwrap();
    let small = turn(&[], 23);
    let first = chain_hashes(&small[..2 * BS], BS, salted_key(0, 0))[0];
    let d = r.route(&small, 0, None, 0, 0.0).unwrap();
    assert_eq!(r.last_routed(first), Some(d.replica));
    // prompts of a whole generation of blocks each, all different
    let big = |base: u32| -> Vec<u32> {
        (0..(defaults::AFFINITY_CAPACITY * BS) as u32)
            .map(|i| base.wrapping_add(i))
            .collect()
    };
    r.route(&big(1 << 30), 0, None, 0, 0.0).unwrap();
    assert_eq!(r.last_routed(first), Some(d.replica), "one generation back");
    r.route(&big(3 << 30), 0, None, 0, 0.0).unwrap();
    assert_eq!(
        r.last_routed(first),
        None,
        "two generations back: forgotten"
    );
}

/// Where a prompt goes when replica 1 holds its 2 reusable blocks (or, `held` false, was only
/// the last sent them) and `queued` cold prompt tokens are in flight there.
fn divert_pick(queued: u32, held: bool) -> usize {
    let mut cfg = RouterConfig::new(2, BS, RoutingPolicy::CacheAware);
    cfg.pending_ttl = 0.0;
    let mut r = Router::new(cfg).unwrap();
    let p = turn(&[], 30); // 9 tokens: 8 in 2 reusable blocks, 1 always computed
    if held {
        serve(&mut r, &mut replica(), 1, 0, &p, 0);
    } else {
        let d = r.route(&p, 0, None, 0b01, 0.0).unwrap();
        r.finish(d.ticket).unwrap(); // ended, its blocks evicted since (no event held them)
    }
    let long: Vec<u32> = (0..queued).map(|i| 5000 + i).collect();
    r.route(&long, 0, None, 0b01, 0.0).unwrap(); // under way on replica 1
    r.route(&p, 0, None, 0, 1.0).unwrap().replica
}

#[test]
fn a_held_prefix_is_left_behind_a_prefill_queue_over_the_divert_ratio() {
    // replica 1: 400 queued + 1 = 401 tokens ahead; replica 0: 9 (5 x 9 = 45 < 401)
    assert_eq!(divert_pick(400, true), 0);
}

#[test]
fn a_held_prefix_is_worth_a_queue_within_the_divert_ratio() {
    // replica 1: 30 + 1 = 31 tokens ahead, under 5 x 9
    assert_eq!(divert_pick(30, true), 1);
}

#[test]
fn a_prefix_its_home_evicted_counts_as_recompute_there_against_the_queue() {
    // the same 30 queued tokens, but replica 1 no longer holds the prefix: 39 ahead there,
    // 9 on replica 0 (39 < 45 stays; 40 + 9 = 49 > 45 leaves)
    assert_eq!(divert_pick(30, false), 1);
    assert_eq!(divert_pick(40, false), 0);
    assert_eq!(divert_pick(40, true), 1, "held: 41 ahead, worth the wait");
}

#[test]
fn a_new_prefix_goes_where_the_fewest_remembered_blocks_were_sent_not_the_shortest_queue() {
    let mut cfg = RouterConfig::new(2, BS, RoutingPolicy::CacheAware);
    cfg.pending_ttl = 0.0;
    let mut r = Router::new(cfg).unwrap();
    let long: Vec<u32> = (0..13).map(|i| 7000 + i).collect(); // 3 blocks
    let d = r.route(&long, 0, None, 0b10, 0.0).unwrap(); // to replica 0, ended
    r.finish(d.ticket).unwrap();
    r.route(&turn(&[], 31)[..5], 0, None, 0b01, 0.0).unwrap(); // 1 block, in flight on 1
    assert_eq!((r.num_homed_blocks(0), r.num_homed_blocks(1)), (3, 1));
    // least loaded would take replica 0 (nothing in flight); the claimed cache says 1
    assert_eq!(r.route(&turn(&[], 32), 0, None, 0, 1.0).unwrap().replica, 1);
}

/// `num_homed_blocks` recounted from the remembered hashes.
fn recount_homed(r: &Router) -> Vec<u64> {
    let mut n = vec![0u64; r.cfg.num_replicas];
    let young = &r.last_routed[0];
    let old = r.last_routed[1]
        .iter()
        .filter(|(h, _)| !young.contains_key(h));
    for (_, &rep) in young.iter().chain(old) {
        n[rep as usize] += 1;
    }
    n
}

#[test]
fn remembered_block_counts_follow_a_moved_prefix_and_forgotten_generations() {
    let mut cfg = RouterConfig::new(2, BS, RoutingPolicy::CacheAware);
    cfg.pending_ttl = 0.0;
    let mut r = Router::new(cfg).unwrap();
    let small = turn(&[], 33); // 2 blocks
    r.route(&small, 0, None, 0b10, 0.0).unwrap();
    r.route(&small, 0, None, 0b01, 0.0).unwrap(); // moved to replica 1
    assert_eq!((r.num_homed_blocks(0), r.num_homed_blocks(1)), (0, 2));
    let big = |base: u32| -> Vec<u32> {
        (0..(defaults::AFFINITY_CAPACITY * BS) as u32)
            .map(|i| base.wrapping_add(i))
            .collect()
    };
    r.route(&big(1 << 30), 0, None, 0b10, 0.0).unwrap();
    assert_eq!(r.num_homed_blocks(1), 2, "one generation back");
    r.route(&small, 0, None, 0b10, 0.0).unwrap(); // back to 0 from the old generation
    assert_eq!(
        recount_homed(&r),
        [r.num_homed_blocks(0), r.num_homed_blocks(1)]
    );
    r.route(&big(3 << 30), 0, None, 0b01, 0.0).unwrap();
    assert_eq!(
        recount_homed(&r),
        [r.num_homed_blocks(0), r.num_homed_blocks(1)]
    );
    assert_eq!(
        r.num_homed_blocks(1),
        defaults::AFFINITY_CAPACITY as u64 - 1
    );
}

#[test]
fn without_remembered_blocks_a_new_prefix_is_placed_least_loaded_kv_usage_included() {
    let mut r = router(2, RoutingPolicy::CacheAware); // no affinity: nothing remembered
    r.set_load(0, 1, 1, 0.9).unwrap();
    r.set_load(1, 1, 1, 0.1).unwrap();
    assert_eq!(r.route(&turn(&[], 34), 0, None, 0, 0.0).unwrap().replica, 1);
}

#[test]
fn a_new_prefix_skips_a_replica_more_than_the_slack_in_flight_above_the_least_loaded() {
    let mut cfg = RouterConfig::new(2, BS, RoutingPolicy::CacheAware);
    cfg.pending_ttl = 0.0;
    let mut r = Router::new(cfg).unwrap();
    let long: Vec<u32> = (0..13).map(|i| 7000 + i).collect(); // 3 blocks, remembered on 0
    let d = r.route(&long, 0, None, 0b10, 0.0).unwrap();
    r.finish(d.ticket).unwrap();
    // replica 1: no remembered block, but slack + 1 short requests (no full block) in flight
    for i in 0..=defaults::NEW_PREFIX_SLACK {
        r.route(&[i, i, i], 0, None, 0b01, 0.0).unwrap();
    }
    assert_eq!((r.num_homed_blocks(0), r.num_homed_blocks(1)), (3, 0));
    assert_eq!(r.route(&turn(&[], 35), 0, None, 0, 1.0).unwrap().replica, 0);
}

/// `hashes` stored on `medium` of `replica` as its batch `seq` (after an empty record on the
/// device: the replica names its device `GPU`, so `CPU` is its host tier).
fn store_on(r: &mut Router, replica: usize, seq: u64, hashes: &[u64], medium: u8) {
    let n = hashes.len() as u32;
    let got = r
        .apply_batch_on(
            replica,
            seq,
            &[KvEventKind::Stored as u8; 2],
            &[0, 0, n],
            hashes,
            &[0, medium],
        )
        .unwrap();
    assert_eq!(got, Applied::Applied);
}

#[test]
fn a_prefix_in_a_replicas_host_tier_beats_recompute_elsewhere() {
    use crate::kv::events::Medium;
    let p: Vec<u32> = (0..17).collect();
    let hashes = chain_hashes(&p[..16], BS, 0);
    for medium in [Medium::Host, Medium::Disk] {
        let mut r = router(2, RoutingPolicy::CacheAware);
        store_on(&mut r, 1, 0, &hashes, medium as u8);
        let d = r.route(&p, 0, None, 0, 0.0).unwrap();
        assert_eq!((d.replica, d.matched_blocks), (1, 4), "{medium:?}");
    }
}

#[test]
fn a_device_hit_beats_the_same_prefix_in_another_replicas_host_tier() {
    use crate::kv::events::Medium;
    let p: Vec<u32> = (0..17).collect();
    let hashes = chain_hashes(&p[..16], BS, 0);
    for (device, tier) in [(0, 1), (1, 0)] {
        let mut r = router(2, RoutingPolicy::CacheAware);
        store_on(&mut r, device, 0, &hashes, Medium::Device as u8);
        store_on(&mut r, tier, 0, &hashes, Medium::Host as u8);
        assert_eq!(r.route(&p, 0, None, 0, 0.0).unwrap().replica, device);
    }
}

#[test]
fn a_host_tier_extends_a_device_prefix() {
    use crate::kv::events::Medium;
    let p: Vec<u32> = (0..17).collect();
    let hashes = chain_hashes(&p[..16], BS, 0);
    let mut r = router(2, RoutingPolicy::CacheAware);
    store_on(&mut r, 0, 0, &hashes[..2], Medium::Device as u8);
    store_on(&mut r, 0, 1, &hashes[2..], Medium::Host as u8);
    store_on(&mut r, 1, 0, &hashes[..3], Medium::Device as u8);
    // replica 0: 2 device + 2 host blocks (3.6) beats replica 1's 3 device blocks
    let d = r.route(&p, 0, None, 0, 0.0).unwrap();
    assert_eq!((d.replica, d.matched_blocks), (0, 4));
}
