"""`DraftModelProposer`: speculative decoding's `draft_model` method, a smaller checkpoint with
the target's vocabulary run by the engine on its own paged KV cache.

The draft cache follows the target's block tables: it has the same blocks (same ids, same block
size, shaped for the draft's layers and heads), every step's block operations (swap out, swap
in, copy-on-write copies) are applied to it as to the target's, and the draft runs its forward
on the step's exact inputs (ids, positions, slot mapping, block tables) right after the
target's. Whatever the target's cache holds for a computed token, the draft's holds too, so
allocation, preemption (recompute and swap) and prefix-cache hits stay consistent by
construction.

After the step's update, each sequence the step sampled proposes `k` tokens greedily, `k`
one-token forwards of the draft. Those forwards write the KV of positions the scheduler has not
allocated yet, so they write into scratch blocks past the shared ones (`P` per sequence): the
sequence's table is its shared blocks holding only computed tokens, then its scratch blocks,
the partly computed block copied into the first of them. A proposal never touches a shared
block, and the next step's mirrored forward rewrites every position it scheduled.

Under tensor parallelism the draft is not sharded: it runs whole on rank 0, in the engine
process, beside the scheduler and the verification that use its proposals. A draft is small
(splitting it would add two collectives per layer to each of its `k` one-token forwards, for
little work saved), and the other ranks never see it: their steps carry the drafts as token ids.

Greedy drafts are a point mass `q`, which the rejection sampler takes as such (`draft_probs`
None): sampled requests still get exactly the target's distribution.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.paged import AttentionMetadata
from pagedllm.models import load_model
from pagedllm.worker.cache_engine import CacheEngine


class DraftModelProposer:
    def __init__(self, model_dir: str, k: int, *, dtype: torch.dtype, device: torch.device) -> None:
        self.k = k
        self.device = device
        self.model = load_model(model_dir, dtype=dtype, device=device, pack_for_cpu=True)
        self.config = self.model.config
        self.dtype = dtype
        self.cache: CacheEngine | None = None

    def bytes_per_block(self, block_size: int) -> int:
        cfg = self.config
        return CacheEngine.bytes_per_block(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            block_size=block_size,
            dtype=self.dtype,
        )

    def allocate_cache(
        self, *, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int, max_num_seqs: int
    ) -> None:
        """The target's blocks, then `P` scratch blocks per sequence for the proposals: they
        write positions L-1 .. L+k-2 of a sequence of L tokens, at most `P` blocks."""
        self.block_size = block_size
        self.num_shared_blocks = num_gpu_blocks
        self.scratch_per_seq = (block_size + self.k - 2) // block_size + 1
        cfg = self.config
        self.cache = CacheEngine(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            block_size=block_size,
            num_gpu_blocks=num_gpu_blocks + max_num_seqs * self.scratch_per_seq,
            num_cpu_blocks=num_cpu_blocks,
            dtype=self.dtype,
            device=self.device,
        )

    def execute_block_ops(self, step) -> None:
        """The step's swaps and copies, applied to the draft's cache as to the target's."""
        self.cache.execute(step.blocks_to_swap_out, step.blocks_to_swap_in, step.blocks_to_copy)

    @torch.inference_mode()
    def mirror(self, inputs) -> None:
        """The draft's forward over the target's step inputs: its KV for the same slots. Under
        tensor parallelism the draft runs whole on rank 0 (`inputs.local`: rank 0's tensors)."""
        input_ids, positions, meta, _ = getattr(inputs, "local", inputs)
        self.model(input_ids, positions, self.cache.kv_cache, meta)

    @torch.inference_mode()
    def propose(self, step, requests, scheduler, cut=None) -> None:
        """Drafts for every sequence `step` sampled that is still running (one
        `Scheduler.set_drafts` call; the scheduler keeps those of sequences decoding next).
        `cut` (structured output) trims constrained sequences' drafts to what their grammar
        accepts: it takes and returns the three arrays (None: nothing cut)."""
        seq_ids, rows, tokens = self._candidates(step, requests)
        if not seq_ids:
            scheduler.set_drafts(
                np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
            )
            return
        lengths = np.array([len(t) for t in tokens], dtype=np.int64)
        tables = self._proposal_tables(step.block_tables[rows], lengths)
        token = torch.tensor([t[-1] for t in tokens], dtype=torch.int64, device=self.device)
        drafts = []
        for j in range(self.k):
            positions = lengths - 1 + j
            token = self._forward(token, positions, tables)
            drafts.append(token)
        draft_ids = torch.stack(drafts, dim=1).reshape(-1).cpu().numpy()
        counts = np.full(len(seq_ids), self.k, dtype=np.int64)
        proposals = (np.array(seq_ids, dtype=np.int64), counts, draft_ids)
        if cut is not None:
            proposals = cut(proposals) or proposals
        scheduler.set_drafts(*proposals)

    def _candidates(self, step, requests):
        """(seq ids, step rows, full token lists) of the step's sampled sequences still running,
        each once (a prompt sampled n times is one row)."""
        sample_seq_ids = step.sample_seq_ids.tolist()
        sample_rows = step.sample_rows.tolist()
        seq_index = step.sample_seq_index.tolist()
        seen, seq_ids, rows, tokens = set(), [], [], []
        for seq, row, rid, i in zip(
            sample_seq_ids, sample_rows, step.sample_request_ids, seq_index
        ):
            request = requests.get(rid)
            if seq in seen or request is None or request.finished:
                continue
            state = request.seqs[i]
            if state.finish_reason is not None:
                continue
            seen.add(seq)
            seq_ids.append(seq)
            rows.append(row)
            tokens.append(request.prompt_token_ids + state.token_ids)
        return seq_ids, np.array(rows, dtype=np.int64), tokens

    def _proposal_tables(self, step_tables: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """[N, W] block tables: each sequence's shared blocks below its first uncomputed
        position `L-1`, then its scratch blocks; the shared block holding `L-1` (partly computed)
        is copied into the first scratch block."""
        bs, p = self.block_size, self.scratch_per_seq
        n = len(lengths)
        first = (lengths - 1) // bs  # block of position L-1
        width = int(first.max()) + p
        cols = np.arange(width)
        scratch = (
            self.num_shared_blocks + np.arange(n)[:, None] * p + (cols[None, :] - first[:, None])
        )
        shared = np.zeros((n, width), dtype=np.int64)
        w = min(width, step_tables.shape[1])
        shared[:, :w] = step_tables[:, :w]
        tables = np.where(cols[None, :] < first[:, None], shared, scratch)
        partial = np.flatnonzero((lengths - 1) % bs != 0)
        if len(partial):
            src = torch.from_numpy(shared[partial, first[partial]]).to(self.device)
            dst = torch.from_numpy(self.num_shared_blocks + partial * p).to(self.device)
            kv = self.cache.kv_cache
            kv.index_copy_(2, dst, kv.index_select(2, src))
        return tables.astype(np.int32)

    def _forward(self, token: torch.Tensor, positions: np.ndarray, tables: np.ndarray):
        """One token per sequence at `positions`, written in its scratch slots; the draft's
        greedy next token of each."""
        bs, n, device = self.block_size, len(positions), self.device
        blocks = tables[np.arange(n), positions // bs].astype(np.int64)
        seq_lens = (positions + 1).astype(np.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(blocks * bs + positions % bs).to(device),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=device),
            seq_lens=torch.from_numpy(seq_lens).to(device),
            block_tables=torch.from_numpy(tables).to(device),
            max_query_len=1,
            max_seq_len=int(seq_lens.max()),
            is_decode_only=True,
        )
        pos = torch.from_numpy(positions).to(device)
        hidden = self.model(token, pos, self.cache.kv_cache, meta)
        return self.model.compute_logits(hidden).argmax(dim=-1)
