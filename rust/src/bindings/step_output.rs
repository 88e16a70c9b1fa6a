//! `SchedulerOutput`: one step's work as numpy arrays for the model runner.
//!
//! Each field is declared once, in `step_output_fields!` below: the macro makes its getter,
//! its slot in the per-output cache of built values and its entry in `FIELDS` (a test checks
//! `_core.pyi` and README against it). A field marked `[input]` is one the model runner reads:
//! `STEP_INPUT_SCALARS` / `STEP_INPUT_ARRAYS` name them for Python, which builds from them
//! what a tensor-parallel step carries to every rank (`worker.step_inputs`). Array fields are built on first access — a step whose
//! arrays are never read costs no Python objects — as numpy arrays that own their memory (a
//! vector built for the array is handed over, not copied). Data movement order for the runner:
//! swap out, swap in, copy, then the forward pass.
use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyList;

use super::scheduler::PyScheduler;
use crate::scheduler::StepOutput;

/// A 1-D numpy array that takes `data` over.
fn array<T: numpy::Element>(py: Python<'_>, data: Vec<T>) -> PyResult<Py<PyAny>> {
    Ok(PyArray1::from_vec(py, data).into_any().unbind())
}

/// A 1-D numpy array holding a copy of `data`.
fn array_of<T: numpy::Element + Copy>(py: Python<'_>, data: &[T]) -> PyResult<Py<PyAny>> {
    Ok(PyArray1::from_slice(py, data).into_any().unbind())
}

/// An int64 [N, 2] array of the flat pairs `data`.
fn pairs(py: Python<'_>, data: &[i64]) -> PyResult<Py<PyAny>> {
    let flat = PyArray1::from_slice(py, data);
    Ok(flat.reshape([data.len() / 2, 2])?.into_any().unbind())
}

#[pyclass(name = "SchedulerOutput", module = "pagedllm._core")]
pub(crate) struct PySchedulerOutput {
    pub(crate) out: StepOutput,
    sched: Py<PyScheduler>,
    built: Built,
}

impl PySchedulerOutput {
    pub(crate) fn new(out: StepOutput, sched: Py<PyScheduler>) -> Self {
        PySchedulerOutput {
            out,
            sched,
            built: Built::default(),
        }
    }
}

impl Drop for PySchedulerOutput {
    /// Hands the buffers back to the scheduler (when it is not busy) so the next steps
    /// allocate nothing; arrays already built own their memory and stay valid.
    fn drop(&mut self) {
        let out = std::mem::take(&mut self.out);
        Python::attach(|py| {
            if let Ok(mut sched) = self.sched.bind(py).try_borrow_mut() {
                sched.recycle(out);
            }
        });
    }
}

/// Whether a field's declaration carries the `[input]` marker.
macro_rules! is_input {
    () => {
        false
    };
    (input) => {
        true
    };
}

/// Declares the output's fields once: `plain` ones are read from the step as they are,
/// `built` ones are made by their expression on first access (with `o` the `StepOutput`, `s`
/// the scheduler, `py` the interpreter) and cached. `[input]` after a name marks a field the
/// model runner reads.
macro_rules! step_output_fields {
    (
        plain { $( $(#[doc = $pdoc:expr])* $pname:ident $([$prole:ident])? -> $pty:ty = |$po:ident| $pget:expr; )* }
        built { $( $(#[doc = $bdoc:expr])* $bname:ident $([$brole:ident])? = |$o:ident, $s:ident, $py:ident| $make:expr; )* }
    ) => {
        /// Values of the `built` fields, made on first access.
        struct Built {
            $( $bname: PyOnceLock<Py<PyAny>>, )*
        }

        impl Default for Built {
            fn default() -> Self {
                Built { $( $bname: PyOnceLock::new(), )* }
            }
        }

        /// Every field of `SchedulerOutput`, in declaration order.
        pub(crate) const FIELDS: &[&str] = &[$( stringify!($pname), )* $( stringify!($bname), )*];

        /// The `plain` fields, each with whether the model runner reads it.
        const PLAIN_ROLES: &[(&str, bool)] = &[$( (stringify!($pname), is_input!($($prole)?)), )*];

        /// The `built` fields (arrays, lists), each with whether the model runner reads it.
        const BUILT_ROLES: &[(&str, bool)] = &[$( (stringify!($bname), is_input!($($brole)?)), )*];

        #[pymethods]
        impl PySchedulerOutput {
            $(
                $(#[doc = $pdoc])*
                #[getter]
                fn $pname(&self) -> $pty {
                    let $po = &self.out;
                    $pget
                }
            )*
            $(
                $(#[doc = $bdoc])*
                #[getter]
                fn $bname(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
                    let value = self.built.$bname.get_or_try_init(py, || {
                        let ($o, $s, $py) = (&self.out, &self.sched, py);
                        let _ = ($o, $s);
                        let made: PyResult<Py<PyAny>> = $make;
                        made
                    })?;
                    Ok(value.clone_ref(py))
                }
            )*

            fn __repr__(&self) -> String {
                let o = &self.out;
                format!(
                    "SchedulerOutput(step={}, num_seqs={}, num_batched_tokens={}, num_samples={}, \
                     copies={}, swap_out={}, swap_in={}, preempted={:?}, finished={})",
                    o.step,
                    o.num_seqs(),
                    o.num_batched_tokens,
                    o.num_samples(),
                    o.blocks_to_copy.len() / 2,
                    o.blocks_to_swap_out.len() / 2,
                    o.blocks_to_swap_in.len() / 2,
                    o.preempted,
                    o.finished.len()
                )
            }
        }
    };
}

step_output_fields! {
    plain {
        /// Step number (1 for the first `schedule()`).
        step -> u64 = |o| o.step;
        /// S, the scheduled (computing) sequences.
        num_seqs [input] -> usize = |o| o.num_seqs();
        /// T, the tokens computed this step.
        num_batched_tokens -> usize = |o| o.num_batched_tokens;
        /// K, the samples to draw.
        num_samples -> usize = |o| o.num_samples();
        /// Every scheduled sequence computes exactly one token (False for an empty step).
        is_decode_only [input] -> bool = |o| o.is_decode_only();
    }
    built {
        /// int64 [S] sequence ids, batch order.
        seq_ids = |o, s, py| array_of(py, &o.seq_ids);
        /// list[str] [S] owning request of each scheduled sequence.
        request_ids = |o, s, py| s.borrow(py).id_list(py, &o.handles, &o.gens);
        /// int32 [S] index of each scheduled sequence within its request.
        seq_index = |o, s, py| array_of(py, &o.seq_index);
        /// int32 [S] tokens computed this step.
        num_tokens [input] = |o, s, py| array_of(py, &o.num_tokens);
        /// int32 [S] position of the first of them (= tokens computed before).
        start_pos = |o, s, py| array_of(py, &o.start_pos);
        /// int32 [S] context length after this step (start_pos + num_tokens).
        seq_lens [input] = |o, s, py| array(py, o.seq_lens());
        /// int32 [S+1] cumulative num_tokens.
        query_start_loc [input] = |o, s, py| array(py, o.query_start_loc());
        /// int64 [T] token ids to compute, batch order.
        input_ids [input] = |o, s, py| s.borrow(py).input_ids_array(py, o);
        /// int64 [T] their positions.
        positions [input] = |o, s, py| array(py, o.positions());
        /// int64 [T] KV slot of each token (block * block_size + offset).
        slot_mapping [input] = |o, s, py| array(py, s.borrow(py).slot_mapping(o));
        /// int32 [S, W] block tables padded with 0 to the widest of the step, as they were
        /// at schedule time (the scheduler snapshots them before changing any of them).
        block_tables [input] = |o, s, py| s.borrow(py).block_tables_array(py, o);
        /// int32 [G, S, W] each KV layer group's block tables (hybrid KV groups: a layer
        /// reads its group's; -1 where a sliding window released a block), padded with 0;
        /// [0, S, 0] with one full-attention group (its tables are `block_tables`). Read
        /// before the step is applied or discarded.
        kv_group_tables [input] = |o, s, py| s.borrow(py).group_tables_array(py, o);
        /// int64 [G, T] each token's KV slot in each group ([0, T] with one full-attention
        /// group: `slot_mapping`).
        kv_group_slots [input] = |o, s, py| s.borrow(py).group_slots_array(py, o);
        /// int64 [K] batch row (0..S) whose last token's logits each sample uses.
        sample_rows [input] = |o, s, py| array_of(py, &o.sample_rows);
        /// int64 [K] sequence receiving each sample (an n>1 fork repeats a row).
        sample_seq_ids = |o, s, py| array_of(py, &o.sample_seq_ids);
        /// list[str] [K] request of each sample.
        sample_request_ids = |o, s, py| s.borrow(py).id_list(py, &o.sample_handles, &o.sample_gens);
        /// int32 [K] index of the receiving sequence within its request
        /// (CompletionOutput.index).
        sample_seq_index = |o, s, py| array_of(py, &o.sample_seq_index);
        /// int64 [C, 2] (src, dst) device blocks to copy before the forward (copy-on-write).
        blocks_to_copy = |o, s, py| pairs(py, &o.blocks_to_copy);
        /// int64 [O, 2] (device, host) blocks to swap out.
        blocks_to_swap_out = |o, s, py| pairs(py, &o.blocks_to_swap_out);
        /// int64 [I, 2] (host, device) blocks to swap in.
        blocks_to_swap_in = |o, s, py| pairs(py, &o.blocks_to_swap_in);
        /// list[str] request ids preempted this step, in preemption order.
        preempted = |o, s, py| Ok(PyList::new(py, &o.preempted)?.into_any().unbind());
        /// int64 [S] LoRA adapter (`lora_id`, 0 = base model) of each scheduled sequence.
        lora_ids [input] = |o, s, py| match o.extras.lora_ids.len() {
            0 => array(py, vec![0i64; o.num_seqs()]),
            _ => array_of(py, &o.extras.lora_ids),
        };
        /// list[(request_id, reason)] finished at schedule time (ignored: can never be
        /// served).
        finished = |o, s, py| Ok(PyList::new(py, &o.finished)?.into_any().unbind());
        /// int64 [G] indices (into the K samples) of the samples drawn under a grammar
        /// (structured output), in sample order.
        structured_output_samples = |o, s, py| array(py, s.borrow(py).structured_samples(o));
        /// int32 [S] draft tokens at the end of each row's `num_tokens` (speculative
        /// decoding; all 0 when the step has none).
        spec_num_draft_tokens [input] = |o, s, py| match o.extras.spec_num_draft_tokens.len() {
            0 => array(py, vec![0i32; o.num_seqs()]),
            _ => array_of(py, &o.extras.spec_num_draft_tokens),
        };
        /// int64 [D] the draft tokens, row order.
        spec_draft_token_ids [input] = |o, s, py| array_of(py, &o.extras.spec_draft_token_ids);
        /// uint64 [L] KV connector: the transfer of each load this step starts.
        kv_load_jobs = |o, s, py| array_of(py, &o.kv_meta().load_jobs);
        /// int64 [L] the device block each load writes.
        kv_load_blocks = |o, s, py| array_of(py, &o.kv_meta().load_blocks);
        /// int64 [L] the tier's slot each load reads.
        kv_load_slots = |o, s, py| array_of(py, &o.kv_meta().load_slots);
        /// uint64 [L] the block hash each load expects to find in its slot.
        kv_load_hashes = |o, s, py| array_of(py, &o.kv_meta().load_hashes);
        /// uint64 [M] KV connector: the transfer of each save this step starts.
        kv_save_jobs = |o, s, py| array_of(py, &o.kv_meta().save_jobs);
        /// int64 [M] the device block each save reads.
        kv_save_blocks = |o, s, py| array_of(py, &o.kv_meta().save_blocks);
        /// int64 [M] the tier's slot each save writes.
        kv_save_slots = |o, s, py| array_of(py, &o.kv_meta().save_slots);
        /// uint64 [M] the block hash of each saved block.
        kv_save_hashes = |o, s, py| array_of(py, &o.kv_meta().save_hashes);
        /// uint64 [S] the transfers whose loads are synchronous: copied in before this step's
        /// forward and reported (`update_connector_output`) before its output.
        kv_sync_jobs = |o, s, py| array_of(py, &o.kv_meta().sync_jobs);
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySchedulerOutput>()?;
    m.add("SCHEDULER_OUTPUT_FIELDS", FIELDS.to_vec())?;
    m.add("STEP_INPUT_SCALARS", inputs(PLAIN_ROLES))?;
    m.add("STEP_INPUT_ARRAYS", inputs(BUILT_ROLES))?;
    Ok(())
}

/// The names of the fields marked `[input]`, in declaration order.
fn inputs(roles: &[(&'static str, bool)]) -> Vec<&'static str> {
    roles
        .iter()
        .filter(|(_, input)| *input)
        .map(|(name, _)| *name)
        .collect()
}
