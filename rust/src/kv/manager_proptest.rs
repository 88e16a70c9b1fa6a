//! Randomized operation sequences against a simple model; invariants checked after every op.
use std::collections::{BTreeMap, HashSet};

use proptest::prelude::*;

use super::block_table::blocks_for;
use super::{blocks_behind_window, AllocStatus, CacheConfig, KvCacheManager, NULL_BLOCK};
use crate::error::Error;
use crate::ids::{SeqId, TokenId};

const BLOCK_SIZE: usize = 4;
const DEVICE_BLOCKS: usize = 24;
const HOST_BLOCKS: usize = 12;
const MAX_SEQ: SeqId = 6;

#[derive(Debug, Clone)]
enum Op {
    Allocate { seq: SeqId, family: u32, len: usize },
    Append { seq: SeqId, n: usize },
    CacheFull { seq: SeqId },
    Fork { parent: SeqId, child: SeqId },
    Free { seq: SeqId },
    SwapOut { seqs: Vec<SeqId> },
    SwapIn { seqs: Vec<SeqId> },
    ResetPrefixCache,
}

fn op() -> impl Strategy<Value = Op> {
    let seq = 0..MAX_SEQ;
    prop_oneof![
        4 => (seq.clone(), 0..3u32, 1..30usize)
            .prop_map(|(seq, family, len)| Op::Allocate { seq, family, len }),
        4 => (seq.clone(), 1..7usize).prop_map(|(seq, n)| Op::Append { seq, n }),
        2 => seq.clone().prop_map(|seq| Op::CacheFull { seq }),
        2 => (seq.clone(), seq.clone()).prop_map(|(parent, child)| Op::Fork { parent, child }),
        3 => seq.clone().prop_map(|seq| Op::Free { seq }),
        1 => proptest::collection::vec(seq.clone(), 1..3).prop_map(|seqs| Op::SwapOut { seqs }),
        1 => proptest::collection::vec(seq, 1..3).prop_map(|seqs| Op::SwapIn { seqs }),
        1 => Just(Op::ResetPrefixCache),
    ]
}

/// What the model knows about a sequence.
#[derive(Debug, Clone)]
struct ModelSeq {
    tokens: Vec<TokenId>,
    /// Token slots the table must cover.
    num_slots: usize,
    swapped: bool,
}

/// Prompts of one family share their first 12 tokens, so prefix hits happen.
fn prompt(family: u32, seq: SeqId, len: usize) -> Vec<TokenId> {
    (0..len as u32)
        .map(|i| {
            if i < 12 {
                family * 1000 + i
            } else {
                50_000 + seq as u32 * 100 + i
            }
        })
        .collect()
}

fn distinct_blocks(m: &KvCacheManager, model: &BTreeMap<SeqId, ModelSeq>, swapped: bool) -> usize {
    let mut set = HashSet::new();
    for (&seq, s) in model {
        if s.swapped == swapped {
            set.extend(m.table(seq).unwrap().held_blocks());
        }
    }
    set.len()
}

fn check_against_model(m: &KvCacheManager, model: &BTreeMap<SeqId, ModelSeq>) {
    m.check_invariants().unwrap();
    assert_eq!(m.num_sequences(), model.len());
    for (&seq, s) in model {
        assert!(m.contains(seq));
        assert_eq!(m.is_swapped(seq), s.swapped, "seq {seq}");
        assert_eq!(
            m.block_table(seq).unwrap().len(),
            blocks_for(s.num_slots, BLOCK_SIZE)
        );
    }
    assert_eq!(
        m.num_free_device_blocks(),
        m.num_device_blocks() - distinct_blocks(m, model, false)
    );
    assert_eq!(
        m.num_free_host_blocks(),
        m.num_host_blocks() - distinct_blocks(m, model, true)
    );
}

fn apply(m: &mut KvCacheManager, model: &mut BTreeMap<SeqId, ModelSeq>, op: &Op) {
    match op {
        Op::Allocate { seq, family, len } => {
            let tokens = prompt(*family, *seq, *len);
            let r = m.allocate_prompt(*seq, &tokens, None, 0, false);
            if model.contains_key(seq) {
                assert_eq!(r, Err(Error::DuplicateSequence(*seq)));
            } else if let Some(cached) = r.unwrap() {
                assert!(cached < *len && cached % BLOCK_SIZE == 0);
                model.insert(
                    *seq,
                    ModelSeq {
                        tokens,
                        num_slots: *len,
                        swapped: false,
                    },
                );
            } else {
                assert_ne!(m.can_allocate(*len), AllocStatus::Ok);
            }
        }
        Op::Append { seq, n } => {
            let Some(s) = model.get_mut(seq) else {
                assert_eq!(
                    m.append_slots(*seq, 0, 1),
                    Err(Error::UnknownSequence(*seq))
                );
                return;
            };
            if s.swapped {
                assert!(matches!(
                    m.append_slots(*seq, 0, 1),
                    Err(Error::InvalidState(_))
                ));
                return;
            }
            let before = m.table(*seq).unwrap().clone();
            let (first, last) = (s.num_slots, s.num_slots + n);
            match m.append_slots(*seq, first, last).unwrap() {
                Some(copies) => {
                    let after = m.table(*seq).unwrap();
                    for (g, row) in after.rows().enumerate() {
                        // Every block the new slots land in is now exclusively ours.
                        for &block in &row[first / BLOCK_SIZE..blocks_for(last, BLOCK_SIZE)] {
                            assert_eq!(m.device_ref_count(block), Some(1));
                        }
                        // A window holds nothing wholly behind the first new token's window.
                        if let Some(w) = m.group_windows()[g] {
                            let behind = blocks_behind_window(first, w, BLOCK_SIZE);
                            assert!(row[..behind].iter().all(|&b| b == NULL_BLOCK));
                        }
                    }
                    for (src, dst) in copies {
                        let (g, i) = before
                            .rows()
                            .enumerate()
                            .find_map(|(g, r)| Some((g, r.iter().position(|&b| b == src)?)))
                            .unwrap();
                        assert_eq!(after.group(g)[i], dst);
                    }
                    let next = s.tokens.len() as u32;
                    s.tokens.extend((0..*n as u32).map(|k| 90_000 + next + k));
                    s.num_slots = last;
                }
                None => assert_eq!(m.block_table(*seq).unwrap(), &before.blocks[..]),
            }
        }
        Op::CacheFull { seq } => {
            let r = match model.get(seq) {
                Some(s) => m.cache_full_blocks(*seq, &s.tokens, s.num_slots, 0),
                None => m.cache_full_blocks(*seq, &[], 0, 0),
            };
            match model.get(seq) {
                None => assert_eq!(r, Err(Error::UnknownSequence(*seq))),
                Some(s) if s.swapped => assert!(matches!(r, Err(Error::InvalidState(_)))),
                Some(_) => {
                    r.unwrap();
                }
            }
        }
        Op::Fork { parent, child } => {
            let r = m.fork(*parent, *child);
            match model.get(parent).cloned() {
                None => assert_eq!(r, Err(Error::UnknownSequence(*parent))),
                Some(_) if parent == child || model.contains_key(child) => {
                    assert_eq!(r, Err(Error::DuplicateSequence(*child)))
                }
                Some(s) => {
                    r.unwrap();
                    assert_eq!(
                        m.block_table(*parent).unwrap(),
                        m.block_table(*child).unwrap()
                    );
                    model.insert(*child, s);
                }
            }
        }
        Op::Free { seq } => {
            let r = m.free(*seq);
            if model.remove(seq).is_some() {
                r.unwrap();
            } else {
                assert_eq!(r, Err(Error::UnknownSequence(*seq)));
            }
        }
        Op::SwapOut { seqs } => {
            let valid = group_is_valid(model, seqs, false);
            let can = m.can_swap_out(seqs);
            let r = m.swap_out(seqs);
            match (valid, can) {
                (true, true) => {
                    let pairs = r.unwrap();
                    let hosts: HashSet<_> = pairs.iter().map(|p| p.1).collect();
                    assert_eq!(hosts.len(), pairs.len(), "each block crosses once");
                    for s in seqs {
                        model.get_mut(s).unwrap().swapped = true;
                    }
                }
                (true, false) => assert!(matches!(r, Err(Error::OutOfHostBlocks { .. }))),
                (false, _) => assert!(r.is_err() && !can),
            }
        }
        Op::SwapIn { seqs } => {
            let valid = group_is_valid(model, seqs, true);
            let status = m.can_swap_in(seqs, 0);
            let r = m.swap_in(seqs);
            if !valid {
                assert!(r.is_err());
                assert_eq!(status, AllocStatus::Never);
            } else if let Ok(pairs) = r {
                assert_ne!(status, AllocStatus::Never);
                let devices: HashSet<_> = pairs.iter().map(|p| p.1).collect();
                assert_eq!(devices.len(), pairs.len());
                for s in seqs {
                    model.get_mut(s).unwrap().swapped = false;
                }
            } else {
                assert!(matches!(r, Err(Error::OutOfDeviceBlocks { .. })));
                assert_ne!(status, AllocStatus::Ok);
            }
        }
        Op::ResetPrefixCache => m.reset_prefix_cache(),
    }
}

fn group_is_valid(model: &BTreeMap<SeqId, ModelSeq>, seqs: &[SeqId], swapped: bool) -> bool {
    let unique: HashSet<_> = seqs.iter().collect();
    unique.len() == seqs.len()
        && seqs
            .iter()
            .all(|s| model.get(s).is_some_and(|m| m.swapped == swapped))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn random_ops_keep_invariants(ops in proptest::collection::vec(op(), 1..80), wm in 0..3u32) {
        let mut cfg = CacheConfig::new(BLOCK_SIZE, DEVICE_BLOCKS, HOST_BLOCKS);
        cfg.watermark = wm as f64 * 0.05;
        let m = KvCacheManager::new(cfg).unwrap();
        run_ops(m, &ops)?;
    }

    /// The same operations over hybrid layouts (full + sliding-window groups; all windows).
    #[test]
    fn random_ops_keep_invariants_with_sliding_window_groups(
        ops in proptest::collection::vec(op(), 1..80),
        layout in 0..3usize,
    ) {
        let windows = [
            vec![None, Some(6)],
            vec![Some(5), None, Some(9)],
            vec![Some(4)],
        ][layout].clone();
        let cfg = CacheConfig::new(BLOCK_SIZE, DEVICE_BLOCKS * 2, HOST_BLOCKS * 2);
        let mut m = KvCacheManager::new(cfg).unwrap();
        m.set_groups(windows).unwrap();
        run_ops(m, &ops)?;
    }
}

/// Applies `ops`, checking the manager against the model after each, then frees everything.
fn run_ops(mut m: KvCacheManager, ops: &[Op]) -> Result<(), TestCaseError> {
    {
        let mut model = BTreeMap::new();
        for op in ops {
            apply(&mut m, &mut model, op);
            check_against_model(&m, &model);
        }
        // Once every sequence is gone, every block is free (cached-evictable counts as free).
        for seq in model.keys().copied().collect::<Vec<_>>() {
            m.free(seq).unwrap();
        }
        m.check_invariants().unwrap();
        prop_assert_eq!(m.num_free_device_blocks(), m.num_device_blocks());
        prop_assert_eq!(m.num_free_host_blocks(), m.num_host_blocks());
    }
    Ok(())
}
