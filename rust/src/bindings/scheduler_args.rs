//! Python arguments of the scheduler turned into its Rust types, checked before anything is
//! queued (integers against their Rust types, token ids strictly as integers), and the knobs'
//! names, defaults and rules that Python reads from here so they live in one place (the rules
//! themselves are the core's: these functions convert and ask).
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};

use super::convert::{read_i64, seconds, wall_clock, IntArg, I64_RANGE};
use super::errors::non_negative;
use crate::ids::TokenId;
use crate::kv::CacheConfig;
use crate::scheduler::{
    defaults, request_repr, too_many_seqs, Policy, PreemptionMode, RequestParams, Scheduler,
    SchedulerConfig, StopParams, Strategy,
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
/// The one rule of the argument: `Scheduler.abort_request` and the engine (`request_id_list`)
/// both read it here.
pub(crate) fn request_ids(request_id: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    if let Ok(id) = request_id.downcast::<PyString>() {
        return Ok(vec![id.to_str()?.to_owned()]);
    }
    const TAKES: &str = "abort_request takes a request id (str) or an iterable of them";
    let mut ids = Vec::new();
    let items = request_id
        .try_iter()
        .map_err(|_| PyTypeError::new_err(format!("{TAKES}, got {}", shown(request_id))))?;
    for (i, item) in items.enumerate() {
        let item = item?;
        let id = item.downcast::<PyString>().map_err(|_| {
            PyTypeError::new_err(format!(
                "{TAKES}; item {i}: request id must be a str, got {}",
                shown(&item)
            ))
        })?;
        ids.push(id.to_str()?.to_owned());
    }
    Ok(ids)
}

/// `abort_request`'s argument as a list of ids (see `request_ids`), for the engine, which
/// aborts its own state of each id too.
#[pyfunction]
fn request_id_list(request_ids: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    self::request_ids(request_ids)
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
    /// The constructor's defaults (no blocks).
    pub(crate) fn defaults() -> Self {
        SchedulerArgs {
            num_gpu_blocks: 0,
            block_size: defaults::BLOCK_SIZE as i64,
            num_cpu_blocks: 0,
            max_num_batched_tokens: None,
            max_num_seqs: defaults::MAX_NUM_SEQS as i64,
            max_model_len: defaults::MAX_MODEL_LEN as i64,
            scheduling: Strategy::ALL[0].as_str(),
            policy: Policy::ALL[0].as_str(),
            preemption_mode: None,
            enable_prefix_caching: defaults::ENABLE_PREFIX_CACHING,
            watermark: defaults::WATERMARK,
            long_prefill_token_threshold: defaults::LONG_PREFILL_TOKEN_THRESHOLD as i64,
            num_lookahead_slots: defaults::NUM_LOOKAHEAD_SLOTS as i64,
            delay_factor: defaults::DELAY_FACTOR,
            max_loras: 0,
            num_speculative_tokens: 0,
            prompt_lookup_max: None,
            prompt_lookup_min: None,
        }
    }

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
    pub best_of: Option<IntArg<'py>>,
    pub priority: IntArg<'py>,
    pub arrival_time: Option<&'a Bound<'py, PyAny>>,
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
    /// The request's parameters, and the name of its sequence count (`best_of` when given,
    /// else `n`), converted from Python (integers against their Rust types, token ids strictly
    /// as integers): a ValueError naming the request, the field and its limit. The request
    /// rules themselves are the core's (`Scheduler::validate_request`).
    pub(crate) fn into_params(
        self,
        id: &str,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_num_seqs: usize,
    ) -> PyResult<(RequestParams, &'static str)> {
        let named = |m: String| PyValueError::new_err(format!("request {}: {m}", request_repr(id)));
        let token = |(i, &t): (usize, &i64), what: &str| {
            TokenId::try_from(t).map_err(|_| {
                named(format!(
                    "{what} id {t} (position {i}) is outside the token ids [0, {}]",
                    TokenId::MAX
                ))
            })
        };
        // Sequences: `best_of` when given (vLLM: the engine returns the best `n` of them).
        // Values beyond the Rust type get the core's message; the rest (n < 1, above
        // max_num_seqs) the core refuses itself.
        let (seqs, field) = match self.best_of {
            Some(best_of) => (best_of, "best_of"),
            None => (self.n, "n"),
        };
        let over = |shown: &str| too_many_seqs(field, &shown, max_num_seqs);
        let n = seqs.get_or(id, field, I64_RANGE, &over)?;
        let arrival_time = match self.arrival_time {
            None => wall_clock(),
            Some(t) => seconds(
                t,
                &format!("request {}: ", request_repr(id)),
                "arrival_time",
            )?,
        };
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
            &format!("request {}: prompt_token_ids", request_repr(id)),
            &mut raw,
        )?;
        let prompt = raw
            .iter()
            .enumerate()
            .map(|t| token(t, "prompt token"))
            .collect::<PyResult<Vec<_>>>()?;
        let stop_ids = match self.stop_token_ids {
            None => Vec::new(),
            Some(obj) => {
                read_i64(
                    obj,
                    &format!("request {}: stop_token_ids", request_repr(id)),
                    &mut raw,
                )?;
                raw.iter()
                    .enumerate()
                    .map(|t| token(t, "stop token"))
                    .collect::<PyResult<Vec<_>>>()?
            }
        };
        let params = RequestParams {
            prompt,
            n: usize::try_from(n).unwrap_or(0),
            priority,
            arrival_time,
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
        };
        Ok((params, field))
    }
}

/// The n-gram proposer's configuration from the constructor's arguments: off for
/// `num_speculative_tokens = 0`; the lookup bounds are `NgramConfig::lookup_bounds`'.
fn ngram_config(
    k: i64,
    lookup_max: Option<i64>,
    lookup_min: Option<i64>,
) -> PyResult<Option<NgramConfig>> {
    let k = non_negative("num_speculative_tokens", k)?;
    if k == 0 {
        return Ok(None);
    }
    let (max, min) = ngram_lookup_bounds(lookup_max, lookup_min)?;
    Ok(Some(NgramConfig::new(k, max, min)?))
}

/// The n-gram lookup bounds `(prompt_lookup_max, prompt_lookup_min)` from the ones given (the
/// core's defaults and rule, `NgramConfig::lookup_bounds`); ValueError naming a bad one.
#[pyfunction]
#[pyo3(signature = (prompt_lookup_max = None, prompt_lookup_min = None))]
fn ngram_lookup_bounds(
    prompt_lookup_max: Option<i64>,
    prompt_lookup_min: Option<i64>,
) -> PyResult<(usize, usize)> {
    let max = prompt_lookup_max
        .map(|v| non_negative("prompt_lookup_max", v))
        .transpose()?;
    let min = prompt_lookup_min
        .map(|v| non_negative("prompt_lookup_min", v))
        .transpose()?;
    Ok(NgramConfig::lookup_bounds(max, min)?)
}

/// The fewest KV-cache blocks (of `block_size` tokens, under `watermark`) with which the
/// longest sequence the scheduler can hold (`max_model_len`, or the token budget under
/// `prefill_first`, which never splits a prompt) can ever be admitted: the cache admission's
/// rule (`Scheduler::min_device_blocks`), which start-up sizing asks. `kv_groups`: the
/// cache's layer groups (`Scheduler.set_kv_groups`; None: one full-attention group), a window
/// group's blocks bounded by its window and the chunk.
#[pyfunction]
#[pyo3(signature = (max_model_len, *, block_size = defaults::BLOCK_SIZE as i64,
                    watermark = defaults::WATERMARK, scheduling = Strategy::ALL[0].as_str(),
                    max_num_batched_tokens = None, kv_groups = None))]
fn min_kv_blocks(
    max_model_len: i64,
    block_size: i64,
    watermark: f64,
    scheduling: &str,
    max_num_batched_tokens: Option<i64>,
    kv_groups: Option<Vec<Option<i64>>>,
) -> PyResult<usize> {
    let (cache, mut cfg) = SchedulerArgs {
        block_size,
        max_model_len,
        scheduling,
        watermark,
        max_num_batched_tokens,
        ..SchedulerArgs::defaults()
    }
    .into_configs()?;
    cfg.resolve_budget();
    Scheduler::check_config(&cache, &cfg)?;
    let Some(windows) = kv_groups else {
        return Ok(Scheduler::min_device_blocks(&cache, &cfg));
    };
    let windows = windows
        .into_iter()
        .map(|w| w.map(|w| non_negative("window", w)).transpose())
        .collect::<PyResult<Vec<_>>>()?;
    if windows.is_empty() || windows.contains(&Some(0)) {
        return Err(PyValueError::new_err(format!(
            "kv_groups must name at least one group, none with a window of 0: {windows:?}"
        )));
    }
    Ok(Scheduler::min_device_blocks_grouped(&cache, &cfg, &windows))
}

/// Checks the scheduler's and the cache's knobs as the `Scheduler` constructor would (the
/// core's rules, nothing built): ValueError naming the knob and the value. `max_model_len` /
/// `max_num_batched_tokens` None: not checked (the engine resolves them later). Integers must
/// be ints (a float or a bool is refused, never truncated).
#[pyfunction]
#[pyo3(signature = (*, block_size = IntArg::Default(defaults::BLOCK_SIZE as i128),
                    max_num_seqs = IntArg::Default(defaults::MAX_NUM_SEQS as i128),
                    max_model_len = None, max_num_batched_tokens = None,
                    scheduling = Strategy::ALL[0].as_str(),
                    policy = Policy::ALL[0].as_str(),
                    preemption_mode = None,
                    watermark = defaults::WATERMARK,
                    long_prefill_token_threshold =
                        IntArg::Default(defaults::LONG_PREFILL_TOKEN_THRESHOLD as i128),
                    delay_factor = defaults::DELAY_FACTOR))]
#[allow(clippy::too_many_arguments)]
fn check_scheduler_config(
    block_size: IntArg<'_>,
    max_num_seqs: IntArg<'_>,
    max_model_len: Option<IntArg<'_>>,
    max_num_batched_tokens: Option<IntArg<'_>>,
    scheduling: &str,
    policy: &str,
    preemption_mode: Option<&str>,
    watermark: f64,
    long_prefill_token_threshold: IntArg<'_>,
    delay_factor: f64,
) -> PyResult<()> {
    let knob = |arg: &IntArg<'_>, name: &str| arg.knob(name, I64_RANGE).map(|v| v as i64);
    let max_model_len = match max_model_len {
        Some(v) => knob(&v, "max_model_len")?,
        None => defaults::MAX_MODEL_LEN as i64,
    };
    let max_num_batched_tokens = max_num_batched_tokens
        .map(|v| knob(&v, "max_num_batched_tokens"))
        .transpose()?;
    let (cache, cfg) = SchedulerArgs {
        block_size: knob(&block_size, "block_size")?,
        max_num_batched_tokens,
        max_num_seqs: knob(&max_num_seqs, "max_num_seqs")?,
        max_model_len,
        scheduling,
        policy,
        preemption_mode,
        watermark,
        long_prefill_token_threshold: knob(
            &long_prefill_token_threshold,
            "long_prefill_token_threshold",
        )?,
        delay_factor,
        ..SchedulerArgs::defaults()
    }
    .into_configs()?;
    let mut cfg = cfg;
    cfg.resolve_budget();
    Ok(Scheduler::check_config(&cache, &cfg)?)
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
    m.add_function(wrap_pyfunction!(request_id_list, m)?)?;
    m.add_function(wrap_pyfunction!(ngram_lookup_bounds, m)?)?;
    m.add_function(wrap_pyfunction!(min_kv_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(check_scheduler_config, m)?)?;
    register_knobs(m)
}
