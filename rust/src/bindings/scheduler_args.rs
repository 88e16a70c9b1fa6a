//! Python arguments of the scheduler turned into its Rust types, checked before anything is
//! queued (integers against their Rust types, token ids strictly as integers), and the knobs'
//! names and defaults that Python reads from here so they live in one place.
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};

use super::convert::{read_i64, wall_clock, IntArg, I64_RANGE};
use super::errors::non_negative;
use crate::ids::TokenId;
use crate::kv::CacheConfig;
use crate::scheduler::{
    defaults, Policy, PreemptionMode, RequestParams, SchedulerConfig, StopParams, Strategy,
};
use crate::spec::NgramConfig;

/// "type repr" of a Python object, for errors naming what was given.
fn shown(obj: &Bound<'_, PyAny>) -> String {
    let name = obj.get_type().name().map(|n| n.to_string());
    let repr = obj.repr().map(|r| r.to_string());
    format!("{} {}", name.unwrap_or_default(), repr.unwrap_or_default())
}

/// `request_id` as a Python str; TypeError naming what was given otherwise.
pub(crate) fn request_id_str<'a, 'py>(
    request_id: &'a Bound<'py, PyAny>,
) -> PyResult<&'a Bound<'py, PyString>> {
    request_id.downcast::<PyString>().map_err(|_| {
        PyTypeError::new_err(format!(
            "request_id must be a str, got {}",
            shown(request_id)
        ))
    })
}

/// `abort_request`'s argument: one id (a str) or an iterable of them; TypeError naming what
/// was given for anything else (an int, an iterable holding a non-str), before any id is used.
pub(crate) fn request_ids(request_id: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    if let Ok(id) = request_id.downcast::<PyString>() {
        return Ok(vec![id.to_str()?.to_owned()]);
    }
    let not_ids = |what: &Bound<'_, PyAny>| {
        PyTypeError::new_err(format!(
            "abort_request takes a request id (str) or an iterable of them, got {}",
            shown(what)
        ))
    };
    let mut ids = Vec::new();
    for item in request_id.try_iter().map_err(|_| not_ids(request_id))? {
        let item = item?;
        let id = item.downcast::<PyString>().map_err(|_| not_ids(&item))?;
        ids.push(id.to_str()?.to_owned());
    }
    Ok(ids)
}

/// The constructor's arguments as Python gave them.
pub(crate) struct SchedulerArgs<'a> {
    pub num_gpu_blocks: i64,
    pub block_size: i64,
    pub num_cpu_blocks: i64,
    pub max_num_batched_tokens: Option<i64>,
    pub max_num_seqs: i64,
    pub max_model_len: i64,
    pub scheduling: &'a str,
    pub policy: &'a str,
    pub preemption_mode: Option<&'a str>,
    pub enable_prefix_caching: bool,
    pub watermark: f64,
    pub long_prefill_token_threshold: i64,
    pub num_lookahead_slots: i64,
    pub delay_factor: f64,
    pub max_loras: i64,
    pub num_speculative_tokens: i64,
    pub prompt_lookup_max: Option<i64>,
    pub prompt_lookup_min: Option<i64>,
}

impl SchedulerArgs<'_> {
    /// The cache's and the scheduler's configurations; ValueError naming a bad argument (the
    /// core checks the rest when it is built).
    pub(crate) fn into_configs(self) -> PyResult<(CacheConfig, SchedulerConfig)> {
        let speculative = ngram_config(
            self.num_speculative_tokens,
            self.prompt_lookup_max,
            self.prompt_lookup_min,
        )?;
        let budget = match self.max_num_batched_tokens {
            None => 0,
            Some(v) if v >= 1 => v as usize,
            Some(v) => {
                return Err(PyValueError::new_err(format!(
                    "max_num_batched_tokens must be >= 1 (or None), got {v}"
                )))
            }
        };
        let cache = CacheConfig {
            block_size: non_negative("block_size", self.block_size)?,
            num_device_blocks: non_negative("num_gpu_blocks", self.num_gpu_blocks)?,
            num_host_blocks: non_negative("num_cpu_blocks", self.num_cpu_blocks)?,
            watermark: self.watermark,
            enable_prefix_caching: self.enable_prefix_caching,
        };
        let threshold = self.long_prefill_token_threshold;
        let cfg = SchedulerConfig {
            max_num_batched_tokens: budget,
            max_num_seqs: non_negative("max_num_seqs", self.max_num_seqs)?,
            max_model_len: non_negative("max_model_len", self.max_model_len)?,
            strategy: Strategy::parse(self.scheduling)?,
            policy: Policy::parse(self.policy)?,
            preemption_mode: PreemptionMode::parse(self.preemption_mode)?,
            long_prefill_token_threshold: non_negative("long_prefill_token_threshold", threshold)?,
            num_lookahead_slots: non_negative("num_lookahead_slots", self.num_lookahead_slots)?,
            delay_factor: self.delay_factor,
            max_loras: non_negative("max_loras", self.max_loras)?,
            speculative,
        };
        Ok((cache, cfg))
    }
}

/// `add_request`'s keyword arguments as Python gave them.
pub(crate) struct RequestArgs<'a, 'py> {
    pub n: IntArg<'py>,
    pub priority: IntArg<'py>,
    pub arrival_time: Option<f64>,
    pub max_tokens: IntArg<'py>,
    pub min_tokens: IntArg<'py>,
    pub eos_token_id: Option<IntArg<'py>>,
    pub stop_token_ids: Option<&'a Bound<'py, PyAny>>,
    pub ignore_eos: bool,
    pub extra_key: IntArg<'py>,
    pub lora_id: IntArg<'py>,
    pub structured_output: bool,
}

impl RequestArgs<'_, '_> {
    /// The request's parameters; ValueError naming the request, the field and its limit.
    pub(crate) fn into_params(
        self,
        id: &str,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_num_seqs: usize,
    ) -> PyResult<RequestParams> {
        let named = |m: String| PyValueError::new_err(format!("request {id:?}: {m}"));
        let token = |t: i64, what: &str| {
            TokenId::try_from(t).map_err(|_| named(format!("{what} {t} is not a valid token id")))
        };
        // n < 1 passes here and is refused by the core with its own message
        let max_seqs = max_num_seqs as i128;
        let n = self
            .n
            .get(id, "n", (I64_RANGE.0, max_seqs), " (max_num_seqs)")?;
        let count = |arg: IntArg<'_>, what: &str, lo: i128| {
            arg.get(id, what, (lo, I64_RANGE.1), "").map(|v| v as usize)
        };
        let max_tokens = count(self.max_tokens, "max_tokens", 1)?;
        let min_tokens = count(self.min_tokens, "min_tokens", 0)?;
        let priority = self.priority.get(id, "priority", I64_RANGE, "")? as i64;
        let extra_key = self
            .extra_key
            .get(id, "extra_key", (0, u64::MAX as i128), "")? as u64;
        // i64 range: the step output reports adapters as int64.
        let lora_id = self.lora_id.get(id, "lora_id", (0, I64_RANGE.1), "")? as u64;
        let eos_token_id = self
            .eos_token_id
            .map(|t| {
                t.get(
                    id,
                    "eos_token_id",
                    (0, TokenId::MAX as i128),
                    " (a token id)",
                )
            })
            .transpose()?
            .map(|t| t as TokenId);
        let mut raw = Vec::new();
        read_i64(
            prompt_token_ids,
            &format!("request {id:?}: prompt_token_ids"),
            &mut raw,
        )?;
        let prompt = raw
            .iter()
            .map(|&t| token(t, "prompt token"))
            .collect::<PyResult<Vec<_>>>()?;
        let stop_ids = match self.stop_token_ids {
            None => Vec::new(),
            Some(obj) => {
                read_i64(obj, &format!("request {id:?}: stop_token_ids"), &mut raw)?;
                raw.iter()
                    .map(|&t| token(t, "stop token"))
                    .collect::<PyResult<Vec<_>>>()?
            }
        };
        Ok(RequestParams {
            prompt,
            n: usize::try_from(n).unwrap_or(0),
            priority,
            arrival_time: self.arrival_time.unwrap_or_else(wall_clock),
            stop: StopParams {
                max_tokens,
                min_tokens,
                eos_token_id,
                stop_token_ids: stop_ids,
                ignore_eos: self.ignore_eos,
            },
            extra_key,
            lora_id,
            structured_output: self.structured_output,
        })
    }
}

/// The n-gram proposer's configuration from the constructor's arguments: off for
/// `num_speculative_tokens = 0`; a lookup bound not given takes the other's value (both
/// missing: 4 and 1).
fn ngram_config(
    k: i64,
    lookup_max: Option<i64>,
    lookup_min: Option<i64>,
) -> PyResult<Option<NgramConfig>> {
    let k = non_negative("num_speculative_tokens", k)?;
    if k == 0 {
        return Ok(None);
    }
    let (max, min) = match (lookup_max, lookup_min) {
        (None, None) => (4, 1),
        (Some(max), None) => (max, max),
        (None, Some(min)) => (min, min),
        (Some(max), Some(min)) => (max, min),
    };
    let max = non_negative("prompt_lookup_max", max)?;
    let min = non_negative("prompt_lookup_min", min)?;
    Ok(Some(NgramConfig::new(k, max, min)?))
}

/// Names and defaults of the knobs, read by Python (`EngineArgs`) so they live in one place.
fn register_knobs(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add(
        "SCHEDULING_STRATEGIES",
        PyTuple::new(py, Strategy::ALL.map(Strategy::as_str))?,
    )?;
    m.add(
        "POLICIES",
        PyTuple::new(py, Policy::ALL.map(Policy::as_str))?,
    )?;
    m.add(
        "PREEMPTION_MODES",
        PyTuple::new(py, PreemptionMode::ALL.map(PreemptionMode::as_str))?,
    )?;
    let d = PyDict::new(py);
    d.set_item("block_size", defaults::BLOCK_SIZE)?;
    d.set_item("max_num_seqs", defaults::MAX_NUM_SEQS)?;
    d.set_item("max_model_len", defaults::MAX_MODEL_LEN)?;
    d.set_item("scheduling", Strategy::ALL[0].as_str())?;
    d.set_item("policy", Policy::ALL[0].as_str())?;
    d.set_item("preemption_mode", PreemptionMode::ALL[0].as_str())?;
    d.set_item("enable_prefix_caching", defaults::ENABLE_PREFIX_CACHING)?;
    d.set_item("watermark", defaults::WATERMARK)?;
    d.set_item(
        "long_prefill_token_threshold",
        defaults::LONG_PREFILL_TOKEN_THRESHOLD,
    )?;
    d.set_item("num_lookahead_slots", defaults::NUM_LOOKAHEAD_SLOTS)?;
    d.set_item("delay_factor", defaults::DELAY_FACTOR)?;
    m.add("DEFAULTS", d)?;
    Ok(())
}

/// `max_num_batched_tokens` that `None` stands for under `scheduling` (prefill_first must fit
/// a whole prompt of `max_model_len`).
#[pyfunction]
fn default_max_num_batched_tokens(scheduling: &str, max_model_len: usize) -> PyResult<usize> {
    Ok(SchedulerConfig::default_batched_tokens(
        Strategy::parse(scheduling)?,
        max_model_len,
    ))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(default_max_num_batched_tokens, m)?)?;
    register_knobs(m)
}
