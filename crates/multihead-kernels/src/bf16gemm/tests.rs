#![allow(clippy::unwrap_used)]

use super::*;
use crate::attention::{with_simd_level, SimdLevel};
use crate::convert::f32_to_bf16_bits;
use crate::testutil::{levels, rand_vec};

/// The three layouts `multihead` would use: `x·Wᵀ`, `dy·W` and `dyᵀ·x`, as
/// `(a strides, b strides)` over row-major data.
fn layouts(m: usize, n: usize, k: usize) -> [([usize; 2], [usize; 2]); 3] {
    [([k, 1], [1, k]), ([k, 1], [n, 1]), ([1, m], [n, 1])]
}

fn view<'a>(data: Elems<'a>, rows: usize, cols: usize, s: [usize; 2]) -> BfMat<'a> {
    BfMat { data, rows, cols, row_stride: s[0], col_stride: s[1] }
}

/// `|x - y| <= tol · (1 + Σ|a||b|)` per element (f32 summation error against f64), NaN
/// where both are NaN.
fn assert_close(got: &[f32], want: &[f32], scale: &[f32], tol: f32, what: &str) {
    for (i, ((g, w), s)) in got.iter().zip(want).zip(scale).enumerate() {
        if g.is_nan() && w.is_nan() {
            continue;
        }
        assert!((g - w).abs() <= tol * (1.0 + s), "{what}: element {i}: {g} vs {w}");
    }
}

/// `Σ_p |a_ip||b_pj|` of the rounded operands (the scale of the summation error).
fn abs_products(a: BfMat, b: BfMat, ldc: usize) -> Vec<f32> {
    let abs = |x: &[f32]| x.iter().map(|v| v.abs()).collect::<Vec<_>>();
    let (fa, fb) = match (a.data, b.data) {
        (Elems::F32(x), Elems::F32(y)) => (abs(x), abs(y)),
        _ => unreachable!("f32 operands only"),
    };
    let mut out = vec![0f32; a.rows * ldc];
    let av = BfMat { data: Elems::F32(&fa), ..a };
    let bv = BfMat { data: Elems::F32(&fb), ..b };
    matmul_bf16_reference(av, bv, &mut out, ldc, false).unwrap();
    out
}

#[test]
fn matches_the_reference_for_every_layout_level_and_thread_count() {
    // Awkward sizes: edge tiles both ways, odd k, several k blocks (the last one odd and
    // short), one row, more columns than one n block (NC = 1024), with one row block and
    // with several (`A` then rounded once for all n blocks).
    let shapes = [
        (1, 1, 1),
        (13, 65, 7),
        (25, 47, 385),
        (7, 1030, 64),
        (130, 1030, 40),
        (200, 35, 193),
        (3, 200, 2),
        (9, 40, 2 * super::KC + 3),
        // Several row blocks over two depth blocks (a transposed `A` packed for every row
        // block of a depth block at once).
        (200, 70, super::KC + 37),
    ];
    for (m, n, k) in shapes {
        let a = rand_vec(m * k, (m * k) as u64);
        let b = rand_vec(k * n, (k * n + 1) as u64);
        for (sa, sb) in layouts(m, n, k) {
            let (av, bv) = (view(Elems::F32(&a), m, k, sa), view(Elems::F32(&b), k, n, sb));
            let ldc = n + 3;
            let c0 = rand_vec(m * ldc, 11);
            let scale = abs_products(av, bv, ldc);
            for accumulate in [false, true] {
                let mut want = c0.clone();
                matmul_bf16_reference(av, bv, &mut want, ldc, accumulate).unwrap();
                let mut first: Option<Vec<f32>> = None;
                for level in levels() {
                    for threads in [1, 2, 3] {
                        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
                        let mut got = c0.clone();
                        pool.unwrap().install(|| {
                            with_simd_level(level, || {
                                matmul_bf16(av, bv, &mut got, ldc, accumulate).unwrap()
                            })
                        });
                        let what = format!(
                            "{m}x{n}x{k} {sa:?}/{sb:?} acc={accumulate} {level:?} t={threads}"
                        );
                        assert_close(&got, &want, &scale, 2e-6 * k as f32, &what);
                        // Padding columns of C are never written.
                        for i in 0..m {
                            assert_eq!(
                                &got[i * ldc + n..(i + 1) * ldc],
                                &c0[i * ldc + n..(i + 1) * ldc]
                            );
                        }
                        // The same result for every thread count (the order does not move).
                        if threads == 1 {
                            first = Some(got);
                        } else {
                            assert_eq!(Some(&got), first.as_ref(), "{what}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_small_product_gives_the_same_bits_on_the_calling_thread_as_on_the_pool() {
    // Below the serial threshold the tasks run in order on the calling thread, with the row
    // blocks of one thread; sent to a pool of three they must give the same bits, in every
    // layout, f32 and bf16 outputs, with a bias and an activation (several row blocks and
    // column parts, two depth blocks).
    use crate::epilogue::Act;
    let (m, n, k) = (40, 9, super::KC + 37);
    assert!(m * n * k < 1 << 19);
    let a = rand_vec(m * k, 41);
    let b = rand_vec(k * n, 42);
    let bias = rand_vec(n, 43);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
    let run = |forced: bool, sa, sb| {
        let (av, bv) = (view(Elems::F32(&a), m, k, sa), view(Elems::F32(&b), k, n, sb));
        pool.install(|| {
            driver::FORCE_PARALLEL.with(|f| f.set(forced));
            let f32_out = matmul_bf16_new_with(av, bv, Some(&bias), Act::Relu).unwrap();
            let bf16_out = matmul_bf16_to_bf16(av, bv, Some(&bias), Act::Gelu).unwrap();
            driver::FORCE_PARALLEL.with(|f| f.set(false));
            (f32_out, bf16_out)
        })
    };
    for (sa, sb) in layouts(m, n, k) {
        let (serial, parallel) = (run(false, sa, sb), run(true, sa, sb));
        assert_eq!(serial.0, parallel.0, "f32 output, {sa:?}/{sb:?}");
        assert_eq!(serial.1, parallel.1, "bf16 output, {sa:?}/{sb:?}");
        let reference = {
            let (av, bv) = (view(Elems::F32(&a), m, k, sa), view(Elems::F32(&b), k, n, sb));
            let mut c = vec![0f32; m * n];
            matmul_bf16_reference(av, bv, &mut c, n, false).unwrap();
            c
        };
        // The ReLU output over the bias-free reference plus the bias, within f32 summation.
        for (i, (&g, &r)) in serial.0.iter().zip(&reference).enumerate() {
            let want = (r + bias[i % n]).max(0.0);
            assert!((g - want).abs() <= 1e-3 * (1.0 + want.abs()), "element {i}: {g} vs {want}");
        }
    }
}

#[test]
fn bf16_operands_give_what_their_f32_values_give() {
    // Every layout (the transposing packers read bf16 runs as they read f32 ones), with rows,
    // pairs and columns that cross the packers' 16-row, 16-pair and 16-column groups.
    let (m, n, k) = (37, 70, 203);
    let a = rand_vec(m * k, 5).iter().map(|&x| f32_to_bf16_bits(x * 3.0)).collect::<Vec<_>>();
    let w = rand_vec(n * k, 6).iter().map(|&x| f32_to_bf16_bits(x)).collect::<Vec<_>>();
    let wide =
        |v: &[u16]| v.iter().map(|&b| crate::convert::bf16_bits_to_f32(b)).collect::<Vec<_>>();
    let (a32, w32) = (wide(&a), wide(&w));
    for (l, (sa, sb)) in layouts(m, n, k).into_iter().enumerate() {
        let mut from_bits = vec![0f32; m * n];
        let mut from_f32 = vec![0f32; m * n];
        let (ab, bb) = (view(Elems::Bf16(&a), m, k, sa), view(Elems::Bf16(&w), k, n, sb));
        let (af, bf) = (view(Elems::F32(&a32), m, k, sa), view(Elems::F32(&w32), k, n, sb));
        matmul_bf16(ab, bb, &mut from_bits, n, false).unwrap();
        matmul_bf16(af, bf, &mut from_f32, n, false).unwrap();
        assert_eq!(from_bits, from_f32, "layout {l}");
    }
}

#[test]
fn rounds_f32_operands_to_nearest_even_bf16() {
    // 1 + 2^-8 is halfway between two bf16 values and rounds to 1 (even); 1 + 3·2^-8 rounds
    // up to 1 + 2^-6; the product with 1.0 shows what each operand became.
    let x = [1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0];
    let one = [1.0f32];
    let mut y = [0f32; 2];
    matmul_bf16(BfMat::f32(&x, 2, 1), BfMat::f32(&one, 1, 1), &mut y, 1, false).unwrap();
    assert_eq!(y, [1.0, 1.0 + 1.0 / 64.0]);
}

#[test]
fn propagates_nan_and_infinity_and_agrees_across_kernels_on_normal_numbers() {
    let (m, n, k) = (8, 64, 10);
    let mut a = rand_vec(m * k, 1);
    let b = rand_vec(k * n, 2);
    a[3] = f32::NAN; // row 0
    a[k + 2] = f32::INFINITY; // row 1
    let mut got = vec![0f32; m * n];
    let mut portable = vec![0f32; m * n];
    matmul_bf16(BfMat::f32(&a, m, k), BfMat::f32(&b, k, n), &mut got, n, false).unwrap();
    with_simd_level(SimdLevel::Scalar, || {
        matmul_bf16(BfMat::f32(&a, m, k), BfMat::f32(&b, k, n), &mut portable, n, false).unwrap()
    });
    assert!(got[..n].iter().all(|x| x.is_nan()));
    assert!(got[n..2 * n].iter().all(|x| x.is_infinite() || x.is_nan()));
    for (g, p) in got.iter().zip(&portable) {
        assert!(g.to_bits() == p.to_bits() || (g.is_nan() && p.is_nan()), "{g} vs {p}");
    }
}

#[test]
fn bad_arguments_are_errors() {
    let a = [0f32; 6];
    let mut c = [0f32; 4];
    let e = matmul_bf16(BfMat::f32(&a, 2, 3), BfMat::f32(&a, 2, 3), &mut c, 2, false);
    assert!(matches!(e, Err(KernelError::InvalidArgument { name: "b", .. })), "{e:?}");
    let e = matmul_bf16(BfMat::f32(&a, 2, 3), BfMat::f32(&a, 3, 2), &mut c[..3], 2, false);
    assert!(matches!(e, Err(KernelError::SliceTooShort { name: "c", .. })), "{e:?}");
    let e = matmul_bf16(BfMat::f32(&a[..5], 2, 3), BfMat::f32(&a, 3, 2), &mut c, 2, false);
    assert!(matches!(e, Err(KernelError::SliceTooShort { name: "a", .. })), "{e:?}");
    let e = matmul_bf16(BfMat::f32(&a, 2, 3), BfMat::f32(&a, 3, 2), &mut c, 1, false);
    assert!(matches!(e, Err(KernelError::OverlappingOutput { name: "c" })), "{e:?}");
    let huge = BfMat { row_stride: usize::MAX, ..BfMat::f32(&a, 2, 3) };
    let e = matmul_bf16(huge, BfMat::f32(&a, 3, 2), &mut c, 2, false);
    assert!(matches!(e, Err(KernelError::Overflow { name: "a" })), "{e:?}");
    // k = 0: C is zeroed, or kept when accumulating.
    let mut c = [5f32; 4];
    matmul_bf16(BfMat::f32(&[], 2, 0), BfMat::f32(&[], 0, 2), &mut c, 2, true).unwrap();
    assert_eq!(c, [5.0; 4]);
    matmul_bf16(BfMat::f32(&[], 2, 0), BfMat::f32(&[], 0, 2), &mut c, 2, false).unwrap();
    assert_eq!(c, [0.0; 4]);
}

#[test]
fn the_rate_is_measured_where_the_instruction_exists() {
    assert_eq!(bf16_dot_speedup().is_some(), bf16_dot_available());
    if let Some(r) = bf16_dot_speedup() {
        assert!(r.is_finite() && r > 0.05 && r < 20.0, "speedup {r}");
    }
}

#[test]
fn a_new_output_is_the_product_into_zeros_bit_for_bit() {
    // Edge tiles both ways, several k blocks, one row, k = 0 and empty outputs, every layout,
    // at every SIMD level: the unzeroed buffer must hold exactly what a zeroed one would.
    let shapes =
        [(1, 1, 1), (13, 65, 7), (200, 70, super::KC + 5), (3, 0, 4), (0, 5, 4), (4, 6, 0)];
    for level in levels() {
        for (m, n, k) in shapes {
            let a = rand_vec(m * k, (3 * m * k + 1) as u64);
            let b = rand_vec(k * n, (5 * k * n + 2) as u64);
            for (sa, sb) in layouts(m, n, k) {
                let (av, bv) = (view(Elems::F32(&a), m, k, sa), view(Elems::F32(&b), k, n, sb));
                let mut want = vec![0f32; m * n];
                let got = with_simd_level(level, || {
                    matmul_bf16(av, bv, &mut want, n, false).unwrap();
                    matmul_bf16_new(av, bv).unwrap()
                });
                assert_eq!(got.len(), m * n);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{level:?} {m}x{n}x{k} {sa:?} {sb:?}");
            }
        }
    }
    // Its errors are the product's.
    let a = [0f32; 6];
    let e = matmul_bf16_new(BfMat::f32(&a, 2, 3), BfMat::f32(&a, 2, 3));
    assert!(matches!(e, Err(KernelError::InvalidArgument { name: "b", .. })), "{e:?}");
    let e = matmul_bf16_new(BfMat::f32(&a[..5], 2, 3), BfMat::f32(&a, 3, 2));
    assert!(matches!(e, Err(KernelError::SliceTooShort { name: "a", .. })), "{e:?}");
    let wide = BfMat { rows: usize::MAX, row_stride: 0, ..BfMat::f32(&a, 2, 3) };
    let e = matmul_bf16_new(wide, BfMat { cols: 2, col_stride: 0, ..BfMat::f32(&a, 3, 2) });
    assert!(matches!(e, Err(KernelError::InvalidArgument { name: "c", .. })), "{e:?}");
}

#[test]
fn transposed_and_row_major_packing_keep_nan_infinity_and_broadcast_views() {
    // The packers that read along the source (a transposed A, a row-major B) on NaN and
    // infinity in either operand, and on broadcast (stride 0) views, at every level, against
    // the reference: NaN where the reference has NaN, the same infinities, close elsewhere.
    let (m, n, k) = (14, 70, super::KC + 9);
    let mut a = rand_vec(m * k, 21);
    let mut b = rand_vec(k * n, 22);
    a[5] = f32::NAN; // A(5, 0) under the transposed view [1, m]
    a[2 * m + 9] = f32::INFINITY; // A(9, 2)
    b[(k - 1) * n + 3] = f32::NAN; // B(k-1, 3): the odd last row of a pair
    b[7 * n + 66] = f32::NEG_INFINITY; // B(7, 66): the second panel
    let cases: [([usize; 2], [usize; 2]); 4] =
        [([1, m], [n, 1]), ([1, 0], [n, 1]), ([1, m], [0, 1]), ([0, 1], [n, 1])];
    for (sa, sb) in cases {
        let (av, bv) = (view(Elems::F32(&a), m, k, sa), view(Elems::F32(&b), k, n, sb));
        let mut want = vec![0f32; m * n];
        matmul_bf16_reference(av, bv, &mut want, n, false).unwrap();
        let finite = |x: &[f32]| {
            x.iter().map(|v| if v.is_finite() { v.abs() } else { 0.0 }).collect::<Vec<_>>()
        };
        let (fa, fb) = (finite(&a), finite(&b));
        let scale = abs_products(
            BfMat { data: Elems::F32(&fa), ..av },
            BfMat { data: Elems::F32(&fb), ..bv },
            n,
        );
        for level in levels() {
            let got = with_simd_level(level, || matmul_bf16_new(av, bv).unwrap());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let what = format!("{level:?} {sa:?} {sb:?} element {i}");
                if w.is_nan() || w.is_infinite() {
                    assert!(
                        g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                        "{what}: {g} vs {w}"
                    );
                } else {
                    let tol = 2e-6 * k as f32; // as in the layout test: f32 sums against f64
                    assert!((g - w).abs() <= tol * (1.0 + scale[i]), "{what}: {g} vs {w}");
                }
            }
            assert!(want.iter().any(|w| w.is_nan()), "the case has NaN outputs");
        }
    }
}

#[test]
fn fused_epilogues_are_the_f32_product_then_the_epilogue_bit_for_bit() {
    use crate::convert::bf16_bits_to_f32;
    use crate::epilogue::Act;
    // Every kernel this CPU runs (the AMX tiles where granted, their emulation everywhere),
    // awkward sizes, a depth past one f32 block (the bf16 output takes the depth in one
    // block), more columns than one block, every layout, NaN in the bias, 1-3 threads.
    let mut kernels = vec![Bf16Kernel::Portable, Bf16Kernel::AmxEmulated];
    if amx_available() {
        kernels.push(Bf16Kernel::Amx);
    }
    if bf16_dot_available() {
        kernels.push(Bf16Kernel::Avx512Bf16);
    }
    // (9, 45, 20): a tile of 32 columns stored as one line and 13 more two passes.
    let shapes = [
        (1, 1, 1),
        (33, 70, 40),
        (9, 45, 20),
        (17, 66, 2 * KC + 17),
        (5, 1030, 33),
        (130, 1030, 33),
        (0, 5, 4),
        (3, 4, 0),
    ];
    for (m, n, k) in shapes {
        let a = rand_vec(m * k, 41);
        let b = rand_vec(k * n, 42);
        let mut bias = rand_vec(n, 43);
        if n > 3 {
            bias[3] = f32::NAN;
        }
        for (l, (sa, sb)) in layouts(m, n, k).into_iter().enumerate() {
            let (av, bv) = (view(Elems::F32(&a), m, k, sa), view(Elems::F32(&b), k, n, sb));
            for act in [Act::Identity, Act::Relu, Act::Gelu] {
                for bias in [None, Some(&bias[..])] {
                    let reference = matmul_bf16_to_bf16_reference(av, bv, bias, act).unwrap();
                    for &kern in &kernels {
                        for threads in [1, 2, 3] {
                            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build();
                            let (got, want, got32, want32) = pool.unwrap().install(|| {
                                with_bf16_kernel(kern, || {
                                    let got = matmul_bf16_to_bf16(av, bv, bias, act).unwrap();
                                    let got32 = matmul_bf16_new_with(av, bv, bias, act).unwrap();
                                    let mut y = matmul_bf16_new(av, bv).unwrap();
                                    crate::epilogue::bias_act_in_place(&mut y, n, bias, act)
                                        .unwrap();
                                    let want: Vec<u16> =
                                        y.iter().map(|&x| f32_to_bf16_bits(x)).collect();
                                    (got, want, got32, y)
                                })
                            });
                            let what = format!(
                                "{kern:?} {m}x{n}x{k} layout {l} {act:?} bias {} t={threads}",
                                bias.is_some()
                            );
                            assert_eq!(got, want, "{what}");
                            let bits =
                                |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                            assert_eq!(bits(&got32), bits(&want32), "{what} (f32 output)");
                            // The reference twin: within bf16's rounding of f32 sums.
                            for (i, (g, r)) in got.iter().zip(&reference).enumerate() {
                                let (g, r) = (bf16_bits_to_f32(*g), bf16_bits_to_f32(*r));
                                assert!(
                                    (g.is_nan() && r.is_nan())
                                        || (g - r).abs()
                                            <= 1e-2 * (1.0 + r.abs()) + 1e-5 * k as f32,
                                    "{what}: element {i}: {g} vs reference {r}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
    let e = matmul_bf16_to_bf16(
        BfMat::f32(&[1.0; 6], 2, 3),
        BfMat::f32(&[1.0; 6], 3, 2),
        Some(&[0.0; 3]),
        Act::Identity,
    );
    assert!(matches!(e, Err(KernelError::InvalidArgument { name: "bias", .. })), "{e:?}");
}

#[test]
fn a_tall_deep_bf16_output_in_l2_sized_column_blocks_is_the_f32_product_rounded() {
    use crate::epilogue::Act;
    // 1600 rows are at least 16 row blocks for every kernel, so the bf16 output's `B` block
    // is cut to 1 MiB: at a depth of 2048, 300 columns become two blocks of 192 and 108 (even
    // widths, whole panels). The sums do not depend on the column blocks: bit for bit what the
    // f32 product (blocks of 1024 deep) gives, rounded after the bias. A transposed `A` (a
    // weight gradient's `dyᵀ`) takes the same blocks, rounded once for both.
    let (m, n, k) = (1600, 300, 2048);
    let a = rand_vec(m * k, 51);
    let w = rand_vec(n * k, 52);
    let bias = rand_vec(n, 53);
    let wv = BfMat::f32(&w, n, k).t();
    for av in [BfMat::f32(&a, m, k), BfMat::f32(&a, k, m).t()] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let (got, want) = pool.install(|| {
            let got = matmul_bf16_to_bf16(av, wv, Some(&bias), Act::Identity).unwrap();
            let mut y = matmul_bf16_new(av, wv).unwrap();
            crate::epilogue::bias_act_in_place(&mut y, n, Some(&bias), Act::Identity).unwrap();
            (got, y.iter().map(|&x| f32_to_bf16_bits(x)).collect::<Vec<_>>())
        });
        assert_eq!(got, want, "a's column stride {}", av.col_stride);
    }
}

#[test]
fn a_chunked_weight_gradient_is_the_blocked_product_bit_for_bit() {
    use crate::epilogue::Act;
    // Deeper than 2048 with a bf16 output: on the tile kernels the depth runs in chunks whose
    // partial sums wait in f32, over row blocks of up to 256 rows (two here, the last one's
    // tile partial), `A` read in place, rounded once or packed a chunk at a time (the three
    // layouts), the depth's last chunk short and odd. An f32 output added to runs in blocks
    // of 1024 with the partial sums in the output: added to zeros, the same sums in the same
    // order, so bit for bit the same after the bias, GELU and the rounding; and so is the f32
    // output not added to (in chunks too). 1 and 3 threads, each after another product
    // (stale buffers).
    let (m, n, k) = (290, 70, 2 * KC + 301);
    let a = rand_vec(m * k, 61);
    let b = rand_vec(k * n, 62);
    let bias = rand_vec(n, 63);
    let dirt = rand_vec(64 * 600, 64);
    let mut kernels = vec![Bf16Kernel::AmxEmulated];
    if amx_available() {
        kernels.push(Bf16Kernel::Amx);
    }
    for (l, (sa, sb)) in layouts(m, n, k).into_iter().enumerate() {
        let (av, bv) = (view(Elems::F32(&a), m, k, sa), view(Elems::F32(&b), k, n, sb));
        for &kern in &kernels {
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let (got, want) = pool.install(|| {
                    with_bf16_kernel(kern, || {
                        matmul_bf16_new(BfMat::f32(&dirt, 64, 600), BfMat::f32(&dirt, 600, 64))
                            .unwrap();
                        let got = matmul_bf16_to_bf16(av, bv, Some(&bias), Act::Gelu).unwrap();
                        let mut y = vec![0.0; m * n];
                        matmul_bf16(av, bv, &mut y, n, true).unwrap();
                        let fresh = matmul_bf16_new(av, bv).unwrap();
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&fresh), bits(&y), "{kern:?} layout {l} t={threads}");
                        crate::epilogue::bias_act_in_place(&mut y, n, Some(&bias), Act::Gelu)
                            .unwrap();
                        (got, y.iter().map(|&x| f32_to_bf16_bits(x)).collect::<Vec<_>>())
                    })
                });
                assert_eq!(got, want, "{kern:?} layout {l} t={threads}");
            }
        }
    }
}

#[test]
fn fused_epilogues_take_broadcast_views_and_refuse_what_cannot_be() {
    use crate::epilogue::Act;
    // A broadcast A (every row the same, row stride 0) and a B read through a column stride:
    // the epilogue paths give the unfused bits.
    let (m, n, k) = (37, 70, 45);
    let row = rand_vec(k, 61);
    let b = rand_vec(n * k, 62);
    let mut bias = rand_vec(n, 63);
    bias[5] = f32::NAN;
    let av = BfMat { data: Elems::F32(&row), rows: m, cols: k, row_stride: 0, col_stride: 1 };
    let bv = BfMat::f32(&b, n, k).t();
    let mut want = matmul_bf16_new(av, bv).unwrap();
    crate::epilogue::bias_act_in_place(&mut want, n, Some(&bias), Act::Gelu).unwrap();
    let got = matmul_bf16_new_with(av, bv, Some(&bias), Act::Gelu).unwrap();
    let same = |g: f32, w: f32| g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
    assert!(got.iter().zip(&want).all(|(g, w)| same(*g, *w)), "f32 output");
    let got = matmul_bf16_to_bf16(av, bv, Some(&bias), Act::Gelu).unwrap();
    assert!(got.iter().zip(&want).all(|(g, w)| *g == f32_to_bf16_bits(*w)), "bf16 output");
    // Rows equal, as the broadcast says.
    assert_eq!(got[..n], got[(m - 1) * n..]);
    // A short view, an output too large to count, a wrong bias: typed errors naming them.
    let short = BfMat { rows: m + 1, ..av };
    let e = matmul_bf16_to_bf16(BfMat { row_stride: k, ..short }, bv, None, Act::Identity);
    assert!(
        matches!(
            e,
            Err(KernelError::SliceTooShort { .. }) | Err(KernelError::InvalidArgument { .. })
        ),
        "{e:?}"
    );
    let huge = BfMat { rows: usize::MAX / 2, ..av };
    let e = matmul_bf16_new_with(huge, bv, None, Act::Relu);
    assert!(matches!(e, Err(KernelError::InvalidArgument { name: "c", .. })), "{e:?}");
    let e = matmul_bf16_to_bf16(huge, bv, None, Act::Relu);
    assert!(matches!(e, Err(KernelError::InvalidArgument { name: "c", .. })), "{e:?}");
    let e = matmul_bf16_new_with(av, bv, Some(&bias[..3]), Act::Identity);
    assert!(matches!(e, Err(KernelError::InvalidArgument { name: "bias", .. })), "{e:?}");
}

/// A bf16 row-major `A` read in place by the `vdpbf16ps`-layout kernels (AVX512-BF16 where the
/// CPU has it, and the portable kernel): the same bits as its f32 values rounded into a packed
/// copy, for f32 outputs over several `k` blocks (accumulated too) and bf16 outputs with an
/// epilogue, at 1-3 threads; with row blocks that end in a partial tile (packed), odd row
/// strides (pairs read off their 4-byte alignment), rows wider than the view holding NaN (a
/// read past the depth would show), and the layouts that keep the packed copy (rows 1 KiB
/// apart at a depth of 512, an odd depth).
#[test]
fn a_bf16_a_read_in_place_by_the_vector_kernels_gives_the_packed_bits() {
    use super::driver::reads_a_in_place;
    use crate::epilogue::Act;
    let mut kernels = vec![Bf16Kernel::Portable];
    if bf16_dot_available() {
        kernels.push(Bf16Kernel::Avx512Bf16);
    } else {
        eprintln!("no AVX512-BF16 on this CPU: the portable kernel only");
    }
    // (m, n, k, row stride of A, read in place)
    let shapes = [
        (96, 70, 2 * KC + 64, 2 * KC + 64, true),
        (100, 130, 578, 600, true),
        (37, 65, 530, 531, true),
        (12, 200, 64, 66, true),
        (64, 64, 512, 512, false),
        (65, 70, 601, 601, false),
        // Every row the same memory (a broadcast view, row stride 0), deeper than 512.
        (30, 70, 600, 0, true),
    ];
    for kern in kernels {
        for (m, n, k, rs, in_place) in shapes {
            let bits = match rs {
                0 => crate::testutil::bf16_rows_nan_past(1, k, k),
                _ => crate::testutil::bf16_rows_nan_past(m, k, rs),
            };
            let wide: Vec<f32> =
                bits.iter().map(|&b| crate::convert::bf16_bits_to_f32(b)).collect();
            let a_bits = view(Elems::Bf16(&bits), m, k, [rs, 1]);
            let a_f32 = view(Elems::F32(&wide), m, k, [rs, 1]);
            let resolved = with_bf16_kernel(kern, super::select::resolve);
            let what = format!("{kern:?} {m}x{n}x{k} stride {rs}");
            assert_eq!(reads_a_in_place(resolved, &a_bits), in_place, "{what}");
            assert!(!reads_a_in_place(resolved, &a_f32), "{what}: f32 is rounded");
            let [b, bias, c0] = crate::testutil::gemm_operands(m, n, k);
            let bv = BfMat::f32(&b, k, n);
            for threads in [1, 2, 3] {
                let pool = crate::testutil::pool(threads);
                let run = |a, acc| {
                    let mut c = c0.clone();
                    pool.install(|| with_bf16_kernel(kern, || matmul_bf16(a, bv, &mut c, n, acc)))
                        .unwrap();
                    c.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                };
                for accumulate in [false, true] {
                    let got = run(a_bits, accumulate);
                    assert_eq!(got, run(a_f32, accumulate), "{what} t={threads} acc={accumulate}");
                    assert!(got.iter().all(|&x| f32::from_bits(x).is_finite()), "{what}: NaN read");
                }
                let out = |a| {
                    pool.install(|| {
                        with_bf16_kernel(kern, || {
                            matmul_bf16_to_bf16(a, bv, Some(&bias), Act::Gelu).unwrap()
                        })
                    })
                };
                assert_eq!(out(a_bits), out(a_f32), "{what} t={threads}: bf16 output");
            }
        }
    }
}
