//! The fused CPU kernels inside candle, and the choice between them and the composed path.
//!
//! * [`dispatch`]: the one function that picks a path for a call, and the [`Plan`] that says
//!   why.
//! * `flash`: the flash-attention kernels as candle custom ops with a backward.
//! * `sinks`: the attention sinks' gradient, joined to the graph by an identity on the output.
//! * `mask_grad`: a learned additive mask's gradient, the same way.
//! * `varlen`: flash attention over a packed batch of variable-length sequences.
//! * `linear`: `F.linear` (optionally followed by ReLU) as one candle op on gemm's kernels,
//!   with a backward.
//! * `bf16_linear`: `F.linear` with bf16 products (AVX512-BF16), without a backward, for
//!   bf16 inference where that instruction is fast.
//! * `activation`: exact-form GELU and ReLU as one candle op each, with a backward.
//! * `norm`: LayerNorm as one candle op over `multihead_kernels::norm`, with a backward.
//! * `zeros`: the zeros of a call with nothing to compute, kept in the graph.
//! * `sum`: the sum of every element in f32, whose backward writes the gradient out whole.
//!
//! [`Plan`]: dispatch::Plan

pub(crate) mod activation;
pub(crate) mod add;
pub(crate) mod bf16_linear;
pub(crate) mod convert;
pub(crate) mod decode;
pub mod dispatch;
pub(crate) mod flash;
pub(crate) mod flash_packed;
pub(crate) mod linear;
pub(crate) mod mask_grad;
pub(crate) mod norm;
pub(crate) mod sinks;
pub(crate) mod sum;
pub(crate) mod varlen;
pub(crate) mod varlen_sinks;
pub(crate) mod weights_grad;
pub(crate) mod zeros;

/// Makes a forward-only linear op (a type with `fn run(&self, x, w, bias: Option<_>)` over CPU
/// storages and layouts) a `CustomOp2` (without a bias) and a `CustomOp3` (with one), named
/// `$name`.
macro_rules! forward_only_linear_ops {
    ($t:ty, $name:expr) => {
        impl candle_core::CustomOp2 for $t {
            fn name(&self) -> &'static str {
                $name
            }
            fn cpu_fwd(
                &self,
                xs: &candle_core::CpuStorage,
                xl: &candle_core::Layout,
                ws: &candle_core::CpuStorage,
                wl: &candle_core::Layout,
            ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
                self.run((xs, xl), (ws, wl), None)
            }
        }

        impl candle_core::CustomOp3 for $t {
            fn name(&self) -> &'static str {
                $name
            }
            fn cpu_fwd(
                &self,
                xs: &candle_core::CpuStorage,
                xl: &candle_core::Layout,
                ws: &candle_core::CpuStorage,
                wl: &candle_core::Layout,
                bs: &candle_core::CpuStorage,
                bl: &candle_core::Layout,
            ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
                self.run((xs, xl), (ws, wl), Some((bs, bl)))
            }
        }
    };
}
pub(crate) use forward_only_linear_ops;

/// The f32 data of a CPU storage, or an error naming the op.
pub(crate) fn cpu_f32<'a>(
    s: &'a candle_core::CpuStorage,
    op: &str,
) -> candle_core::Result<&'a [f32]> {
    match s {
        candle_core::CpuStorage::F32(v) => Ok(v),
        _ => candle_core::bail!("{op}: expected f32 tensors"),
    }
}

/// The f32 data of a storage on the CPU, or an error naming the op.
pub(crate) fn storage_f32<'a>(
    s: &'a candle_core::Storage,
    op: &str,
) -> candle_core::Result<&'a [f32]> {
    match s {
        candle_core::Storage::Cpu(c) => cpu_f32(c, op),
        _ => candle_core::bail!("{op}: expected f32 tensors on the CPU"),
    }
}
