//! One hop onto rayon's pool per call (`multihead::on_pool`, and the modules' own hop for
//! calls large enough to go parallel): the call runs on a worker with the caller's modes, the
//! worker's own modes come back afterwards, and the numbers are the same bits. One call at a
//! time runs there; a concurrent one runs on its caller, and writes to parameters while other
//! threads call the modules do not deadlock.

use candle_core::{DType, Tensor};
use candle_nn::{VarBuilder, VarMap};
use multihead::transformer::{LayerConfig, TransformerEncoder};
use multihead::{
    autocast, autocast_dtype, default_backend, grad_enabled, no_grad, on_pool, with_backend,
    Backend, Mask, MhaConfig, MhaOptions,
};
use multihead_kernels::bf16gemm::{active_bf16_kernel, with_bf16_kernel, Bf16Kernel};

use crate::common::{bits, det, dev, mha};

/// `on_pool(f)` on a worker of the pool: one call at a time runs there, and another test's
/// may hold it (then `f` runs on the caller), so this waits for a turn (a minute at most).
fn on_a_worker<R: Send>(f: impl Fn() -> R + Sync) -> R {
    let start = std::time::Instant::now();
    loop {
        if let Some(r) = on_pool(|| rayon::current_thread_index().map(|_| f())) {
            return r;
        }
        assert!(start.elapsed().as_secs() < 60, "no turn on the pool in a minute");
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
}

#[test]
fn on_pool_runs_on_a_worker_with_the_callers_modes() {
    assert!(rayon::current_thread_index().is_none(), "the test thread is not a worker");
    assert!(on_a_worker(|| rayon::current_thread_index().is_some()));
    assert!(!no_grad(|| on_a_worker(grad_enabled)));
    let backend = with_backend(Backend::Composed, || on_a_worker(default_backend));
    assert_eq!(backend, Backend::Composed);
    assert_eq!(autocast(DType::BF16, || on_a_worker(autocast_dtype)), Some(DType::BF16));
    let k = with_bf16_kernel(Bf16Kernel::Portable, || on_a_worker(active_bf16_kernel));
    assert_eq!(k, Bf16Kernel::Portable);
    // Nested: already on a worker, the call runs there.
    assert!(!no_grad(|| on_a_worker(|| on_pool(grad_enabled))));
    // The workers keep their own modes once the calls are done (whichever worker takes them).
    for _ in 0..8 {
        let modes = on_a_worker(|| (grad_enabled(), default_backend(), autocast_dtype()));
        assert_eq!(modes, (true, Backend::Auto, None));
    }
}

/// A module call large enough to hop carries the backend: forced fused kernels on a call
/// they cannot run is still the error, not a silent composed run on the worker.
#[test]
fn a_hopping_module_call_keeps_the_backend() {
    // f64: the fused kernels take f32 only.
    let (m, _vm) = mha(MhaConfig::new(64, 4), DType::F64);
    let x = det(&[64, 2, 64], DType::F64, 1.0); // 128 rows × 64 × 192: hops
    let o = MhaOptions::default().need_weights(false);
    assert!(m.forward(&x, &x, &x, &o).is_ok());
    let forced = with_backend(Backend::Fused, || m.forward(&x, &x, &x, &o));
    assert!(forced.is_err(), "the forced backend was lost on the hop");
    // The same on a worker for certain (the module's hop may have run on this thread).
    let forced = with_backend(Backend::Fused, || on_a_worker(|| m.forward(&x, &x, &x, &o)));
    assert!(forced.is_err(), "the forced backend was lost on the hop");
}

/// `no_grad` crosses the hop: an evaluating encoder large enough to hop takes PyTorch's
/// inference path (padded rows exactly zero) only under `no_grad`, and the output equals the
/// call made on a worker directly, bit for bit.
#[test]
fn a_hopping_encoder_keeps_no_grad_and_its_bits() {
    let vm = VarMap::new();
    let cfg = LayerConfig::new(64, 4).with_dim_feedforward(128).with_batch_first(true);
    let mut enc =
        TransformerEncoder::new(cfg, 2, None, VarBuilder::from_varmap(&vm, DType::F32, &dev()))
            .unwrap();
    enc.eval();
    let x = det(&[8, 64, 64], DType::F32, 2.0); // 512 rows × 64 × 192: hops
    let pad: Vec<u8> = (0..8 * 64).map(|i| u8::from(i % 64 >= 40)).collect();
    let kpm = Mask::Bool(Tensor::from_vec(pad, (8, 64), &dev()).unwrap());
    let y = no_grad(|| enc.forward(&x, None, Some(&kpm), None)).unwrap();
    let padded = y.narrow(1, 40, 24).unwrap().abs().unwrap().max_all().unwrap();
    assert_eq!(padded.to_scalar::<f32>().unwrap(), 0.0, "no_grad was lost on the hop");
    let on_worker = on_a_worker(|| no_grad(|| enc.forward(&x, None, Some(&kpm), None))).unwrap();
    let hopped = no_grad(|| on_a_worker(|| enc.forward(&x, None, Some(&kpm), None))).unwrap();
    let padded = hopped.narrow(1, 40, 24).unwrap().abs().unwrap().max_all().unwrap();
    assert_eq!(padded.to_scalar::<f32>().unwrap(), 0.0, "no_grad was lost on the hop");
    let d = (&y - &on_worker).unwrap().abs().unwrap().max_all().unwrap();
    assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
    // With gradients recorded, the padded rows are computed (PyTorch's training path).
    let y = enc.forward(&x, None, Some(&kpm), None).unwrap();
    let padded = y.narrow(1, 40, 24).unwrap().abs().unwrap().max_all().unwrap();
    assert!(padded.to_scalar::<f32>().unwrap() > 0.0);
}

/// While one call runs on the pool, a call from another thread runs on its own thread (with
/// its own modes), not queued behind or on top of the first.
#[test]
fn a_second_caller_runs_on_its_own_thread_while_the_pool_is_busy() {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    let (inside, done) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
    let got_a_turn = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            // Another test may hold the pool: wait for a turn on it (a minute at most).
            let start = std::time::Instant::now();
            while start.elapsed().as_secs() < 60 && !got_a_turn.load(Relaxed) {
                on_pool(|| {
                    if rayon::current_thread_index().is_some() {
                        got_a_turn.store(true, Relaxed);
                        inside.wait();
                        done.wait();
                    }
                });
            }
            if !got_a_turn.load(Relaxed) {
                inside.wait();
                done.wait();
            }
        });
        inside.wait();
        let seen = no_grad(|| on_pool(|| (rayon::current_thread_index(), grad_enabled())));
        done.wait();
        assert!(got_a_turn.load(Relaxed), "no turn on the pool in a minute");
        assert_eq!(seen, (None, false), "the second call did not run on its caller");
    });
}

/// Writing a parameter (`Var::set`, as an optimiser step or a weight reload does) while other
/// threads call a module that reads it, from a plain thread and from inside `on_pool`, with
/// and without a backward: every call and every write finishes. A call queued on the same
/// pool as another could run on top of it, under its read locks, and wait for the write that
/// waits for them (a deadlock within seconds before the pool took one call at a time).
#[test]
fn writes_to_parameters_beside_concurrent_calls_do_not_deadlock() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    let w = candle_core::Var::from_tensor(&det(&[512, 512], DType::F32, 1.0)).unwrap();
    let lin = Arc::new(multihead::Linear::from_weights(w.as_tensor().clone(), None));
    let x = Arc::new(det(&[256, 512], DType::F32, 2.0)); // 2^26 multiply-adds: the call hops
    let (stop, done) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
    let mut threads = Vec::new();
    for train in [false, true] {
        let (lin, x, stop, done) = (lin.clone(), x.clone(), stop.clone(), done.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Relaxed) {
                let y = lin.forward(&x).unwrap();
                if train {
                    y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
                }
                done.fetch_add(1, Relaxed);
            }
        }));
    }
    for in_pool in [false, true] {
        let (w, stop, done) = (w.clone(), stop.clone(), done.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Relaxed) {
                let set = || w.set(&w.as_tensor().copy().unwrap()).unwrap();
                if in_pool {
                    on_pool(set)
                } else {
                    set()
                }
                done.fetch_add(1, Relaxed);
            }
        }));
    }
    // Four seconds of traffic; nothing finishing for three seconds is a deadlock (the stuck
    // threads are left behind: the assertion fails the test instead of hanging it).
    let (start, mut last, mut since) = (Instant::now(), 0, Instant::now());
    while start.elapsed() < Duration::from_secs(4) {
        std::thread::sleep(Duration::from_millis(100));
        let now = done.load(Relaxed);
        if now != last {
            (last, since) = (now, Instant::now());
        }
        assert!(since.elapsed() < Duration::from_secs(3), "deadlock after {now} calls and writes");
    }
    stop.store(true, Relaxed);
    // Every thread ends within seconds (a stuck one would hang a join: poll instead).
    let end = Instant::now();
    while !threads.iter().all(|t| t.is_finished()) {
        assert!(end.elapsed() < Duration::from_secs(10), "a thread is stuck after {last} calls");
        std::thread::sleep(Duration::from_millis(20));
    }
    for t in threads {
        t.join().unwrap();
    }
    assert!(last > 8, "only {last} calls and writes in four seconds");
}

/// Holds every thread of rayon's global pool until dropped (a test's call that sends work
/// there waits for it meanwhile). One test holds it at a time: two holding at once could each
/// get some of the threads and wait for the rest.
struct HeldPool {
    release: std::sync::Arc<std::sync::atomic::AtomicBool>,
    _turn: std::sync::MutexGuard<'static, ()>,
}

/// Whose turn it is to hold rayon's pool.
static HOLDING: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl HeldPool {
    fn hold() -> HeldPool {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
        use std::sync::Arc;
        let turn = HOLDING.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let (release, held) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
        let threads = rayon::current_num_threads();
        for _ in 0..threads {
            let (release, held) = (release.clone(), held.clone());
            rayon::spawn(move || {
                held.fetch_add(1, SeqCst);
                while !release.load(SeqCst) {
                    std::thread::sleep(std::time::Duration::from_micros(100));
                }
            });
        }
        let start = std::time::Instant::now();
        while held.load(SeqCst) < threads {
            if start.elapsed().as_secs() >= 60 {
                release.store(true, SeqCst); // let the threads it has go
                panic!("rayon's pool not free in a minute");
            }
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        HeldPool { release, _turn: turn }
    }
}

impl Drop for HeldPool {
    fn drop(&mut self) {
        self.release.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Runs `f` on a new thread while rayon's global pool is held, and says whether it finished
/// before the pool was let go (within ten seconds).
fn finishes_while_the_pool_is_held(f: impl FnOnce() + Send) -> bool {
    let held = HeldPool::hold();
    std::thread::scope(|s| {
        let h = s.spawn(f);
        let start = std::time::Instant::now();
        while !h.is_finished() && start.elapsed().as_secs() < 10 {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        let finished = h.is_finished();
        drop(held);
        h.join().expect("the steps ran");
        finished
    })
}

/// The three decoding models of the tests below, in eval mode, E wide with H heads (the
/// layers' feed-forward F wide): MultiheadAttention, a decoder-only stack of two encoder
/// layers and a two-layer decoder.
struct Decoders {
    m: multihead::MultiheadAttention,
    gpt: TransformerEncoder,
    dec: multihead::transformer::TransformerDecoder,
    _vms: (VarMap, VarMap),
}

fn decoders(e: usize, h: usize, f: usize) -> Decoders {
    use multihead::transformer::TransformerDecoder;
    let (m, m_vm) = mha(MhaConfig::new(e, h).with_batch_first(true), DType::F32);
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let cfg = LayerConfig::new(e, h).with_dim_feedforward(f).with_batch_first(true);
    let mut gpt = TransformerEncoder::new(cfg.clone(), 2, None, vb.pp("gpt")).unwrap();
    let mut dec = TransformerDecoder::new(cfg, 2, None, vb.pp("dec")).unwrap();
    gpt.eval();
    dec.eval();
    Decoders { m, gpt, dec, _vms: (m_vm, vm) }
}

/// A small model's decoding step (MultiheadAttention's, a decoder-only stack's and an
/// encoder-decoder's, E=64) runs on its caller without sending work to rayon's pool: a
/// wake-up and a sleep per operation cost a step 5-10 times its own time. Its steps finish
/// while every thread of the pool is busy elsewhere (before the change each step's products
/// and cache read waited for the pool), with the bits they give when the pool is free.
#[test]
fn a_small_decoding_step_runs_on_its_caller_without_rayons_pool() {
    let Decoders { m, gpt, dec, .. } = decoders(64, 4, 128);
    let memory = det(&[1, 16, 64], DType::F32, 3.0);
    let prompt = det(&[1, 16, 64], DType::F32, 1.0);
    let tokens: Vec<Tensor> =
        (0..4).map(|i| det(&[1, 1, 64], DType::F32, 2.0 + i as f64)).collect();
    // Fresh caches from the prompt, then four steps of each model: their outputs as bits.
    let steps = || -> Vec<Vec<u32>> {
        let (mut cache, mut caches) = (m.new_cache(1, 32).unwrap(), gpt.new_caches(1, 32).unwrap());
        let mut state = dec.start(&memory, None, 32).unwrap();
        m.forward_cached(&prompt, &mut cache, None).unwrap();
        gpt.forward_cached(&prompt, &mut caches, None).unwrap();
        let mut outs = Vec::new();
        for x in &tokens {
            outs.push(bits(&m.forward_cached(x, &mut cache, None).unwrap()));
            outs.push(bits(&gpt.forward_cached(x, &mut caches, None).unwrap()));
            outs.push(bits(&dec.forward_step(x, &mut state, None).unwrap()));
        }
        outs
    };
    let mut held = Vec::new();
    let finished = finishes_while_the_pool_is_held(|| held = steps());
    assert!(finished, "a small decoding step waited for rayon's pool");
    let free = steps();
    assert_eq!(held, free);
    assert!(free.iter().all(|y| y.len() == 64 && y.iter().all(|&b| f32::from_bits(b).is_finite())));
}

/// A decoding step large enough to hop onto the pool (E=512: its projection and feed-forward
/// products go parallel) gives the bits of the same step run in place on one thread, for
/// MultiheadAttention and a decoder-only stack, cache contents included.
#[test]
fn a_hopping_decoding_step_gives_the_bits_of_one_thread() {
    let Decoders { m, gpt, .. } = decoders(512, 8, 1024);
    let (mut cache, mut caches) = (m.new_cache(2, 80).unwrap(), gpt.new_caches(2, 80).unwrap());
    let prompt = det(&[2, 64, 512], DType::F32, 1.0);
    m.forward_cached(&prompt, &mut cache, None).unwrap();
    gpt.forward_cached(&prompt, &mut caches, None).unwrap();
    let token = det(&[2, 1, 512], DType::F32, 2.0);
    let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    for _ in 0..3 {
        let mut c1 = cache.try_clone().unwrap();
        let mut cs1: Vec<_> = caches.iter().map(|c| c.try_clone().unwrap()).collect();
        let (c1, cs1) = (&mut c1, &mut cs1);
        let hopped = (
            m.forward_cached(&token, &mut cache, None).unwrap(),
            gpt.forward_cached(&token, &mut caches, None).unwrap(),
        );
        let here = one.install(|| {
            (
                m.forward_cached(&token, c1, None).unwrap(),
                gpt.forward_cached(&token, cs1, None).unwrap(),
            )
        });
        assert_eq!(bits(&hopped.0), bits(&here.0), "MultiheadAttention");
        assert_eq!(bits(&hopped.1), bits(&here.1), "the stack");
        assert_eq!(bits(cache.keys()), bits(c1.keys()));
        assert_eq!(bits(caches[1].values()), bits(cs1[1].values()));
    }
}

/// One named call of a test.
type Call<'a> = Box<dyn Fn() + Sync + 'a>;

/// A small model's calls, forward and backward, run on their caller without sending work to
/// rayon's pool (each operation that did would cost a wake-up and a sleep, more than the
/// operation): each finishes while every thread of the pool is busy elsewhere.
#[test]
fn small_calls_run_on_their_caller_without_rayons_pool() {
    use multihead::functional::scaled_dot_product_attention;
    use multihead::transformer::{DecoderMasks, TransformerDecoderLayer, TransformerEncoderLayer};
    use multihead::{Linear, SdpaOptions};
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &dev());
    let cfg = LayerConfig::new(64, 4).with_dim_feedforward(128).with_batch_first(true);
    let enc = TransformerEncoderLayer::new(cfg.clone(), vb.pp("enc")).unwrap();
    let mut enc_eval = enc.clone();
    enc_eval.eval();
    let mut dec = TransformerDecoderLayer::new(cfg, vb.pp("dec")).unwrap();
    dec.eval();
    let (m, _m_vm) = mha(MhaConfig::new(64, 4).with_batch_first(true), DType::F32);
    let (m16, _m16_vm) = mha(MhaConfig::new(32, 4).with_batch_first(true), DType::BF16);
    let lin =
        Linear::from_weights(det(&[128, 64], DType::F32, 4.0), Some(det(&[128], DType::F32, 5.0)));
    let x = candle_core::Var::from_tensor(&det(&[1, 17, 64], DType::F32, 1.0)).unwrap();
    let x16 = candle_core::Var::from_tensor(&det(&[2, 32, 32], DType::BF16, 2.0)).unwrap();
    let q = det(&[1, 4, 17, 16], DType::F32, 3.0);
    let fast = MhaOptions::default().need_weights(false);
    let backward = |y: Tensor| {
        y.to_dtype(DType::F32).unwrap().sum_all().unwrap().backward().unwrap();
    };
    let cases: Vec<(&str, Call)> = vec![
        (
            "MHA eval",
            Box::new(|| {
                no_grad(|| m.forward(&x, &x, &x, &fast)).unwrap();
            }),
        ),
        (
            "MHA eval, need_weights",
            Box::new(|| {
                no_grad(|| m.forward(&x, &x, &x, &MhaOptions::default())).unwrap();
            }),
        ),
        ("MHA training", Box::new(|| backward(m.forward(&x, &x, &x, &fast).unwrap().output))),
        (
            "bf16 MHA training",
            Box::new(|| backward(m16.forward(&x16, &x16, &x16, &fast).unwrap().output)),
        ),
        (
            "encoder layer training",
            Box::new(|| backward(enc.forward(&x, None, None, false).unwrap())),
        ),
        (
            "encoder layer eval",
            Box::new(|| {
                no_grad(|| enc_eval.forward(&x, None, None, false)).unwrap();
            }),
        ),
        (
            "decoder layer eval",
            Box::new(|| {
                no_grad(|| dec.forward(&x, &x, &DecoderMasks::default())).unwrap();
            }),
        ),
        (
            "causal SDPA",
            Box::new(|| {
                let o = SdpaOptions { is_causal: true, ..Default::default() };
                no_grad(|| scaled_dot_product_attention(&q, &q, &q, &o)).unwrap();
            }),
        ),
        ("Linear training", Box::new(|| backward(lin.forward(&x).unwrap()))),
    ];
    // Once each before holding the pool: what a first call sets up is not the point here.
    cases.iter().for_each(|(_, f)| f());
    let waited: Vec<&str> = cases
        .iter()
        .filter(|(_, f)| !finishes_while_the_pool_is_held(f))
        .map(|(name, _)| *name)
        .collect();
    assert!(waited.is_empty(), "these small calls waited for rayon's pool: {waited:?}");
}

/// The pool's other threads wait for a call's tasks awake (looking for them between its
/// parallel operations), but only for a millisecond without one: a call that pauses for 400 ms
/// after its tasks leaves them napping, not looking (which would take about 400 ms of CPU
/// each).
#[cfg(target_os = "linux")]
#[test]
fn a_pausing_call_does_not_keep_the_pools_threads_spinning() {
    use rayon::prelude::*;
    let used = on_a_worker(|| {
        // Tasks first: the other threads are awake and looking for more when the pause starts.
        let s: f64 = (0..1 << 18).into_par_iter().map(|i| (i as f64).sqrt()).sum();
        assert!(s > 0.0);
        let before = crate::common::threads_cpu_ns("multihead-").0;
        std::thread::sleep(std::time::Duration::from_millis(400));
        crate::common::threads_cpu_ns("multihead-").0 - before
    });
    let ms = used / 1_000_000;
    assert!(ms < 100, "the pool's threads used {ms} ms of CPU during a 400 ms pause");
}

/// A call that panics on the pool gives its panic to the caller, and the pool takes the next
/// calls (its other threads are released from waiting for the call's tasks).
#[test]
fn a_panicking_call_leaves_the_pool_usable() {
    use rayon::prelude::*;
    for _ in 0..3 {
        let caught = std::panic::catch_unwind(|| {
            on_a_worker(|| {
                let s: u64 = (0..1u64 << 16).into_par_iter().sum();
                if s > 0 {
                    panic!("on purpose");
                }
            })
        });
        assert!(caught.is_err(), "the panic did not reach the caller");
        let s: u64 = on_a_worker(|| (0..1u64 << 16).into_par_iter().sum());
        assert_eq!(s, (1u64 << 16) * ((1u64 << 16) - 1) / 2);
    }
}
