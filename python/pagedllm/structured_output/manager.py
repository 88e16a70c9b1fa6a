"""`StructuredOutputManager`: the engine's side of structured output.

- Compiling: each constraint compiles on a small thread pool (llguidance releases the GIL while
  it builds a matcher), cached by (kind, spec) as a template matcher; the tokenizer's
  vocabulary is handed to llguidance once, at the first compile. The engine queues the
  request in the scheduler as waiting for its grammar and, at each step, `take_compiled`
  gives every request whose compile finished its matchers (one per sequence, copied from the
  template: the n > 1 fork happens before any sampled token) or its error.
- Each step with constrained samples: `start_fill` fills their token bitmask on a worker
  thread (llguidance fills the rows in parallel without the GIL) while the forward pass runs;
  the sampler waits for it (`StepGrammar.mask`) and masks the logits first. After sampling,
  `advance` feeds each matcher its sampled token; a rejected token ends that request.
- Speculative decoding (`drafts`): a constrained sequence's drafts are cut to the prefix its
  grammar accepts before the step (`cut_drafts`); a step's constrained sample with `d` drafts
  gets `d + 1` bitmask rows (its grammar after each draft prefix), and its matcher advances
  over every token verification kept.
- A matcher lives on its request (`RequestState.matchers`): preemption (recompute keeps the
  generated tokens, so the matcher is already where the sequence is) and swapping leave it
  as it is, and a finished or aborted request takes it along.

Test hook: compiles call this module's `compile_params` at run time, so a test may replace it
(e.g. with a slow one) to show that other requests keep decoding meanwhile.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sampling.grammar_mask import TokenBitmask
from pagedllm.structured_output.compiler import GrammarError, compile_params, short_error
from pagedllm.structured_output.drafts import cut_drafts, mask_rows
from pagedllm.structured_output.params import StructuredOutputsParams
from pagedllm.tokenizer import Tokenizer

# Compile threads: grammars compile in parallel, and a slow one holds one thread only.
COMPILE_WORKERS = 2
# Compiled grammars kept (least recently used dropped first): a server sees many schemas.
CACHE_SIZE = 256


@dataclass
class FillStats:
    """Bitmask cost, summed over steps: `fill_s` is the fill's own time (on its worker
    thread), `wait_s` what the sampler still waited for it after the forward."""

    steps: int = 0
    rows: int = 0
    fill_s: float = 0.0
    wait_s: float = 0.0


@dataclass
class DraftCuts:
    """Constrained sequences' draft tokens, summed over steps: proposed, and kept after the
    grammar cut them (`cut_drafts`)."""

    proposed: int = 0
    kept: int = 0


class StepGrammar:
    """One step's constrained samples: which (`rows`, indices into the step's samples), their
    requests and matchers, and the bitmask being filled for them: one row each, or with
    speculation `num_drafts[g] + 1` rows for constrained sample `g` (`num_drafts` [K]: every
    sample's drafts; None when the step has none)."""

    def __init__(
        self,
        rows: list[int],
        request_ids: list[str],
        matchers: list,
        bits,
        fill,
        num_drafts: np.ndarray | None = None,
    ):
        self.rows = rows
        self.request_ids = request_ids
        self.matchers = matchers
        self.num_drafts = num_drafts
        self.bits: torch.Tensor = bits
        self._fill: Future = fill
        self._mask: TokenBitmask | None = None
        self.wait_s = 0.0

    def mask(self) -> TokenBitmask:
        """The filled bitmask (waits for the fill the first time)."""
        if self._mask is None:
            t0 = time.perf_counter()
            self._fill.result()
            self.wait_s = time.perf_counter() - t0
            self._mask = TokenBitmask(torch.tensor(self.rows, dtype=torch.int64), self.bits)
        return self._mask

    def verification_mask(self, samples: list[int] | None = None) -> TokenBitmask | None:
        """The mask of a verification step's logits (the `d + 1` positions of each sample, or
        of `samples` only; None when none of them is constrained), every position of a
        constrained sample masked by its own row."""
        mask = self.mask()
        if self.num_drafts is None:  # one position per sample: the plain mask
            return mask if samples is None else mask.subset(samples)
        logit_rows, bit_rows = mask_rows(self.rows, self.num_drafts, samples)
        if samples is None:
            return TokenBitmask(torch.from_numpy(logit_rows), mask.bits)
        if not len(logit_rows):
            return None
        return TokenBitmask(torch.from_numpy(logit_rows), mask.bits[torch.from_numpy(bit_rows)])

    def settle(self) -> None:
        """Waits for the fill to end, whatever happens to the step (a failed step must not
        leave a fill running on matchers the next step uses)."""
        wait([self._fill])


def consume_run(matcher, run: list[int]) -> bool:
    """Feeds `run` to `matcher`; False if the grammar rejects a token. A matcher whose grammar
    is complete has stopped, and llguidance's `consume_tokens` refuses even the EOS it must
    accept then (its `consume_token` takes it): such a run goes token by token."""
    if matcher.is_stopped():
        return all(matcher.consume_token(token) for token in run)
    return matcher.consume_tokens(run)


class StructuredOutputManager:
    """Compiles constraints, fills each step's bitmask, advances the matchers."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        eos_token_ids: Sequence[int],
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = tuple(eos_token_ids)
        self._ll_tokenizer = None
        self._ll_lock = threading.Lock()
        self._compile_pool: ThreadPoolExecutor | None = None
        self._fill_pool: ThreadPoolExecutor | None = None
        self._executor = None  # llguidance.LLExecutor, its parallel mask filler
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._pending: dict[str, Future] = {}
        self._inflight: StepGrammar | None = None
        self.live: set[str] = set()  # requests holding matchers
        # speculation: scheduler sequence id -> (request id, sequence index) of constrained
        # sequences, learnt from the first step that schedules each request (`_unmapped` until
        # then), so drafts proposed by sequence id find their matcher
        self._seq_owner: dict[int, tuple[str, int]] = {}
        self._seqs_of: dict[str, list[int]] = {}
        self._unmapped: set[str] = set()
        self.stats = FillStats()
        self.draft_cuts = DraftCuts()

    # ---- compiling ----------------------------------------------------------------------------

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The template matcher of `params` (a future; compiled once per (kind, spec) while it
        is among the `CACHE_SIZE` most recently used)."""
        if self._tokenizer is None:
            raise ValueError(
                "structured_outputs needs a tokenizer; the engine was built with "
                "skip_tokenizer_init=True"
            )
        key = params.key
        with self._cache_lock:  # the server checks constraints from its event loop thread
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            if self._compile_pool is None:
                self._compile_pool = ThreadPoolExecutor(
                    COMPILE_WORKERS, thread_name_prefix="pagedllm-grammar"
                )
            future = self._compile_pool.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                # requests holding the dropped future keep it; only the cache forgets it
                self._cache.popitem(last=False)
        return future

    def _compile(self, params: StructuredOutputsParams):
        return compile_params(self._vocabulary(), params)

    def _vocabulary(self):
        """llguidance's view of the tokenizer, built once (under a lock: compiles run in
        parallel)."""
        with self._ll_lock:
            if self._ll_tokenizer is None:
                from pagedllm.structured_output.vocab import ll_tokenizer

                self._ll_tokenizer = ll_tokenizer(
                    self._tokenizer, self._vocab_size, self._eos_token_ids
                )
            return self._ll_tokenizer

    def check(self, constraints: Iterable[tuple[str, StructuredOutputsParams]]) -> None:
        """Compiles every (name, params) (in parallel, cached) and raises `GrammarError`
        (a ValueError) naming the first that fails; for callers that want bad constraints
        refused before anything is queued (`LLM.generate`, the server)."""
        futures = [(name, self.compile(params)) for name, params in constraints]
        for name, future in futures:
            exc = future.exception()
            if isinstance(exc, ValueError):
                raise GrammarError(f"{name}: {exc}") from exc
            if exc is not None:
                raise exc

    def submit(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Starts compiling the grammar of a request the scheduler holds until it is ready."""
        self._pending[request_id] = self.compile(params)

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def wait_for_compile(self, timeout: float) -> None:
        """Blocks until a pending compile ends or `timeout` passes (for an engine with
        nothing else to do than wait for grammars)."""
        if self._pending:
            wait(list(self._pending.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def take_compiled(self, requests) -> list[tuple[str, Exception | None]]:
        """(request id, error or None) for each request whose compile ended; each live one
        that compiled gets one matcher per sequence (attached through `requests`, the engine's
        `RequestRegistry`). Requests gone meanwhile (aborted) are dropped."""
        done = [rid for rid, future in self._pending.items() if future.done()]
        results = []
        for request_id in done:
            future = self._pending.pop(request_id)
            request = requests.get(request_id)
            if request is None or request.finished:
                continue
            exc = future.exception()
            if exc is None:
                template = future.result()
                requests.attach_matchers(request_id, [template.deep_copy() for _ in request.seqs])
                self.live.add(request_id)
                self._unmapped.add(request_id)
            results.append((request_id, exc))
        return results

    def release(self, request_id: str) -> None:
        """A finished request: forget it (its matchers go with its state)."""
        self.live.discard(request_id)
        self._pending.pop(request_id, None)
        self._unmapped.discard(request_id)
        for seq_id in self._seqs_of.pop(request_id, ()):
            del self._seq_owner[seq_id]

    # ---- one step ---------------------------------------------------------------------------

    def start_fill(self, step, requests: Mapping) -> StepGrammar | None:
        """Starts filling the bitmask of `step`'s constrained samples on the fill thread;
        None when it has none."""
        if not self.live:
            return None
        if self._unmapped and step.num_seqs:
            self._map_seqs(step, requests)
        rows = step.structured_output_samples.tolist()
        if not rows:
            return None
        if self._inflight is not None:
            self._inflight.settle()
        request_ids = step.sample_request_ids
        seq_index = step.sample_seq_index
        ids = [request_ids[k] for k in rows]
        matchers = [requests[rid].matchers[seq_index[k]] for rid, k in zip(ids, rows)]
        self._start_filler()
        num_drafts = None
        if len(step.spec_draft_token_ids):
            num_drafts = step.spec_num_draft_tokens[step.sample_rows].astype(np.int64)
        if num_drafts is None or not num_drafts[rows].any():
            bits = self._bitmask(len(rows))
            fill = self._fill_pool.submit(self._fill, matchers, bits)
        else:
            # d + 1 rows per constrained sample: its grammar after each prefix of its drafts
            d = num_drafts[rows]
            starts = np.cumsum(num_drafts) - num_drafts
            drafts = step.spec_draft_token_ids
            runs = [drafts[starts[k] : starts[k] + n].tolist() for k, n in zip(rows, d.tolist())]
            bits = self._bitmask(int(d.sum()) + len(rows))
            fill = self._fill_pool.submit(self._fill_drafts, matchers, runs, bits)
        self._inflight = StepGrammar(rows, ids, matchers, bits, fill, num_drafts)
        return self._inflight

    def _map_seqs(self, step, requests: Mapping) -> None:
        """Learns the sequence ids of constrained requests this step schedules for the first
        time (a request's sequence ids are consecutive from its first)."""
        seq_ids = step.seq_ids
        seq_index = step.seq_index
        for row, request_id in enumerate(step.request_ids):
            if request_id not in self._unmapped:
                continue
            self._unmapped.discard(request_id)
            first = int(seq_ids[row]) - int(seq_index[row])
            ids = [first + i for i in range(len(requests[request_id].matchers))]
            self._seqs_of[request_id] = ids
            for i, seq_id in enumerate(ids):
                self._seq_owner[seq_id] = (request_id, i)

    def cut_drafts(self, proposals, requests: Mapping):
        """`proposals` (`Scheduler.propose_drafts`' arrays) with each constrained sequence's
        drafts cut to the prefix its grammar accepts; None when nothing was cut."""
        if not self._seq_owner or not len(proposals[0]):
            return None
        matchers = {
            seq_id: requests[request_id].matchers[index]
            for seq_id, (request_id, index) in self._seq_owner.items()
            if request_id in requests
        }
        return cut_drafts(*proposals, matchers, self._eos_token_ids, self.draft_cuts)

    def fill_now(self, matchers: list) -> torch.Tensor:
        """The bitmask of `matchers`, filled on the calling thread (tests, benchmarks)."""
        bits = self._bitmask(len(matchers))
        self._start_filler()
        self._fill(matchers, bits)
        return bits

    def _start_filler(self) -> None:
        if self._fill_pool is None:
            import llguidance

            self._executor = llguidance.LLExecutor()
            self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-bitmask")

    def _bitmask(self, num_rows: int) -> torch.Tensor:
        words = (self._vocabulary().vocab_size + 31) // 32
        pin = torch.cuda.is_available()
        return torch.zeros((num_rows, words), dtype=torch.int32, pin_memory=pin)

    def _fill(self, matchers: list, bits: torch.Tensor) -> None:
        t0 = time.perf_counter()
        rows, words = bits.shape
        # row g of `bits` gets matcher g's mask; llguidance writes it in place, in parallel
        self._executor.unsafe_compute_mask_ptr(
            [(m, g) for g, m in enumerate(matchers)], bits.data_ptr(), words * 4, rows
        )
        self.stats.fill_s += time.perf_counter() - t0

    def _fill_drafts(self, matchers: list, runs: list[list[int]], bits: torch.Tensor) -> None:
        """`_fill` for a step with drafts: matcher g's rows are its mask, then its mask after
        each prefix of `runs[g]` (llguidance consumes the drafts and rolls them back)."""
        t0 = time.perf_counter()
        rows, words = bits.shape
        first, plain, drafted = 0, [], []
        for matcher, run in zip(matchers, runs):
            # llguidance's draft fill takes non-empty runs only
            if run:
                drafted.append((matcher, first, run))
            else:
                plain.append((matcher, first))
            first += len(run) + 1
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bits.data_ptr(), words * 4, rows)
        self._executor.unsafe_compute_mask_ptr_with_draft_token(
            drafted, bits.data_ptr(), words * 4, rows
        )
        self.stats.fill_s += time.perf_counter() - t0

    def advance(self, grammar: StepGrammar, tokens, num_tokens=None) -> dict[str, Exception]:
        """Feeds each constrained sample's tokens to its matcher: `tokens` holds the step's K
        sampled ids, or with speculation (`num_tokens` [K]) sample k's run of `num_tokens[k]`
        (the drafts it accepted, then the target's token). Returns {request id: error} for a
        matcher that rejected a token."""
        if num_tokens is None or not (np.asarray(num_tokens)[grammar.rows] > 1).any():
            if num_tokens is not None:
                tokens = tokens[np.cumsum(num_tokens) - num_tokens]
            picked = [int(tokens[k]) for k in grammar.rows]
            accepted = self._executor.consume_token_par(list(zip(grammar.matchers, picked)))
        else:
            counts = np.asarray(num_tokens, dtype=np.int64)
            starts = np.cumsum(counts) - counts
            picked = [tokens[starts[k] : starts[k] + counts[k]].tolist() for k in grammar.rows]
            accepted = [consume_run(m, run) for m, run in zip(grammar.matchers, picked)]
        stats = self.stats
        stats.steps += 1
        stats.rows += int(grammar.bits.shape[0])
        stats.wait_s += grammar.wait_s
        faulty: dict[str, Exception] = {}
        for request_id, matcher, token, ok in zip(
            grammar.request_ids, grammar.matchers, picked, accepted
        ):
            if not ok:
                what = f"tokens {token}" if isinstance(token, list) else f"token {token}"
                faulty.setdefault(
                    request_id,
                    GrammarError(f"{what} broke the grammar: {short_error(matcher.get_error())}"),
                )
        return faulty
