//! The manager's invariant checker, run by the tests after every operation and
//! exposed to Python as `check_invariants()`.
use super::block_pool::BlockState;
use super::block_table::{BlockTable, Location, NULL_BLOCK};
use super::manager::KvCacheManager;
use crate::ids::{BlockId, SeqId};

impl KvCacheManager {
    /// The manager's invariants: per pool free + in use = total and a consistent free stack / LRU
    /// list; every ref count equals the number of table references (so nothing leaks and no
    /// block is both free and referenced); prefix-cache map and block hashes agree; cached
    /// blocks are registered; tables are well-formed.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.device.check("device")?;
        self.host.check("host")?;
        self.prefix_cache.check()?;
        let mut device_refs = vec![0u32; self.device.num_blocks()];
        let mut host_refs = vec![0u32; self.host.num_blocks()];
        for (&seq, table) in &self.tables {
            let (refs, name) = match table.location {
                Location::Device => (&mut device_refs, "device"),
                Location::Host => (&mut host_refs, "host"),
            };
            for block in table.held_blocks() {
                let count = refs.get_mut(block as usize).ok_or_else(|| {
                    format!("sequence {seq} references {name} block {block} outside the pool")
                })?;
                *count += 1;
            }
            self.check_group_rows(seq, table)?;
            if table.num_registered > table.len() || table.num_registered > table.hashes.len() {
                return Err(format!(
                    "sequence {seq}: {} registered blocks but {} blocks and {} hashes",
                    table.num_registered,
                    table.len(),
                    table.hashes.len()
                ));
            }
        }
        for (pool, refs, name) in [
            (&self.device, &device_refs, "device"),
            (&self.host, &host_refs, "host"),
        ] {
            for (block, &expected) in refs.iter().enumerate() {
                let actual = pool.ref_count(block as BlockId).unwrap_or(0);
                if actual != expected {
                    return Err(format!(
                        "{name} block {block}: ref count {actual} but {expected} table references"
                    ));
                }
            }
        }
        for block in 0..self.device.num_blocks() as BlockId {
            let registered = self.prefix_cache.is_registered(block);
            match self.device.state(block) {
                Some(BlockState::Cached) if !registered => {
                    return Err(format!(
                        "device block {block} is evictable but not registered"
                    ));
                }
                Some(BlockState::Free) if registered => {
                    return Err(format!("device block {block} is free but still registered"));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// A table has one row per layer group, all as long as group 0's; a full-attention row
    /// holds a block everywhere, a sliding-window row `NULL_BLOCK` only as a leading run
    /// (the blocks behind its window, released oldest first).
    fn check_group_rows(&self, seq: SeqId, table: &BlockTable) -> std::result::Result<(), String> {
        if table.others.len() + 1 != self.windows.len() {
            return Err(format!(
                "sequence {seq}: {} block rows for {} kv groups",
                table.others.len() + 1,
                self.windows.len()
            ));
        }
        for (g, row) in table.rows().enumerate() {
            if row.len() != table.len() {
                return Err(format!(
                    "sequence {seq}: group {g} has {} blocks, group 0 {}",
                    row.len(),
                    table.len()
                ));
            }
            let leading = row.iter().take_while(|&&b| b == NULL_BLOCK).count();
            if self.windows[g].is_none() && leading > 0 {
                return Err(format!(
                    "sequence {seq}: full-attention group {g} released {leading} blocks"
                ));
            }
            if row[leading..].contains(&NULL_BLOCK) {
                return Err(format!(
                    "sequence {seq}: group {g} has a released block after a held one"
                ));
            }
        }
        Ok(())
    }
}
