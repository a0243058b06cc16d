"""The KV subsystem, split by role.

- `pool`: the blocks of one tier (ref counts, the free LRU list, the eviction hook); no tensors.
- `storage`: the tensors those block ids index, and their layout.
- `prefix_index`: full, computed blocks by their chained hash (the prefix cache).
- `document_index`: cached documents (content + weight version + placement -> blocks, length).
- `handles`: explicit pins on blocks, held by whoever keeps KV alive (a request, a cached
  document in use, an agent session between turns).
- `segments`: a sequence's KV as a list of segments (pool, blocks, valid length, position base,
  visibility), the description the attention backend receives.

`engine/block_manager.py` composes these into the per-sequence allocation API the scheduler uses.
Nothing here runs a model or touches attention kernels.
"""
