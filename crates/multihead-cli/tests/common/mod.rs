//! Helpers shared by the binary's test files.

// Each test file compiles this module for itself and uses a part of it.
#![allow(dead_code)]

use std::ops::Deref;
use std::path::{Path, PathBuf};

/// A fresh directory for one test under the system's temporary directory, removed with
/// everything in it when dropped, so that test runs leave nothing behind. Derefs to the
/// directory's path (or, after [`Scratch::sub`], to a folder inside it).
pub struct Scratch {
    _root: tempfile::TempDir,
    path: PathBuf,
}

impl Scratch {
    /// A new empty directory whose name starts with `multihead-{name}-`.
    pub fn new(name: &str) -> Scratch {
        let root = tempfile::Builder::new()
            .prefix(&format!("multihead-{name}-"))
            .tempdir()
            .expect("a temporary directory");
        let path = root.path().to_path_buf();
        Scratch { _root: root, path }
    }

    /// The same scratch, now pointing at `rel` inside it (created).
    pub fn sub(self, rel: &str) -> Scratch {
        let path = self.path.join(rel);
        std::fs::create_dir_all(&path).expect("a folder in the scratch directory");
        Scratch { path, ..self }
    }
}

impl Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.path.as_os_str()
    }
}
