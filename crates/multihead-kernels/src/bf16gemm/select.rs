//! Which micro-kernel runs the bf16 products: a choice per thread, a default per process (from
//! the environment), resolved against what the CPU has.

use std::cell::Cell;
use std::sync::OnceLock;

use super::amx::amx_available;
use super::micro::Kernel;
use super::rate::bf16_dot_available;

/// Whether [`Bf16Kernel::Auto`] takes AMX tiles where they are granted. On since the AMX
/// kernel ran on an AMX CPU (an Intel Xeon, family 6 model 167 under KVM): there its tests
/// match the emulation bit for bit (the products, the attention tiles and the edges of the
/// f32 range), and its products ran 3.7x faster than f32 FMA (`BENCHMARKS.md`). Naming another
/// kernel (`MULTIHEAD_BF16_KERNEL=avx512bf16`, [`with_bf16_kernel`]) turns it off.
pub const AMX_BY_DEFAULT: bool = true;

/// The micro-kernel of bf16 products ([`matmul_bf16`](super::matmul_bf16)).
///
/// Every kernel computes `C (+)= A·B` on bf16 operands with f32 sums, through the same driver
/// (blocking, packing, threads); they differ in instructions and in the order of the f32
/// additions within a pair (see each variant).
///
/// * `Auto`: AMX where granted and [`AMX_BY_DEFAULT`] allows it, AVX512-BF16 where the CPU has
///   it and the SIMD level is AVX-512, the portable kernel elsewhere.
/// * `Amx`: AMX tiles (`tdpbf16ps`) where the CPU has AMX-BF16 and the operating system grants
///   the tile state; `Auto`'s choice elsewhere.
/// * `AmxEmulated`: the AMX kernel's exact emulation in the AMX layout, on any CPU (slow; for
///   tests).
/// * `Avx512Bf16`: `vdpbf16ps` where the CPU has it; the portable kernel elsewhere.
/// * `Portable`: plain f32 arithmetic giving `vdpbf16ps`'s sums on normal numbers.
///
/// The process default is `Auto`, or what the environment variable `MULTIHEAD_BF16_KERNEL`
/// names (`auto`, `amx`, `amx-emulated`, `avx512bf16`, `portable`);
/// `MULTIHEAD_BF16_PRODUCTS=amx` also asks for `Amx`. [`with_bf16_kernel`] overrides it on one
/// thread.
///
/// # Example
/// ```
/// use multihead_kernels::bf16gemm::{active_bf16_kernel, with_bf16_kernel, Bf16Kernel};
///
/// let k = with_bf16_kernel(Bf16Kernel::AmxEmulated, active_bf16_kernel);
/// assert_eq!(k, Bf16Kernel::AmxEmulated);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Bf16Kernel {
    /// The fastest kernel enabled on this CPU.
    #[default]
    Auto,
    /// AMX tiles.
    Amx,
    /// The AMX kernel's emulation.
    AmxEmulated,
    /// AVX512-BF16 `vdpbf16ps`.
    Avx512Bf16,
    /// The portable kernel.
    Portable,
}

impl std::str::FromStr for Bf16Kernel {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Bf16Kernel::Auto),
            "amx" => Ok(Bf16Kernel::Amx),
            "amx-emulated" => Ok(Bf16Kernel::AmxEmulated),
            "avx512bf16" => Ok(Bf16Kernel::Avx512Bf16),
            "portable" => Ok(Bf16Kernel::Portable),
            other => Err(format!(
                "unknown bf16 kernel {other:?}; use auto, amx, amx-emulated, avx512bf16 or portable"
            )),
        }
    }
}

thread_local! {
    static CHOICE: Cell<Option<Bf16Kernel>> = const { Cell::new(None) };
}

/// The process default: `MULTIHEAD_BF16_KERNEL`, else `amx` when `MULTIHEAD_BF16_PRODUCTS=amx`,
/// else `Auto` (an unknown value is `Auto` too; an empty one is unset).
fn process_default() -> Bf16Kernel {
    static DEFAULT: OnceLock<Bf16Kernel> = OnceLock::new();
    *DEFAULT.get_or_init(|| {
        // An empty value is unset, as `multihead::check_bf16_environment` treats it.
        if let Ok(v) = std::env::var("MULTIHEAD_BF16_KERNEL").as_deref() {
            if !v.is_empty() {
                return v.parse().unwrap_or_default();
            }
        }
        match std::env::var("MULTIHEAD_BF16_PRODUCTS") {
            Ok(v) if v.eq_ignore_ascii_case("amx") => Bf16Kernel::Amx,
            _ => Bf16Kernel::Auto,
        }
    })
}

/// Runs `f` with bf16 products on `choice` on this thread (the products `f` starts take it to
/// their worker threads).
pub fn with_bf16_kernel<R>(choice: Bf16Kernel, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Bf16Kernel>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CHOICE.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(CHOICE.with(|c| c.replace(Some(choice))));
    f()
}

/// The kernel a bf16 product started on this thread runs now (never `Auto`).
pub fn active_bf16_kernel() -> Bf16Kernel {
    match resolve() {
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512Bf16 => Bf16Kernel::Avx512Bf16,
        #[cfg(target_arch = "x86_64")]
        Kernel::Amx => Bf16Kernel::Amx,
        Kernel::AmxEmulated => Bf16Kernel::AmxEmulated,
        Kernel::Portable => Bf16Kernel::Portable,
    }
}

/// The kernel the current choice resolves to on this CPU.
pub(crate) fn resolve() -> Kernel {
    let choice = CHOICE.with(|c| c.get()).unwrap_or_else(process_default);
    match choice {
        Bf16Kernel::AmxEmulated => Kernel::AmxEmulated,
        Bf16Kernel::Portable => Kernel::Portable,
        #[cfg(target_arch = "x86_64")]
        Bf16Kernel::Amx if amx_available() => Kernel::Amx,
        #[cfg(target_arch = "x86_64")]
        Bf16Kernel::Auto if AMX_BY_DEFAULT && amx_available() => Kernel::Amx,
        _ => vector_or_portable(),
    }
}

/// AVX512-BF16 when the CPU has it and the SIMD level is AVX-512, else the portable kernel.
pub(crate) fn vector_or_portable() -> Kernel {
    #[cfg(target_arch = "x86_64")]
    if bf16_dot_available() && crate::attention::simd_level() == crate::attention::SimdLevel::Avx512
    {
        return Kernel::Avx512Bf16;
    }
    Kernel::Portable
}
