"""Step faults: what the engine does when a step fails after it was scheduled.

A failed step (building inputs, the forward, batched sampling with no request to blame) is
taken back by `roll_back` with `Scheduler.discard_step`: its requests are recomputed by later
steps, with the same outputs. To find who is at fault without blaming the innocent, the requests
whose forward failed are put in quarantine: from the next step on they run in groups of their own
(a forward per group over the group's rows of the step, `run_groups`; everyone else still runs
in one batch), a group that fails again is halved, and
- a group that runs fine leaves quarantine: its requests join the batch again;
- a request whose forward fails alone while the rest of its step runs fine takes a strike, and
  is given up at `max_step_faults` strikes (finished as "abort", the error as `stop_reason`);
- a failure in a step where nothing ran fine blames nobody (the device itself may be failing):
  its requests are given up only after `max_unattributed_faults` such steps in a row, so that a
  device that stays broken, or a failing request with nothing to compare it with, still ends.
An interrupt (`KeyboardInterrupt`) counts against nobody. While a step fails, its requests make
no progress (the whole step is recomputed); they lose time, never tokens.

A fault that is one request's own (its sampling rows or its output processing raise, its LoRA
adapter can no longer be read) ends that request alone, at once (`end_faulty`, `end_request`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.engine.registry import RequestRegistry
from pagedllm.engine.request import RequestState
from pagedllm.sampling.verification import has_drafts

logger = logging.getLogger("pagedllm")

# the quarantine group of a request under no suspicion: the step's one batch
BATCH = 0


def sample_isolating(sample: Callable, step, logits: torch.Tensor):
    """(sampled, {}) normally; when batched sampling raises, (None, {request id: error}) of the
    requests whose own rows fail to sample, or the error itself if none does alone.

    `sample(step, logits, rows=None)` samples every row of `logits`, or only `rows` of them."""
    try:
        return sample(step, logits), {}
    except Exception:
        rows_of: dict[str, list[int]] = {}
        for k, request_id in enumerate(step.sample_request_ids):
            rows_of.setdefault(request_id, []).append(k)
        faulty = {}
        for request_id, rows in rows_of.items():
            try:
                sample(step, logits, rows)
            except Exception as exc:
                faulty[request_id] = exc
        if not faulty:
            raise
        return None, faulty


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """int64: the concatenated ranges `[starts[i], starts[i] + counts[i])`."""
    counts = np.asarray(counts, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.repeat(np.asarray(starts, dtype=np.int64) - (ends - counts), counts) + np.arange(
        int(ends[-1]) if len(ends) else 0, dtype=np.int64
    )


class StepRows:
    """Some sequence rows of a step (`rows`, ascending), with the fields `ModelRunner.prepare`
    reads of a step: their requests, tokens, KV slots, block tables, adapters, drafts and
    samples.
    `samples` are the step's sample indices these rows hold, in order."""

    def __init__(self, step, rows: np.ndarray) -> None:
        num_tokens = step.num_tokens[rows]
        tokens = _ranges(step.query_start_loc[rows], num_tokens)
        self.num_seqs = len(rows)
        self.request_ids = [step.request_ids[r] for r in rows]
        self.num_tokens = num_tokens
        self.query_start_loc = np.concatenate(([0], np.cumsum(num_tokens))).astype(np.int32)
        self.seq_lens = step.seq_lens[rows]
        self.input_ids = step.input_ids[tokens]
        self.positions = step.positions[tokens]
        self.slot_mapping = step.slot_mapping[tokens]
        self.block_tables = step.block_tables[rows]
        self.kv_group_tables = step.kv_group_tables[:, rows]
        self.kv_group_slots = step.kv_group_slots[:, tokens]
        self.is_decode_only = step.is_decode_only
        self.lora_ids = step.lora_ids[rows]
        drafts = step.spec_num_draft_tokens
        self.spec_num_draft_tokens = drafts[rows]
        first_draft = np.cumsum(drafts) - drafts
        self.spec_draft_token_ids = step.spec_draft_token_ids[
            _ranges(first_draft[rows], drafts[rows])
        ]
        place = np.full(step.num_seqs, -1, dtype=np.int64)
        place[rows] = np.arange(len(rows))
        of_sample = place[step.sample_rows]
        self.samples = np.flatnonzero(of_sample >= 0)
        self.sample_rows = of_sample[self.samples]


def _logit_rows(step) -> tuple[np.ndarray, np.ndarray]:
    """(first logits row, number of rows) of each sample of `step`: one row, or with drafts to
    verify one per draft plus one (`ModelRunner.forward`'s layout)."""
    counts = np.ones(step.num_samples, dtype=np.int64)
    if has_drafts(step):
        counts += step.spec_num_draft_tokens[step.sample_rows]
    return np.cumsum(counts) - counts, counts


@dataclass
class Group:
    """The requests of one quarantine group (`BATCH`: those under no suspicion) in a step."""

    key: int
    rows: np.ndarray  # their sequence rows in the step, ascending
    request_ids: list[str]  # in row order


class StepFaults:
    """Rolls failed steps back, quarantines the requests of failed forwards until the one at
    fault is found, and ends the requests a fault belongs to (through `requests`, their owner).
    It keeps each live request's strikes itself."""

    def __init__(
        self,
        scheduler,
        requests: RequestRegistry,
        max_step_faults: int,
        max_unattributed_faults: int,
    ) -> None:
        self.scheduler = scheduler
        self.requests = requests
        self.max_step_faults = max_step_faults
        self.max_unattributed_faults = max_unattributed_faults
        self._group_of: dict[str, int] = {}  # request in quarantine -> its group
        # strikes: failed steps whose forward failed on the request alone while the rest ran
        # fine (`max_step_faults`), and failed steps in a row in which nothing ran fine
        # (`max_unattributed_faults`, reset when its group runs fine)
        self._num_faults: dict[str, int] = {}
        self._num_unattributed: dict[str, int] = {}
        self._keys = itertools.count(BATCH + 1)
        # (failed groups, whether another group ran fine) of the step `run_groups` failed
        self._failed: tuple[list[Group], bool] | None = None

    # ---- quarantine -------------------------------------------------------------------------

    def groups(self, step) -> list[Group] | None:
        """The step's groups, the batch first; None when none of its requests is in quarantine
        (the step runs as one forward)."""
        self._failed = None
        if not self._group_of:
            return None
        groups = self._partition(step)
        return None if [g.key for g in groups] == [BATCH] else groups

    def _partition(self, step) -> list[Group]:
        rows_of: dict[int, list[int]] = {}
        request_ids = step.request_ids
        for row, request_id in enumerate(request_ids):
            rows_of.setdefault(self._group_of.get(request_id, BATCH), []).append(row)
        return [
            Group(key, np.array(rows), list(dict.fromkeys(request_ids[r] for r in rows)))
            for key, rows in sorted(rows_of.items())
        ]

    def run_groups(
        self, step, groups: list[Group], forward: Callable[[StepRows], torch.Tensor | None]
    ) -> torch.Tensor | None:
        """Runs each group's rows by themselves (`forward(rows)` -> their logits) and returns the
        step's logits, each sample's rows where one forward over the step puts them. A group
        that runs fine leaves quarantine; if any fails, the first error is raised once every
        group has run (`roll_back` then blames the failed groups)."""
        first_row, num_rows = _logit_rows(step)
        logits, failed, error = None, [], None
        for group in groups:
            rows = StepRows(step, group.rows)
            try:
                out = forward(rows)
            except Exception as exc:
                failed.append(group)
                error = error or exc
                continue
            self._cleared(group)
            if out is not None:
                if logits is None:
                    logits = out.new_empty((int(num_rows.sum()), out.shape[-1]))
                where = _ranges(first_row[rows.samples], num_rows[rows.samples])
                logits[torch.from_numpy(where).to(out.device)] = out
        if failed:
            self._failed = (failed, len(failed) < len(groups))
            raise error
        return logits

    def _cleared(self, group: Group) -> None:
        if group.key == BATCH:
            return
        for request_id in group.request_ids:
            if self._group_of.pop(request_id, None) is not None:
                self._num_unattributed.pop(request_id, None)

    def _quarantine(self, request_ids: list[str]) -> None:
        """Two new groups of halves (one of a lone request)."""
        half = (len(request_ids) + 1) // 2
        for part in (request_ids[:half], request_ids[half:]):
            key = next(self._keys)
            for request_id in part:
                self._group_of[request_id] = key

    def forget(self, request_id: str) -> None:
        """A finished request leaves quarantine, its strikes with it."""
        self._group_of.pop(request_id, None)
        self._num_faults.pop(request_id, None)
        self._num_unattributed.pop(request_id, None)

    # ---- failed steps -----------------------------------------------------------------------

    def roll_back(self, step, touched: dict[str, RequestState], exc: BaseException) -> None:
        """Takes back a step that failed: its requests are recomputed by later steps, those of
        the failed forwards (every group when the failure was not one group's) in quarantine,
        given up as the module docstring says. An interrupt counts against nobody. The requests
        given up are added to `touched`."""
        failed, self._failed = self._failed, None
        counts = isinstance(exc, Exception)
        if counts and failed is None:
            failed = (self._partition(step), False)
        rolled_back = self.scheduler.discard_step(step)
        note = (
            f"pagedllm: step {step.step} was rolled back; {len(rolled_back)} request(s) will be "
            f"recomputed by the next steps (the engine keeps serving)"
        )
        if counts:
            groups, others_ran = failed
            for group in groups:
                self._blame(group.request_ids, others_ran, exc, touched)
            suspects = sum(len(g.request_ids) for g in groups)
            note += f"; the {suspects} request(s) whose forward failed run apart until found"
        exc.add_note(note)

    def _blame(
        self,
        request_ids: list[str],
        others_ran: bool,
        exc: Exception,
        touched: dict[str, RequestState],
    ) -> None:
        self._quarantine(request_ids)
        for request_id in request_ids:
            reason = None
            if not others_ran:
                strikes = self._strike(self._num_unattributed, request_id)
                if strikes >= self.max_unattributed_faults:
                    reason = (
                        f"gave up after {strikes} failed steps in a row "
                        f"in which nothing else ran fine"
                    )
            elif len(request_ids) == 1:
                strikes = self._strike(self._num_faults, request_id)
                if strikes >= self.max_step_faults:
                    reason = (
                        f"gave up after {strikes} failed steps whose forward failed "
                        f"on this request alone while the rest of the step ran fine"
                    )
            if reason is not None:
                touched[request_id] = self.give_up(
                    request_id, f"{reason}; last error: {type(exc).__name__}: {exc}"
                )

    @staticmethod
    def _strike(counts: dict[str, int], request_id: str) -> int:
        counts[request_id] = counts.get(request_id, 0) + 1
        return counts[request_id]

    def end_faulty(
        self,
        step,
        faulty: dict[str, Exception],
        touched: dict[str, RequestState],
        stage: str = "sampling",
    ) -> None:
        """Ends the requests whose `stage` failed; the rest of the step is recomputed later."""
        self.scheduler.discard_step(step)
        for request_id, exc in faulty.items():
            self.end_request(request_id, stage, exc)
            touched[request_id] = self.requests[request_id]

    def end_request(self, request_id: str, stage: str, exc: Exception) -> None:
        """Ends one request because its `stage` ("sampling", "output processing") failed."""
        self.give_up(request_id, f"{stage} failed: {type(exc).__name__}: {exc}")
        logger.error(
            "request %r ended: %s failed: %s: %s", request_id, stage, type(exc).__name__, exc
        )

    def give_up(self, request_id: str, reason: str) -> RequestState:
        """Ends the request: aborted, with `reason` as its `stop_reason`."""
        return self.requests.abort(request_id, reason)
