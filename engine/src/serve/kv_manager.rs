//! Per-request block tables on top of the [`BlockPool`], with prefix-cache lookups.

use std::collections::HashMap;

use crate::serve::CacheScope;
use crate::serve::block_pool::{BlockHash, BlockId, BlockPool, CacheKey};

#[derive(Debug, Default)]
struct ReqBlocks {
    blocks: Vec<BlockId>,
    /// Hashes of this request's full blocks, computed once.
    hashes: Vec<BlockHash>,
    /// Full blocks already offered to the cache.
    cached: usize,
}

/// Block tables of all live requests.
#[derive(Debug)]
pub struct KvManager {
    pool: BlockPool,
    block_size: usize,
    model_keys: Vec<CacheKey>,
    reqs: HashMap<String, ReqBlocks>,
}

impl KvManager {
    /// A manager over `num_blocks` blocks of `block_size` tokens. `model_keys` (the model
    /// revision, the adapter) join every block hash.
    pub fn new(num_blocks: usize, block_size: usize, model_keys: Vec<CacheKey>) -> KvManager {
        KvManager { pool: BlockPool::new(num_blocks), block_size, model_keys, reqs: HashMap::new() }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The pool (for statistics).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    fn keys(&self, scope: &CacheScope, adapter: Option<&[u8; 32]>) -> Vec<CacheKey> {
        let s = match scope {
            CacheScope::Tenant(t) => format!("tenant:{t}"),
            CacheScope::Private(r) => format!("private:{r}"),
        };
        let mut k = vec![CacheKey::Scope(s)];
        k.extend(self.model_keys.iter().cloned());
        // A prefix computed under one adapter is another model's: never the base's or
        // another adapter's.
        k.extend(
            adapter.map(|a| CacheKey::Adapter(a.iter().map(|b| format!("{b:02x}")).collect())),
        );
        k
    }

    fn hashes_for(
        &mut self,
        id: &str,
        tokens: &[u32],
        scope: &CacheScope,
        adapter: Option<&[u8; 32]>,
    ) -> &[BlockHash] {
        let keys = self.keys(scope, adapter);
        let bs = self.block_size;
        let e = self.reqs.entry(id.to_string()).or_default();
        let full = tokens.len() / bs;
        while e.hashes.len() < full {
            let i = e.hashes.len();
            let parent = i.checked_sub(1).map(|p| e.hashes[p]);
            e.hashes.push(BlockHash::new(parent, &tokens[i * bs..(i + 1) * bs], &keys));
        }
        &e.hashes[..full]
    }

    /// Cached blocks holding a prefix of `tokens` (at most `max_hit_tokens` tokens, in whole
    /// blocks) for a request that holds no blocks yet.
    pub fn find_prefix(
        &mut self,
        id: &str,
        tokens: &[u32],
        scope: &CacheScope,
        adapter: Option<&[u8; 32]>,
        max_hit_tokens: usize,
    ) -> Vec<BlockId> {
        let limit = max_hit_tokens / self.block_size;
        let hashes: Vec<BlockHash> =
            self.hashes_for(id, tokens, scope, adapter).iter().take(limit).copied().collect();
        hashes.iter().map_while(|h| self.pool.lookup(h)).collect()
    }

    /// Gives request `id` the `hits` (from [`find_prefix`](Self::find_prefix)) and enough new
    /// blocks to hold `total_tokens`; all or nothing.
    pub fn allocate(&mut self, id: &str, hits: &[BlockId], total_tokens: usize) -> bool {
        let have = self.reqs.get(id).map_or(0, |r| r.blocks.len());
        let want = total_tokens.div_ceil(self.block_size);
        let new = want.saturating_sub(have + hits.len());
        let hits_on_free_list = hits.iter().filter(|&&b| self.pool.is_free(b)).count();
        if new + hits_on_free_list > self.pool.free() {
            return false;
        }
        for &b in hits {
            self.pool.touch(b);
        }
        let fresh = self.pool.allocate(new).unwrap_or_default();
        let e = self.reqs.entry(id.to_string()).or_default();
        if e.blocks.is_empty() {
            // Hit blocks are already in the cache under these hashes.
            e.cached = hits.len();
        }
        e.blocks.extend_from_slice(hits);
        e.blocks.extend(fresh);
        true
    }

    /// Offers the request's full blocks among its first `computed` tokens to the cache.
    pub fn cache_computed(
        &mut self,
        id: &str,
        tokens: &[u32],
        computed: usize,
        scope: &CacheScope,
        adapter: Option<&[u8; 32]>,
    ) {
        let bs = self.block_size;
        let full = computed.min(tokens.len()) / bs;
        self.hashes_for(id, &tokens[..full * bs], scope, adapter);
        let Some(e) = self.reqs.get_mut(id) else { return };
        while e.cached < full.min(e.blocks.len()) {
            let i = e.cached;
            self.pool.cache(e.blocks[i], e.hashes[i]);
            e.cached += 1;
        }
    }

    /// Block table of a request.
    pub fn blocks(&self, id: &str) -> &[BlockId] {
        self.reqs.get(id).map_or(&[], |r| &r.blocks)
    }

    /// Frees a request's blocks (last block first, so tails are evicted before prefixes).
    pub fn free(&mut self, id: &str) {
        if let Some(r) = self.reqs.remove(id) {
            self.pool.release(r.blocks.into_iter().rev());
        }
    }

    /// Frees a request's blocks but keeps its memoized hashes (preemption).
    pub fn free_blocks_keep_hashes(&mut self, id: &str) {
        if let Some(r) = self.reqs.get_mut(id) {
            let blocks = std::mem::take(&mut r.blocks);
            r.cached = 0;
            self.pool.release(blocks.into_iter().rev());
        }
    }
}
