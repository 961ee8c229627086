//! Per-thread modes: gradient recording (PyTorch's `torch.no_grad()`), mixed precision
//! ([`autocast`], PyTorch's `torch.autocast`) and the default attention backend.
//!
//! All are thread-local, like PyTorch's grad mode. They are read once, on the calling thread,
//! when a call is planned; the kernels that then run on rayon's worker threads do not read them.
//! A closure that itself spawns work on other threads (for example `rayon::scope` or a
//! `par_iter` around several forwards) must enter [`no_grad`], [`autocast`] or
//! [`with_backend`] inside each task: otherwise each task runs with the modes of whichever
//! thread runs it, so an `eval` encoder under `no_grad` outside the `par_iter` may give
//! PyTorch's inference numbers for some items and its training-path numbers for others.
//! The one hop onto a pool that a large module call makes, and [`on_pool`](crate::on_pool),
//! carry every mode of the calling thread with them.
//!
//! The scopes restore the previous mode when they end, also when the closure panics and the
//! panic is caught further up.

use std::cell::Cell;

use candle_core::{DType, Tensor};

/// Which implementation runs attention and linear layers.
///
/// * `Auto` (the default): the fused CPU kernels where they apply (f32 on the CPU, no
///   `bias_k`/`zero_attn`, weights only when no gradient is recorded), the composed candle
///   path otherwise. Both give PyTorch's numbers.
/// * `Composed`: always the composed candle operations (the reference; f64 and every device).
/// * `Fused`: always the fused kernels; a call they cannot run is an error that says why,
///   instead of a silent fall-back.
///
/// Set it per call ([`MhaOptions::backend`](crate::MhaOptions::backend),
/// [`SdpaOptions::backend`](crate::SdpaOptions::backend)) or for a scope ([`with_backend`]).
/// The plan of a call says which path runs and why: see
/// [`MultiheadAttention::explain`](crate::MultiheadAttention::explain).
///
/// # Example
/// ```
/// use multihead::{with_backend, default_backend, Backend};
/// assert_eq!(with_backend(Backend::Composed, default_backend), Backend::Composed);
/// assert_eq!(default_backend(), Backend::Auto);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Fused kernels where they apply, composed otherwise.
    #[default]
    Auto,
    /// Always the composed candle path.
    Composed,
    /// Always the fused kernels, or an error.
    Fused,
}

impl Backend {
    /// `self`, or the thread's default ([`default_backend`]) when `self` is `Auto`.
    pub fn resolve(self) -> Backend {
        match self {
            Backend::Auto => default_backend(),
            other => other,
        }
    }
}

impl std::str::FromStr for Backend {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Backend::Auto),
            "composed" => Ok(Backend::Composed),
            "fused" => Ok(Backend::Fused),
            other => Err(crate::Error::Config {
                op: "Backend::from_str",
                arg: "backend",
                msg: format!("unknown backend {other:?}; use auto, composed or fused"),
            }),
        }
    }
}

/// How bf16 computation multiplies: bf16 operands directly, or widened to f32 first
/// ([`explain_bf16_products`](crate::explain_bf16_products) says which, on which micro-kernel,
/// and why).
///
/// * `Auto` (the default): [`Direct`](Self::Direct) on CPUs where the bf16 dot-product
///   instruction (AVX512-BF16 `vdpbf16ps`) outruns f32 FMA (measured once per process: AMD
///   Zen 4 and Zen 5) or where the bf16 products run on AMX tiles, [`Widened`](Self::Widened)
///   elsewhere. The environment variable `MULTIHEAD_BF16_PRODUCTS=direct` or `=widened`
///   overrides the measurement; `=amx` means direct products on AMX tiles where the CPU and
///   the operating system grant them (which `Auto` takes too; `MULTIHEAD_BF16_KERNEL` names
///   another micro-kernel: `multihead_kernels::bf16gemm::Bf16Kernel`). Unless the environment
///   asks for one choice, `Auto` widens the products of a small call outside [`no_grad`] (a
///   module's forward, a layer's, a functional call whose largest product is under 2^20
///   multiply-adds, such as an MHA of `N·L·E² < 2^20`): in training the f32 kernels are as
///   fast there, and widened products keep a small bf16 call's gradients within PyTorch's
///   bf16 error, where direct products exceed it by chance (a ReLU gate within a bf16
///   rounding of zero). Inside `no_grad` (inference) small calls stay direct, the faster.
/// * `Direct`: products take bf16 operands, summed in f32, as PyTorch's bf16 CPU products do:
///   a bf16 [`Linear`](crate::Linear) multiplies its bf16 input and weight as they are, and
///   inside a bf16 [`MultiheadAttention`](crate::MultiheadAttention), Transformer layer or
///   [`scaled_dot_product_attention`](crate::functional::scaled_dot_product_attention) (and
///   under [`autocast`] to bf16) each product's operands are rounded to bf16 first, the
///   attention's probabilities included (as PyTorch's bf16 flash kernel rounds them).
///   With a gradient recorded, the backward products take bf16 operands too (the linear
///   layers' output gradient times weight and times input; attention's five products), with
///   f32 sums. Attention keeps f32 products where PyTorch's takes its math path (dropout; in
///   `scaled_dot_product_attention`, `Ev ≠ E`, a 3-D mask on 4-D inputs, inputs not 3-D or
///   4-D, a broadcast batch), for grouped-query heads, and when it returns its weights.
///   Without AVX512-BF16 a portable kernel computes the same sums, slowly.
/// * `Widened`: the operands are widened to f32 and multiplied on the f32 kernels; inside a
///   layer, intermediate results stay f32 until the layer's output is rounded.
///
/// The two differ by about one bf16 rounding of the products' inputs, within the error of
/// PyTorch's own bf16 computation (both pass the bfloat16 golden cases by the same rule).
/// The choice concerns the fused kernels: the composed backend ([`Backend::Composed`]) always
/// widens.
///
/// # Example
/// ```
/// use multihead::{bf16_products, with_bf16_products, Bf16Products};
/// assert!(with_bf16_products(Bf16Products::Direct, bf16_products));
/// assert!(!with_bf16_products(Bf16Products::Widened, bf16_products));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Bf16Products {
    /// Direct where the CPU's bf16 dot product is the faster, widened elsewhere.
    #[default]
    Auto,
    /// bf16 operands multiplied as they are (rounded to bf16 inside layers).
    Direct,
    /// Operands widened to f32.
    Widened,
}

/// Runs `f` with bf16 products chosen as `choice` on this thread.
pub fn with_bf16_products<R>(choice: Bf16Products, f: impl FnOnce() -> R) -> R {
    let _restore = Restore::set(&BF16_PRODUCTS, choice);
    f()
}

/// Whether bf16 products take bf16 operands directly on this thread (see [`Bf16Products`]):
/// in every call, or under `Auto` in calls large enough (`Auto` widens small calls outside
/// [`no_grad`]).
pub fn bf16_products() -> bool {
    match BF16_PRODUCTS.with(|c| c.get()) {
        Bf16Products::Direct => true,
        Bf16Products::Widened => false,
        Bf16Products::Auto => bf16_products_auto(),
    }
}

/// `Auto`'s choice: the environment override, AMX tiles where asked for and granted, or the
/// measured rate of the bf16 dot product (one decision, explained by
/// [`explain_bf16_products`](crate::explain_bf16_products)).
fn bf16_products_auto() -> bool {
    AUTO_DECISION.with(|c| c.get()).unwrap_or_else(|| crate::products::auto_decision().0)
}

/// Runs `f` with `Auto`'s decision for this process replaced by `direct` on this thread (and
/// the pool threads its calls hop onto): for tests of `Auto`'s rules that must run the same
/// on CPUs where it decides otherwise.
#[doc(hidden)]
pub fn with_auto_bf16_decision<R>(direct: bool, f: impl FnOnce() -> R) -> R {
    let _restore = Restore::set(&AUTO_DECISION, Some(direct));
    f()
}

/// Whether a call whose largest product is `macs` multiply-adds (its estimate:
/// [`crate::products::call_macs`]) takes bf16 operands directly: [`bf16_products`], except that
/// `Auto` widens a call below [`crate::products::WIDEN_BELOW_MACS`] that may record a gradient
/// (outside [`no_grad`]: faster there, and its gradients closer to PyTorch's), unless the
/// environment asked for one choice for every call. Inside a call's [`rounded_products`], the
/// call's decision: its parts (a layer's attention and projections, an attention's
/// projections) follow the call as a whole.
pub(crate) fn bf16_products_at(macs: u64) -> bool {
    use crate::products::{auto_by_size, WIDEN_BELOW_MACS};
    if let Some(direct) = CALL_DIRECT.with(|c| c.get()) {
        return direct;
    }
    match BF16_PRODUCTS.with(|c| c.get()) {
        Bf16Products::Direct => true,
        Bf16Products::Widened => false,
        Bf16Products::Auto => {
            let small = macs < WIDEN_BELOW_MACS && grad_enabled() && auto_by_size();
            bf16_products_auto() && !small
        }
    }
}

/// Runs `f`, a bf16 module's f32 computation whose largest product is `macs` multiply-adds,
/// with its products' operands rounded to bf16 when [`bf16_products_at`] says so (the linear
/// layers and attention inside take the bf16 kernels).
pub(crate) fn rounded_products<R>(dtype: DType, macs: u64, f: impl FnOnce() -> R) -> R {
    let direct = bf16_products_at(macs);
    let _restore = Restore::set(&ROUNDED_PRODUCTS, dtype == DType::BF16 && direct);
    let _call = Restore::set(&CALL_DIRECT, Some(direct));
    f()
}

/// [`rounded_products`] where `like_flash` (PyTorch's bf16 attention would round its products
/// here); otherwise `f` runs with rounding off, products widened to f32 as PyTorch's math path
/// computes them.
pub(crate) fn rounded_products_if<R>(
    dtype: DType,
    like_flash: bool,
    macs: u64,
    f: impl FnOnce() -> R,
) -> R {
    let direct = bf16_products_at(macs);
    let _restore = Restore::set(&ROUNDED_PRODUCTS, like_flash && dtype == DType::BF16 && direct);
    let _call = Restore::set(&CALL_DIRECT, Some(direct));
    f()
}

/// Whether this thread runs inside [`rounded_products`] with rounding on.
pub(crate) fn in_rounded_products() -> bool {
    ROUNDED_PRODUCTS.with(|c| c.get())
}

thread_local! {
    pub(crate) static BF16_PRODUCTS: Cell<Bf16Products> = const { Cell::new(Bf16Products::Auto) };
    static ROUNDED_PRODUCTS: Cell<bool> = const { Cell::new(false) };
    /// The decision of the call whose `rounded_products` scope this thread is in.
    static CALL_DIRECT: Cell<Option<bool>> = const { Cell::new(None) };
    /// `with_auto_bf16_decision`'s replacement for `Auto`'s decision.
    static AUTO_DECISION: Cell<Option<bool>> = const { Cell::new(None) };
    static BACKEND: Cell<Backend> = const { Cell::new(Backend::Auto) };
    static GRAD: Cell<bool> = const { Cell::new(true) };
    static AUTOCAST: Cell<Option<DType>> = const { Cell::new(None) };
}

/// Restores a thread-local cell when dropped (also during unwinding).
struct Restore<T: Copy + 'static> {
    key: &'static std::thread::LocalKey<Cell<T>>,
    old: T,
}

impl<T: Copy + 'static> Restore<T> {
    fn set(key: &'static std::thread::LocalKey<Cell<T>>, value: T) -> Self {
        Restore { key, old: key.with(|c| c.replace(value)) }
    }
}

impl<T: Copy + 'static> Drop for Restore<T> {
    fn drop(&mut self) {
        let old = self.old;
        self.key.with(|c| c.set(old));
    }
}

/// Runs `f` as PyTorch's `with torch.no_grad():` block on this thread.
///
/// Inside it:
/// * attention that returns its weights may use the fused kernels (their weights carry no
///   gradient);
/// * in eval mode, [`TransformerEncoder`](crate::transformer::TransformerEncoder) takes
///   PyTorch's inference-only path (padded positions of the output are zero), so the numbers
///   are those PyTorch gives under `torch.no_grad()`.
///
/// * no autograd graph is recorded: the layers detach their inputs and parameters, so that
///   intermediate tensors are freed as soon as they are used (candle otherwise records a graph
///   whenever a parameter is a `Var`, and the graph keeps every intermediate alive).
///
/// `backward` on what `f` computes therefore gives no gradients. See the
/// [module docs](self) for threads.
///
/// # Example
/// ```
/// let inside = multihead::no_grad(multihead::grad_enabled);
/// assert!(!inside && multihead::grad_enabled());
/// ```
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    let _restore = Restore::set(&GRAD, false);
    f()
}

/// `t` itself, or, inside [`no_grad`], `t` detached from candle's autograd graph: the layers
/// pass their inputs and parameters through this, so that inference builds no graph and
/// keeps no intermediate tensor alive.
pub(crate) fn graph_input(t: &Tensor) -> Tensor {
    if grad_enabled() {
        t.clone()
    } else {
        t.detach()
    }
}

/// Whether gradients may be needed on this thread (false inside [`no_grad`]).
pub fn grad_enabled() -> bool {
    GRAD.with(|c| c.get())
}

/// Runs `f` as PyTorch's `with torch.autocast("cpu", dtype=dtype):` block on this thread:
/// mixed precision, with f32 parameters (the master weights an optimizer updates) and
/// computation in `dtype` (`DType::BF16` or `DType::F16`; any other dtype leaves `f` as it is).
///
/// Inside it, [`Linear`](crate::Linear) and [`MultiheadAttention`](crate::MultiheadAttention),
/// given an f32 input, compute what their `dtype` path computes: their parameters and tensor
/// inputs are rounded to `dtype` (differentiably, so gradients reach the f32 parameters,
/// rounded the same way), each operation runs in f32 on the rounded values, and the output is
/// rounded once. Unlike PyTorch, which returns `dtype` tensors from these operations, the
/// output keeps the input's dtype (f32, holding `dtype` values), so that it composes with the
/// f32 code around it. The Transformer layers run as `torch.autocast` runs PyTorch's: their
/// products (projections, attention, feed-forward) read `dtype` operands (weights and biases
/// rounded, activations rounded as the products read them), while their LayerNorms, with f32
/// parameters, and their residual sums compute in f32 on the f32 input, and their output is
/// f32, not rounded (PyTorch's ends in a LayerNorm or a residual sum, both f32 under autocast);
/// the LayerNorms' gradients are then f32 ones, as PyTorch's. LayerNorm outside a layer and the
/// rest of candle run in f32, as under PyTorch's autocast. Float masks are rounded to `dtype`,
/// as PyTorch's attention casts them.
///
/// A module whose parameters already have `dtype` (a bf16 model under bf16 autocast) runs as
/// outside autocast on its arguments converted to `dtype`, as PyTorch's autocast casts them:
/// `Linear` and `MultiheadAttention` take an f32 input and return `dtype`; the Transformer
/// layers convert their float masks and a decoder's memory (an f32 input to them is refused,
/// as PyTorch's LayerNorm refuses it outside its fused eval path).
///
/// # Example
/// ```
/// use candle_core::{DType, Device, Tensor};
/// let lin = multihead::Linear::from_weights(Tensor::new(&[[1.0f32 / 3.0]], &Device::Cpu)?, None);
/// let x = Tensor::new(&[[1.0f32]], &Device::Cpu)?;
/// let y = multihead::autocast(DType::BF16, || lin.forward(&x))?;
/// assert_eq!(y.dtype(), DType::F32);
/// // 1/3 rounded to bfloat16:
/// assert_eq!(y.to_vec2::<f32>()?[0][0], 0.333_984_38);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn autocast<R>(dtype: DType, f: impl FnOnce() -> R) -> R {
    let _restore = Restore::set(&AUTOCAST, Some(dtype));
    f()
}

/// The dtype of the enclosing [`autocast`] on this thread, if any.
pub fn autocast_dtype() -> Option<DType> {
    AUTOCAST.with(|c| c.get())
}

/// Runs `f` outside any [`autocast`] (a module's own rounded computation).
pub(crate) fn autocast_off<R>(f: impl FnOnce() -> R) -> R {
    let _restore = Restore::set(&AUTOCAST, None);
    f()
}

/// Runs `f` with `backend` as this thread's default (what [`Backend::Auto`] options resolve
/// to).
///
/// # Example
/// ```
/// use multihead::{with_backend, Backend};
/// let inner = with_backend(Backend::Composed, || multihead::default_backend());
/// assert_eq!(inner, Backend::Composed);
/// ```
pub fn with_backend<R>(backend: Backend, f: impl FnOnce() -> R) -> R {
    let _restore = Restore::set(&BACKEND, backend);
    f()
}

/// This thread's default backend: [`Backend::Auto`] unless inside [`with_backend`].
pub fn default_backend() -> Backend {
    BACKEND.with(|c| c.get())
}

/// Every mode of this thread (this module's and the bf16 kernel of
/// [`multihead_kernels::bf16gemm::with_bf16_kernel`]), to be entered on another thread: a call
/// that hops onto rayon's pool ([`crate::pool`]) runs there as it would have run here.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Modes {
    bf16_products: Bf16Products,
    rounded_products: bool,
    call_direct: Option<bool>,
    auto_decision: Option<bool>,
    backend: Backend,
    grad: bool,
    autocast: Option<DType>,
    bf16_kernel: multihead_kernels::bf16gemm::Bf16Kernel,
    simd: multihead_kernels::attention::SimdLevel,
}

impl Modes {
    /// This thread's modes.
    pub(crate) fn current() -> Self {
        Modes {
            bf16_products: BF16_PRODUCTS.with(|c| c.get()),
            rounded_products: ROUNDED_PRODUCTS.with(|c| c.get()),
            call_direct: CALL_DIRECT.with(|c| c.get()),
            auto_decision: AUTO_DECISION.with(|c| c.get()),
            backend: BACKEND.with(|c| c.get()),
            grad: GRAD.with(|c| c.get()),
            autocast: AUTOCAST.with(|c| c.get()),
            bf16_kernel: multihead_kernels::bf16gemm::active_bf16_kernel(),
            simd: multihead_kernels::attention::simd_level(),
        }
    }

    /// Runs `f` on this thread with these modes, restoring the thread's own afterwards.
    pub(crate) fn enter<R>(self, f: impl FnOnce() -> R) -> R {
        let _a = Restore::set(&BF16_PRODUCTS, self.bf16_products);
        let _b = Restore::set(&ROUNDED_PRODUCTS, self.rounded_products);
        let _b2 = Restore::set(&CALL_DIRECT, self.call_direct);
        let _b3 = Restore::set(&AUTO_DECISION, self.auto_decision);
        let _c = Restore::set(&BACKEND, self.backend);
        let _d = Restore::set(&GRAD, self.grad);
        let _e = Restore::set(&AUTOCAST, self.autocast);
        let f = || multihead_kernels::attention::with_simd_level(self.simd, f);
        multihead_kernels::bf16gemm::with_bf16_kernel(self.bf16_kernel, f)
    }
}
