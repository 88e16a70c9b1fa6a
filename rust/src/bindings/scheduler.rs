//! Python face of the scheduler: `Scheduler` (the step arrays are `step_output.rs`'s,
//! its arguments and knobs `scheduler_args.rs`'s).
//!
//! Sampled tokens come back through the buffer protocol (an int64 numpy array is read without
//! conversion).
use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use super::convert::{read_flags, read_i64, wall_clock, IntArg};
use super::errors::{non_negative, PagedLLMError};
use super::scheduler_args::{request_id_str, request_ids, RequestArgs, SchedulerArgs};
use super::scheduler_results::{describe, drafts_tuple, finished_list, stats_dict};
use super::step_output::PySchedulerOutput;
use crate::connector::{block_file_name, DiskConnector, OffloadConnector};
use crate::ids::TokenId;
use crate::scheduler::{defaults, Policy, RequestParams, Scheduler, StepOutput, Strategy};
use pyo3::exceptions::PyValueError;

/// The engine's scheduler, usable without a model: add requests, `schedule()`, feed back
/// sampled tokens with `update_from_output`, abort, read queues and stats.
#[pyclass(name = "Scheduler", module = "pagedllm._core")]
pub(crate) struct PyScheduler {
    inner: Scheduler,
    /// Per request slot: (generation, id as a Python string), so outputs list request ids
    /// without building strings.
    py_ids: Vec<(u32, Py<PyString>)>,
    token_scratch: Vec<i64>,
}

impl PyScheduler {
    /// The scheduler core (`KvEventStream.publish_step` drains its events).
    pub(crate) fn core_mut(&mut self) -> &mut Scheduler {
        &mut self.inner
    }

    /// `add_request`'s arguments converted (`RequestArgs`) and checked by the core's request
    /// rules (`Scheduler::validate_request`): the id as a Python str and the parameters.
    fn checked_request<'py>(
        &self,
        request_id: &Bound<'py, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        args: RequestArgs<'_, '_>,
    ) -> PyResult<(Bound<'py, PyString>, RequestParams)> {
        let request_id = request_id_str(request_id)?.clone();
        let id = request_id.to_str()?;
        let max_num_seqs = self.inner.config().max_num_seqs;
        let (params, n_field) = args.into_params(id, prompt_token_ids, max_num_seqs)?;
        self.inner.check_request(id, &params, n_field)?;
        Ok((request_id, params))
    }

    /// Takes back an output's buffers (see `Scheduler::recycle`).
    pub(crate) fn recycle(&mut self, out: StepOutput) {
        self.inner.recycle(out);
    }

    /// int64 [G] samples of `out` drawn under a grammar.
    pub(crate) fn structured_samples(&self, out: &StepOutput) -> Vec<i64> {
        self.inner.structured_samples(out)
    }

    /// [T] KV slot of each token of `out`.
    pub(crate) fn slot_mapping(&self, out: &StepOutput) -> Vec<i64> {
        self.inner.slot_mapping(out)
    }

    /// int64 [T] token ids of `out` (copied out of the output's built ids).
    pub(crate) fn input_ids_array(&self, py: Python<'_>, out: &StepOutput) -> PyResult<Py<PyAny>> {
        let arr = self
            .inner
            .with_input_ids(out, |ids| PyArray1::from_slice(py, ids));
        Ok(arr.into_any().unbind())
    }

    /// int32 [S, W] block tables of `out` (block ids are below 2**31).
    pub(crate) fn block_tables_array(
        &self,
        py: Python<'_>,
        out: &StepOutput,
    ) -> PyResult<Py<PyAny>> {
        let (data, width) = self.inner.block_tables(out);
        let data: Vec<i32> = data.into_iter().map(|b| b as i32).collect();
        let arr = PyArray1::from_vec(py, data).reshape([out.num_seqs(), width])?;
        Ok(arr.into_any().unbind())
    }

    /// int32 [G, S, W] every KV group's block tables of `out`; [0, S, 0] without hybrid
    /// groups (nothing is built).
    pub(crate) fn group_tables_array(
        &self,
        py: Python<'_>,
        out: &StepOutput,
    ) -> PyResult<Py<PyAny>> {
        let mgr = self.inner.manager();
        if !mgr.is_hybrid() {
            let arr = PyArray1::<i32>::from_vec(py, Vec::new()).reshape([0, out.num_seqs(), 0])?;
            return Ok(arr.into_any().unbind());
        }
        let (data, width) = self.inner.group_tables(out)?;
        let shape = [mgr.num_groups(), out.num_seqs(), width];
        Ok(PyArray1::from_vec(py, data)
            .reshape(shape)?
            .into_any()
            .unbind())
    }

    /// int64 [G, T] every KV group's slot of each token of `out`; [0, T] without hybrid
    /// groups.
    pub(crate) fn group_slots_array(
        &self,
        py: Python<'_>,
        out: &StepOutput,
    ) -> PyResult<Py<PyAny>> {
        let mgr = self.inner.manager();
        let (groups, data) = match mgr.is_hybrid() {
            false => (0, Vec::new()),
            true => (mgr.num_groups(), self.inner.group_slots(out)?),
        };
        let shape = [groups, out.num_batched_tokens];
        Ok(PyArray1::<i64>::from_vec(py, data)
            .reshape(shape)?
            .into_any()
            .unbind())
    }

    /// Python strings of the requests an output names by (slot, generation).
    pub(crate) fn id_list(
        &self,
        py: Python<'_>,
        handles: &[u32],
        gens: &[u32],
    ) -> PyResult<Py<PyAny>> {
        let mut items = Vec::with_capacity(handles.len());
        for (&h, &g) in handles.iter().zip(gens) {
            match self.py_ids.get(h as usize) {
                Some((gen, s)) if *gen == g => items.push(s.clone_ref(py)),
                _ => {
                    return Err(PagedLLMError::new_err(
                        "stale SchedulerOutput: its requests' slots were reused by newer \
                         requests; read request ids before thousands of requests turn over",
                    ))
                }
            }
        }
        Ok(PyList::new(py, items)?.into_any().unbind())
    }
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (*, num_gpu_blocks, block_size = defaults::BLOCK_SIZE as i64,
                        num_cpu_blocks = 0, max_num_batched_tokens = None,
                        max_num_seqs = defaults::MAX_NUM_SEQS as i64,
                        max_model_len = defaults::MAX_MODEL_LEN as i64,
                        scheduling = Strategy::ALL[0].as_str(),
                        policy = Policy::ALL[0].as_str(),
                        preemption_mode = None,
                        enable_prefix_caching = defaults::ENABLE_PREFIX_CACHING,
                        watermark = defaults::WATERMARK,
                        long_prefill_token_threshold = defaults::LONG_PREFILL_TOKEN_THRESHOLD as i64,
                        num_lookahead_slots = defaults::NUM_LOOKAHEAD_SLOTS as i64,
                        delay_factor = defaults::DELAY_FACTOR,
                        max_loras = 0, num_speculative_tokens = 0,
                        prompt_lookup_max = None, prompt_lookup_min = None,
                        kv_offloading_blocks = 0, kv_offloading_path = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_gpu_blocks: i64,
        block_size: i64,
        num_cpu_blocks: i64,
        max_num_batched_tokens: Option<i64>,
        max_num_seqs: i64,
        max_model_len: i64,
        scheduling: &str,
        policy: &str,
        preemption_mode: Option<&str>,
        enable_prefix_caching: bool,
        watermark: f64,
        long_prefill_token_threshold: i64,
        num_lookahead_slots: i64,
        delay_factor: f64,
        max_loras: i64,
        num_speculative_tokens: i64,
        prompt_lookup_max: Option<i64>,
        prompt_lookup_min: Option<i64>,
        kv_offloading_blocks: i64,
        kv_offloading_path: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        let (cache, cfg) = SchedulerArgs {
            num_gpu_blocks,
            block_size,
            num_cpu_blocks,
            max_num_batched_tokens,
            max_num_seqs,
            max_model_len,
            scheduling,
            policy,
            preemption_mode,
            enable_prefix_caching,
            watermark,
            long_prefill_token_threshold,
            num_lookahead_slots,
            delay_factor,
            max_loras,
            num_speculative_tokens,
            prompt_lookup_max,
            prompt_lookup_min,
        }
        .into_configs()?;
        let slots = non_negative("kv_offloading_blocks", kv_offloading_blocks)?;
        let block_size = cache.block_size;
        let mut inner = Scheduler::new(cache, cfg)?;
        match (slots, kv_offloading_path) {
            (0, None) => {}
            (_, None) => {
                inner.set_kv_connector(Box::new(OffloadConnector::new(block_size, slots)))?
            }
            (0, Some(dir)) => {
                if !dir.is_dir() {
                    return Err(PyValueError::new_err(format!(
                        "kv_offloading_path {} is not a directory",
                        dir.display()
                    )));
                }
                inner.set_kv_connector(Box::new(DiskConnector::new(block_size, dir)))?
            }
            (_, Some(_)) => {
                return Err(PyValueError::new_err(
                    "kv_offloading_blocks (the host tier) and kv_offloading_path (the disk \
                     tier) exclude each other",
                ))
            }
        }
        Ok(PyScheduler {
            inner,
            py_ids: Vec::new(),
            token_scratch: Vec::new(),
        })
    }

    fn __repr__(&self) -> String {
        describe(&self.inner)
    }

    /// Queues a request. ValueError (naming the request, the field and its limit) for an
    /// empty prompt, a duplicate id, `n` (or `best_of`, the sequences run when given) above
    /// `max_num_seqs`, token ids that are not integers (floats, bools, strings are refused,
    /// never truncated), integers outside their range, or bad limits (`validate_request`'s
    /// rules); TypeError for a `request_id` that is not a str. Nothing is queued then. A
    /// request that can never be served (prompt too long, more blocks than the cache) is
    /// reported by the next `schedule()` in `finished`, with the reason.
    /// `structured_output=True`: the request samples under a grammar that is still
    /// compiling; it waits in `waiting`, letting others pass, until `grammar_ready`.
    #[pyo3(signature = (request_id, prompt_token_ids, *, n = IntArg::Default(1), best_of = None,
                        priority = IntArg::Default(0), arrival_time = None,
                        max_tokens = IntArg::Default(16), min_tokens = IntArg::Default(0),
                        eos_token_id = None, stop_token_ids = None, ignore_eos = false,
                        extra_key = IntArg::Default(0), lora_id = IntArg::Default(0),
                        structured_output = false),
           text_signature = "($self, request_id, prompt_token_ids, *, n=1, best_of=None, \
                             priority=0, arrival_time=None, max_tokens=16, min_tokens=0, \
                             eos_token_id=None, stop_token_ids=None, ignore_eos=False, \
                             extra_key=0, lora_id=0, structured_output=False)")]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        request_id: &Bound<'_, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        n: IntArg<'_>,
        best_of: Option<IntArg<'_>>,
        priority: IntArg<'_>,
        arrival_time: Option<&Bound<'_, PyAny>>,
        max_tokens: IntArg<'_>,
        min_tokens: IntArg<'_>,
        eos_token_id: Option<IntArg<'_>>,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
        extra_key: IntArg<'_>,
        lora_id: IntArg<'_>,
        structured_output: bool,
    ) -> PyResult<()> {
        let args = RequestArgs {
            n,
            best_of,
            priority,
            arrival_time,
            max_tokens,
            min_tokens,
            eos_token_id,
            stop_token_ids,
            ignore_eos,
            extra_key,
            lora_id,
            structured_output,
        };
        let (request_id, params) = self.checked_request(request_id, prompt_token_ids, args)?;
        let h = self.inner.queue_request(request_id.to_str()?, params) as usize;
        let gen = self.inner.slot_generation(h as u32);
        let entry = (gen, request_id.clone().unbind());
        if h < self.py_ids.len() {
            self.py_ids[h] = entry;
        } else {
            self.py_ids.push(entry);
        }
        Ok(())
    }

    /// The checks of `add_request` (same arguments, same errors), without queuing anything:
    /// for a caller that builds its own state of the request first. Returns the prompt token
    /// ids as a list of Python ints.
    #[pyo3(signature = (request_id, prompt_token_ids, *, n = IntArg::Default(1), best_of = None,
                        priority = IntArg::Default(0), arrival_time = None,
                        max_tokens = IntArg::Default(16), min_tokens = IntArg::Default(0),
                        eos_token_id = None, stop_token_ids = None, ignore_eos = false,
                        extra_key = IntArg::Default(0), lora_id = IntArg::Default(0),
                        structured_output = false),
           text_signature = "($self, request_id, prompt_token_ids, *, n=1, best_of=None, \
                             priority=0, arrival_time=None, max_tokens=16, min_tokens=0, \
                             eos_token_id=None, stop_token_ids=None, ignore_eos=False, \
                             extra_key=0, lora_id=0, structured_output=False)")]
    #[allow(clippy::too_many_arguments)]
    fn validate_request(
        &self,
        request_id: &Bound<'_, PyAny>,
        prompt_token_ids: &Bound<'_, PyAny>,
        n: IntArg<'_>,
        best_of: Option<IntArg<'_>>,
        priority: IntArg<'_>,
        arrival_time: Option<&Bound<'_, PyAny>>,
        max_tokens: IntArg<'_>,
        min_tokens: IntArg<'_>,
        eos_token_id: Option<IntArg<'_>>,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
        extra_key: IntArg<'_>,
        lora_id: IntArg<'_>,
        structured_output: bool,
    ) -> PyResult<Vec<TokenId>> {
        let args = RequestArgs {
            n,
            best_of,
            priority,
            arrival_time,
            max_tokens,
            min_tokens,
            eos_token_id,
            stop_token_ids,
            ignore_eos,
            extra_key,
            lora_id,
            structured_output,
        };
        let (_, params) = self.checked_request(request_id, prompt_token_ids, args)?;
        Ok(params.prompt)
    }

    /// Decides the next step (`now`: seconds on the arrival-time clock, default
    /// `time.time()`; only `delay_factor` reads it). Raises PagedLLMError while the previous
    /// output's samples have not been fed back.
    #[pyo3(signature = (now = None))]
    fn schedule(slf: &Bound<'_, Self>, now: Option<f64>) -> PyResult<PySchedulerOutput> {
        let out = slf
            .borrow_mut()
            .inner
            .schedule(now.unwrap_or_else(wall_clock))?;
        Ok(PySchedulerOutput::new(out, slf.clone().unbind()))
    }

    /// Feeds back one sampled token per sample of `output` (the latest one), aligned with
    /// `output.sample_seq_ids`: an int64 numpy array is read as is, other integer arrays or
    /// lists of ints are converted once; a float or bool array is a ValueError. `stop_string_hit` (optional, bool per sample) finishes that
    /// sequence as stopped. Returns `(request_id, seq_index, finish_reason, stop_reason,
    /// request_finished)` for each sequence that finished.
    /// With `num_tokens` (speculative decoding, int per sample) sample k brings a run of
    /// `num_tokens[k]` consecutive tokens of `sampled_token_ids` (its accepted drafts, then the
    /// target's token; 1 ..= drafts + 1), applied token by token under the stop rules.
    #[pyo3(signature = (output, sampled_token_ids, stop_string_hit = None, *, num_tokens = None))]
    fn update_from_output(
        &mut self,
        py: Python<'_>,
        output: PyRef<'_, PySchedulerOutput>,
        sampled_token_ids: &Bound<'_, PyAny>,
        stop_string_hit: Option<&Bound<'_, PyAny>>,
        num_tokens: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Py<PyList>> {
        let mut tokens = std::mem::take(&mut self.token_scratch);
        let read = read_i64(sampled_token_ids, "sampled_token_ids", &mut tokens);
        let result = read.and_then(|()| {
            let hits = stop_string_hit
                .map(|h| read_flags(h, "stop_string_hit"))
                .transpose()?;
            let step = output.out.step;
            Ok(match num_tokens {
                None => self
                    .inner
                    .update_from_output(step, &tokens, hits.as_deref())?,
                Some(runs) => {
                    let mut counts = Vec::new();
                    read_i64(runs, "num_tokens", &mut counts)?;
                    self.inner
                        .update_from_output_runs(step, &tokens, &counts, hits.as_deref())?
                }
            })
        });
        self.token_scratch = tokens;
        finished_list(py, result?)
    }

    /// Aborts one id (a str) or an iterable of them from whichever queue holds them,
    /// freeing their blocks. Unknown and finished ids are ignored. Anything else (an int, an
    /// iterable holding a non-str) is a TypeError, raised before any request is aborted.
    fn abort_request(&mut self, request_id: &Bound<'_, PyAny>) -> PyResult<()> {
        for id in request_ids(request_id)? {
            self.inner.abort_request(&id)?;
        }
        Ok(())
    }

    /// Where the stop rules end the tokens of `output` (the latest step, before
    /// `update_from_output`): one token per sample (`num_tokens` None) or, for a verification
    /// step, a run of `num_tokens[k]` consecutive tokens of `sampled_token_ids` per sample, as
    /// `update_from_output` takes them. Returns `(kept int64 [K], by_token bool [K])`: the
    /// tokens each sample's sequence keeps, and whether the last kept one ends it by itself
    /// (EOS or a stop id once `min_tokens` are out; its text is not part of the output).
    /// `update_from_output` then ends the sequences at the same place.
    #[pyo3(signature = (output, sampled_token_ids, num_tokens = None))]
    fn stop_cuts<'py>(
        &self,
        py: Python<'py>,
        output: PyRef<'_, PySchedulerOutput>,
        sampled_token_ids: &Bound<'py, PyAny>,
        num_tokens: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let mut tokens = Vec::new();
        read_i64(sampled_token_ids, "sampled_token_ids", &mut tokens)?;
        let counts = num_tokens
            .map(|runs| {
                let mut counts = Vec::new();
                read_i64(runs, "num_tokens", &mut counts).map(|()| counts)
            })
            .transpose()?;
        let cuts = self
            .inner
            .stop_cuts(output.out.step, &tokens, counts.as_deref())?;
        let kept = PyArray1::from_vec(py, cuts.kept);
        let by_token = PyArray1::from_vec(py, cuts.by_token);
        PyTuple::new(py, [kept.into_any(), by_token.into_any()])
    }

    /// Marks the grammar of a request added with `structured_output=True` compiled: it is
    /// schedulable from the next `schedule()` on. Returns False for unknown or finished ids
    /// and for a grammar already marked; ValueError for a request without structured output.
    /// A grammar that fails to compile: abort the request.
    fn grammar_ready(&mut self, request_id: &str) -> PyResult<bool> {
        Ok(self.inner.grammar_ready(request_id)?)
    }

    /// Beam search, between the latest step's forward and its `update_from_output`: sequence
    /// `i` of the request continues sequence `parents[i]` (a copy-on-write fork of its blocks;
    /// the blocks `i` held are given back). A parent keeps its own place; every sequence
    /// involved must have sampled in this step. Returns how many sequences were forked.
    fn fork_beams(
        &mut self,
        output: PyRef<'_, PySchedulerOutput>,
        request_id: &str,
        parents: Vec<usize>,
    ) -> PyResult<usize> {
        Ok(self
            .inner
            .fork_beams(output.out.step, request_id, &parents)?)
    }

    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }

    fn num_running(&self) -> usize {
        self.inner.num_running()
    }

    fn num_swapped(&self) -> usize {
        self.inner.num_swapped()
    }

    fn has_unfinished_requests(&self) -> bool {
        self.inner.has_unfinished_requests()
    }

    /// Request ids in queue order.
    fn waiting_ids(&self) -> Vec<String> {
        self.inner
            .waiting_ids()
            .into_iter()
            .map(String::from)
            .collect()
    }

    fn running_ids(&self) -> Vec<String> {
        self.inner
            .running_ids()
            .into_iter()
            .map(String::from)
            .collect()
    }

    fn swapped_ids(&self) -> Vec<String> {
        self.inner
            .swapped_ids()
            .into_iter()
            .map(String::from)
            .collect()
    }

    /// "WAITING", "RUNNING", "SWAPPED", "PREEMPTED" or "FINISHED_IGNORED" (until reported)
    /// for a live request; None for unknown and finished ones.
    fn request_status(&self, request_id: &str) -> Option<&'static str> {
        self.inner.request_status(request_id).map(|s| s.as_str())
    }

    /// Prompt tokens served by the prefix cache at the request's first admission (None for
    /// unknown or finished requests).
    fn num_cached_tokens(&self, request_id: &str) -> Option<usize> {
        self.inner.request(request_id).map(|r| r.num_cached_tokens)
    }

    /// Prompt tokens of `num_cached_tokens` that the KV connector (the offload tier) loaded
    /// (None for unknown or finished requests).
    fn num_external_tokens(&self, request_id: &str) -> Option<usize> {
        self.inner
            .request(request_id)
            .map(|r| r.extras.num_external_tokens)
    }

    /// The workers' report of the KV connector's transfers (vLLM's `get_finished`): transfer
    /// ids whose loads are done, whose saves are done, and the device blocks whose load
    /// failed (their tokens are computed again). A step's synchronous loads (`kv_sync_jobs`)
    /// are reported before its output; when one of their blocks failed, the step is
    /// discarded (`discard_step`), not applied. ValueError for an id the scheduler is not
    /// waiting for; nothing is applied then. `removed_hashes`: the blocks whose tier copy the
    /// workers deleted (the disk tier's evictions), published removed first, whatever else
    /// the report holds (the files are gone either way).
    #[pyo3(signature = (
        finished_recving, finished_sending, invalid_blocks = Vec::new(), removed_hashes = Vec::new()
    ))]
    fn update_connector_output(
        &mut self,
        finished_recving: Vec<u64>,
        finished_sending: Vec<u64>,
        invalid_blocks: Vec<u32>,
        removed_hashes: Vec<u64>,
    ) -> PyResult<()> {
        self.inner.kv_tier_removed(&removed_hashes);
        Ok(self.inner.update_connector_output(
            &finished_recving,
            &finished_sending,
            &invalid_blocks,
        )?)
    }

    /// Whether the KV connector has loads or saves the workers have not reported yet (their
    /// blocks stay allocated until then).
    fn has_pending_transfers(&self) -> bool {
        self.inner.has_pending_transfers()
    }

    /// Queue lengths, KV usage, prefix-cache counters (in blocks), preemptions by mode.
    fn get_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, self.inner.stats())
    }

    /// Takes back `output` (the latest step, not yet applied) when it could not be computed:
    /// its requests, and the groups it swapped out, go back to the head of `waiting` to be
    /// recomputed (generated tokens kept); blocks it registered in the prefix cache are
    /// forgotten. Returns the ids of the requests rolled back. PagedLLMError if `output` is
    /// not the latest step or was already applied or discarded.
    fn discard_step(&mut self, output: PyRef<'_, PySchedulerOutput>) -> PyResult<Vec<String>> {
        Ok(self.inner.discard_step(&output.out)?)
    }

    /// N-gram draft tokens for every running sequence that decodes next step (one call per
    /// step): `(seq_ids int64 [N], num_draft_tokens int32 [N], draft_token_ids int64 [sum])`,
    /// sequences without a proposal left out. PagedLLMError when speculation is off.
    fn propose_drafts<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        drafts_tuple(py, self.inner.propose_drafts()?)
    }

    /// Drafts proposed by the engine (a draft model) for the next step (one call per step):
    /// `(seq_ids, num_draft_tokens, draft_token_ids)` as `propose_drafts` returns them; kept
    /// for the sequences `propose_drafts` would serve, trimmed to their room. Returns the drafts
    /// kept, in the same form. ValueError for inconsistent arrays, PagedLLMError when
    /// speculation is off.
    fn set_drafts<'py>(
        &mut self,
        py: Python<'py>,
        seq_ids: &Bound<'py, PyAny>,
        num_draft_tokens: &Bound<'py, PyAny>,
        draft_token_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let (mut seqs, mut counts, mut drafts) = (Vec::new(), Vec::new(), Vec::new());
        read_i64(seq_ids, "seq_ids", &mut seqs)?;
        read_i64(num_draft_tokens, "num_draft_tokens", &mut counts)?;
        read_i64(draft_token_ids, "draft_token_ids", &mut drafts)?;
        drafts_tuple(py, self.inner.set_drafts(&seqs, &counts, &drafts)?)
    }

    /// Turns the KV events of the prefix cache (read with `drain_kv_events`) and of the
    /// offload tier on or off (both read by `KvEventStream.publish_step`).
    fn set_kv_events(&mut self, enabled: bool) {
        super::kv_events::set_recording(&mut self.inner, enabled);
    }

    /// The prefix cache's changes since the last call, as arrays (`bindings/kv_events.rs`).
    fn drain_kv_events<'py>(&mut self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        super::kv_events::batch_tuple(py, self.inner.kv_events_mut().drain())
    }

    /// Lays out the model's KV layer groups, before any request: one entry per group, its
    /// sliding window in tokens or None for full attention (`[None]`, the default, is every
    /// model without windows).
    fn set_kv_groups(&mut self, windows: Vec<Option<i64>>) -> PyResult<()> {
        let windows = windows
            .into_iter()
            .map(|w| w.map(|w| non_negative("window", w)).transpose())
            .collect::<PyResult<Vec<_>>>()?;
        Ok(self.inner.set_kv_groups(windows)?)
    }

    /// Each KV layer group's sliding window (None: full attention).
    #[getter]
    fn kv_groups(&self) -> Vec<Option<usize>> {
        self.inner.manager().group_windows().to_vec()
    }

    /// Layer group `group`'s block row of sequence `seq_id` (a `SchedulerOutput`'s
    /// `seq_ids`), -1 where its window released a block: the table that group's layers read.
    fn group_block_table(&self, seq_id: u64, group: usize) -> PyResult<Vec<i32>> {
        let row = self.inner.manager().group_block_table(seq_id, group)?;
        Ok(row.iter().map(|&b| b as i32).collect())
    }

    /// Raises PagedLLMError naming the first broken invariant (manager and queues).
    fn check_invariants(&self) -> PyResult<()> {
        self.inner
            .check_invariants()
            .map_err(PagedLLMError::new_err)
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }

    #[getter]
    fn max_num_batched_tokens(&self) -> usize {
        self.inner.config().max_num_batched_tokens
    }

    #[getter]
    fn max_num_seqs(&self) -> usize {
        self.inner.config().max_num_seqs
    }

    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner.config().max_model_len
    }

    #[getter]
    fn scheduling(&self) -> &'static str {
        self.inner.config().strategy.as_str()
    }

    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.config().policy.as_str()
    }

    #[getter]
    fn preemption_mode(&self) -> Option<&'static str> {
        self.inner.config().preemption_mode.as_str()
    }
}

/// The disk tier's file name of the block with chained hash `block_hash` (the scheduler
/// looks for it, the workers write and read it).
#[pyfunction]
fn kv_block_file_name(block_hash: u64) -> String {
    block_file_name(block_hash)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_function(wrap_pyfunction!(kv_block_file_name, m)?)?;
    super::scheduler_args::register(m)
}
