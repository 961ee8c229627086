//! Step 2 of every call: the one place that picks the fused kernels or the composed candle
//! path, and says why.

use std::fmt;

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::mode::Backend;

/// The implementation a call runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Path {
    /// The fused CPU kernels of `multihead-kernels` (flash attention, fused linear).
    Fused,
    /// candle operations composed as PyTorch's reference implementation computes them.
    Composed,
}

/// Why a call takes its path.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Reason {
    /// Every condition of the fused kernels holds.
    Eligible,
    /// The backend was `Composed` (per call or for the scope).
    Requested,
    /// The fused kernels are f32 only.
    DType(DType),
    /// The fused kernels run on the CPU only.
    Device,
    /// `bias_k`/`bias_v` add key columns. No longer given: the fused path appends them.
    #[deprecated(note = "no longer given: the fused path appends bias_k/bias_v")]
    BiasKv,
    /// `add_zero_attn` adds a key column. No longer given: the fused path appends it.
    #[deprecated(note = "no longer given: the fused path appends the zero key")]
    ZeroAttn,
    /// The weights were asked for while gradients are recorded. No longer given: the fused
    /// path gives its weights their gradient (or computes them with candle operations).
    #[deprecated(note = "no longer given: the fused path gives the weights their gradient")]
    WeightsWithGrad,
    /// SDPA inputs that cannot run as one 4-D `(N, H, L, E)` call: ranks that differ between
    /// query, key and value.
    NotFourD,
    /// SDPA batch dimensions that broadcast (differ between query, key and value). No longer
    /// given: the fused path reads them in place.
    #[deprecated(note = "no longer given: the fused path reads broadcast batches in place")]
    BroadcastBatch,
    /// SDPA key and value head counts differ, neither being 1.
    KvHeads,
    /// An attention mask of more than 4 dimensions.
    MaskRank,
    /// The input's rows are not evenly strided (a fused linear needs `(m, k)` rows).
    Layout,
    /// A float mask is part of the graph (a learned bias). No longer given: the fused path
    /// gives learned masks their gradient (SDPA and MultiheadAttention).
    #[deprecated(note = "no longer given: the fused path gives learned masks their gradient")]
    MaskGrad,
}

// (The deprecated variants keep their texts for code that still builds them.)
#[allow(deprecated)]
impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Eligible => write!(f, "every condition of the fused kernels holds"),
            Reason::Requested => write!(f, "the composed path was requested (Backend::Composed)"),
            Reason::DType(d) => write!(f, "the fused kernels take f32 tensors, these are {d:?}"),
            Reason::Device => write!(f, "the fused kernels run on the CPU only"),
            Reason::BiasKv => {
                write!(f, "bias_k/bias_v append key columns, which the fused kernels do not take")
            }
            Reason::ZeroAttn => {
                write!(f, "add_zero_attn appends a key column, which the fused kernels do not take")
            }
            Reason::WeightsWithGrad => write!(
                f,
                "need_weights=true while gradients are recorded: the fused kernels' weights carry \
                 no gradient (run under multihead::no_grad or set need_weights=false)"
            ),
            Reason::NotFourD => write!(
                f,
                "the fused SDPA takes query, key and value of one rank ((N, H, L, E), or \
                 (L, E), (H, L, E) and wider ones merged to it)"
            ),
            Reason::BroadcastBatch => {
                write!(f, "query, key and value have different batch sizes (broadcast)")
            }
            Reason::KvHeads => write!(f, "key and value have different head counts"),
            Reason::MaskRank => write!(f, "the mask has more than 4 dimensions"),
            Reason::Layout => write!(f, "the input rows are not evenly strided"),
            Reason::MaskGrad => write!(
                f,
                "a float mask records a gradient (a learned bias), which the fused kernels do not \
                 propagate"
            ),
        }
    }
}

/// The path a call takes and why: what [`MultiheadAttention::explain`] and
/// [`explain_sdpa`](crate::functional::explain_sdpa) return. Its `Display` is one line. How
/// the products of bf16 inputs multiply (bf16 operands on AMX tiles or AVX512-BF16, or widened
/// to f32) is the thread's choice and, under `Auto`, the call's size (small calls outside
/// `no_grad` widen), not the path's: [`explain_bf16_products`] says it.
///
/// [`MultiheadAttention::explain`]: crate::MultiheadAttention::explain
/// [`explain_bf16_products`]: crate::explain_bf16_products
///
/// # Example
/// ```
/// use candle_core::{Device, Tensor};
/// use multihead::functional::{explain_sdpa, SdpaOptions};
/// use multihead::Path;
///
/// let q = Tensor::zeros((1, 2, 3, 4), candle_core::DType::F64, &Device::Cpu)?;
/// let plan = explain_sdpa(&q, &q, &q, &SdpaOptions::default())?;
/// assert_eq!(plan.path, Path::Composed);
/// assert!(plan.to_string().contains("F64"));
/// # Ok::<(), multihead::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The operation planned (PyTorch's function name).
    pub op: &'static str,
    /// The path that runs.
    pub path: Path,
    /// Why that path.
    pub reason: Reason,
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.path {
            Path::Fused => "fused CPU kernels",
            Path::Composed => "composed candle operations",
        };
        write!(f, "{}: {what}, because {}", self.op, self.reason)
    }
}

/// Decides between the paths. `blocker` is the first condition of the fused kernels that
/// fails, if any. A forced `Fused` backend with a blocker is an error that says why.
pub(crate) fn decide(op: &'static str, backend: Backend, blocker: Option<Reason>) -> Result<Plan> {
    let plan = |path, reason| Ok(Plan { op, path, reason });
    match (backend.resolve(), blocker) {
        (Backend::Composed, _) => plan(Path::Composed, Reason::Requested),
        (Backend::Fused, Some(r)) => Err(Error::Config {
            op,
            arg: "backend",
            msg: format!(
                "Backend::Fused was requested but cannot run this call: {r}; use Backend::Auto \
                 to fall back to the composed path"
            ),
        }),
        (_, Some(r)) => plan(Path::Composed, r),
        (_, None) => plan(Path::Fused, Reason::Eligible),
    }
}

/// The dtype and device conditions every fused kernel shares.
pub(crate) fn dtype_device_blocker(t: &Tensor) -> Option<Reason> {
    blocker_for(t, &[DType::F32])
}

/// `t` must have one of `dtypes` and be on the CPU.
fn blocker_for(t: &Tensor, dtypes: &[DType]) -> Option<Reason> {
    if !dtypes.contains(&t.dtype()) {
        Some(Reason::DType(t.dtype()))
    } else if !matches!(t.device(), Device::Cpu) {
        Some(Reason::Device)
    } else {
        None
    }
}

/// The dtype and device conditions of the kernels that also read bfloat16 (the decode
/// kernel's cache and the few-rows product's weight, widened exactly in registers).
pub(crate) fn f32_or_bf16_blocker(t: &Tensor) -> Option<Reason> {
    blocker_for(t, &[DType::F32, DType::BF16])
}

/// Whether a float mask takes part in the autograd graph while gradients are wanted.
pub(crate) fn mask_records_grad(mask: Option<&crate::Mask>) -> bool {
    crate::mode::grad_enabled() && matches!(mask, Some(crate::Mask::Float(t)) if t.track_op())
}
