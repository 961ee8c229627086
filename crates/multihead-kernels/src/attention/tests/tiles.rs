//! The attention's bf16 products in the AMX tile layout: each product on the tile kernels
//! (their exact emulation everywhere, the real tiles where granted) equals the sequential
//! emulation of `tdpbf16ps` over the same rounded operands bit for bit, at awkward sizes.

use crate::attention::bf16::{self as bf, Scores, Shape, Values};
use crate::bf16gemm::amx::{amx_available, tdp_pair};
use crate::bf16gemm::micro::Kernel;
use crate::bf16gemm::NR;
use crate::convert::f32_to_bf16_bits as round;
use crate::testutil::rand_vec;

/// The tile kernels this CPU runs: the emulation everywhere, AMX where granted.
fn tile_kernels() -> Vec<Kernel> {
    let mut v = vec![Kernel::AmxEmulated];
    #[cfg(target_arch = "x86_64")]
    if amx_available() {
        v.push(Kernel::Amx);
    } else {
        eprintln!("AMX tiles are not granted on this CPU: the attention tiles ran on their emulation only");
    }
    v
}

/// `Σ_p tdp_pair` over the pairs of two rows given as functions of the depth index.
fn tdp_dot(n: usize, a: impl Fn(usize) -> f32, b: impl Fn(usize) -> f32, acc: f32) -> f32 {
    let word = |f: &dyn Fn(usize) -> f32, p: usize| {
        let at = |i: usize| if i < n { round(f(i)) } else { 0 };
        u32::from(at(2 * p)) | (u32::from(at(2 * p + 1)) << 16)
    };
    (0..n.div_ceil(2)).fold(acc, |acc, p| tdp_pair(acc, word(&a, p), word(&b, p)))
}

fn same_bits(got: &[f32], want: &[f32], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.to_bits() == w.to_bits(), "{what}: element {i}: {g:e} vs {w:e}");
    }
}

fn buffers(kern: Kernel, bc: usize, d: usize, dv: usize) -> Vec<Vec<f32>> {
    // NaN-filled: any element a product reads without packing it first shows.
    bf::scratch(kern, bc, d, dv).iter().map(|&n| vec![f32::NAN; n + 16]).collect()
}

/// `Sᵀ = scale · K Qᵀ` and `Oᵀ = Vᵀ Pᵀ` (then `+=` a second time) on the tile layout.
#[test]
fn attention_products_on_tiles_equal_the_sequential_emulation() {
    for kern in tile_kernels() {
        let _tiles = kern.begin();
        for (bc, d, dv, br) in [
            (1usize, 1usize, 1usize, 1usize),
            (17, 5, 3, 16),
            (33, 32, 17, 33),
            (70, 33, 40, 64),
            (64, 64, 64, 48),
        ] {
            let what = format!("{kern:?} bc={bc} d={d} dv={dv} br={br}");
            let brp = br.div_ceil(16) * 16;
            let (ld, ldv) = (d + 3, dv + 5);
            let k = rand_vec(bc * ld, 1);
            let q = rand_vec(br * d, 2);
            let v = rand_vec(bc * ldv, 3);
            let mut buf = buffers(kern, 256, d, dv);
            let [qp, kb, vw, pw, ot] = [0, 1, 2, 3, 4].map(|i| buf[i].as_mut_ptr());
            let (qp, kb, vw, pw) = (qp as *mut u32, kb as *mut u16, vw as *mut u32, pw as *mut u32);
            let mut st = vec![f32::NAN; bc * brp];
            let scale = 0.37f32;
            let kp = Shape::of(kern).kp(d.div_ceil(2));
            // SAFETY: the buffers are sized by `scratch` for 256 keys (>= bc) and the kernel;
            // the rows and panels read below exist.
            unsafe {
                bf::pack_q(q.as_ptr(), d, br, d, (qp, kp));
                let sc =
                    Scores { k: k.as_ptr(), ld, bc, d, qp, scale, st: st.as_mut_ptr(), brp, kb };
                bf::scores(kern, &sc);
            }
            let want: Vec<f32> = (0..bc * brp)
                .map(|x| {
                    let (j, i) = (x / brp, x % brp);
                    let qi = |c: usize| if i < br { q[i * d + c] } else { 0.0 };
                    tdp_dot(d, |c| k[j * ld + c], qi, 0.0) * scale
                })
                .collect();
            same_bits(&st, &want, &format!("{what}: scores"));

            // P: the scores as probabilities-like values; Oᵀ = Vᵀ Pᵀ, then accumulated again.
            let mut otv = vec![0f32; dv * NR];
            for accumulate in [false, true] {
                let x = Values {
                    st: st.as_ptr(),
                    brp,
                    bc,
                    v: v.as_ptr(),
                    ld: ldv,
                    dv,
                    ot,
                    accumulate,
                    vw,
                    pw,
                };
                // SAFETY: as above; `ot` holds `dv` rounded to `MR` rows of `NR` floats.
                unsafe { bf::values(kern, &x) };
                for c in 0..dv {
                    for i in 0..NR {
                        let pi = |j: usize| if i < brp { st[j * brp + i] } else { 0.0 };
                        otv[c * NR + i] = tdp_dot(
                            bc,
                            |j| v[j * ldv + c],
                            pi,
                            if accumulate { otv[c * NR + i] } else { 0.0 },
                        );
                    }
                }
                let got = &buf[4][..dv * NR];
                same_bits(got, &otv, &format!("{what}: values, accumulate={accumulate}"));
            }
        }
    }
}
