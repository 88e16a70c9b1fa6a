//! The scheduler's results as Python values: the sequences an update finished, draft
//! proposals, the stats dictionary, the repr.
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyList, PyTuple};

use super::manager::{set_pool_counts, set_prefix_counters};
use crate::scheduler::{DraftProposals, FinishedSeq, Scheduler, SchedulerStats};

/// `update_from_output`'s result: `(request_id, seq_index, finish_reason, stop_reason,
/// request_finished)` per finished sequence.
pub(crate) fn finished_list(py: Python<'_>, finished: Vec<FinishedSeq>) -> PyResult<Py<PyList>> {
    let list = PyList::empty(py);
    for f in finished {
        let item = PyTuple::new(
            py,
            [
                f.request_id.into_pyobject(py)?.into_any(),
                f.seq_index.into_pyobject(py)?.into_any(),
                f.reason.as_str().into_pyobject(py)?.into_any(),
                f.stop_reason.into_pyobject(py)?.into_any(),
                PyBool::new(py, f.request_finished).to_owned().into_any(),
            ],
        )?;
        list.append(item)?;
    }
    Ok(list.unbind())
}

/// Drafts as `(seq_ids int64 [N], num_draft_tokens int32 [N], draft_token_ids int64 [sum])`.
pub(crate) fn drafts_tuple(py: Python<'_>, p: DraftProposals) -> PyResult<Bound<'_, PyTuple>> {
    PyTuple::new(
        py,
        [
            PyArray1::from_vec(py, p.seq_ids).into_any(),
            PyArray1::from_vec(py, p.num_draft_tokens).into_any(),
            PyArray1::from_vec(py, p.draft_token_ids).into_any(),
        ],
    )
}

/// `get_stats()`: queue lengths, KV usage, prefix-cache counters (in blocks), preemptions by
/// mode, step counters.
pub(crate) fn stats_dict(py: Python<'_>, s: SchedulerStats) -> PyResult<Bound<'_, PyDict>> {
    let c = &s.counters;
    let d = PyDict::new(py);
    d.set_item("num_waiting", s.num_waiting)?;
    d.set_item("num_running", s.num_running)?;
    d.set_item("num_swapped", s.num_swapped)?;
    d.set_item("num_running_seqs", s.num_running_seqs)?;
    d.set_item("kv_usage", s.cache.device_usage)?;
    d.set_item("cpu_kv_usage", s.cache.host_usage)?;
    set_pool_counts(&d, &s.cache)?;
    set_prefix_counters(&d, &s.cache)?;
    d.set_item(
        "num_preemptions",
        c.num_preemptions_recompute + c.num_preemptions_swap,
    )?;
    d.set_item("num_preemptions_recompute", c.num_preemptions_recompute)?;
    d.set_item("num_preemptions_swap", c.num_preemptions_swap)?;
    d.set_item("num_steps", c.num_steps)?;
    d.set_item("num_finished", c.num_finished)?;
    d.set_item("num_ignored", c.num_ignored)?;
    d.set_item("num_aborted", c.num_aborted)?;
    d.set_item("num_batched_tokens_total", c.num_batched_tokens_total)?;
    d.set_item("num_rolled_back_steps", c.num_rolled_back_steps)?;
    if let Some(o) = s.offload {
        d.set_item("num_waiting_for_remote_kvs", s.num_waiting_for_remote_kvs)?;
        d.set_item("kv_offload_num_slots", o.num_slots)?;
        d.set_item("kv_offload_used_slots", o.num_used_slots)?;
        d.set_item("kv_offload_hit_blocks", o.hit_blocks)?;
        d.set_item("kv_offload_missed_blocks", o.missed_blocks)?;
        d.set_item("kv_offload_loaded_blocks", o.loaded_blocks)?;
        d.set_item("kv_offload_failed_blocks", o.failed_blocks)?;
        d.set_item("kv_offload_saved_blocks", o.saved_blocks)?;
        d.set_item("kv_offload_evicted_blocks", o.evicted_blocks)?;
    }
    Ok(d)
}

/// `Scheduler(...)`: the configuration that shapes its steps, and the queues.
pub(crate) fn describe(s: &Scheduler) -> String {
    let c = s.config();
    format!(
        "Scheduler(scheduling={:?}, policy={:?}, preemption_mode={:?}, block_size={}, \
         max_num_batched_tokens={}, max_num_seqs={}, max_model_len={}, waiting={}, \
         running={}, swapped={})",
        c.strategy.as_str(),
        c.policy.as_str(),
        c.preemption_mode.as_str(),
        s.block_size(),
        c.max_num_batched_tokens,
        c.max_num_seqs,
        c.max_model_len,
        s.num_waiting(),
        s.num_running(),
        s.num_swapped()
    )
}
