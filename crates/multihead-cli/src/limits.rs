//! Checks of the commands' size flags before anything is allocated: a value out of range, or
//! sizes whose tensors cannot fit in memory, are errors naming the flag, never a panic
//! (capacity overflow) or an abort (candle allocates infallibly).

use anyhow::{bail, Result};

/// `value` of `flag` must lie in `lo..=hi`.
pub(crate) fn in_range(flag: &str, value: usize, lo: usize, hi: usize) -> Result<()> {
    if !(lo..=hi).contains(&value) {
        match hi {
            usize::MAX => bail!("{flag} must be at least {lo}, got {value}"),
            _ => bail!("{flag} must be between {lo} and {hi}, got {value}"),
        }
    }
    Ok(())
}

/// `count` f32 tensors of shape `dims` (made from the flags named in `what`) must fit in the
/// memory available now.
pub(crate) fn fits(what: &str, dims: &[usize], count: usize) -> Result<()> {
    let bytes = dims
        .iter()
        .chain([&4usize, &count])
        .try_fold(1u128, |acc, &d| acc.checked_mul(d as u128))
        .unwrap_or(u128::MAX);
    let available = available_bytes().unwrap_or(u64::MAX) as u128;
    if bytes > available || usize::try_from(bytes).is_err() {
        bail!(
            "{what}: {count} tensors of shape {dims:?} need {:.1} GiB, more than the {:.1} GiB of memory available; use smaller sizes",
            bytes as f64 / (1u128 << 30) as f64,
            available as f64 / (1u128 << 30) as f64
        );
    }
    Ok(())
}

/// `MemAvailable` of `/proc/meminfo` in bytes, where there is one.
fn available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
