//! The decode kernel against its reference twin: every SIMD level, thread counts, modes.

#![allow(clippy::unwrap_used)]

use super::*;
use crate::attention::with_simd_level;
use crate::testutil::{levels, rand_vec};

/// One decode problem with its buffers (contiguous layouts).
struct Case {
    dims: DecodeDims,
    causal: bool,
    kv_len: Vec<usize>,
    q_pos: Vec<usize>,
    q_len: Vec<usize>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    softcap: Option<f32>,
    sinks: Option<Vec<f32>>,
    alibi: Option<Vec<f32>>,
    window: Option<usize>,
}

impl Case {
    fn new(dims: DecodeDims, causal: bool, kv_len: Vec<usize>, seed: u64) -> Self {
        let d = dims;
        let q_pos = kv_len.iter().map(|&n| n.saturating_sub(d.rows)).collect();
        let q_len = kv_len.iter().map(|&n| n.min(d.rows)).collect();
        Case {
            dims,
            causal,
            kv_len,
            q_pos,
            q_len,
            q: rand_vec(d.batch * d.heads_q * d.rows * d.d, seed),
            k: rand_vec(d.batch * d.heads_kv * d.capacity * d.d, seed + 1),
            v: rand_vec(d.batch * d.heads_kv * d.capacity * d.dv, seed + 2),
            softcap: None,
            sinks: None,
            alibi: None,
            window: None,
        }
    }
    fn params(&self) -> DecodeParams<'_> {
        DecodeParams {
            dims: self.dims,
            scale: 0.7 / (self.dims.d as f32).sqrt(),
            causal: self.causal,
            kv_len: &self.kv_len,
            q_pos: &self.q_pos,
            q_len: &self.q_len,
            softcap: self.softcap,
            sinks: self.sinks.as_deref(),
            alibi: self.alibi.as_deref(),
            window: self.window,
        }
    }
    fn layouts(&self) -> [Layout4; 4] {
        let d = self.dims;
        [
            Layout4::contiguous(d.heads_q, d.rows, d.d),
            Layout4::contiguous(d.heads_kv, d.capacity, d.d),
            Layout4::contiguous(d.heads_kv, d.capacity, d.dv),
            Layout4::contiguous(d.heads_q, d.rows, d.dv),
        ]
    }
    fn out_len(&self) -> usize {
        let d = self.dims;
        d.batch * d.heads_q * d.rows * d.dv
    }
    fn run(&self, sequential: bool) -> Vec<f32> {
        let [ql, kl, vl, ol] = self.layouts();
        let mut out = vec![f32::NAN; self.out_len()];
        decode_impl(
            &self.params(),
            (&self.q, ql),
            (&self.k, kl),
            (&self.v, vl),
            (&mut out, ol),
            sequential,
        )
        .unwrap();
        out
    }
    fn reference(&self) -> Vec<f32> {
        let [ql, kl, vl, ol] = self.layouts();
        let mut out = vec![f32::NAN; self.out_len()];
        decode_reference(&self.params(), &self.q, ql, &self.k, kl, &self.v, vl, &mut out, ol)
            .unwrap();
        out
    }
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    let mut seed = 1;
    for (hq, hk) in [(4, 4), (6, 2), (3, 1)] {
        for rows in [1, 3, 9] {
            for (d, dv) in [(8, 8), (64, 64), (19, 33), (24, 80)] {
                for causal in [false, true] {
                    let dims = DecodeDims {
                        batch: 3,
                        heads_q: hq,
                        heads_kv: hk,
                        rows,
                        capacity: 600,
                        d,
                        dv,
                    };
                    // Empty, tiny, at the chunk boundaries, and full.
                    let kv =
                        [[0, 1, 255], [256, 257, 600], [rows.min(600), 2, 513]][seed % 3].to_vec();
                    out.push(Case::new(dims, causal, kv, seed as u64));
                    seed += 1;
                }
            }
        }
    }
    out
}

/// `case` at every SIMD level, in both modes (split across chunks and sequential), within
/// `tol` of the reference.
fn assert_matches_reference(case: &Case, tol: f32) {
    let want = case.reference();
    for level in levels() {
        for sequential in [false, true] {
            let got = with_simd_level(level, || case.run(sequential));
            let err = max_diff(&got, &want);
            let (d, w, m) = (case.dims, case.window, &case.alibi);
            assert!(err <= tol, "{d:?} window {w:?} alibi {m:?} {level:?} seq={sequential}: {err}");
        }
    }
}

/// A soft cap and sinks (gpt-oss, Gemma 2) against the reference, in both modes (split across
/// chunks and sequential), with grouped heads, a sink of -inf (none) and a large one.
#[test]
fn softcap_and_sinks_match_the_reference() {
    for (n, mut case) in cases().into_iter().enumerate().filter(|(n, _)| n % 5 == 0) {
        let hq = case.dims.heads_q;
        case.softcap = (n % 2 == 0).then_some(0.8);
        let pool = [0.5f32, -2.0, f32::NEG_INFINITY, 6.0, 0.0, 1.5];
        case.sinks = Some((0..hq).map(|h| pool[(h + n) % pool.len()]).collect());
        assert_matches_reference(&case, 3e-6);
    }
}

/// Caps so large that `s/c` is subnormal for small scores, which the kernels' flush-to-zero
/// would make 0: the capped score must stay `s` (an adversarial sweep found the scalar tail of
/// a row losing them, 0.37 off at a cap of 1e38), at every SIMD level.
#[test]
fn huge_soft_caps_keep_small_scores() {
    for (n, mut case) in cases().into_iter().enumerate().filter(|(n, _)| n % 4 == 3) {
        case.softcap = Some([1e30, 1e36, 1e37, 3e38][n % 4]);
        assert_matches_reference(&case, 3e-6);
    }
}

/// ALiBi slopes against the reference, alone and with a soft cap and sinks, in both modes,
/// causal or not, with grouped heads and rows that start past the first chunk.
#[test]
fn alibi_matches_the_reference() {
    for (n, mut case) in cases().into_iter().enumerate().filter(|(n, _)| n % 4 == 1) {
        let hq = case.dims.heads_q;
        case.alibi = Some((0..hq).map(|h| 2f32.powi(-(h as i32 + n as i32 % 3))).collect());
        case.softcap = (n % 3 == 0).then_some(1.5);
        case.sinks = (n % 2 == 0).then(|| (0..hq).map(|h| h as f32 - 1.0).collect());
        assert_matches_reference(&case, 3e-6);
    }
}

/// A left window over a full cache against the reference: narrower than a chunk, across chunk
/// boundaries, zero (the row's own key only), wider than the cache; causal or not, with ALiBi
/// and sinks, in both modes.
#[test]
fn windows_match_the_reference() {
    let windows = [Some(0), Some(1), Some(37), Some(511), Some(513), Some(usize::MAX)];
    for (n, mut case) in cases().into_iter().enumerate().filter(|(n, _)| n % 3 == 2) {
        let hq = case.dims.heads_q;
        case.window = windows[n % windows.len()];
        case.alibi = (n % 4 == 0).then(|| (0..hq).map(|h| 0.1 * (h + 1) as f32).collect());
        case.sinks = (n % 5 == 0).then(|| vec![0.25; hq]);
        assert_matches_reference(&case, 3e-6);
    }
}

/// Slopes so large that the bias of distant keys overflows to -inf: those keys get no
/// weight (the chunks they fill give nothing), as in the f64 reference, not NaN.
#[test]
fn an_overflowing_alibi_bias_hides_keys_instead_of_giving_nan() {
    let dims =
        DecodeDims { batch: 1, heads_q: 2, heads_kv: 1, rows: 2, capacity: 1100, d: 8, dv: 8 };
    let mut case = Case::new(dims, true, vec![1100], 13);
    case.alibi = Some(vec![1e36, 0.5]);
    let want = case.reference();
    for level in levels() {
        for sequential in [false, true] {
            let got = with_simd_level(level, || case.run(sequential));
            assert!(got.iter().all(|x| x.is_finite()), "{level:?}: {got:?}");
            assert!(max_diff(&got, &want) <= 2e-6, "{level:?} sequential={sequential}");
        }
    }
}

/// Keys before a row's window are never read: NaN there changes nothing.
#[test]
fn keys_before_the_window_are_never_read() {
    let dims =
        DecodeDims { batch: 1, heads_q: 2, heads_kv: 1, rows: 3, capacity: 1200, d: 8, dv: 8 };
    let mut case = Case::new(dims, true, vec![1200], 11);
    case.window = Some(100);
    let clean = case.run(false);
    // Row 0 sits at position 1197 and sees keys 1097.. ; everything before is poisoned.
    for j in 0..1097 {
        case.k[j * 8] = f32::NAN;
        case.v[j * 8 + 1] = f32::INFINITY;
    }
    let got = case.run(false);
    assert!(got.iter().zip(&clean).all(|(a, b)| a.to_bits() == b.to_bits()));
    assert!(max_diff(&got, &case.reference()) <= 2e-6);
}

#[test]
fn decode_matches_the_reference_at_every_simd_level() {
    for case in cases() {
        let want = case.reference();
        for level in levels() {
            let got = with_simd_level(level, || case.run(false));
            let err = max_diff(&got, &want);
            assert!(
                err <= 2e-6,
                "{:?} causal={} {level:?}: max diff {err}",
                case.dims,
                case.causal
            );
        }
    }
}

/// A bfloat16 cache gives the bits of the f32 kernel on its widened copy, at every level,
/// in both modes, with head dimensions that leave vector tails (19, 33).
#[test]
fn a_bf16_cache_gives_the_bits_of_the_f32_kernel_on_its_widened_copy() {
    let round = |xs: &[f32]| -> (Vec<u16>, Vec<f32>) {
        let bits: Vec<u16> = xs.iter().map(|&x| crate::convert::f32_to_bf16_bits(x)).collect();
        let wide = bits.iter().map(|&b| crate::convert::bf16_bits_to_f32(b)).collect();
        (bits, wide)
    };
    for mut case in cases().into_iter().step_by(3) {
        let (kb, kw) = round(&case.k);
        let (vb, vw) = round(&case.v);
        case.k = kw;
        case.v = vw;
        let [ql, kl, vl, ol] = case.layouts();
        for level in levels() {
            for sequential in [false, true] {
                let want = with_simd_level(level, || case.run(sequential));
                let mut got = vec![f32::NAN; case.out_len()];
                with_simd_level(level, || {
                    decode_impl(
                        &case.params(),
                        (&case.q, ql),
                        (&kb, kl),
                        (&vb, vl),
                        (&mut got, ol),
                        sequential,
                    )
                })
                .unwrap();
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{:?} {level:?} sequential={sequential}", case.dims);
            }
        }
        // And the public entry point checks the bf16 slices' lengths like the f32 ones.
        let mut out = vec![0f32; case.out_len()];
        let short = decode_attention_bf16(
            &case.params(),
            &case.q,
            ql,
            &kb[..kb.len() - 1],
            kl,
            &vb,
            vl,
            &mut out,
            ol,
        );
        assert!(matches!(short, Err(KernelError::SliceTooShort { name: "k", .. })));
    }
}

#[test]
fn split_and_sequential_modes_and_thread_counts_give_the_same_bits() {
    for case in cases().iter().step_by(5) {
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let want = one.install(|| case.run(false));
        for threads in [2, 3] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for sequential in [false, true] {
                let got = pool.install(|| case.run(sequential));
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{:?}: {threads} threads, sequential={sequential}", case.dims);
            }
        }
    }
}

#[test]
fn rows_decoded_one_at_a_time_equal_rows_decoded_together() {
    // A causal prefill of 5 rows over a cache of 300 (positions 295..300) ...
    let dims =
        DecodeDims { batch: 2, heads_q: 4, heads_kv: 2, rows: 5, capacity: 300, d: 16, dv: 16 };
    let all = Case::new(dims, true, vec![300, 300], 7);
    let together = all.run(false);
    // ... equals five single-row calls, each seeing the cache up to its own position.
    let [ql, kl, vl, _] = all.layouts();
    for t in 0..5 {
        let one = DecodeDims { rows: 1, ..dims };
        let q1: Vec<f32> = (0..2 * 4)
            .flat_map(|bh| {
                let (b, h) = (bh / 4, bh % 4);
                all.q[ql.offset(b, h, t)..][..16].to_vec()
            })
            .collect();
        let kv_len = vec![296 + t; 2];
        let (q_pos, q_len) = (vec![295 + t; 2], vec![1; 2]);
        let p = DecodeParams {
            dims: one,
            kv_len: &kv_len,
            q_pos: &q_pos,
            q_len: &q_len,
            ..all.params()
        };
        let ol = Layout4::contiguous(4, 1, 16);
        let mut out = vec![0f32; 2 * 4 * 16];
        decode_attention(&p, &q1, ol, &all.k, kl, &all.v, vl, &mut out, ol).unwrap();
        for bh in 0..8 {
            let got = &out[bh * 16..][..16];
            let want = &together[(bh * 5 + t) * 16..][..16];
            let same = got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "row {t}, batch·head {bh}: {got:?} != {want:?}");
        }
    }
}

#[test]
fn padding_rows_are_zero_and_keys_past_the_length_are_never_read() {
    let dims = DecodeDims { batch: 2, heads_q: 2, heads_kv: 2, rows: 3, capacity: 40, d: 8, dv: 8 };
    let mut case = Case::new(dims, true, vec![10, 30], 3);
    case.q_len = vec![1, 3];
    case.q_pos = vec![9, 27];
    let clean = case.run(false);
    // NaN past each entry's length changes nothing.
    let kl = Layout4::contiguous(2, 40, 8);
    for h in 0..2 {
        for (b, n) in [(0, 10), (1, 30)] {
            for j in n..40 {
                case.k[kl.offset(b, h, j)] = f32::NAN;
                case.v[kl.offset(b, h, j)] = f32::NAN;
            }
        }
    }
    let got = case.run(false);
    assert!(got.iter().zip(&clean).all(|(a, b)| a.to_bits() == b.to_bits()));
    // Rows 1 and 2 of entry 0 are padding.
    let ol = Layout4::contiguous(2, 3, 8);
    for h in 0..2 {
        for t in 1..3 {
            assert!(got[ol.offset(0, h, t)..][..8].iter().all(|&x| x == 0.0));
        }
    }
    assert!(max_diff(&got, &case.reference()) <= 2e-6);
}

#[test]
fn a_nan_key_in_view_makes_its_rows_nan() {
    let dims =
        DecodeDims { batch: 1, heads_q: 2, heads_kv: 1, rows: 1, capacity: 300, d: 8, dv: 8 };
    let mut case = Case::new(dims, false, vec![300], 5);
    case.k[270 * 8 + 3] = f32::NAN;
    for level in levels() {
        let got = with_simd_level(level, || case.run(false));
        assert!(got.iter().all(|x| x.is_nan()), "{level:?}: {got:?}");
    }
}

/// A chunk whose only visible key is NaN gives NaN, not the empty chunk of an all -inf one.
#[test]
fn a_lone_nan_key_makes_its_row_nan() {
    let dims = DecodeDims { batch: 1, heads_q: 1, heads_kv: 1, rows: 1, capacity: 4, d: 8, dv: 8 };
    let mut case = Case::new(dims, true, vec![1], 5);
    case.k[2] = f32::NAN;
    for level in levels() {
        for sequential in [false, true] {
            let got = with_simd_level(level, || case.run(sequential));
            assert!(got.iter().all(|x| x.is_nan()), "{level:?}: {got:?}");
        }
    }
}

#[test]
fn bad_arguments_are_errors() {
    let dims = DecodeDims { batch: 2, heads_q: 4, heads_kv: 3, rows: 1, capacity: 8, d: 4, dv: 4 };
    let case = Case::new(DecodeDims { heads_kv: 2, ..dims }, false, vec![8, 8], 1);
    let [ql, kl, vl, ol] = case.layouts();
    let mut out = vec![0f32; case.out_len()];
    let mut call = |p: &DecodeParams, k: &[f32]| {
        decode_attention(p, &case.q, ql, k, kl, &case.v, vl, &mut out, ol).unwrap_err()
    };
    let p = DecodeParams { dims, ..case.params() };
    assert!(matches!(call(&p, &case.k), KernelError::InvalidHeads { .. }));
    let long = [9, 8];
    let p = DecodeParams { kv_len: &long, ..case.params() };
    assert!(call(&p, &case.k).to_string().contains("holds 9 keys"));
    let short = [8];
    let p = DecodeParams { kv_len: &short, ..case.params() };
    assert!(call(&p, &case.k).to_string().contains("1 entries for a batch of 2"));
    let (few, nan) = ([0.5f32; 3], [0.5f32, f32::NAN, 0.1, 0.2]);
    for slopes in [&few[..], &nan[..]] {
        let p = DecodeParams { alibi: Some(slopes), ..case.params() };
        let e = call(&p, &case.k);
        assert!(matches!(e, KernelError::InvalidArgument { name: "alibi", .. }), "{e}");
    }
    let p = case.params();
    assert!(matches!(call(&p, &case.k[1..]), KernelError::SliceTooShort { name: "k", .. }));
}

/// Rows that share their keys (the query heads of a grouped-query kv head, the rows of a
/// prefill without a causal rule) are register-tiled together; each row must still get the
/// bits it gets alone: one call per `(batch, head, row)` over a one-head copy of its cache.
#[test]
fn tiled_rows_give_the_bits_of_each_row_alone() {
    let mut seed = 40;
    for (hq, hk, rows, causal) in [
        (8, 1, 1, false),
        (6, 2, 3, false),
        (3, 1, 2, true),
        (5, 5, 9, false),
        (2, 2, 11, true),
        (4, 2, 6, true),
    ] {
        for (d, dv) in [(64, 64), (19, 33), (24, 80)] {
            let dims =
                DecodeDims { batch: 2, heads_q: hq, heads_kv: hk, rows, capacity: 700, d, dv };
            let mut case = Case::new(dims, causal, vec![700, 530], seed);
            seed += 1;
            // A window puts the first visible key inside a sub-block (runs with `lo > 0`).
            case.window = (seed % 2 == 0).then_some(333);
            match seed % 3 {
                0 => case.softcap = Some(1.5),
                1 => case.alibi = Some((0..hq).map(|h| 0.01 * (h + 1) as f32).collect()),
                _ => case.sinks = Some((0..hq).map(|h| h as f32 * 0.3 - 1.0).collect()),
            }
            let [ql, kl, vl, ol] = case.layouts();
            for level in levels() {
                let together = with_simd_level(level, || case.run(false));
                for (b, h, t) in (0..2)
                    .flat_map(|b| (0..hq).flat_map(move |h| (0..rows).map(move |t| (b, h, t))))
                {
                    let kvh = h / (hq / hk);
                    let one = DecodeDims { batch: 1, heads_q: 1, heads_kv: 1, rows: 1, ..dims };
                    let q = case.q[ql.offset(b, h, t)..][..d].to_vec();
                    let k = case.k[kl.offset(b, kvh, 0)..][..700 * d].to_vec();
                    let v = case.v[vl.offset(b, kvh, 0)..][..700 * dv].to_vec();
                    let (kv_len, q_pos, q_len) =
                        ([case.kv_len[b]], [case.q_pos[b] + t], [usize::from(t < case.q_len[b])]);
                    let (sinks, alibi) =
                        (case.sinks.as_ref().map(|x| [x[h]]), case.alibi.as_ref().map(|x| [x[h]]));
                    let mut p = DecodeParams::new(one, &kv_len, &q_pos, &q_len);
                    (p.scale, p.causal, p.softcap) = (case.params().scale, causal, case.softcap);
                    p.window = case.window;
                    (p.sinks, p.alibi) =
                        (sinks.as_ref().map(|x| &x[..]), alibi.as_ref().map(|x| &x[..]));
                    let mut out = vec![f32::NAN; dv];
                    let (l1q, l1k, l1v) = (
                        Layout4::contiguous(1, 1, d),
                        Layout4::contiguous(1, 700, d),
                        Layout4::contiguous(1, 700, dv),
                    );
                    with_simd_level(level, || {
                        decode_attention(
                            &p,
                            &q,
                            l1q,
                            &k,
                            l1k,
                            &v,
                            l1v,
                            &mut out,
                            Layout4::contiguous(1, 1, dv),
                        )
                    })
                    .unwrap();
                    let want = &together[ol.offset(b, h, t)..][..dv];
                    let same = out.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{dims:?} causal={causal} window={:?} {level:?} row ({b}, {h}, {t})",
                        case.window
                    );
                }
            }
        }
    }
}

/// The vector ALiBi bias gives the bits of the one-score-at-a-time f64 distances at every
/// level: keys before and after the row, distances up to and past 2^24, ragged tails.
#[test]
fn vector_alibi_gives_the_bits_of_the_f64_distances() {
    use crate::attention::simd::{Scalar, Simd};
    use crate::attention::SimdLevel;
    fn run_at<S: Simd>(x: &mut [f32], m: f32, pos: usize, start: usize) {
        // SAFETY: only called at a level the CPU supports.
        unsafe { add_alibi::<S>(x, m, pos, start) }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn run512(x: &mut [f32], m: f32, pos: usize, start: usize) {
        run_at::<crate::attention::simd::Avx512>(x, m, pos, start)
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run256(x: &mut [f32], m: f32, pos: usize, start: usize) {
        run_at::<crate::attention::simd::Avx2>(x, m, pos, start)
    }
    let big = 1usize << 24;
    for (pos, start, n) in [
        (300, 0, 301),
        (10, 0, 37),
        (5, 100, 17),
        (big - 3, big - 40, 37),
        (big - 1, big - 512, 512),
        (big + 5, big - 7, 19),
        (3 * big + 1, 3, 33),
    ] {
        for m in [-0.5f32, -0.0123, -3.0e-7] {
            let scores: Vec<f32> = (0..n).map(|j| (j as f32 * 0.37).sin()).collect();
            let want: Vec<f32> = scores
                .iter()
                .enumerate()
                .map(|(j, &s)| s + (pos as f64 - (start + j) as f64).abs() as f32 * m)
                .collect();
            for level in levels() {
                let mut got = scores.clone();
                match level {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `levels()` only yields supported levels.
                    SimdLevel::Avx512 => unsafe { run512(&mut got, m, pos, start) },
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: as above.
                    SimdLevel::Avx2 => unsafe { run256(&mut got, m, pos, start) },
                    _ => run_at::<Scalar>(&mut got, m, pos, start),
                }
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{level:?} pos {pos} start {start} n {n} slope {m}");
            }
        }
    }
}

/// Causal prefill rows share a tile although they end at different keys: a NaN key or value
/// that only the later rows see makes those rows NaN and leaves the earlier ones finite (the
/// tile computes the shorter rows' scores past their end but never uses them).
#[test]
fn a_nan_past_a_tiled_rows_end_stays_out_of_it() {
    let dims =
        DecodeDims { batch: 1, heads_q: 1, heads_kv: 1, rows: 8, capacity: 40, d: 16, dv: 16 };
    for in_key in [true, false] {
        let mut case = Case::new(dims, true, vec![40], 9);
        // Rows sit at positions 32..40; key 35 is seen by rows 3.. only.
        let at = 35 * 16 + 5;
        if in_key {
            case.k[at] = f32::NAN;
        } else {
            case.v[at] = f32::NAN;
        }
        for level in levels() {
            let got = with_simd_level(level, || case.run(false));
            for (t, row) in got.chunks(16).enumerate() {
                let nan = if in_key { row.iter().all(|x| x.is_nan()) } else { row[5].is_nan() };
                let finite = row.iter().all(|x| x.is_finite());
                assert!(
                    if t < 3 { finite } else { nan },
                    "{level:?} key={in_key} row {t}: {row:?}"
                );
            }
        }
    }
}
