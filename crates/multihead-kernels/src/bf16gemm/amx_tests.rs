//! The AMX layout: the driver on the emulated tile kernel (and on real tiles where granted)
//! against a sequential emulation of the whole product, bit for bit; the emulated instruction
//! against the tiles' measured arithmetic (on every CPU) and against the tiles themselves at the
//! edges of the f32 range (where AMX is granted); and the kernel choice.

#![allow(clippy::unwrap_used)]

use super::amx::{tdp_element, AMX_KP};
use super::*;
use crate::testutil::rand_vec;

/// `C (+)= A·B` as tile products compute it, one element at a time: for each `k` block of the
/// driver ([`KC`] deep, its pairs rounded up to whole 16-pair tile steps with zeros), each step
/// of 16 pairs in order through [`tdp_element`].
fn amx_reference(a: BfMat, b: BfMat, c: &mut [f32], ldc: usize, accumulate: bool) {
    let (m, k, n) = (a.rows, a.cols, b.cols);
    for i in 0..m {
        for j in 0..n {
            let mut acc = if accumulate { c[i * ldc + j] } else { 0.0 };
            for p0 in (0..k).step_by(KC) {
                let kc = (k - p0).min(KC);
                let kp = kc.div_ceil(2).div_ceil(16) * 16;
                let word = |get: &dyn Fn(usize) -> u16, q: usize| {
                    let half = |e: usize| if e < kc { u32::from(get(p0 + e)) } else { 0 };
                    half(2 * q) | (half(2 * q + 1) << 16)
                };
                for q0 in (0..kp).step_by(AMX_KP) {
                    acc = tdp_element(acc, |q| {
                        (word(&|p| a.bits(i, p), q0 + q), word(&|p| b.bits(p, j), q0 + q))
                    });
                }
            }
            c[i * ldc + j] = acc;
        }
    }
}

/// The tile kernels this CPU runs: the emulation everywhere, AMX where granted.
fn tile_kernels() -> Vec<Bf16Kernel> {
    let mut v = vec![Bf16Kernel::AmxEmulated];
    if amx_available() {
        v.push(Bf16Kernel::Amx);
    } else {
        eprintln!("AMX tiles are not granted on this CPU: the driver ran on their emulation only");
    }
    v
}

fn same_bits(got: &[f32], want: &[f32], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
            "{what}: element {i}: {g:e} ({:#x}) vs {w:e} ({:#x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

#[test]
fn tile_kernels_match_the_sequential_emulation_bit_for_bit() {
    // Awkward sizes (0, 1, 15, 16, 17, 31, 33), tall and skinny, several k blocks (the last
    // short and odd), two n blocks; each after another product in the same threads, so that
    // the reused packing buffers hold stale values (the padding must be written, not assumed).
    let shapes = [
        (40, 70, 2 * KC + 17),
        // One deep block past `KC` (an f32 output not added to), over 3 row tiles a task.
        (200, 130, KC + 40),
        (5, 1030, 33),
        // Several row blocks over two n blocks: `A` rounded once for both.
        (130, 1030, 33),
        (200, 5, 40),
        (3, 300, 70),
        (0, 5, 4),
        (4, 0, 3),
        (3, 4, 0),
        (1, 1, 1),
        (15, 15, 15),
        (16, 16, 16),
        (17, 17, 17),
        (31, 33, 31),
        (33, 31, 33),
    ];
    // NaN among them: zero padding times a stale finite value would hide a missing pad.
    let dirt: Vec<f32> = rand_vec(64 * 600, 99)
        .into_iter()
        .enumerate()
        .map(|(i, x)| if i % 5 == 0 { f32::NAN } else { x })
        .collect();
    for kern in tile_kernels() {
        for (m, n, k) in shapes {
            let mut a = rand_vec(m * k, (m * k + 7) as u64);
            let mut b = rand_vec(k * n, (k * n + 8) as u64);
            if m * k > 3 && k * n > 3 {
                a[m * k / 2] = f32::NAN;
                b[k * n / 3] = f32::INFINITY;
                a[1] = 1e-39; // an f32 subnormal (its bf16 rounding is one too)
            }
            for (l, (sa, sb)) in
                [([k, 1], [1, k]), ([k, 1], [n, 1]), ([1, m], [n, 1])].into_iter().enumerate()
            {
                let av = BfMat {
                    data: Elems::F32(&a),
                    rows: m,
                    cols: k,
                    row_stride: sa[0],
                    col_stride: sa[1],
                };
                let bv = BfMat {
                    data: Elems::F32(&b),
                    rows: k,
                    cols: n,
                    row_stride: sb[0],
                    col_stride: sb[1],
                };
                let ldc = n + 2;
                let c0 = rand_vec(m * ldc, 3);
                for accumulate in [false, true] {
                    let mut want = c0.clone();
                    amx_reference(av, bv, &mut want, ldc, accumulate);
                    let mut f64_ref = c0.clone();
                    matmul_bf16_reference(av, bv, &mut f64_ref, ldc, accumulate).unwrap();
                    for threads in [1, 2, 3] {
                        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
                        let mut got = c0.clone();
                        pool.unwrap().install(|| {
                            with_bf16_kernel(kern, || {
                                // Fill this pool's packing buffers with other values first.
                                matmul_bf16_new(
                                    BfMat::f32(&dirt, 64, 600),
                                    BfMat::f32(&dirt, 600, 64),
                                )
                                .unwrap();
                                matmul_bf16(av, bv, &mut got, ldc, accumulate).unwrap()
                            })
                        });
                        let what =
                            format!("{kern:?} {m}x{n}x{k} layout {l} acc={accumulate} t={threads}");
                        same_bits(&got, &want, &what);
                    }
                    // The emulation is a product: close to the f64 sums of the rounded operands
                    // wherever those are finite (the subnormal operand reads as zero).
                    for (i, (w, r)) in want.iter().zip(&f64_ref).enumerate() {
                        if r.is_finite() {
                            assert!(
                                (w - r).abs() <= 1e-5 * k as f32 + 1e-6,
                                "{kern:?} {m}x{n}x{k} element {i}: {w} vs {r}"
                            );
                        } else {
                            assert!(
                                w.is_nan() || w == r,
                                "{kern:?} {m}x{n}x{k} element {i}: {w} vs {r}"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn tile_kernels_match_the_sequential_emulation_at_the_edges_of_f32() {
    // Products near the subnormal range (chains flushed mid-way), products overflowing to
    // infinity (and chains of opposite infinities), and a subnormal accumulator: where the
    // order and the flushing of the tiles' sums decide the bits. Random signs and exponents.
    let (m, n, k) = (33, 47, 2 * KC + 40);
    let spread = |len: usize, seed: u64, base: i32, span: i32| -> Vec<f32> {
        let e = rand_vec(len, seed ^ 0x55);
        rand_vec(len, seed)
            .into_iter()
            .zip(e)
            .map(|(x, e)| x * 2f32.powi(base + (e.abs() * span as f32) as i32))
            .collect()
    };
    let cases = [("tiny", -66, 6, 2f32.powi(-124)), ("huge", 58, 8, 1.0), ("normal", -3, 6, 1e-39)];
    for kern in tile_kernels() {
        for (what, base, span, c_scale) in cases {
            let a = spread(m * k, 11, base, span);
            let b = spread(k * n, 12, base, span);
            let av = BfMat::f32(&a, m, k);
            let bv = BfMat::f32(&b, k, n);
            let c0: Vec<f32> = rand_vec(m * n, 13).into_iter().map(|x| x * c_scale).collect();
            for accumulate in [false, true] {
                let mut want = c0.clone();
                amx_reference(av, bv, &mut want, n, accumulate);
                for threads in [1, 2] {
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
                    let mut got = c0.clone();
                    pool.unwrap()
                        .install(|| {
                            with_bf16_kernel(kern, || matmul_bf16(av, bv, &mut got, n, accumulate))
                        })
                        .unwrap();
                    same_bits(
                        &got,
                        &want,
                        &format!("{kern:?} {what} acc={accumulate} t={threads}"),
                    );
                }
            }
        }
    }
}

/// One emulated instruction on pairs `(a_k, b_k)` for `k < pairs.len()`, zeros after.
fn tdp(acc: f32, pairs: &[(u32, u32)]) -> f32 {
    tdp_element(acc, |k| pairs.get(k).copied().unwrap_or((0, 0)))
}

#[test]
fn the_emulated_instruction_follows_the_tiles_measured_arithmetic() {
    let bf = |x: f32| crate::convert::f32_to_bf16_bits(x);
    let pair = |even: f32, odd: f32| u32::from(bf(even)) | (u32::from(bf(odd)) << 16);
    let one = pair(1.0, 1.0);
    let tiny = 2f32.powi(-24);
    // The even and the odd products run in two chains: even 1 + 2^-24 = 1 (ties to even), odd
    // 2^-24 + 2^-24 = 2^-23, then 1 + 2^-23. Intel's sequential order gives 1.
    assert_eq!(tdp(0.0, &[(pair(1.0, tiny), one), (pair(tiny, tiny), one)]), 1.0 + 2.0 * tiny);
    // The accumulator comes last: 1 + (2^-24 + 2^-24). Added first, each half-ulp would be lost.
    assert_eq!(tdp(1.0, &[(pair(tiny, tiny), one)]), 1.0 + 2.0 * tiny);
    // Each chain step is fused: 2^-126 + 2^-140 is a normal number and kept exactly, though the
    // product 2^-140 alone is subnormal (and would be flushed).
    let e63 = 2f32.powi(-63);
    let e70 = 2f32.powi(-70);
    let min = f32::MIN_POSITIVE;
    let chain = [(pair(e63, 0.0), pair(e63, 0.0)), (pair(e70, 0.0), pair(e70, 0.0))];
    assert_eq!(tdp(0.0, &chain), min + 2f32.powi(-140));
    // A subnormal step is flushed to zero of its sign, and the chains start at +0: -0 survives
    // only from the last pair (after it, no +0 product turns it into +0).
    let neg = (pair(-e70, -e70), pair(e70, e70));
    let mut last = [(0, 0); 16];
    last[15] = neg;
    assert_eq!(tdp(-0.0, &last).to_bits(), 0x8000_0000);
    assert_eq!(tdp(0.0, &last).to_bits(), 0);
    assert_eq!(tdp(-0.0, &[neg]).to_bits(), 0);
    // A subnormal accumulator reads as zero, as does a subnormal bf16 input (2^-130 · 2^100
    // would be 2^-30).
    assert_eq!(tdp(1e-39, &[]).to_bits(), 0);
    let sub = 0x0010u32; // bf16 2^-130, subnormal
    assert_eq!(tdp(0.0, &[(sub, pair(2f32.powi(100), 0.0))]), 0.0);
    // NaN and infinity propagate; inf - inf is NaN, across the chains too.
    assert!(tdp(0.0, &[(pair(f32::NAN, 1.0), one)]).is_nan());
    assert!(tdp(0.0, &[(pair(f32::INFINITY, 1.0), pair(1.0, f32::NEG_INFINITY))]).is_nan());
    assert_eq!(tdp(1.0, &[(pair(f32::INFINITY, 0.0), pair(2.0, 0.0))]), f32::INFINITY);
    // Chains that overflow apart: +inf + -inf is NaN, where one chain would have kept +inf.
    let big = 2f32.powi(64);
    assert!(tdp(0.0, &[(pair(big, big), pair(big, -big))]).is_nan());
}

#[test]
fn the_kernel_choice_resolves_against_the_cpu() {
    assert_eq!(
        with_bf16_kernel(Bf16Kernel::AmxEmulated, active_bf16_kernel),
        Bf16Kernel::AmxEmulated
    );
    assert_eq!(with_bf16_kernel(Bf16Kernel::Portable, active_bf16_kernel), Bf16Kernel::Portable);
    let amx = with_bf16_kernel(Bf16Kernel::Amx, active_bf16_kernel);
    assert_eq!(amx == Bf16Kernel::Amx, amx_available(), "{amx:?}");
    let auto = with_bf16_kernel(Bf16Kernel::Auto, active_bf16_kernel);
    let vector = if bf16_dot_available()
        && crate::attention::simd_level() == crate::attention::SimdLevel::Avx512
    {
        Bf16Kernel::Avx512Bf16
    } else {
        Bf16Kernel::Portable
    };
    if AMX_BY_DEFAULT && amx_available() {
        assert_eq!(auto, Bf16Kernel::Amx);
    } else {
        assert_eq!(auto, vector);
    }
    // Not granted: AMX falls back to Auto's choice.
    if !amx_available() {
        assert_eq!(amx, vector);
    }
    // The choice is restored after the call, and is per thread.
    with_bf16_kernel(Bf16Kernel::AmxEmulated, || {
        assert_eq!(active_bf16_kernel(), Bf16Kernel::AmxEmulated);
        let other = std::thread::spawn(active_bf16_kernel).join().unwrap();
        assert_ne!(other, Bf16Kernel::AmxEmulated);
    });
    assert_eq!("amx-emulated".parse::<Bf16Kernel>(), Ok(Bf16Kernel::AmxEmulated));
    assert_eq!("AMX".parse::<Bf16Kernel>(), Ok(Bf16Kernel::Amx));
    let e = "tiles".parse::<Bf16Kernel>().unwrap_err();
    assert!(e.contains("unknown bf16 kernel \"tiles\"") && e.contains("amx-emulated"), "{e}");
}

/// A bf16 row-major `A` on cache lines is read in place by the tile kernels: the same bits as
/// the sequential emulation and as the same values packed (`A` one element off a line), for
/// f32 outputs over several `k` blocks (accumulated too) and bf16 outputs with an epilogue;
/// with row blocks that end in a partial tile (packed), rows wider than the view (NaN
/// there: a read past the depth would show), and strides that keep the packed copy.
#[test]
fn a_bf16_a_read_in_place_gives_the_packed_bits() {
    use crate::aligned::aligned_mut;
    use crate::epilogue::Act;
    // (m, n, k, row stride of A)
    let shapes = [
        (64, 70, 544, 544),
        (100, 130, 576, 608),
        (96, 64, 2 * KC + 64, 2 * KC + 64),
        (200, 300, 32, 32),
        (33, 64, 1024, 1024),
        (64, 64, 512, 512), // rows 1 KiB apart at a depth of 512: packed
        // Deeper than 2048: the bf16 output in chunks over row blocks of up to 256 rows, the
        // last one ending in a partial tile (packed a chunk at a time).
        (290, 70, 2 * KC + 64, 2 * KC + 96),
    ];
    for kern in tile_kernels() {
        for (m, n, k, rs) in shapes {
            let bits = crate::testutil::bf16_rows_nan_past(m, k, rs);
            let (mut on, mut off) = (Vec::new(), Vec::new());
            let on = aligned_mut(&mut on, bits.len()).unwrap();
            on.copy_from_slice(&bits);
            let off = &mut aligned_mut(&mut off, bits.len() + 1).unwrap()[1..];
            off.copy_from_slice(&bits);
            let (a_on, a_off) = (row_major_bf16(on, m, k, rs), row_major_bf16(off, m, k, rs));
            let expect_in_place = k > 512 || rs % 512 != 0;
            let resolved = with_bf16_kernel(kern, super::select::resolve);
            assert_eq!(
                super::driver::reads_a_in_place(resolved, &a_on),
                expect_in_place,
                "{kern:?} {m}x{n}x{k}"
            );
            assert!(!super::driver::reads_a_in_place(resolved, &a_off));
            let [b, bias, c0] = crate::testutil::gemm_operands(m, n, k);
            let bv = BfMat::f32(&b, k, n);
            for threads in [1, 2, 3] {
                let pool = crate::testutil::pool(threads);
                let what = format!("{kern:?} {m}x{n}x{k} stride {rs} t={threads}");
                for accumulate in [false, true] {
                    let mut want = c0.clone();
                    amx_reference(a_off, bv, &mut want, n, accumulate);
                    for a in [a_on, a_off] {
                        let mut got = c0.clone();
                        pool.install(|| {
                            with_bf16_kernel(kern, || matmul_bf16(a, bv, &mut got, n, accumulate))
                        })
                        .unwrap();
                        same_bits(&got, &want, &format!("{what} acc={accumulate}"));
                    }
                }
                let run = |a| {
                    pool.install(|| {
                        with_bf16_kernel(kern, || {
                            matmul_bf16_to_bf16(a, bv, Some(&bias), Act::Gelu).unwrap()
                        })
                    })
                };
                assert_eq!(run(a_on), run(a_off), "{what}: bf16 output");
            }
        }
    }
}

/// A row-major bf16 `rows × cols` view with row stride `rs`.
fn row_major_bf16(data: &[u16], rows: usize, cols: usize, rs: usize) -> BfMat<'_> {
    BfMat { data: Elems::Bf16(data), rows, cols, row_stride: rs, col_stride: 1 }
}

/// A broadcast `A` (every row the same memory: row stride 0, as a broadcast view gives) read
/// in place, and a NaN inside the rows the tiles read in place: the bits of the sequential
/// emulation, as for a packed copy.
#[test]
fn a_broadcast_or_nan_bf16_a_read_in_place_gives_the_emulated_bits() {
    use crate::aligned::aligned_mut;
    use crate::convert::f32_to_bf16_bits;
    let (m, n, k) = (96, 70, 576);
    for kern in tile_kernels() {
        let row: Vec<u16> = rand_vec(k, 7).iter().map(|&x| f32_to_bf16_bits(x)).collect();
        let mut buf = Vec::new();
        let one = aligned_mut(&mut buf, k).unwrap();
        one.copy_from_slice(&row);
        let mut full_buf = Vec::new();
        let full = aligned_mut(&mut full_buf, m * k).unwrap();
        for (i, x) in full.iter_mut().enumerate() {
            *x = row[i % k];
        }
        full[5 * k + 300] = 0x7fc0; // NaN in row 5, read in place
        let resolved = with_bf16_kernel(kern, super::select::resolve);
        let b = rand_vec(k * n, 8);
        let bv = BfMat::f32(&b, k, n);
        for a in [row_major_bf16(one, m, k, 0), row_major_bf16(full, m, k, k)] {
            assert!(super::driver::reads_a_in_place(resolved, &a), "{kern:?}");
            let mut want = vec![0f32; m * n];
            amx_reference(a, bv, &mut want, n, false);
            for threads in [1, 2] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let mut got = vec![0f32; m * n];
                pool.install(|| with_bf16_kernel(kern, || matmul_bf16(a, bv, &mut got, n, false)))
                    .unwrap();
                same_bits(&got, &want, &format!("{kern:?} stride {} t={threads}", a.row_stride));
            }
            if a.row_stride == k {
                assert!(want[5 * n..6 * n].iter().all(|x| x.is_nan()), "the NaN row");
                assert!(want[..5 * n].iter().all(|x| x.is_finite()), "the rows before it");
            }
        }
    }
}
