//! Flush-to-zero for the attention kernels: results below f32's normal range become zero
//! while a guard lives.
//!
//! On Intel cores an arithmetic result that is subnormal (below 2^-126) takes a microcode
//! assist of a hundred cycles or more. Attention makes such results where a probability is
//! tiny: far keys under an ALiBi bias (`e^(−m·|i − j|)` times a value), an output block
//! rescaled by a tiny `e^(m_old − m_new)`. Measured on an Emerald Rapids Xeon, the ALiBi
//! forward at B=8 H=8 L=S=512 D=64 took 13% longer than the plain call, all of it in the
//! products; with flush-to-zero, 2%. (AMD's cores handle subnormals without an assist.)
//!
//! The guard sets MXCSR's flush-to-zero bit (FTZ, bit 15) and clears it again when it is
//! dropped, also on unwinding, unless it was set before; operands are read as they are (DAZ stays
//! off), so a subnormal input still counts. What changes is a result below 1.2e-38 in
//! magnitude, which becomes a zero of its sign: an absolute difference below 1.2e-38 per
//! operation, as TensorFlow's CPU kernels do by default (`ScopedFlushDenormal`). Outside x86-64
//! the guard does nothing.
//!
//! Rust's and LLVM's model of floating point assumes the default MXCSR, so the compiler may
//! move a float operation across the guard's `ldmxcsr` or fold it at compile time: then that
//! result is rounded as if the guard were off (or on). That changes which tiny results are
//! flushed, never memory safety; the kernels' results hold either way (a flushed result is
//! within 2^-126 of the exact one), and the guard is set and cleared around whole tasks, whose
//! floating point work runs through the SIMD intrinsics between the two.

/// Flush-to-zero on the current thread until dropped (see the module docs).
pub(crate) struct FlushToZero {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

/// MXCSR's flush-to-zero bit.
#[cfg(target_arch = "x86_64")]
const FTZ: u32 = 1 << 15;

impl FlushToZero {
    /// Turns flush-to-zero on for this thread.
    pub(crate) fn on() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let saved = read_mxcsr();
            if saved & FTZ == 0 {
                write_mxcsr(saved | FTZ);
            }
            FlushToZero { saved }
        }
        #[cfg(not(target_arch = "x86_64"))]
        FlushToZero {}
    }
}

impl Drop for FlushToZero {
    fn drop(&mut self) {
        // Only the bit this guard set is cleared: the sticky exception flags raised meanwhile
        // stay raised, as they would without the guard.
        #[cfg(target_arch = "x86_64")]
        if self.saved & FTZ == 0 {
            write_mxcsr(read_mxcsr() & !FTZ);
        }
    }
}

/// The current thread's MXCSR.
#[cfg(target_arch = "x86_64")]
pub(crate) fn read_mxcsr() -> u32 {
    let mut x = 0u32;
    // SAFETY: `stmxcsr` stores the 32-bit MXCSR to the address given, a live local u32; it
    // touches nothing else (SSE is part of x86-64, so the instruction always exists).
    unsafe {
        core::arch::asm!("stmxcsr [{}]", in(reg) &mut x, options(nostack, preserves_flags));
    }
    x
}

/// Sets the current thread's MXCSR.
#[cfg(target_arch = "x86_64")]
fn write_mxcsr(x: u32) {
    // SAFETY: `ldmxcsr` reads 32 bits from a live local; the values written are the current
    // MXCSR with only the FTZ bit changed, so no reserved bit is set and it cannot fault. It changes this thread's rounding controls only, which the guard restores.
    unsafe {
        core::arch::asm!("ldmxcsr [{}]", in(reg) &x, options(nostack, preserves_flags, readonly));
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use std::hint::black_box;

    /// The product 2^-100 · 2^-30 = 2^-130 is subnormal.
    fn tiny_product() -> f32 {
        black_box(2f32.powi(-100)) * black_box(2f32.powi(-30))
    }

    #[test]
    fn flushes_inside_the_guard_and_restores_after() {
        // The control bits, without the sticky exception flags (bits 0-5).
        let control = || read_mxcsr() & !0x3f;
        let before = control();
        assert_eq!(before & FTZ, 0, "flush-to-zero is off by default");
        assert_eq!(tiny_product(), 2f32.powi(-130));
        {
            let _g = FlushToZero::on();
            assert_eq!(tiny_product(), 0.0);
            assert_eq!(control(), before | FTZ);
            // A subnormal operand is still read as it is (no DAZ).
            assert_eq!(black_box(2f32.powi(-130)) * black_box(2f32.powi(10)), 2f32.powi(-120));
            {
                // A nested guard leaves the outer one's setting alone.
                let _inner = FlushToZero::on();
            }
            assert_eq!(tiny_product(), 0.0);
        }
        assert_eq!(control(), before);
        assert_eq!(tiny_product(), 2f32.powi(-130));
    }
}
