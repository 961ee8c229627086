//! Incremental decoding inside candle: an in-place op that writes new keys/values into a
//! [`KvCache`](crate::KvCache)'s preallocated storage, and the flash-decoding kernel of
//! `multihead_kernels::decode` as a `CustomOp3` (inference only: it has no backward, and the
//! cached forward runs without a graph).

use candle_core::{CpuStorage, CustomOp3, InplaceOp2, Layout, Shape, WithDType};
use multihead_kernels::attention::Layout4;
use multihead_kernels::decode::{
    decode_attention, decode_attention_bf16, DecodeDims, DecodeParams,
};

use super::convert::{bits, f32_values, narrow_vec};
use super::flash::Convention;

const APPEND: &str = "kv cache append";

/// Copies new rows into cache slots `(N, Hk, C, D)`: token `t` of batch entry `b` goes to
/// slot `slots[b] + t` (modulo `C` in a ring), for `t < counts[b]`. The rows are `(N, Hk, T,
/// D)` or, as the projections leave them, `(N, T, Hk·D)`: any strides whose last is 1 (a
/// narrowed or transposed view is read in place, not copied first).
pub(crate) struct Append {
    pub slots: Vec<usize>,
    pub counts: Vec<usize>,
    pub ring: bool,
}

/// Where the new rows' `(b, h, t)` vectors of `d` elements lie in their storage.
struct Source {
    start: usize,
    /// Strides of the batch entry, the head and the token.
    stride: [usize; 3],
    t: usize,
}

impl Source {
    /// The rows' layout, checked against the cache's `(n, hk, d)` and the storage's `len`.
    fn of(sl: &Layout, (n, hk, d): (usize, usize, usize), len: usize) -> candle_core::Result<Self> {
        let (dims, st) = (sl.dims(), sl.stride());
        let (t, stride, last) = match (dims, st) {
            (&[n2, hk2, t, d2], &[s0, s1, s2, s3]) if (n2, hk2, d2) == (n, hk, d) => {
                (t, [s0, s1, s2], s3)
            }
            (&[n2, t, w], &[s0, s1, s2]) if n2 == n && Some(w) == hk.checked_mul(d) => {
                (t, [s0, d.saturating_mul(s2), s1], s2)
            }
            _ => candle_core::bail!(
                "{APPEND}: rows {dims:?} fit neither (N, Hk, T, D) nor (N, T, Hk·D) for a cache \
                 of N={n}, Hk={hk}, D={d}"
            ),
        };
        if d > 1 && last != 1 {
            candle_core::bail!("{APPEND}: the rows' last dimension must have stride 1");
        }
        // The last element of the last vector lies inside the storage.
        let reach = [n, hk, t]
            .iter()
            .zip(stride)
            .try_fold(sl.start_offset(), |acc, (&k, s)| {
                k.saturating_sub(1).checked_mul(s).and_then(|x| acc.checked_add(x))
            })
            .and_then(|x| x.checked_add(d));
        if n * hk * t * d > 0 && reach.is_none_or(|r| r > len) {
            candle_core::bail!("{APPEND}: the rows' layout reaches past their storage");
        }
        Ok(Self { start: sl.start_offset(), stride, t })
    }

    /// The offset of vector `(b, h, i)`.
    fn at(&self, b: usize, h: usize, i: usize) -> usize {
        self.start + b * self.stride[0] + h * self.stride[1] + i * self.stride[2]
    }
}

impl Append {
    fn copy<T: WithDType>(
        &self,
        dst: &mut [T],
        dl: &Layout,
        src: &[T],
        sl: &Layout,
    ) -> candle_core::Result<()> {
        let &[n, hk, c, d] = dl.dims() else {
            candle_core::bail!("{APPEND}: expected a 4-D cache");
        };
        let Some((d0, d1)) = dl.contiguous_offsets() else {
            candle_core::bail!("{APPEND}: the cache must be contiguous");
        };
        let from = Source::of(sl, (n, hk, d), src.len())?;
        if self.slots.len() != n || self.counts.len() != n {
            candle_core::bail!("{APPEND}: {} slots for a batch of {n}", self.slots.len());
        }
        let dst = &mut dst[d0..d1];
        for b in 0..n {
            if self.counts[b] > from.t || (!self.ring && self.slots[b] + self.counts[b] > c) {
                candle_core::bail!("{APPEND}: row {b} does not fit");
            }
            for h in 0..hk {
                for i in 0..self.counts[b] {
                    let slot = if self.ring { (self.slots[b] + i) % c } else { self.slots[b] + i };
                    let to = ((b * hk + h) * c + slot) * d;
                    let at = from.at(b, h, i);
                    dst[to..to + d].copy_from_slice(&src[at..at + d]);
                }
            }
        }
        Ok(())
    }
}

impl InplaceOp2 for Append {
    fn name(&self) -> &'static str {
        APPEND
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        match (s1, s2) {
            (CpuStorage::F32(d), CpuStorage::F32(s)) => self.copy(d, l1, s, l2),
            (CpuStorage::F64(d), CpuStorage::F64(s)) => self.copy(d, l1, s, l2),
            (CpuStorage::BF16(d), CpuStorage::BF16(s)) => self.copy(d, l1, s, l2),
            (CpuStorage::F16(d), CpuStorage::F16(s)) => self.copy(d, l1, s, l2),
            _ => candle_core::bail!("{APPEND}: cache and rows must share a float dtype"),
        }
    }
}

/// Attention of the new queries over the cache (see `multihead_kernels::decode`).
pub(crate) struct DecodeOp {
    pub heads: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    pub batch_first: bool,
    pub causal: bool,
    pub kv_len: Vec<usize>,
    pub q_pos: Vec<usize>,
    pub q_len: Vec<usize>,
    /// Soft cap and sinks (`forward_cached_with`).
    pub softcap: Option<f32>,
    pub sinks: Option<Vec<f32>>,
    /// ALiBi slopes per query head.
    pub alibi: Option<Vec<f32>>,
    /// A left window (`CachedOptions::window`).
    pub window: Option<usize>,
}

impl CustomOp3 for DecodeOp {
    fn name(&self) -> &'static str {
        "decode attention"
    }

    /// `q` is `(T, N, H·D)` (`(N, T, H·D)` with `batch_first`), `k`/`v` the cache
    /// `(N, Hk, C, D)`; the output is laid out like `q`. All f32, or all bf16: a bf16 cache is
    /// read as bf16 (half the bytes) and widened in registers, the few query rows are widened
    /// first, and the output is rounded once to bf16.
    fn cpu_fwd(
        &self,
        qs: &CpuStorage,
        ql: &Layout,
        ks: &CpuStorage,
        kl: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let name = self.name();
        let mut widened = Vec::new();
        let q_len = match qs {
            CpuStorage::F32(q) => q.len(),
            CpuStorage::BF16(q) => q.len(),
            _ => candle_core::bail!("{name}: expected f32 or bf16 queries"),
        };
        let q = f32_values(qs, (0, q_len), &mut widened, name)?;
        let conv = Convention::SeqFirst {
            heads: self.heads,
            head_dim: self.head_dim,
            batch_first: self.batch_first,
        };
        let (q0, q4) = conv.layout4(ql)?;
        let cache4 = |l: &Layout| -> candle_core::Result<(usize, Layout4, usize)> {
            let (&[_, hk, c, d], Some((o, _))) = (l.dims(), l.contiguous_offsets()) else {
                candle_core::bail!("{name}: the cache must be a contiguous (N, Hk, C, D) tensor");
            };
            Ok((o, Layout4::contiguous(hk, c, d), c))
        };
        let ((k0, k4, cap), (v0, v4, _)) = (cache4(kl)?, cache4(vl)?);
        let dims = ql.dims();
        let (t, n) = if self.batch_first { (dims[1], dims[0]) } else { (dims[0], dims[1]) };
        let e = self.heads * self.head_dim;
        let o4 = if self.batch_first {
            Layout4 { batch: t * e, head: self.head_dim, seq: e }
        } else {
            Layout4 { batch: e, head: self.head_dim, seq: n * e }
        };
        let mut out = crate::alloc::try_zeros::<f32>(n * t * e, name)?;
        let kdims = DecodeDims {
            batch: n,
            heads_q: self.heads,
            heads_kv: self.heads_kv,
            rows: t,
            capacity: cap,
            d: self.head_dim,
            dv: self.head_dim,
        };
        let mut params = DecodeParams::new(kdims, &self.kv_len, &self.q_pos, &self.q_len);
        params.scale = (1.0 / (self.head_dim as f64).sqrt()) as f32;
        params.causal = self.causal;
        params.softcap = self.softcap;
        params.sinks = self.sinks.as_deref();
        params.alibi = self.alibi.as_deref();
        params.window = self.window;
        let q = &q[q0..];
        match (qs, ks, vs) {
            (CpuStorage::F32(_), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                decode_attention(&params, q, q4, &k[k0..], k4, &v[v0..], v4, &mut out, o4)
            }
            (CpuStorage::BF16(_), CpuStorage::BF16(k), CpuStorage::BF16(v)) => {
                let (k, v) = (bits(k), bits(v));
                decode_attention_bf16(&params, q, q4, &k[k0..], k4, &v[v0..], v4, &mut out, o4)
            }
            _ => candle_core::bail!("{name}: queries and cache must all be f32 or all bf16"),
        }
        .map_err(|e| candle_core::Error::Msg(format!("{name}: {e}")))?;
        let shape = Shape::from(dims.to_vec());
        match qs {
            CpuStorage::BF16(_) => Ok((CpuStorage::BF16(narrow_vec(&out, name)?), shape)),
            _ => Ok((CpuStorage::F32(out), shape)),
        }
    }
}
