//! The instruction-set level the CPU kernels run at, decided once per process: the highest level
//! the processor AND the operating system grant, or a lower one forced by `PAGEDLLM_CPU_ISA`
//! (for comparisons and tests). Every kernel's dispatch asks `level()`; nothing else checks CPU
//! features, so forcing a level reaches every kernel.
//!
//! AMX needs more than the CPUID bits: Linux hands a process the (8 KiB) tile state only after it
//! asks for it (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); a tile instruction
//! without that permission kills the process with SIGILL. Detection only asks whether the kernel
//! supports the tile state (`ARCH_GET_XCOMP_SUPP`): a kernel or VM that does not leaves the level
//! at AVX-512. The request itself, which grows every thread's signal frame and context switches
//! by the tile state, waits for an AMX kernel's first use: `amx_tile_permission`.

use std::sync::OnceLock;

/// The kernels' instruction-set levels, each including the ones below it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum IsaLevel {
    /// Plain Rust (what any CPU runs; the only level off x86-64).
    Portable,
    /// AVX2 + FMA (and F16C, which every AVX2 processor has: half-precision conversions): 8 float
    /// lanes.
    Avx2,
    /// AVX-512 F, BW and VL: 16 float lanes, masked tails.
    Avx512,
    /// AMX tiles (int8 and bf16), with the OS's permission for the tile state.
    Amx,
}

impl IsaLevel {
    const ALL: [IsaLevel; 4] = [Self::Portable, Self::Avx2, Self::Avx512, Self::Amx];

    /// The level's name, as `PAGEDLLM_CPU_ISA` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
            Self::Amx => "amx",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|l| l.name().eq_ignore_ascii_case(name.trim()))
    }
}

/// What this machine grants: its highest level and the feature flags found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Machine {
    pub level: IsaLevel,
    /// The detected flags among those the levels use or report (`avx2`, `avx512vnni`, ...;
    /// `amx-*` only where the OS supports the tile state, so would grant it on request).
    pub flags: Vec<&'static str>,
}

/// The process's decision: the level the kernels run at, the machine's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuIsa {
    pub level: IsaLevel,
    pub machine: Machine,
}

/// The variable that forces a level.
pub const FORCE_VAR: &str = "PAGEDLLM_CPU_ISA";

/// The kernels' level (a dispatch asks this, so it is cheap after the first call). A
/// `PAGEDLLM_CPU_ISA` that `cpu_isa` rejects leaves the machine's level here; the engine calls
/// `cpu_isa` at start-up, which raises the error.
#[inline]
pub(crate) fn level() -> IsaLevel {
    match decided() {
        Ok(isa) => isa.level,
        Err((machine, _)) => machine.level,
    }
}

/// An instruction-set extension beside a level's required flags, which a kernel may take where the
/// machine has it AND the process runs at the level it belongs to (so forcing a lower level with
/// `PAGEDLLM_CPU_ISA` turns it off as well, and `avx2` behaves like an AVX2-only machine).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Extension {
    /// `vpdpbusd` / `vpdpwssd` on 512-bit registers (int8 and int16 dot products): `avx512vnni`.
    Avx512Vnni,
    /// `vdpbf16ps` and the bf16 conversions on 512-bit registers: `avx512bf16`.
    Avx512Bf16,
}

impl Extension {
    const ALL: [Extension; 2] = [Self::Avx512Vnni, Self::Avx512Bf16];

    /// The flag `detect` reports for it.
    pub fn flag(self) -> &'static str {
        match self {
            Self::Avx512Vnni => "avx512vnni",
            Self::Avx512Bf16 => "avx512bf16",
        }
    }

    /// The level a kernel using it runs at (its own instructions need that level's too).
    pub fn level(self) -> IsaLevel {
        IsaLevel::Avx512
    }
}

/// Whether the kernels may use `ext` (decided once per process, cheap to ask per call).
#[inline]
pub(crate) fn has(ext: Extension) -> bool {
    static GRANTED: OnceLock<[bool; 2]> = OnceLock::new();
    let granted = GRANTED.get_or_init(|| {
        let flags = match decided() {
            Ok(isa) => &isa.machine.flags,
            Err((machine, _)) => &machine.flags,
        };
        Extension::ALL.map(|e| level() >= e.level() && flags.contains(&e.flag()))
    });
    granted[ext as usize]
}

/// The process's level and the machine's flags; an error naming a `PAGEDLLM_CPU_ISA` value that
/// is not a level or is above what the machine grants.
pub fn cpu_isa() -> crate::error::Result<&'static CpuIsa> {
    decided()
        .as_ref()
        .map_err(|(_, msg)| crate::error::Error::InvalidArgument(msg.clone()))
}

type Decision = Result<CpuIsa, (Machine, String)>;

fn decided() -> &'static Decision {
    static DECIDED: OnceLock<Decision> = OnceLock::new();
    DECIDED.get_or_init(|| {
        let machine = detect();
        let forced = std::env::var(FORCE_VAR).ok();
        match decide(&machine, forced.as_deref()) {
            Ok(level) => Ok(CpuIsa { level, machine }),
            Err(msg) => Err((machine, msg)),
        }
    })
}

/// The level to run at: the machine's, or `forced` (unset or empty: the machine's) where it is
/// a level no higher than the machine's.
fn decide(machine: &Machine, forced: Option<&str>) -> Result<IsaLevel, String> {
    let Some(name) = forced.filter(|s| !s.trim().is_empty()) else {
        return Ok(machine.level);
    };
    let supports = || {
        format!(
            "this machine supports up to {} (flags: {})",
            machine.level.name(),
            if machine.flags.is_empty() {
                "none".to_string()
            } else {
                machine.flags.join(" ")
            }
        )
    };
    let Some(level) = IsaLevel::parse(name) else {
        let names: Vec<_> = IsaLevel::ALL.iter().map(|l| l.name()).collect();
        return Err(format!(
            "{FORCE_VAR}={name:?} is not a CPU ISA level (one of {}); {}",
            names.join(", "),
            supports()
        ));
    };
    if level > machine.level {
        return Err(format!(
            "{FORCE_VAR}={name:?} asks for more than the machine grants: {}",
            supports()
        ));
    }
    Ok(level)
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Machine {
    Machine {
        level: IsaLevel::Portable,
        flags: Vec::new(),
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Machine {
    // `is_x86_feature_detected!` also checks that the OS saves the registers (XCR0)
    macro_rules! detected {
        ($($flag:tt),*) => {
            [$(($flag, std::arch::is_x86_feature_detected!($flag))),*]
        };
    }
    let mut flags: Vec<&'static str> = detected!(
        "avx2",
        "fma",
        "f16c",
        "avxvnni",
        "avx512f",
        "avx512bw",
        "avx512vl",
        "avx512vnni",
        "avx512bf16",
        "avx512fp16"
    )
    .into_iter()
    .filter_map(|(flag, on)| on.then_some(flag))
    .collect();
    let amx = amx_flags();
    if !amx.is_empty() && amx_tile_state_supported() {
        flags.extend(amx);
    }
    Machine {
        level: level_of(&flags),
        flags,
    }
}

/// The highest level whose every flag is in `flags`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn level_of(flags: &[&str]) -> IsaLevel {
    let has = |need: &[&str]| need.iter().all(|f| flags.contains(f));
    let mut level = IsaLevel::Portable;
    for (next, need) in [
        (IsaLevel::Avx2, &["avx2", "fma", "f16c"][..]),
        (IsaLevel::Avx512, &["avx512f", "avx512bw", "avx512vl"][..]),
        (IsaLevel::Amx, &["amx-tile", "amx-int8", "amx-bf16"][..]),
    ] {
        if !has(need) {
            break;
        }
        level = next;
    }
    level
}

/// The AMX flags of CPUID leaf 7 (std's detection of them is not stable Rust yet).
#[cfg(target_arch = "x86_64")]
fn amx_flags() -> Vec<&'static str> {
    use std::arch::x86_64::{__cpuid_count, __get_cpuid_max};
    // SAFETY: CPUID exists on every x86-64 CPU (the intrinsics are safe in newer Rust).
    #[allow(unused_unsafe)]
    let edx = unsafe {
        if __get_cpuid_max(0).0 < 7 {
            return Vec::new();
        }
        __cpuid_count(7, 0).edx
    };
    [(24, "amx-tile"), (25, "amx-int8"), (22, "amx-bf16")]
        .into_iter()
        .filter_map(|(bit, flag)| ((edx >> bit) & 1 == 1).then_some(flag))
        .collect()
}

/// Whether this process may run tile instructions, asking Linux for the AMX tile state on the
/// first call (process-wide, once). Every AMX kernel must call this before its first tile
/// instruction and take its AVX-512 path where it returns false: a level forced below AMX, a
/// machine without it, or a request refused (e.g. a signal stack too small for the tile state).
// no AMX kernel yet: the first one calls this where it is chosen
#[allow(dead_code)]
pub(crate) fn amx_tile_permission() -> bool {
    static GRANTED: OnceLock<bool> = OnceLock::new();
    *GRANTED.get_or_init(|| level() >= IsaLevel::Amx && request_amx_tile_state())
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod xcomp {
    pub const GET_SUPP: libc::c_long = 0x1021;
    pub const GET_PERM: libc::c_long = 0x1022;
    pub const REQ_PERM: libc::c_long = 0x1023;
    pub const XTILEDATA: libc::c_long = 18;

    /// An `ARCH_GET_XCOMP_*` feature mask: whether it has the tile data (false where the call
    /// fails: a kernel before 5.16).
    pub fn has_tile_data(code: libc::c_long) -> bool {
        let mut mask: u64 = 0;
        // SAFETY: arch_prctl with a GET code writes one u64 through the pointer, which points at
        // a live local.
        let rc = unsafe { libc::syscall(libc::SYS_arch_prctl, code, &mut mask as *mut u64) };
        rc == 0 && (mask >> XTILEDATA) & 1 == 1
    }
}

/// Whether Linux supports the AMX tile state (it would grant a request); asks for nothing.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn amx_tile_state_supported() -> bool {
    xcomp::has_tile_data(xcomp::GET_SUPP)
}

/// Asks Linux for the AMX tile state (process-wide) and reads the permission back; false where
/// the kernel or a VM refuses.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_amx_tile_state() -> bool {
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM) takes an integer argument and touches no memory.
    let rc = unsafe { libc::syscall(libc::SYS_arch_prctl, xcomp::REQ_PERM, xcomp::XTILEDATA) };
    rc == 0 && xcomp::has_tile_data(xcomp::GET_PERM)
}

/// Elsewhere the tile state is neither supported nor requested, so AMX is not used.
#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn amx_tile_state_supported() -> bool {
    false
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request_amx_tile_state() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(level: IsaLevel) -> Machine {
        let flags = match level {
            IsaLevel::Portable => vec![],
            IsaLevel::Avx2 => vec!["avx2", "fma", "f16c"],
            _ => vec!["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"],
        };
        Machine { level, flags }
    }

    #[test]
    fn an_unset_or_empty_variable_keeps_the_machines_level() {
        let m = machine(IsaLevel::Avx2);
        assert_eq!(decide(&m, None), Ok(IsaLevel::Avx2));
        assert_eq!(decide(&m, Some("")), Ok(IsaLevel::Avx2));
    }

    #[test]
    fn a_forced_level_at_or_below_the_machines_is_honoured() {
        let m = machine(IsaLevel::Avx512);
        assert_eq!(decide(&m, Some("portable")), Ok(IsaLevel::Portable));
        assert_eq!(decide(&m, Some("AVX2")), Ok(IsaLevel::Avx2));
        assert_eq!(decide(&m, Some("avx512")), Ok(IsaLevel::Avx512));
    }

    #[test]
    fn a_forced_level_above_the_machines_names_the_value_and_the_machine() {
        let err = decide(&machine(IsaLevel::Avx2), Some("amx")).unwrap_err();
        assert!(err.contains("PAGEDLLM_CPU_ISA=\"amx\""), "{err}");
        assert!(err.contains("up to avx2 (flags: avx2 fma f16c)"), "{err}");
    }

    #[test]
    fn an_unknown_level_lists_the_levels() {
        let err = decide(&machine(IsaLevel::Portable), Some("sse4")).unwrap_err();
        assert!(err.contains("\"sse4\" is not a CPU ISA level"), "{err}");
        assert!(err.contains("portable, avx2, avx512, amx"), "{err}");
        assert!(err.contains("flags: none"), "{err}");
    }

    #[test]
    fn the_level_needs_every_flag_of_it_and_of_the_levels_below() {
        assert_eq!(level_of(&["avx2"]), IsaLevel::Portable);
        assert_eq!(level_of(&["avx2", "fma"]), IsaLevel::Portable);
        assert_eq!(
            level_of(&["avx2", "fma", "f16c", "avx512f"]),
            IsaLevel::Avx2
        );
        let amx_without_avx512 = ["avx2", "fma", "f16c", "amx-tile", "amx-int8", "amx-bf16"];
        assert_eq!(level_of(&amx_without_avx512), IsaLevel::Avx2);
        let all = [
            "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "amx-tile", "amx-int8",
            "amx-bf16",
        ];
        assert_eq!(level_of(&all), IsaLevel::Amx);
    }

    /// The tile state this process holds now (never requested here: only `amx_tile_permission`).
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    fn tile_state_permitted() -> bool {
        xcomp::has_tile_data(xcomp::GET_PERM)
    }

    #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
    fn tile_state_permitted() -> bool {
        false
    }

    #[test]
    fn the_tile_state_is_requested_at_first_use_not_at_detection() {
        // the only test that calls amx_tile_permission: nothing else requests the tile state
        let machine = detect();
        assert!(
            !tile_state_permitted(),
            "detection requested the tile state"
        );
        let granted = amx_tile_permission();
        assert!(
            !granted || level() >= IsaLevel::Amx,
            "granted below the AMX level"
        );
        assert_eq!(tile_state_permitted(), granted);
        assert_eq!(amx_tile_permission(), granted);
        if level() >= IsaLevel::Amx {
            // the machine reported AMX only where the kernel supports the tile state
            assert!(machine.flags.contains(&"amx-tile"));
            assert!(granted, "the kernel supports the tile state but refused it");
        }
    }

    #[test]
    fn an_extension_is_granted_only_at_its_level_and_where_the_machine_has_it() {
        let isa = decided().as_ref().expect("a valid PAGEDLLM_CPU_ISA");
        for ext in Extension::ALL {
            let want = level() >= ext.level() && isa.machine.flags.contains(&ext.flag());
            assert_eq!(has(ext), want, "{ext:?}");
        }
    }

    #[test]
    fn the_process_level_is_the_machines_or_the_forced_one() {
        // the whole test binary shares one decision: it ran under PAGEDLLM_CPU_ISA or not
        let isa = decided().as_ref().expect("a valid PAGEDLLM_CPU_ISA");
        let forced = std::env::var(FORCE_VAR).ok().filter(|s| !s.is_empty());
        let want = forced.map_or(isa.machine.level, |name| IsaLevel::parse(&name).unwrap());
        assert_eq!(level(), want);
        assert!(level() <= isa.machine.level);
    }
}
