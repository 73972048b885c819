//! The KV cache's blocks: reference counts, free lists in LRU order, and the prefix-cache
//! map from block hash to block.
//!
//! A freed block whose contents are cached keeps its hash and stays findable until it is
//! reused. The free blocks are in two lists (a segmented LRU): blocks whose contents were
//! found again by a prefix hit since they were written are *protected*, the rest are on
//! *probation*. Allocation takes from the head of the probation list (least recently freed
//! first), and from the protected list only once probation is empty, evicting the hash of
//! the block it takes. So a flood of prompts that are never reused (a tenant sending long
//! unique prompts) cycles through probation and leaves the prefixes that others do reuse in
//! the cache; the protected list holds at most [`PROTECTED_SHARE`] of the blocks, its least
//! recent going back to probation past that. Removing a cached free block that gets hit
//! again is O(1): the lists are doubly linked through arrays.

use std::collections::HashMap;

use sha2::{Digest, Sha256};

/// Identifier of a block in the KV cache.
pub type BlockId = u32;

/// Content hash of a full block: `hash(parent, tokens, extra keys)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockHash(pub [u8; 16]);

/// Typed extra keys of a block hash: each kind is tagged, so a tenant scope can never
/// collide with an adapter name or a model revision.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CacheKey {
    /// The tenant scope (or a private per-request scope).
    Scope(String),
    /// Model revision.
    ModelRevision(String),
    /// Adapter `id@revision`.
    Adapter(String),
}

impl BlockHash {
    /// Hash of a full block given its parent's hash and the extra keys.
    pub fn new(parent: Option<BlockHash>, tokens: &[u32], keys: &[CacheKey]) -> BlockHash {
        let mut h = Sha256::new();
        match parent {
            Some(p) => {
                h.update([1u8]);
                h.update(p.0);
            }
            None => h.update([0u8]),
        }
        h.update((tokens.len() as u64).to_le_bytes());
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        for k in keys {
            let (tag, s) = match k {
                CacheKey::Scope(s) => (1u8, s),
                CacheKey::ModelRevision(s) => (2u8, s),
                CacheKey::Adapter(s) => (3u8, s),
            };
            h.update([tag]);
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
        let d = h.finalize();
        let mut out = [0u8; 16];
        out.copy_from_slice(&d[..16]);
        BlockHash(out)
    }
}

const NIL: u32 = u32::MAX;

/// The most of the blocks the protected free list holds (its least recent go back on
/// probation past it), so blocks once reused cannot keep the whole cache for ever.
pub const PROTECTED_SHARE: f64 = 0.75;

/// The free lists: blocks not reused since they were written, and blocks that were.
const PROBATION: usize = 0;
const PROTECTED: usize = 1;
/// `list` of a block on no free list (in use).
const IN_USE: u8 = u8::MAX;

/// Blocks, reference counts, the two LRU free lists and the hash map.
#[derive(Debug)]
pub struct BlockPool {
    ref_count: Vec<u32>,
    hash: Vec<Option<BlockHash>>,
    /// Whether the block was found by a prefix hit since it was allocated.
    reused: Vec<bool>,
    /// Which free list the block is on ([`PROBATION`], [`PROTECTED`] or [`IN_USE`]).
    list: Vec<u8>,
    prev: Vec<u32>,
    next: Vec<u32>,
    head: [u32; 2],
    tail: [u32; 2],
    len: [usize; 2],
    cached: HashMap<BlockHash, BlockId>,
}

impl BlockPool {
    /// A pool of `n` free blocks.
    pub fn new(n: usize) -> BlockPool {
        let n32 = n as u32;
        let mut p = BlockPool {
            ref_count: vec![0; n],
            hash: vec![None; n],
            reused: vec![false; n],
            list: vec![PROBATION as u8; n],
            prev: (0..n32).map(|i| if i == 0 { NIL } else { i - 1 }).collect(),
            next: (0..n32).map(|i| if i + 1 == n32 { NIL } else { i + 1 }).collect(),
            head: [if n == 0 { NIL } else { 0 }, NIL],
            tail: [if n == 0 { NIL } else { n32 - 1 }, NIL],
            len: [n, 0],
            cached: HashMap::new(),
        };
        if n == 0 {
            p.prev.clear();
        }
        p
    }

    /// Total blocks.
    pub fn total(&self) -> usize {
        self.ref_count.len()
    }

    /// Blocks with no user (including cached ones that may be evicted).
    pub fn free(&self) -> usize {
        self.len[PROBATION] + self.len[PROTECTED]
    }

    /// Free blocks on the protected list (found again by a prefix hit since written).
    pub fn protected(&self) -> usize {
        self.len[PROTECTED]
    }

    /// Fraction of blocks in use.
    pub fn usage(&self) -> f64 {
        if self.total() == 0 { 0.0 } else { 1.0 - self.free() as f64 / self.total() as f64 }
    }

    /// Takes block `b` off the free list it is on.
    fn unlink(&mut self, b: BlockId) {
        let l = usize::from(self.list[b as usize]);
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        if p == NIL {
            self.head[l] = n
        } else {
            self.next[p as usize] = n
        }
        if n == NIL {
            self.tail[l] = p
        } else {
            self.prev[n as usize] = p
        }
        self.prev[b as usize] = NIL;
        self.next[b as usize] = NIL;
        self.list[b as usize] = IN_USE;
        self.len[l] -= 1;
    }

    fn push_tail(&mut self, b: BlockId, l: usize) {
        self.prev[b as usize] = self.tail[l];
        self.next[b as usize] = NIL;
        if self.tail[l] == NIL {
            self.head[l] = b
        } else {
            self.next[self.tail[l] as usize] = b
        }
        self.tail[l] = b;
        self.list[b as usize] = l as u8;
        self.len[l] += 1;
    }

    /// Takes `n` blocks from the head of the probation list, then of the protected one
    /// (evicting their cached hashes), or none when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let l = if self.len[PROBATION] > 0 { PROBATION } else { PROTECTED };
            let b = self.head[l];
            self.unlink(b);
            self.reused[b as usize] = false;
            if let Some(h) = self.hash[b as usize].take()
                && self.cached.get(&h) == Some(&b)
            {
                self.cached.remove(&h);
            }
            self.ref_count[b as usize] = 1;
            out.push(b);
        }
        Some(out)
    }

    /// Whether block `b` has no user (it sits on the free list).
    pub fn is_free(&self, b: BlockId) -> bool {
        self.ref_count[b as usize] == 0
    }

    /// The cached block with this hash, if any.
    pub fn lookup(&self, h: &BlockHash) -> Option<BlockId> {
        self.cached.get(h).copied()
    }

    /// Adds a user to a cached block found by [`lookup`](Self::lookup): it was reused, so
    /// once free again it is protected.
    pub fn touch(&mut self, b: BlockId) {
        if self.ref_count[b as usize] == 0 {
            self.unlink(b);
        }
        self.ref_count[b as usize] += 1;
        self.reused[b as usize] = true;
    }

    /// Records that block `b` (full, in use) holds content with hash `h`. If another block
    /// already holds it, `b` simply stays uncached.
    pub fn cache(&mut self, b: BlockId, h: BlockHash) {
        if self.hash[b as usize].is_some() {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(h) {
            e.insert(b);
            self.hash[b as usize] = Some(h);
        }
    }

    /// Drops one user of each block, in the given order: blocks reaching zero users join the
    /// tail of their free list (callers pass a request's blocks last-first, so its tail
    /// blocks are evicted before its prefix).
    pub fn release(&mut self, blocks: impl IntoIterator<Item = BlockId>) {
        let cap = (self.total() as f64 * PROTECTED_SHARE) as usize;
        for b in blocks {
            let rc = &mut self.ref_count[b as usize];
            if *rc == 0 {
                continue;
            }
            *rc -= 1;
            if *rc != 0 {
                continue;
            }
            if !self.reused[b as usize] {
                self.push_tail(b, PROBATION);
                continue;
            }
            self.push_tail(b, PROTECTED);
            if self.len[PROTECTED] > cap {
                let oldest = self.head[PROTECTED];
                self.unlink(oldest);
                self.push_tail(oldest, PROBATION);
            }
        }
    }

    /// Number of blocks currently holding a cached hash.
    pub fn cached_blocks(&self) -> usize {
        self.cached.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u32) -> BlockHash {
        BlockHash::new(None, &[i], &[])
    }

    #[test]
    fn allocate_release_returns_to_the_start() {
        let mut p = BlockPool::new(8);
        let a = p.allocate(5).unwrap_or_default();
        assert_eq!(p.free(), 3);
        assert!(p.allocate(4).is_none(), "over-allocation must fail whole");
        assert_eq!(p.free(), 3);
        p.release(a.iter().rev().copied());
        assert_eq!(p.free(), 8);
    }

    #[test]
    fn cached_free_blocks_are_found_then_evicted_lru_first() {
        let mut p = BlockPool::new(3);
        let a = p.allocate(3).unwrap_or_default();
        for (i, &b) in a.iter().enumerate() {
            p.cache(b, h(i as u32));
        }
        // Release in order 2, 1, 0: block 2 is least recently freed.
        p.release(a.iter().rev().copied());
        assert_eq!(p.free(), 3);
        assert_eq!(p.lookup(&h(0)), Some(a[0]));
        // A hit on block 0 takes it off the free list.
        p.touch(a[0]);
        assert_eq!(p.free(), 2);
        // The next allocation evicts block 2 (head of the free list) and its hash.
        let b = p.allocate(1).unwrap_or_default();
        assert_eq!(b, vec![a[2]]);
        assert_eq!(p.lookup(&h(2)), None);
        assert_eq!(p.lookup(&h(1)), Some(a[1]));
        p.release([a[0], b[0]]);
        assert_eq!(p.free(), 3);
    }

    #[test]
    fn reused_prefixes_outlive_a_flood_of_blocks_never_reused() {
        let mut p = BlockPool::new(8);
        // A prefix of two blocks, written, freed, then found again and freed: protected.
        let prefix = p.allocate(2).unwrap_or_default();
        p.cache(prefix[0], h(0));
        p.cache(prefix[1], h(1));
        p.release(prefix.iter().rev().copied());
        assert_eq!(p.protected(), 0, "not reused yet");
        for &b in &prefix {
            p.touch(b);
        }
        p.release(prefix.iter().rev().copied());
        assert_eq!(p.protected(), 2);
        // A flood of unique prompts cycles through the other six blocks many times over.
        for round in 0..50u32 {
            let flood = p.allocate(6).unwrap_or_default();
            assert!(flood.iter().all(|b| !prefix.contains(b)), "round {round} evicted it");
            for (i, &b) in flood.iter().enumerate() {
                p.cache(b, h(100 + 6 * round + i as u32));
            }
            p.release(flood.iter().rev().copied());
        }
        assert_eq!(p.lookup(&h(0)), Some(prefix[0]));
        assert_eq!(p.lookup(&h(1)), Some(prefix[1]));
        // Every block can still be taken: probation first, then the protected ones.
        let all = p.allocate(8).unwrap_or_default();
        assert_eq!(all.len(), 8);
        // The protected blocks go last, in the order they were freed (the tail first).
        assert_eq!(&all[6..], &[prefix[1], prefix[0]]);
        assert_eq!(p.lookup(&h(0)), None);
        p.release(all);
        assert_eq!((p.free(), p.protected()), (8, 0), "allocation forgets the reuse");
    }

    #[test]
    fn the_protected_list_keeps_at_most_its_share() {
        let mut p = BlockPool::new(8);
        let cap = (8.0 * PROTECTED_SHARE) as usize;
        let all = p.allocate(8).unwrap_or_default();
        for (i, &b) in all.iter().enumerate() {
            p.cache(b, h(i as u32));
            p.touch(b);
        }
        // Two users each; the last release of each block frees it, reused.
        p.release(all.iter().copied());
        p.release(all.iter().copied());
        assert_eq!((p.free(), p.protected()), (8, cap));
        // The oldest protected went back on probation, and is taken first.
        assert_eq!(p.allocate(1).unwrap_or_default(), vec![all[0]]);
    }

    #[test]
    fn typed_keys_never_collide() {
        let a = BlockHash::new(None, &[1, 2], &[CacheKey::Scope("x".into())]);
        let b = BlockHash::new(None, &[1, 2], &[CacheKey::Adapter("x".into())]);
        let c = BlockHash::new(None, &[1, 2], &[CacheKey::Scope("y".into())]);
        let d = BlockHash::new(Some(a), &[1, 2], &[CacheKey::Scope("x".into())]);
        assert!(a != b && a != c && a != d);
        assert_eq!(a, BlockHash::new(None, &[1, 2], &[CacheKey::Scope("x".into())]));
    }

    #[test]
    fn duplicate_content_keeps_the_first_block() {
        let mut p = BlockPool::new(2);
        let a = p.allocate(2).unwrap_or_default();
        p.cache(a[0], h(7));
        p.cache(a[1], h(7));
        assert_eq!(p.lookup(&h(7)), Some(a[0]));
        assert_eq!(p.cached_blocks(), 1);
    }
}
