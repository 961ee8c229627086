//! How bf16 products multiply, and why: [`Bf16Products::Auto`]'s one decision
//! ([`explain_bf16_products`]), which [`crate::bf16_products`] follows.

use std::fmt;

use multihead_kernels::bf16gemm::{
    active_bf16_kernel, amx_available, bf16_dot_speedup, Bf16Kernel, AMX_BY_DEFAULT,
};

use crate::mode::{Bf16Products, BF16_PRODUCTS};

/// How the bf16 products started on this thread multiply, and why (from
/// [`explain_bf16_products`]).
///
/// # Example
/// ```
/// use multihead::{explain_bf16_products, with_bf16_products, Bf16Products};
///
/// let plan = with_bf16_products(Bf16Products::Widened, explain_bf16_products);
/// assert!(!plan.direct);
/// assert!(plan.to_string().starts_with("bf16 products widened to f32"), "{plan}");
/// ```
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ProductsPlan {
    /// bf16 operands multiplied as they are (summed in f32); else widened to f32 first.
    pub direct: bool,
    /// The micro-kernel of direct products (linear layers and attention alike).
    pub kernel: Bf16Kernel,
    /// Why, in words.
    pub reason: String,
}

impl fmt::Display for ProductsPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.direct, self.kernel) {
            (false, _) => write!(f, "bf16 products widened to f32, because {}", self.reason),
            (true, k) => {
                let on = match k {
                    Bf16Kernel::Amx => "AMX tiles (tdpbf16ps)",
                    Bf16Kernel::AmxEmulated => "the emulation of AMX tiles",
                    Bf16Kernel::Avx512Bf16 => "AVX512-BF16 (vdpbf16ps)",
                    _ => "the portable kernel",
                };
                write!(f, "bf16 products on {on}, because {}", self.reason)
            }
        }
    }
}

/// How bf16 products started on this thread multiply ([`Bf16Products`]: the thread's choice,
/// or `Auto`'s decision for this process, made once from the environment and the CPU), on
/// which micro-kernel (this thread's `Bf16Kernel`), and why: for example "bf16 products on
/// AMX tiles (tdpbf16ps), because the environment asked for AMX and the kernel granted the
/// tile state", or "bf16 products widened to f32, because the environment asked for AMX, which
/// is not available (...), and this CPU has no AVX512-BF16".
pub fn explain_bf16_products() -> ProductsPlan {
    let (direct, reason) = match BF16_PRODUCTS.with(|c| c.get()) {
        Bf16Products::Direct => (true, "Bf16Products::Direct was asked for".to_string()),
        Bf16Products::Widened => (false, "Bf16Products::Widened was asked for".to_string()),
        Bf16Products::Auto => {
            let (process, why) = auto_decision().clone();
            // `with_auto_bf16_decision` (tests) replaces the process's decision.
            let direct = crate::mode::bf16_products();
            let why = match direct == process {
                true => why,
                false => format!("with_auto_bf16_decision replaced Auto's decision ({why})"),
            };
            match direct && auto_by_size() {
                true => (direct, format!("{why}; outside no_grad, calls whose largest product is under 2^20 multiply-adds widen (faster there in training, and closer to PyTorch's gradients)")),
                false => (direct, why),
            }
        }
    };
    ProductsPlan { direct, kernel: active_bf16_kernel(), reason }
}

/// Checks the two environment variables that steer bf16 products, `MULTIHEAD_BF16_PRODUCTS`
/// (`amx`, `direct`, `widened` or `auto`) and `MULTIHEAD_BF16_KERNEL` (`auto`, `amx`,
/// `amx-emulated`, `avx512bf16` or `portable`). The library ignores an unknown value (`Auto`
/// decides as if it were unset, and [`explain_bf16_products`] says so); a program can call
/// this first to refuse a misspelt one instead, as the `multihead` command does.
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) naming the variable, its value and the valid ones.
///
/// # Example
/// ```
/// // Unset or valid values pass.
/// std::env::remove_var("MULTIHEAD_BF16_PRODUCTS");
/// multihead::check_bf16_environment()?;
/// # Ok::<(), multihead::Error>(())
/// ```
pub fn check_bf16_environment() -> crate::Result<()> {
    let read = |arg: &'static str| match std::env::var(arg) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(crate::Error::Config {
            op: "bf16 products",
            arg,
            msg: format!("value {v:?} is not UTF-8; use one of the documented names, or unset it"),
        }),
    };
    let (products, kernel) = (read("MULTIHEAD_BF16_PRODUCTS")?, read("MULTIHEAD_BF16_KERNEL")?);
    match environment_problem(products.as_deref(), kernel.as_deref()) {
        None => Ok(()),
        Some((arg, msg)) => Err(crate::Error::Config { op: "bf16 products", arg, msg }),
    }
}

/// The first of the two variables whose value is unknown, and why.
fn environment_problem(
    products: Option<&str>,
    kernel: Option<&str>,
) -> Option<(&'static str, String)> {
    let known = |p: &str| {
        matches!(p.to_ascii_lowercase().as_str(), "" | "auto" | "amx" | "direct" | "widened")
    };
    if let Some(p) = products.filter(|p| !known(p)) {
        return Some((
            "MULTIHEAD_BF16_PRODUCTS",
            format!("unknown value {p:?}; use amx, direct, widened or auto, or unset it"),
        ));
    }
    match kernel.filter(|k| !k.is_empty()).map(str::parse::<Bf16Kernel>) {
        Some(Err(e)) => Some(("MULTIHEAD_BF16_KERNEL", format!("{e}, or unset it"))),
        _ => None,
    }
}

/// Whether `Auto` weighs each call's size ([`WIDEN_BELOW_MACS`]): unless
/// `MULTIHEAD_BF16_PRODUCTS` asks for `direct`, `widened` or `amx`, which hold for every call.
pub(crate) fn auto_by_size() -> bool {
    static SIZED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SIZED.get_or_init(|| {
        let products = std::env::var("MULTIHEAD_BF16_PRODUCTS").unwrap_or_default();
        !matches!(products.to_ascii_lowercase().as_str(), "direct" | "widened" | "amx")
    })
}

/// `Auto`'s choice for this process: direct or widened, and why.
pub(crate) fn auto_decision() -> &'static (bool, String) {
    static AUTO: std::sync::OnceLock<(bool, String)> = std::sync::OnceLock::new();
    AUTO.get_or_init(|| {
        // Names in any ASCII case, as the kernel's names are.
        let products =
            std::env::var("MULTIHEAD_BF16_PRODUCTS").ok().map(|v| v.to_ascii_lowercase());
        let kernel = std::env::var("MULTIHEAD_BF16_KERNEL").ok();
        let (direct, why) =
            decide(products.as_deref(), kernel.as_deref(), amx_available(), bf16_dot_speedup());
        match environment_problem(products.as_deref(), kernel.as_deref()) {
            Some((var, msg)) => (direct, format!("{why} ({var}: {msg}; it was ignored)")),
            None => (direct, why),
        }
    })
}

/// `Auto`'s rule, from the two environment variables, whether AMX is granted, and the measured
/// rate of the bf16 dot product over f32 FMA.
fn decide(
    products: Option<&str>,
    kernel: Option<&str>,
    amx: bool,
    speedup: Option<f64>,
) -> (bool, String) {
    match products {
        Some("direct") => return (true, "MULTIHEAD_BF16_PRODUCTS=direct".into()),
        Some("widened") => return (false, "MULTIHEAD_BF16_PRODUCTS=widened".into()),
        _ => {}
    }
    let named = kernel.and_then(|k| k.parse::<Bf16Kernel>().ok());
    let asked_amx = products == Some("amx") || named == Some(Bf16Kernel::Amx);
    // A kernel named in the environment other than AMX (or `auto`) keeps the tiles off.
    let other_kernel = named.is_some_and(|k| !matches!(k, Bf16Kernel::Auto | Bf16Kernel::Amx));
    // AMX tiles run bf16 products several times faster than f32 FMA.
    let tiles = match (asked_amx, AMX_BY_DEFAULT && !other_kernel, amx) {
        (true, _, true) => {
            return (true, "the environment asked for AMX and the kernel granted the tile state".into())
        }
        (_, true, true) => return (true, "AMX tiles are granted on this CPU".into()),
        (true, _, false) => "the environment asked for AMX, which is not available (no AMX-BF16, or the operating system did not grant the tile state)",
        (false, false, true) if other_kernel => "AMX tiles are granted, but MULTIHEAD_BF16_KERNEL names another kernel",
        (false, false, true) => "AMX tiles are granted but not taken by default (MULTIHEAD_BF16_KERNEL=amx turns them on for the process, with_bf16_kernel for a thread)",
        (false, _, false) => "this CPU has no AMX tiles",
    };
    match speedup {
        Some(r) if r >= 1.25 => {
            (true, format!("{tiles}, and the bf16 dot product runs at {r:.2}x the f32 FMA rate"))
        }
        Some(r) => (
            false,
            format!("{tiles}, and the bf16 dot product runs at only {r:.2}x the f32 FMA rate (1.25x needed)"),
        ),
        None => (false, format!("{tiles}, and this CPU has no AVX512-BF16")),
    }
}

/// `Auto` widens the bf16 products of a call outside `no_grad` (a module's forward, a layer's,
/// a functional call) whose largest product is smaller than this many multiply-adds: there
/// the f32 kernels run a training step at least as fast as the bf16 ones with their roundings
/// and packing (on a Zen 5, an MHA training step at N=2 L=32 E=32 took 0.059 ms direct and
/// 0.042 ms widened, at N=4 L=64 E=64 0.30 ms both ways), and widened products never exceed
/// PyTorch's bf16 error where direct ones do by chance (docs/pytorch-behaviour.md §14). In
/// inference (inside `no_grad`) direct products stay the faster at these sizes too (0.013
/// against 0.014 ms, 0.07 against 0.09 ms) and their outputs pass PyTorch's rule.
pub(crate) const WIDEN_BELOW_MACS: u64 = 1 << 20;

/// The multiply-adds of the largest product of an attention call (an MHA or a layer's
/// attention) with query `q` (last dimension `E`: the projections' width) and key `k` (last
/// dimension the key's width), `(L, N, E)` or `(N, L, E)` with `batch_first`, or unbatched
/// `(L, E)`: the larger of the query's and the key's projections (rows times both widths) and
/// the attention's products (query rows times the key's length `S` times `E`). An estimate
/// for [`WIDEN_BELOW_MACS`].
pub(crate) fn call_macs(
    q: &candle_core::Tensor,
    k: &candle_core::Tensor,
    batch_first: bool,
) -> u64 {
    let width = |t: &candle_core::Tensor| t.dims().last().copied().unwrap_or(1).max(1) as u64;
    let (e, kd) = (width(q), width(k));
    let rows = |t: &candle_core::Tensor, w: u64| t.elem_count() as u64 / w;
    let (lq, lk) = (rows(q, e), rows(k, kd));
    let seq = match (k.rank(), batch_first) {
        (3, true) => 1,
        _ => 0,
    };
    let s = k.dims().get(seq).copied().unwrap_or(1) as u64;
    let m = |a: u64, b: u64, c: u64| a.saturating_mul(b).saturating_mul(c);
    m(lq, e, e).max(m(lk, kd, e)).max(m(lq, s, e))
}

/// [`call_macs`] of a Transformer layer's attention (self-attention over `x`, and for a
/// decoder layer the cross-attention over `memory`) with the feed-forward products (`x`'s
/// rows times `E` times `dim_feedforward`) beside it.
pub(crate) fn layer_macs(
    x: &candle_core::Tensor,
    memory: &candle_core::Tensor,
    ff: usize,
    batch_first: bool,
) -> u64 {
    let e = x.dims().last().copied().unwrap_or(1).max(1) as u64;
    let rows = x.elem_count() as u64 / e;
    let attention = call_macs(x, x, batch_first).max(call_macs(x, memory, batch_first));
    attention.max(rows.saturating_mul(e).saturating_mul(ff as u64))
}

/// The multiply-adds of the attention over a packed batch of sequences (`cu_q`, `cu_k`), `e`
/// wide: `Σ Lᵢ·Sᵢ·e` over the sequences and `heads` (each sequence attends only to itself).
pub(crate) fn packed_attention_macs(
    cu_q: &crate::functional::CuSeqlens,
    cu_k: &crate::functional::CuSeqlens,
    heads: usize,
    e: usize,
) -> u64 {
    let pairs = cu_q.lengths().into_iter().zip(cu_k.lengths());
    let per_head =
        pairs.fold(0u64, |a, (l, s)| a.saturating_add((l as u64).saturating_mul(s as u64)));
    per_head.saturating_mul(heads as u64).saturating_mul(e as u64)
}

#[cfg(test)]
mod tests {
    use super::decide;

    #[test]
    fn auto_decides_from_the_environment_amx_and_the_measured_rate() {
        let d = |p, k, amx, r| decide(p, k, amx, r);
        assert!(d(Some("direct"), None, false, None).0);
        assert!(!d(Some("widened"), Some("amx"), true, Some(2.0)).0);
        let (on, why) = d(Some("amx"), None, true, Some(0.5));
        assert!(on && why.contains("granted"), "{why}");
        let (on, why) = d(None, Some("amx"), false, Some(0.5));
        assert!(!on && why.contains("not available") && why.contains("0.50x"), "{why}");
        let (on, why) = d(None, None, false, Some(2.0));
        assert!(on && why.contains("2.00x"), "{why}");
        let (on, why) = d(None, None, false, None);
        assert!(!on && why.contains("no AVX512-BF16"), "{why}");
        // Unknown values are named (the library ignores them; the CLI refuses them).
        let bad = super::environment_problem(Some("fast"), None).unwrap_or_default();
        assert_eq!(bad.0, "MULTIHEAD_BF16_PRODUCTS");
        assert!(bad.1.contains("\"fast\"") && bad.1.contains("direct"), "{}", bad.1);
        let bad = super::environment_problem(Some("direct"), Some("tiles")).unwrap_or_default();
        assert_eq!(bad.0, "MULTIHEAD_BF16_KERNEL");
        assert!(bad.1.contains("\"tiles\"") && bad.1.contains("avx512bf16"), "{}", bad.1);
        for (p, k) in [(None, None), (Some("AMX"), Some("amx-emulated")), (Some(""), Some(""))] {
            assert_eq!(super::environment_problem(p, k), None, "{p:?} {k:?}");
        }
        // Granted tiles are taken by default, unless the environment names another kernel.
        const { assert!(multihead_kernels::bf16gemm::AMX_BY_DEFAULT) };
        let (on, why) = d(None, None, true, Some(0.5));
        assert!(on && why == "AMX tiles are granted on this CPU", "{why}");
        let (on, why) = d(None, Some("avx512bf16"), true, Some(0.5));
        assert!(!on && why.contains("names another kernel") && why.contains("0.50x"), "{why}");
        let (on, _) = d(None, Some("auto"), true, Some(0.5));
        assert!(on);
    }
}
