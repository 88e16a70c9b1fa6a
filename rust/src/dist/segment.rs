//! A POSIX shared-memory segment mapped read-write into this process.
use std::collections::hash_map::RandomState;
use std::ffi::CString;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use super::{os_error, DistError, DistResult};

static CREATED: AtomicU64 = AtomicU64::new(0);

/// One mapping of a named segment. Dropping it unmaps it (the name is separate: see `unlink`).
pub struct Segment {
    ptr: *mut u8,
    len: usize,
    name: String,
}

// SAFETY: the mapping is plain memory owned by this value; the users synchronise every access
// to its contents through atomics in the segment itself.
unsafe impl Send for Segment {}
unsafe impl Sync for Segment {}

fn c_name(name: &str) -> DistResult<CString> {
    let valid = name.len() > 1
        && name.len() < 250
        && name.starts_with('/')
        && !name[1..].contains('/')
        && !name.contains('\0');
    if !valid {
        return Err(DistError::InvalidArgument(format!(
            "{name:?} is not a shared-memory segment name (one '/' then up to 248 characters)"
        )));
    }
    Ok(CString::new(name).expect("checked for NUL above"))
}

impl Segment {
    /// Creates a new segment of `len` bytes (zeroed) named `/{prefix}-{pid}-{n}-{random}`.
    pub fn create(prefix: &str, len: usize) -> DistResult<Segment> {
        let mut hasher = RandomState::new().build_hasher();
        hasher.write_u64(CREATED.fetch_add(1, Ordering::Relaxed));
        let name = format!(
            "/{prefix}-{}-{}-{:016x}",
            std::process::id(),
            CREATED.load(Ordering::Relaxed),
            hasher.finish()
        );
        let c = c_name(&name)?;
        // SAFETY: plain libc calls on a valid C string; every failure is checked.
        unsafe {
            let fd = libc::shm_open(
                c.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600 as libc::mode_t,
            );
            if fd < 0 {
                return Err(os_error(&format!("shm_open({name}) failed")));
            }
            if libc::ftruncate(fd, len as libc::off_t) != 0 {
                let err = os_error(&format!("ftruncate({name}, {len}) failed"));
                libc::close(fd);
                libc::shm_unlink(c.as_ptr());
                return Err(err);
            }
            match Self::map(fd, len, &name) {
                Ok(ptr) => Ok(Segment { ptr, len, name }),
                Err(err) => {
                    libc::shm_unlink(c.as_ptr());
                    Err(err)
                }
            }
        }
    }

    /// Maps the existing segment `name` (its whole size).
    pub fn open(name: &str) -> DistResult<Segment> {
        let c = c_name(name)?;
        // SAFETY: as in `create`.
        unsafe {
            let fd = libc::shm_open(c.as_ptr(), libc::O_RDWR, 0);
            if fd < 0 {
                return Err(os_error(&format!("shm_open({name}) failed")));
            }
            let mut stat: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut stat) != 0 {
                let err = os_error(&format!("fstat({name}) failed"));
                libc::close(fd);
                return Err(err);
            }
            let len = stat.st_size as usize;
            let ptr = Self::map(fd, len, name)?;
            Ok(Segment {
                ptr,
                len,
                name: name.to_string(),
            })
        }
    }

    /// mmaps `fd` and closes it (the mapping keeps the segment alive).
    unsafe fn map(fd: libc::c_int, len: usize, name: &str) -> DistResult<*mut u8> {
        let ptr = libc::mmap(
            std::ptr::null_mut(),
            len.max(1),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        );
        let err = os_error(&format!("mmap({name}, {len}) failed"));
        libc::close(fd);
        if ptr == libc::MAP_FAILED {
            return Err(err);
        }
        Ok(ptr.cast())
    }

    /// Removes the name from `/dev/shm` (the memory lives on while mapped). Idempotent.
    pub fn unlink(&self) -> DistResult<()> {
        unlink(&self.name)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
}

/// Removes the segment `name`; a name already gone is not an error.
pub fn unlink(name: &str) -> DistResult<()> {
    let c = c_name(name)?;
    // SAFETY: plain libc call on a valid C string.
    if unsafe { libc::shm_unlink(c.as_ptr()) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::ENOENT) {
            return Err(DistError::Os(format!("shm_unlink({name}) failed: {err}")));
        }
    }
    Ok(())
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are the mapping made in `map`, unmapped once.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len.max(1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exists(name: &str) -> bool {
        std::path::Path::new(&format!("/dev/shm{name}")).exists()
    }

    #[test]
    fn a_created_segment_is_shared_with_an_opener_and_gone_once_unlinked() {
        let a = Segment::create("pagedllm-test", 4096).unwrap();
        let b = Segment::open(a.name()).unwrap();
        assert_eq!(b.len(), 4096);
        unsafe {
            *a.as_ptr().add(100) = 42;
            assert_eq!(*b.as_ptr().add(100), 42);
        }
        assert!(exists(a.name()));
        a.unlink().unwrap();
        assert!(!exists(a.name()));
        a.unlink().unwrap(); // idempotent
        unsafe { assert_eq!(*b.as_ptr().add(100), 42) }; // still mapped
    }

    #[test]
    fn a_bad_name_is_refused() {
        assert!(matches!(
            Segment::open("no-slash"),
            Err(DistError::InvalidArgument(_))
        ));
        assert!(matches!(
            Segment::open("/pagedllm-missing-x"),
            Err(DistError::Os(_))
        ));
    }
}
