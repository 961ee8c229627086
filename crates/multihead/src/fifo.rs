//! Opening a file to read without hanging on a FIFO that nobody writes.
//!
//! Opening a FIFO for reading waits until a writer opens it: for a path that names a FIFO no
//! process will write (a leftover `mkfifo`), loading would hang for ever. A FIFO is opened
//! without that wait instead, and its reader ([`wait_for_data`]) waits a bounded time for the
//! first bytes, then says what is wrong.

use std::fs::File;
use std::path::Path;
use std::time::{Duration, Instant};

/// How long a reader waits for a FIFO's first bytes (a writer that is still starting).
pub(crate) const FIFO_WAIT: Duration = Duration::from_secs(5);

/// `path` opened for reading, and whether it is a FIFO (opened without waiting for a writer;
/// its reads block as usual, and return end-of-file while no writer has it open).
pub(crate) fn open(path: &Path) -> std::io::Result<(File, bool)> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
        if std::fs::metadata(path).is_ok_and(|m| m.file_type().is_fifo()) {
            let file =
                std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
            blocking(&file)?;
            return Ok((file, true));
        }
    }
    Ok((File::open(path)?, false))
}

/// Clears `O_NONBLOCK` on `file`: reads wait for data again.
#[cfg(unix)]
fn blocking(file: &File) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    // SAFETY: `fd` stays open while `file` lives; F_GETFL and F_SETFL only read and set the
    // descriptor's status flags.
    let ok = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) >= 0
    };
    match ok {
        true => Ok(()),
        false => Err(std::io::Error::last_os_error()),
    }
}

/// For a FIFO's reader that got end-of-file before any byte: whether to try again (no writer
/// yet, and less than [`FIFO_WAIT`] since `since`), after a short sleep.
pub(crate) fn wait_for_data(since: Instant) -> bool {
    if since.elapsed() >= FIFO_WAIT {
        return false;
    }
    std::thread::sleep(Duration::from_millis(10));
    true
}
