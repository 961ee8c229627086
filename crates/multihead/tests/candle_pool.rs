//! The workspace's candle-core keeps its barrier pool off the cores this crate's pool needs
//! (vendor/candle-core/PATCHED.md, the second change): candle's element-wise operations called
//! on a rayon thread split their work over that rayon pool, and the barrier pool's workers
//! stop looking for the next operation soon, giving their core away meanwhile. Its own test
//! binary, so that no other test wakes candle's pool while these measure its threads' CPU
//! time; both fail if the `[patch]` goes.

#![allow(clippy::unwrap_used)]

use std::sync::Mutex;
use std::time::Duration;

use candle_core::{Device, Tensor};

#[path = "integration/common.rs"]
mod common;

/// The tests below read the CPU time of candle's pool: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// Elements of the tensors added: above candle's 64 Ki threshold for going parallel.
const N: usize = 1 << 20;

/// CPU time in nanoseconds that candle's barrier pool threads (`candle-bp-*`) have used so far.
fn barrier_pool_cpu_ns() -> u64 {
    let (ns, threads) = common::threads_cpu_ns("candle-bp-");
    assert!(threads > 0 || std::thread::available_parallelism().map_or(1, |n| n.get()) == 1);
    ns
}

/// Two large tensors, and their sum computed once on this (non-rayon) thread, which starts
/// candle's barrier pool; then a pause, so that its workers are parked when the test measures.
fn operands() -> (Tensor, Tensor, Vec<f32>) {
    let a = Tensor::randn(0f32, 1.0, N, &Device::Cpu).unwrap();
    let b = Tensor::randn(0f32, 1.0, N, &Device::Cpu).unwrap();
    let sum = a.add(&b).unwrap().to_vec1::<f32>().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    (a, b, sum)
}

/// Inside `on_pool` (a thread of this crate's pool) candle's adds split over the pool's
/// threads, which are awake during the call, and leave candle's barrier pool parked. Upstream
/// candle wakes that pool for each add; its worker then does half the add and spins for the
/// next one on a core the call's next parallel operation needs (24 ms of its CPU over these
/// 300 adds with upstream candle on an AMD Zen 5; none with the patch).
#[test]
fn candle_ops_inside_on_pool_leave_candles_barrier_pool_parked() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b, sum) = operands();
    let before = barrier_pool_cpu_ns();
    let got = multihead::on_pool(|| {
        let mut last = a.add(&b);
        for _ in 0..300 {
            last = a.add(&b);
        }
        last
    })
    .unwrap();
    let used_ms = (barrier_pool_cpu_ns() - before) as f64 / 1e6;
    assert_eq!(got.to_vec1::<f32>().unwrap(), sum, "the add inside on_pool changed its bits");
    assert!(
        used_ms < 1.0,
        "candle's barrier pool used {used_ms:.2} ms of CPU during 300 adds inside on_pool"
    );
}

/// Called from a thread outside rayon, candle's add still runs on its barrier pool (the same
/// bits), whose worker then looks for the next operation for only a short while (2,000
/// rounds, giving its core away every 64) before it parks: 0.1 ms on an AMD Zen 5, where
/// upstream's 25,000 rounds kept a core busy for 1.3 ms after every parallel operation, beside
/// this crate's pool at work.
#[test]
fn candles_barrier_pool_parks_soon_after_an_operation() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (a, b, sum) = operands();
    let mut worst_ms: f64 = 0.0;
    for _ in 0..5 {
        let got = a.add(&b).unwrap();
        let before = barrier_pool_cpu_ns();
        std::thread::sleep(Duration::from_millis(50));
        let used_ms = (barrier_pool_cpu_ns() - before) as f64 / 1e6;
        assert_eq!(got.to_vec1::<f32>().unwrap(), sum, "the add changed its bits");
        worst_ms = worst_ms.max(used_ms);
    }
    assert!(worst_ms < 0.5, "candle's barrier pool spun for {worst_ms:.2} ms after an add");
}
