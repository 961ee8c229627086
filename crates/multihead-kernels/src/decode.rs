//! Attention of a few new query rows over a long key/value cache (incremental decoding,
//! "flash-decoding"): the keys are split into fixed chunks of [`KEY_CHUNK`], each
//! `(batch, kv head, row block, chunk)` is one parallel task that computes a partial softmax,
//! and the partials are combined in chunk order.
//!
//! # Semantics
//!
//! The cache holds `kv_len[b]` keys and values of batch entry `b` (slots `0..kv_len[b]` of a
//! `[batch, heads_kv, capacity, d]` view). Query row `t` of entry `b` sees keys `0..vis(b, t)`:
//!
//! * `vis = 0` when `t >= q_len[b]` (a padding row: its output is zero);
//! * `vis = min(q_pos[b] + t + 1, kv_len[b])` when `causal` (row `t` sits at position
//!   `q_pos[b] + t` and sees itself and everything before it);
//! * `vis = kv_len[b]` otherwise;
//!
//! and with a left `window` `w`, only keys from `first(b, t) = q_pos[b] + t − w` on (Mistral's
//! sliding window over a full cache: whole chunks before it are skipped).
//!
//! `out[b,h,t,:] = Σ_j softmax_j(cap(scale · q[b,h,t,:]·k[b,hk,j,:])) v[b,hk,j,:]` over the
//! visible keys (`cap` the optional soft cap; an optional sink per head joins the softmax's
//! denominator), with `hk = h / (heads_q / heads_kv)` (grouped-query attention: the query heads of
//! one kv head share one pass over its keys). A row with no visible key is zero. Keys a row
//! cannot see are never read, so whatever the cache holds past `kv_len` does not matter.
//!
//! # Determinism
//!
//! The chunking depends only on the sizes, never on the thread count, and every row combines
//! its chunks in order, so results are bitwise identical for any number of threads. A row's
//! result does not depend on the other rows of the call either: decoding tokens one at a time
//! or all at once (causal) gives the same bits.
//!
//! # Example
//!
//! ```
//! use multihead_kernels::attention::Layout4;
//! use multihead_kernels::decode::{decode_attention, DecodeDims, DecodeParams};
//!
//! // One new token per sequence, 2 sequences, 4 query heads sharing 2 kv heads, a cache of 10.
//! let dims = DecodeDims { batch: 2, heads_q: 4, heads_kv: 2, rows: 1, capacity: 10, d: 8, dv: 8 };
//! let q = vec![0.1f32; 2 * 4 * 8];
//! let kv = vec![0.5f32; 2 * 2 * 10 * 8];
//! let (kv_len, q_pos, q_len) = ([3, 10], [2, 9], [1, 1]);
//! let mut p = DecodeParams::new(dims, &kv_len, &q_pos, &q_len);
//! (p.scale, p.causal) = (0.35, true);
//! let mut out = vec![0f32; 2 * 4 * 8];
//! let (ql, cl) = (Layout4::contiguous(4, 1, 8), Layout4::contiguous(2, 10, 8));
//! decode_attention(&p, &q, ql, &kv, cl, &kv, cl, &mut out, ql)?;
//! assert!(out.iter().all(|&x| (x - 0.5).abs() < 1e-6));
//! # Ok::<(), multihead_kernels::attention::KernelError>(())
//! ```

use crate::attention::exec::{round16, try_par_run, Carver, ConstPtr, SyncPtr, Task};
use crate::attention::simd::Simd;
use crate::attention::{check_tensor, simd_level, KernelError, Layout4};
use crate::elem::Elem;
use tiles::{run_scores, run_weighted, runs_of, Rows};

/// Keys per chunk (one task's share of a row's keys).
pub const KEY_CHUNK: usize = 512;
/// Keys per sub-block inside a chunk: 64 keys and values of 64 floats fit in L1 together.
const SUB_BLOCK: usize = 64;
/// Query rows (new tokens × query heads of one kv head) one task handles together.
pub const ROW_BLOCK: usize = 8;
/// Above this many floats of partial results, each row block runs its chunks in one task
/// (same arithmetic, same bits; long prefills have enough row blocks to fill the threads).
const MAX_PARTIAL_FLOATS: usize = 1 << 24;

/// Sizes of a decode call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DecodeDims {
    /// Batch size.
    pub batch: usize,
    /// Query heads.
    pub heads_q: usize,
    /// Key/value heads; must divide `heads_q`.
    pub heads_kv: usize,
    /// New query rows per batch entry (`T`).
    pub rows: usize,
    /// Cache slots per `(batch, kv head)`.
    pub capacity: usize,
    /// Query/key head dimension.
    pub d: usize,
    /// Value head dimension.
    pub dv: usize,
}

/// Everything but the tensors: [`DecodeParams::new`], then set the fields a call needs (the
/// struct grows with the kernel's options, hence `#[non_exhaustive]`).
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct DecodeParams<'a> {
    /// Sizes.
    pub dims: DecodeDims,
    /// Multiplies `q·k`.
    pub scale: f32,
    /// Row `t` sees only keys up to its own position `q_pos[b] + t`.
    pub causal: bool,
    /// Keys in the cache per batch entry (at most `capacity`).
    pub kv_len: &'a [usize],
    /// The position of row 0 per batch entry (used when `causal`).
    pub q_pos: &'a [usize],
    /// Valid rows per batch entry; rows from `q_len[b]` on are padding and give zeros.
    pub q_len: &'a [usize],
    /// Tanh soft cap of the scaled scores, `c·tanh(scale·q·k / c)` (finite, positive), as in
    /// [`AttnParams::softcap`](crate::attention::AttnParams::softcap).
    pub softcap: Option<f32>,
    /// Attention sinks, one logit per query head (`heads_q` values) in every row's softmax
    /// denominator, as in [`AttnParams::sinks`](crate::attention::AttnParams::sinks). A
    /// padding row stays zero.
    pub sinks: Option<&'a [f32]>,
    /// ALiBi slopes, one per query head (`heads_q` finite values): row `t` at position
    /// `q_pos[b] + t` adds `−m_h·|q_pos[b] + t − j|` to its score of key `j` (after the cap),
    /// as [`AttnParams::alibi`](crate::attention::AttnParams::alibi) does with a diagonal
    /// offset of `q_pos[b]`.
    pub alibi: Option<&'a [f32]>,
    /// A left window: row `t` sees no key before `q_pos[b] + t − window`, as
    /// [`Window::left`](crate::attention::Window::left) with a diagonal offset of `q_pos[b]`.
    pub window: Option<usize>,
}

impl<'a> DecodeParams<'a> {
    /// Parameters without a causal rule, cap, sinks, ALiBi or window, `scale = 1/sqrt(d)`.
    pub fn new(
        dims: DecodeDims,
        kv_len: &'a [usize],
        q_pos: &'a [usize],
        q_len: &'a [usize],
    ) -> Self {
        DecodeParams {
            dims,
            scale: 1.0 / (dims.d.max(1) as f32).sqrt(),
            causal: false,
            kv_len,
            q_pos,
            q_len,
            softcap: None,
            sinks: None,
            alibi: None,
            window: None,
        }
    }

    /// Keys row `t` of batch entry `b` sees.
    #[inline]
    pub fn visible(&self, b: usize, t: usize) -> usize {
        visible_keys(self.causal, self.kv_len[b], self.q_pos[b], self.q_len[b], t)
    }

    /// The first key row `t` of batch entry `b` sees (0 without a window).
    #[inline]
    pub fn first(&self, b: usize, t: usize) -> usize {
        first_key(self.window, self.q_pos[b], t)
    }
}

/// The first key row `t` sees under a left `window`, its row 0 at position `q_pos` (the rule
/// of the module docs; composed paths use it too).
#[inline]
pub fn first_key(window: Option<usize>, q_pos: usize, t: usize) -> usize {
    window.map_or(0, |w| q_pos.saturating_add(t).saturating_sub(w))
}

/// The keys row `t` sees in a batch entry with `kv_len` cached keys, its row 0 at position
/// `q_pos` and `q_len` real rows (the rule of the module docs; composed paths use it too).
#[inline]
pub fn visible_keys(causal: bool, kv_len: usize, q_pos: usize, q_len: usize, t: usize) -> usize {
    if t >= q_len {
        0
    } else if causal {
        q_pos.saturating_add(t + 1).min(kv_len)
    } else {
        kv_len
    }
}

fn invalid(name: &'static str, msg: String) -> KernelError {
    KernelError::InvalidArgument { name, msg }
}

fn check_params(p: &DecodeParams) -> Result<(), KernelError> {
    let d = p.dims;
    if d.heads_kv == 0 || !d.heads_q.is_multiple_of(d.heads_kv) {
        return Err(KernelError::InvalidHeads { heads_q: d.heads_q, heads_kv: d.heads_kv });
    }
    for (name, xs) in [("kv_len", p.kv_len), ("q_pos", p.q_pos), ("q_len", p.q_len)] {
        if xs.len() != d.batch {
            return Err(invalid(
                name,
                format!("has {} entries for a batch of {}", xs.len(), d.batch),
            ));
        }
    }
    if let Some(c) = p.softcap.filter(|c| !(c.is_finite() && *c > 0.0)) {
        return Err(invalid(
            "softcap",
            format!("the soft cap must be finite and positive, got {c}"),
        ));
    }
    if let Some(x) = p.sinks.filter(|x| x.len() != d.heads_q) {
        return Err(invalid(
            "sinks",
            format!("expected one value per query head ({}), got {}", d.heads_q, x.len()),
        ));
    }
    if let Some(m) = p.alibi {
        if m.len() != d.heads_q || m.iter().any(|x| !x.is_finite()) {
            return Err(invalid(
                "alibi",
                format!("expected one finite slope per query head ({}), got {m:?}", d.heads_q),
            ));
        }
    }
    if let Some((b, &n)) = p.kv_len.iter().enumerate().find(|(_, &n)| n > d.capacity) {
        return Err(invalid(
            "kv_len",
            format!("entry {b} holds {n} keys but the cache has {} slots", d.capacity),
        ));
    }
    Ok(())
}

/// Checks the parameters and that every view fits its slice (`(len, layout)` each).
fn check_args(
    p: &DecodeParams,
    (q, ql): (usize, Layout4),
    (k, kl): (usize, Layout4),
    (v, vl): (usize, Layout4),
    (out, ol): (usize, Layout4),
) -> Result<(), KernelError> {
    check_params(p)?;
    let d = p.dims;
    check_tensor("q", q, [d.batch, d.heads_q, d.rows, d.d], ql, false)?;
    check_tensor("k", k, [d.batch, d.heads_kv, d.capacity, d.d], kl, false)?;
    check_tensor("v", v, [d.batch, d.heads_kv, d.capacity, d.dv], vl, false)?;
    check_tensor("out", out, [d.batch, d.heads_q, d.rows, d.dv], ol, true)
}

/// Attention of `rows` new query rows per batch entry over the cache (see the module docs).
///
/// `q` and `out` are `[batch, heads_q, rows, d]` / `[.., dv]` views, `k` and `v`
/// `[batch, heads_kv, capacity, d]` / `[.., dv]` views, all with a contiguous last dimension.
#[allow(clippy::too_many_arguments)]
// Mirrors torch.nn.functional.scaled_dot_product_attention of new query rows over a KV cache.
pub fn decode_attention(
    p: &DecodeParams,
    q: &[f32],
    ql: Layout4,
    k: &[f32],
    kl: Layout4,
    v: &[f32],
    vl: Layout4,
    out: &mut [f32],
    ol: Layout4,
) -> Result<(), KernelError> {
    decode_impl(p, (q, ql), (k, kl), (v, vl), (out, ol), false)
}

/// [`decode_attention`] over a bfloat16 cache: `k` and `v` hold bfloat16 bits, widened
/// exactly in registers, so the result has the bits of [`decode_attention`] on the widened
/// cache while half the bytes are read (the step is bound by reading the cache).
#[allow(clippy::too_many_arguments)]
pub fn decode_attention_bf16(
    p: &DecodeParams,
    q: &[f32],
    ql: Layout4,
    k: &[u16],
    kl: Layout4,
    v: &[u16],
    vl: Layout4,
    out: &mut [f32],
    ol: Layout4,
) -> Result<(), KernelError> {
    decode_impl(p, (q, ql), (k, kl), (v, vl), (out, ol), false)
}

/// [`decode_attention`] for a cache of `E`, optionally forced into the sequential mode.
pub(crate) fn decode_impl<E: Elem>(
    p: &DecodeParams,
    (q, ql): (&[f32], Layout4),
    (k, kl): (&[E], Layout4),
    (v, vl): (&[E], Layout4),
    (out, ol): (&mut [f32], Layout4),
    sequential: bool,
) -> Result<(), KernelError> {
    check_args(p, (q.len(), ql), (k.len(), kl), (v.len(), vl), (out.len(), ol))?;
    let d = p.dims;
    if d.batch == 0 || d.heads_q == 0 || d.rows == 0 || d.dv == 0 {
        return Ok(());
    }
    let group = d.heads_q / d.heads_kv;
    let blocks = (d.rows * group).div_ceil(ROW_BLOCK);
    let max_kv = p.kv_len.iter().copied().max().unwrap_or(0);
    let chunks = max_kv.div_ceil(KEY_CHUNK).max(1);
    let base = Base {
        p: *p,
        group,
        blocks,
        chunks,
        q: ConstPtr(q.as_ptr()),
        ql,
        k: ConstPtr(k.as_ptr()),
        kl,
        v: ConstPtr(v.as_ptr()),
        vl,
        out: SyncPtr(out.as_mut_ptr()),
        ol,
    };
    run(&base, sequential)
}

thread_local! {
    /// The partial results of the split mode, kept between calls (every slot a call reads
    /// was written by that call), so that a decode step does not fault in fresh pages.
    static PARTIALS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs the tasks, split across chunks unless the partials would be too large or
/// `sequential` is asked for (the tests compare the two modes bit for bit).
fn run<E: Elem>(base: &Base<E>, sequential: bool) -> Result<(), KernelError> {
    let d = base.p.dims;
    let units = d.batch * d.heads_kv * base.blocks;
    let partial_floats = units
        .checked_mul(base.chunks)
        .and_then(|n| n.checked_mul(ROW_BLOCK * (d.dv + 2)))
        .filter(|&n| n <= MAX_PARTIAL_FLOATS && !sequential);
    match partial_floats {
        Some(n) => {
            PARTIALS.with(|cell| -> Result<(), KernelError> {
                let mut own = Vec::new();
                // A re-entrant call (not expected) takes a private buffer.
                let mut guard = cell.try_borrow_mut();
                let partials = match guard.as_mut() {
                    Ok(v) => &mut **v,
                    Err(_) => &mut own,
                };
                if partials.len() < n {
                    partials
                        .try_reserve_exact(n - partials.len())
                        .map_err(|_| invalid("partials", format!("cannot allocate {n} floats")))?;
                    partials.resize(n, 0.0);
                }
                let parts = SyncPtr(partials.as_mut_ptr());
                try_par_run(simd_level(), &PartialTask { base, parts }, "decode_attention")?;
                let combine = CombineTask { base, parts: ConstPtr(parts.0) };
                try_par_run(simd_level(), &combine, "decode_attention")
            })?;
        }
        None => try_par_run(simd_level(), &SequentialTask { base }, "decode_attention")?,
    }
    Ok(())
}

/// The arguments every task reads.
struct Base<'a, E> {
    p: DecodeParams<'a>,
    group: usize,
    blocks: usize,
    chunks: usize,
    q: ConstPtr<f32>,
    ql: Layout4,
    k: ConstPtr<E>,
    kl: Layout4,
    v: ConstPtr<E>,
    vl: Layout4,
    out: SyncPtr<f32>,
    ol: Layout4,
}

/// One row of a block: its query head, its row index and how many keys it sees.
#[derive(Clone, Copy)]
struct Row {
    h: usize,
    t: usize,
    /// Keys `first..vis` are visible.
    first: usize,
    vis: usize,
}

impl<E: Elem> Base<'_, E> {
    /// Floats per row of a partial result: max, sum, then `dv` accumulators.
    fn stride(&self) -> usize {
        self.p.dims.dv + 2
    }

    /// About the multiply-adds of the scores and the weighted values of every row (for
    /// [`Task::work`]: a short cache's step runs on the calling thread).
    fn macs(&self) -> usize {
        let d = self.p.dims;
        let keys: usize = self.p.kv_len.iter().fold(0usize, |a, &k| a.saturating_add(k));
        keys.saturating_mul(d.heads_q)
            .saturating_mul(d.rows)
            .saturating_mul(d.d.saturating_add(d.dv))
    }

    /// Splits a unit index into `(b, kv head, block)` and lists the block's rows.
    fn rows(&self, unit: usize) -> (usize, usize, [Option<Row>; ROW_BLOCK]) {
        let d = self.p.dims;
        let blk = unit % self.blocks;
        let hk = (unit / self.blocks) % d.heads_kv;
        let b = unit / (self.blocks * d.heads_kv);
        let mut rows = [None; ROW_BLOCK];
        for (i, slot) in rows.iter_mut().enumerate() {
            let r = blk * ROW_BLOCK + i;
            if r < d.rows * self.group {
                let (t, g) = (r / self.group, r % self.group);
                let (first, vis) = (self.p.first(b, t), self.p.visible(b, t));
                *slot = Some(Row { h: hk * self.group + g, t, first, vis });
            }
        }
        (b, hk, rows)
    }

    /// The partial softmaxes of a block's rows over chunk `c` (keys `c·KEY_CHUNK ..`), into
    /// `parts` (`ROW_BLOCK` rows of `[max, sum, acc; dv]`). The chunk is walked in sub-blocks of
    /// [`SUB_BLOCK`] keys with the rows inside, so that the rows of a grouped-query block read
    /// each sub-block of keys and values from L1, and rows that see the same keys go through
    /// the products together, register-tiled ([`tiles`]: each key and value vector loaded once
    /// for up to four rows, the bits of each row unchanged). `buf` holds [`chunk_scratch`]
    /// floats.
    ///
    /// # Safety
    /// `S`'s instruction set is available; the layouts were checked by the entry point.
    #[inline(always)]
    unsafe fn block_partial<S: Simd>(
        &self,
        (b, hk): (usize, usize),
        rows: &[Option<Row>; ROW_BLOCK],
        c: usize,
        parts: &mut [f32],
        buf: &mut [f32],
    ) {
        let (d, st) = (self.p.dims, self.stride());
        let start = c * KEY_CHUNK;
        let (lo, len) = chunk_spans(rows, start, parts, st);
        let longest = len.iter().copied().max().unwrap_or(0);
        if longest == 0 {
            return;
        }
        let mut carve = Carver::new(buf);
        let qs = carve.take(ROW_BLOCK * round16(d.d));
        let scores = carve.take(ROW_BLOCK * KEY_CHUNK);
        let q_of = |i: usize| i * round16(d.d)..i * round16(d.d) + d.d;
        // SAFETY: every pointer below addresses an element of a checked `[b, h, i, :]` row:
        // `b < batch`, `h < heads`, `i < rows` or `i < kv_len[b] <= capacity`.
        unsafe {
            for (i, row) in rows.iter().enumerate() {
                if let (Some(row), true) = (row, len[i] > 0) {
                    let qr = self.q.0.add(self.ql.offset(b, row.h, row.t));
                    for (j, x) in qs[q_of(i)].iter_mut().enumerate() {
                        *x = *qr.add(j) * self.p.scale;
                    }
                }
            }
            let keys = |from: usize| Rows {
                base: self.k.0.add(self.kl.offset(b, hk, start + from)),
                stride: self.kl.seq,
            };
            let values = |from: usize| Rows {
                base: self.v.0.add(self.vl.offset(b, hk, start + from)),
                stride: self.vl.seq,
            };
            // Row `i`'s part `from..hi` of the sub-block at `sb` (empty: `from >= hi`).
            let span = |i: usize, sb: usize| (sb.max(lo[i]), len[i].min(sb + SUB_BLOCK));
            let (runs, n_runs) = runs_of(&lo, &len, tiles::max_rows::<S>());
            let scores0 = scores.as_mut_ptr();
            for sb in (0..longest).step_by(SUB_BLOCK) {
                for &(i0, count) in &runs[..n_runs] {
                    // A run's rows start at the same key; each ends at its own.
                    let from = span(i0, sb).0;
                    let n = |r: usize| span(i0 + r, sb).1.saturating_sub(from);
                    if (0..count).any(|r| n(r) > 0) {
                        let q = |r: usize| qs[q_of(i0 + r)].as_ptr();
                        let out = |r: usize| scores0.add((i0 + r) * KEY_CHUNK + from);
                        run_scores::<S, E>(count, q, d.d, keys(from), n, out);
                    }
                }
            }
            let hidden = self.chunk_softmax::<S>((b, start), rows, (&lo, &len), scores, parts);
            let (visible, n_visible) = visible_runs(&runs[..n_runs], &hidden);
            let acc0 = parts.as_mut_ptr();
            for sb in (0..longest).step_by(SUB_BLOCK) {
                for &(i0, count) in &visible[..n_visible] {
                    let from = span(i0, sb).0;
                    let n = |r: usize| span(i0 + r, sb).1.saturating_sub(from);
                    if (0..count).any(|r| n(r) > 0) {
                        let p = |r: usize| scores.as_ptr().add((i0 + r) * KEY_CHUNK + from);
                        let acc = |r: usize| acc0.add((i0 + r) * st + 2);
                        run_weighted::<S, E>(count, p, n, values(from), acc, d.dv);
                    }
                }
            }
        }
    }

    /// The softmax statistics of each row's scores in a chunk (after the soft cap and ALiBi):
    /// the max into `part[0]` and the sum of exponentials into `part[1]`, the scores left as
    /// their exponentials. Returns the rows whose scores in this chunk are all -inf.
    ///
    /// # Safety
    /// `S`'s instruction set is available; `scores` holds the rows' scores of the chunk
    /// starting at key `start` (`ROW_BLOCK` rows of [`KEY_CHUNK`]), `parts` their states.
    #[inline(always)]
    unsafe fn chunk_softmax<S: Simd>(
        &self,
        (b, start): (usize, usize),
        rows: &[Option<Row>; ROW_BLOCK],
        (lo, len): (&[usize; ROW_BLOCK], &[usize; ROW_BLOCK]),
        scores: &mut [f32],
        parts: &mut [f32],
    ) -> [bool; ROW_BLOCK] {
        let mut hidden = [false; ROW_BLOCK];
        let st = self.stride();
        for (i, part) in parts.chunks_exact_mut(st).enumerate().filter(|(i, _)| len[*i] > 0) {
            let row_scores = &mut scores[i * KEY_CHUNK + lo[i]..i * KEY_CHUNK + len[i]];
            // SAFETY: the caller's contract (`S` is available).
            unsafe {
                if let Some(c) = self.p.softcap {
                    cap_scores::<S>(row_scores, c);
                }
                if let (Some(m), Some(row)) = (self.p.alibi, rows[i]) {
                    let pos = self.p.q_pos[b].saturating_add(row.t);
                    add_alibi::<S>(row_scores, -m[row.h], pos, start + lo[i]);
                }
                part[0] = max_of::<S>(row_scores);
                // Every score of the chunk -inf (an ALiBi bias beyond f32's range): the chunk
                // gives nothing (`(-inf, 0)`, as `merge` expects), not `exp(-inf + inf)` = NaN.
                // (A NaN score may also leave the vector max at -inf: it must stay NaN.)
                hidden[i] = part[0] == f32::NEG_INFINITY
                    && row_scores.iter().all(|&x| x == f32::NEG_INFINITY);
                if !hidden[i] {
                    part[1] = exp_sum::<S>(row_scores, part[0]);
                }
            }
        }
        hidden
    }

    /// Writes row `row`'s output from its combined state.
    ///
    /// # Safety
    /// As for [`chunk_partial`](Self::chunk_partial); only this task writes the row.
    #[inline(always)]
    unsafe fn finish<S: Simd>(&self, b: usize, row: Row, state: &[f32]) {
        let dv = self.p.dims.dv;
        let l = state[1];
        // A sink joins the denominator: `acc · a / (l·a + exp(sink − m'))`, `m' = max(m, sink)`.
        let sink = self.p.sinks.map(|x| x[row.h]).filter(|&s| s != f32::NEG_INFINITY);
        let div = match sink {
            _ if l == 0.0 => 0.0,
            Some(s) if !s.is_finite() => f32::NAN,
            Some(s) => {
                let top = state[0].max(s);
                let a = (state[0] - top).exp();
                (l * a + (s - top).exp()) / a
            }
            None => l,
        };
        // SAFETY: the row `(b, h, t)` of `out` was checked by the entry point.
        unsafe {
            let o = self.out.0.add(self.ol.offset(b, row.h, row.t));
            if l == 0.0 {
                std::ptr::write_bytes(o, 0, dv);
            } else {
                map_div::<S>(&state[2..], div, o);
            }
        }
    }
}

/// Adds ALiBi's `−m·|pos − j|` to the scores of keys `start..start + scores.len()` (the
/// distance exact below 2^24, multiplied by the negated slope as the attention kernels do).
/// Vectors of distances where every position is below 2^24 (then `pos − j` is exact in f32);
/// beyond, each distance is rounded from f64 one score at a time. The same bits either way
/// below 2^24.
///
/// # Safety
/// `S`'s instruction set is available.
#[inline(always)]
unsafe fn add_alibi<S: Simd>(scores: &mut [f32], neg_slope: f32, pos: usize, start: usize) {
    const EXACT: usize = 1 << 24;
    let n = scores.len();
    if pos >= EXACT || start.saturating_add(n) > EXACT {
        for (j, s) in scores.iter_mut().enumerate() {
            let dist = (pos as f64 - (start + j) as f64).abs() as f32;
            *s += dist * neg_slope;
        }
        return;
    }
    const IOTA: [f32; 16] =
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0];
    let l = S::LANES;
    // SAFETY: `IOTA` holds 16 >= LANES floats; masked accesses stay inside `scores`.
    unsafe {
        let (m, iota) = (S::splat(neg_slope), S::load(IOTA.as_ptr()));
        // Both positions are below 2^24, so `d0` and every `d0 − j` are exact integers.
        let d0 = S::splat(pos as f32 - start as f32);
        let p = scores.as_mut_ptr();
        let mut j = 0;
        while j < n {
            let mask = if j + l <= n { S::full_mask() } else { S::tail_mask(n - j) };
            let dist = S::abs(S::sub(d0, S::add(iota, S::splat(j as f32))));
            let x = S::add(S::load_m(p.add(j), mask), S::mul(dist, m));
            S::store_m(p.add(j), x, mask);
            j += l;
        }
    }
}

/// `state ← state ⊕ part`: the online-softmax merge, in one fixed order of operations.
#[inline(always)]
unsafe fn merge<S: Simd>(state: &mut [f32], part: &[f32]) {
    let (mc, lc) = (part[0], part[1]);
    if mc == f32::NEG_INFINITY && lc == 0.0 {
        return; // nothing visible in this chunk
    }
    let m = state[0];
    let mn = m.max(mc);
    let a = if m == f32::NEG_INFINITY { 0.0 } else { (m - mn).exp() };
    let bc = (mc - mn).exp();
    state[0] = mn;
    state[1] = state[1] * a + lc * bc;
    // SAFETY: both slices have `dv + 2` floats (forwarded from the caller).
    unsafe { scale_add::<S>(&mut state[2..], a, &part[2..], bc) };
}

/// `s = c·tanh(s/c)` in place (a vector tanh, within 4 f32 epsilons). The tail goes through
/// the same vector form, masked: a scalar `c·tanh(s/c)` loses small scores under a huge cap,
/// where `s/c` is subnormal and the kernels' flush-to-zero makes it 0 (the vector form
/// multiplies `s` itself by a ratio of polynomials instead).
#[inline(always)]
unsafe fn cap_scores<S: Simd>(s: &mut [f32], c: f32) {
    let (l, n) = (S::LANES, s.len());
    // SAFETY: loads and stores stay inside `s` (the tail's are masked to its length).
    unsafe {
        let inv = 1.0 / c;
        let mut j = 0;
        while j + l <= n {
            let p = s.as_mut_ptr().add(j);
            S::store(p, S::softcap(S::load(p), c, inv));
            j += l;
        }
        if j < n {
            let (p, m) = (s.as_mut_ptr().add(j), S::tail_mask(n - j));
            S::store_m(p, S::softcap(S::load_m(p, m), c, inv), m);
        }
    }
}

/// The largest score (NaN is ignored here; it reaches the sum through `exp`).
#[inline(always)]
unsafe fn max_of<S: Simd>(s: &[f32]) -> f32 {
    let (l, n) = (S::LANES, s.len());
    let mut lanes = [f32::NEG_INFINITY; 16];
    // SAFETY: loads stay inside `s`; `lanes` holds 16 >= LANES floats.
    unsafe {
        let mut acc = S::splat(f32::NEG_INFINITY);
        let mut j = 0;
        while j + l <= n {
            acc = S::max(acc, S::load(s.as_ptr().add(j)));
            j += l;
        }
        S::store(lanes.as_mut_ptr(), acc);
        lanes[..l].iter().chain(&s[j..]).fold(f32::NEG_INFINITY, |m, &x| m.max(x))
    }
}

/// `s ← exp(s − m)` in place; returns `Σ s`.
#[inline(always)]
unsafe fn exp_sum<S: Simd>(s: &mut [f32], m: f32) -> f32 {
    let (l, n) = (S::LANES, s.len());
    // SAFETY: masked loads and stores stay inside `s`.
    unsafe {
        let (mv, mut acc) = (S::splat(m), S::splat(0.0));
        let p = s.as_mut_ptr();
        let mut j = 0;
        while j < n {
            let mask = if j + l <= n { S::full_mask() } else { S::tail_mask(n - j) };
            let e = S::exp(S::sub(S::load_m(p.add(j), mask), mv));
            S::store_m(p.add(j), e, mask);
            // Lanes past the tail were loaded as 0 and exp'd; keep them out of the sum.
            acc = S::add(acc, S::load_m(p.add(j), mask));
            j += l;
        }
        S::reduce_add(acc)
    }
}

/// `acc ← acc·a + x·b`.
#[inline(always)]
unsafe fn scale_add<S: Simd>(acc: &mut [f32], a: f32, x: &[f32], b: f32) {
    let (l, n) = (S::LANES, acc.len());
    // SAFETY: masked accesses stay inside both slices (same length).
    unsafe {
        let (av, bv) = (S::splat(a), S::splat(b));
        let (p, xp) = (acc.as_mut_ptr(), x.as_ptr());
        let mut j = 0;
        while j < n {
            let mask = if j + l <= n { S::full_mask() } else { S::tail_mask(n - j) };
            let y = S::mul(S::load_m(p.add(j), mask), av);
            let y = S::fma(S::load_m(xp.add(j), mask), bv, y);
            S::store_m(p.add(j), y, mask);
            j += l;
        }
    }
}

/// `o ← x / l`.
#[inline(always)]
unsafe fn map_div<S: Simd>(x: &[f32], l: f32, o: *mut f32) {
    let (lanes, n) = (S::LANES, x.len());
    // SAFETY: `o` has `x.len()` writable floats (caller); masked accesses stay in bounds.
    unsafe {
        let lv = S::splat(l);
        let mut j = 0;
        while j < n {
            let mask = if j + lanes <= n { S::full_mask() } else { S::tail_mask(n - j) };
            S::store_m(o.add(j), S::div(S::load_m(x.as_ptr().add(j), mask), lv), mask);
            j += lanes;
        }
    }
}

/// Scratch floats of [`Base::block_partial`]: the scaled queries and the scores of a block.
fn chunk_scratch(d: usize) -> usize {
    ROW_BLOCK * round16(d) + ROW_BLOCK * KEY_CHUNK
}

/// Split mode, pass 1: one task per `(unit, chunk)` writes its rows' partials.
struct PartialTask<'a, E> {
    base: &'a Base<'a, E>,
    parts: SyncPtr<f32>,
}

impl<E: Elem> Task for PartialTask<'_, E> {
    const FLUSH_TO_ZERO: bool = true;

    fn count(&self) -> usize {
        let d = self.base.p.dims;
        d.batch * d.heads_kv * self.base.blocks * self.base.chunks
    }
    fn scratch_len(&self, _lanes: usize) -> usize {
        chunk_scratch(self.base.p.dims.d)
    }
    fn work(&self) -> usize {
        self.base.macs()
    }
    #[inline(always)]
    unsafe fn run<S: Simd>(&self, task: usize, buf: &mut [f32]) {
        let base = self.base;
        let (unit, c) = (task / base.chunks, task % base.chunks);
        let (b, hk, rows) = base.rows(unit);
        let len = ROW_BLOCK * base.stride();
        // SAFETY: task `t` owns partial floats `t·len .. (t+1)·len` (allocated by the entry
        // point for every task); no other task writes them.
        let parts = unsafe { std::slice::from_raw_parts_mut(self.parts.0.add(task * len), len) };
        // SAFETY: forwarded from the entry point's checks.
        unsafe { base.block_partial::<S>((b, hk), &rows, c, parts, buf) };
    }
}

/// Split mode, pass 2: one task per unit merges its rows' partials in chunk order.
struct CombineTask<'a, E> {
    base: &'a Base<'a, E>,
    parts: ConstPtr<f32>,
}

impl<E: Elem> Task for CombineTask<'_, E> {
    const FLUSH_TO_ZERO: bool = true;

    fn count(&self) -> usize {
        let d = self.base.p.dims;
        d.batch * d.heads_kv * self.base.blocks
    }
    fn scratch_len(&self, _lanes: usize) -> usize {
        round16(self.base.stride())
    }
    fn work(&self) -> usize {
        // One merge of a row's partial per chunk.
        let units = self.count().saturating_mul(self.base.chunks);
        units.saturating_mul(ROW_BLOCK * self.base.stride())
    }
    #[inline(always)]
    unsafe fn run<S: Simd>(&self, unit: usize, buf: &mut [f32]) {
        let base = self.base;
        let (b, _, rows) = base.rows(unit);
        let st = base.stride();
        let state = &mut buf[..st];
        for (i, row) in rows.iter().enumerate() {
            let Some(row) = *row else { continue };
            state[0] = f32::NEG_INFINITY;
            state[1..].fill(0.0);
            for c in 0..base.chunks {
                let at = ((unit * base.chunks + c) * ROW_BLOCK + i) * st;
                // SAFETY: pass 1 wrote `at..at + st` (task `unit·chunks + c`, row `i`); nothing
                // writes it now.
                let part = unsafe { std::slice::from_raw_parts(self.parts.0.add(at), st) };
                // SAFETY: both slices have `st` floats.
                unsafe { merge::<S>(state, part) };
            }
            // SAFETY: only this task writes the rows of `unit`.
            unsafe { base.finish::<S>(b, row, state) };
        }
    }
}

/// Sequential mode: one task per unit computes and merges its chunks in order.
struct SequentialTask<'a, E> {
    base: &'a Base<'a, E>,
}

impl<E: Elem> Task for SequentialTask<'_, E> {
    const FLUSH_TO_ZERO: bool = true;

    fn count(&self) -> usize {
        let d = self.base.p.dims;
        d.batch * d.heads_kv * self.base.blocks
    }
    fn scratch_len(&self, _lanes: usize) -> usize {
        2 * round16(ROW_BLOCK * self.base.stride()) + chunk_scratch(self.base.p.dims.d)
    }
    fn work(&self) -> usize {
        self.base.macs()
    }
    #[inline(always)]
    unsafe fn run<S: Simd>(&self, unit: usize, buf: &mut [f32]) {
        let base = self.base;
        let (b, hk, rows) = base.rows(unit);
        let st = base.stride();
        let mut carve = Carver::new(buf);
        let states = carve.take(ROW_BLOCK * st);
        let parts = carve.take(ROW_BLOCK * st);
        let rest = carve.take(chunk_scratch(base.p.dims.d));
        for state in states.chunks_exact_mut(st) {
            state[0] = f32::NEG_INFINITY;
            state[1..].fill(0.0);
        }
        for c in 0..base.chunks {
            // SAFETY: forwarded from the entry point's checks.
            unsafe { base.block_partial::<S>((b, hk), &rows, c, parts, rest) };
            for (state, part) in states.chunks_exact_mut(st).zip(parts.chunks_exact(st)) {
                // SAFETY: both slices have `st` floats.
                unsafe { merge::<S>(state, part) };
            }
        }
        for (row, state) in rows.iter().zip(states.chunks_exact(st)) {
            if let Some(row) = row {
                // SAFETY: only this task writes the rows of `unit`.
                unsafe { base.finish::<S>(b, *row, state) };
            }
        }
    }
}

/// The reference twin of [`decode_attention`]: a plain two-pass softmax per row in f64.
#[allow(clippy::too_many_arguments)]
pub fn decode_reference(
    p: &DecodeParams,
    q: &[f32],
    ql: Layout4,
    k: &[f32],
    kl: Layout4,
    v: &[f32],
    vl: Layout4,
    out: &mut [f32],
    ol: Layout4,
) -> Result<(), KernelError> {
    check_args(p, (q.len(), ql), (k.len(), kl), (v.len(), vl), (out.len(), ol))?;
    let d = p.dims;
    let group = (d.heads_q / d.heads_kv).max(1);
    for b in 0..d.batch {
        for h in 0..d.heads_q {
            let hk = h / group;
            for t in 0..d.rows {
                let (first, vis) = (p.first(b, t).min(p.visible(b, t)), p.visible(b, t));
                let qr = &q[ql.offset(b, h, t)..][..d.d];
                let scores: Vec<f64> = (first..vis)
                    .map(|j| {
                        let kr = &k[kl.offset(b, hk, j)..][..d.d];
                        let s: f64 = qr.iter().zip(kr).map(|(&a, &b)| a as f64 * b as f64).sum();
                        let s = s * p.scale as f64;
                        let s = p.softcap.map_or(s, |c| c as f64 * (s / c as f64).tanh());
                        let pos = p.q_pos[b].saturating_add(t) as f64;
                        s - p.alibi.map_or(0.0, |m| m[h] as f64 * (pos - j as f64).abs())
                    })
                    .collect();
                let sink = p.sinks.map_or(f64::NEG_INFINITY, |x| x[h] as f64);
                let m = scores.iter().copied().fold(sink, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let sum: f64 = w.iter().sum::<f64>() + (sink - m).exp();
                let o = &mut out[ol.offset(b, h, t)..][..d.dv];
                for (c, x) in o.iter_mut().enumerate() {
                    let acc: f64 = w
                        .iter()
                        .enumerate()
                        .map(|(j, wj)| wj * v[vl.offset(b, hk, first + j) + c] as f64)
                        .sum();
                    *x = if first == vis { 0.0 } else { (acc / sum) as f32 };
                }
            }
        }
    }
    Ok(())
}

mod tiles;

/// The keys of a chunk starting at key `start` that each row of a block sees: row `i` sees
/// `lo[i]..len[i]` (both 0 when it sees none), with its partial state in `parts` reset to
/// `(-inf, 0, 0…)` (`st` floats each).
fn chunk_spans(
    rows: &[Option<Row>; ROW_BLOCK],
    start: usize,
    parts: &mut [f32],
    st: usize,
) -> ([usize; ROW_BLOCK], [usize; ROW_BLOCK]) {
    let (mut lo, mut len) = ([0usize; ROW_BLOCK], [0usize; ROW_BLOCK]);
    for (i, part) in parts.chunks_exact_mut(st).enumerate() {
        part[0] = f32::NEG_INFINITY;
        part[1..].fill(0.0);
        len[i] = rows[i].map_or(0, |r| r.vis.min(start + KEY_CHUNK).saturating_sub(start));
        lo[i] = rows[i].map_or(0, |r| r.first.saturating_sub(start)).min(len[i]);
        if lo[i] == len[i] {
            (lo[i], len[i]) = (0, 0);
        }
    }
    (lo, len)
}

/// The runs whose rows go through the weighted sums together: a run with a hidden row (all
/// its scores -inf) goes row by row, the hidden row skipped.
fn visible_runs(
    runs: &[(usize, usize)],
    hidden: &[bool; ROW_BLOCK],
) -> ([(usize, usize); ROW_BLOCK], usize) {
    let mut visible = [(0, 0); ROW_BLOCK];
    let mut n_visible = 0;
    for &(i0, count) in runs {
        if hidden[i0..i0 + count].iter().any(|&h| h) {
            for i in (i0..i0 + count).filter(|&i| !hidden[i]) {
                visible[n_visible] = (i, 1);
                n_visible += 1;
            }
        } else {
            visible[n_visible] = (i0, count);
            n_visible += 1;
        }
    }
    (visible, n_visible)
}

#[cfg(test)]
mod tests;
