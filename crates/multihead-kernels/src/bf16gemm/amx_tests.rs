//! The AMX layout: the driver on the emulated tile kernel (and on real tiles where granted)
//! against a sequential emulation of the whole product, bit for bit; the emulated instruction
//! against Intel's definition; and the kernel choice.

#![allow(clippy::unwrap_used)]

use super::amx::tdp_pair;
use super::*;
use crate::testutil::rand_vec;

/// `C (+)= A·B` as tile products compute it, one element at a time: for each `k` block of the
/// driver ([`KC`] deep, its pairs rounded up to whole 16-pair tile steps with zeros), each pair
/// in order through [`tdp_pair`].
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
                for q in 0..kp {
                    acc = tdp_pair(acc, word(&|p| a.bits(i, p), q), word(&|p| b.bits(p, j), q));
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
        (5, 1030, 33),
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
fn the_emulated_instruction_follows_intels_definition() {
    let bf = |x: f32| crate::convert::f32_to_bf16_bits(x);
    let pair = |even: f32, odd: f32| u32::from(bf(even)) | (u32::from(bf(odd)) << 16);
    // The even product is added first: 1 + 2^-24 rounds to 1 (ties to even), then 1 - 1 = 0.
    // Odd first would give 2^-24.
    let tiny = 2f32.powi(-24);
    assert_eq!(tdp_pair(1.0, pair(tiny, 1.0), pair(1.0, -1.0)), 0.0);
    // Each accumulation is fused: 2^-126 + 2^-140 is a normal number and kept exactly, though
    // the product 2^-140 alone is subnormal (and would be flushed).
    let e70 = 2f32.powi(-70);
    let min = f32::MIN_POSITIVE;
    assert_eq!(tdp_pair(min, pair(e70, 0.0), pair(e70, 0.0)), min + 2f32.powi(-140));
    // A subnormal result is flushed to zero of its sign (the odd product here, as the even
    // product of zeros added afterwards would turn -0 into +0).
    assert_eq!(tdp_pair(0.0, pair(0.0, e70), pair(0.0, e70)).to_bits(), 0);
    assert_eq!(tdp_pair(0.0, pair(0.0, -e70), pair(0.0, e70)).to_bits(), 0x8000_0000);
    // A subnormal bf16 input reads as zero: 2^-130 · 2^100 would be 2^-30.
    let sub = 0x0010u32; // bf16 2^-130, subnormal
    assert_eq!(tdp_pair(0.0, sub, pair(2f32.powi(100), 0.0)), 0.0);
    // NaN and infinity propagate; inf - inf is NaN.
    assert!(tdp_pair(0.0, pair(f32::NAN, 1.0), pair(1.0, 1.0)).is_nan());
    assert!(tdp_pair(0.0, pair(f32::INFINITY, 1.0), pair(1.0, f32::NEG_INFINITY)).is_nan());
    assert_eq!(tdp_pair(1.0, pair(f32::INFINITY, 0.0), pair(2.0, 0.0)), f32::INFINITY);
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
