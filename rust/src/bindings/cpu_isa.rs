//! The CPU kernels' instruction-set level (`crate::cpu::isa`), for the engine's start-up log and
//! `get_stats()`.
use pyo3::prelude::*;

/// `(level, flags)`: the level the CPU kernels run at (`portable`, `avx2`, `avx512`, `amx`) and
/// the machine's detected feature flags; ValueError when `PAGEDLLM_CPU_ISA` is not a level or is
/// above what the machine grants.
#[pyfunction]
fn cpu_isa() -> PyResult<(&'static str, Vec<&'static str>)> {
    let isa = crate::cpu::isa::cpu_isa()?;
    Ok((isa.level.name(), isa.machine.flags.clone()))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cpu_isa, m)?)?;
    Ok(())
}
