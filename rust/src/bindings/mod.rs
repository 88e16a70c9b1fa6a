//! PyO3 bindings: the private `pagedllm._core` module. Each submodule registers its own names.
use pyo3::prelude::*;

mod block_hash;
mod convert;
mod cpu_forward;
mod cpu_isa;
mod cpu_moe;
mod cpu_ops;
mod cpu_quant;
mod errors;
mod kv_args;
mod kv_events;
mod kv_types;
mod manager;
mod router;
mod scheduler;
mod scheduler_args;
mod scheduler_results;
mod shm;
mod step_output;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    cpu_ops::register(m)?;
    cpu_isa::register(m)?;
    cpu_moe::register(m)?;
    cpu_quant::register(m)?;
    cpu_forward::register(m)?;
    manager::register(m)?;
    kv_events::register(m)?;
    router::register(m)?;
    scheduler::register(m)?;
    step_output::register(m)?;
    shm::register(m)?;
    Ok(())
}
