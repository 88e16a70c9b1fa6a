//! The examples' memory as the engine places weights and KV caches: an anonymous mapping aligned
//! to 2 MiB, advised onto transparent huge pages (or off them) before its first touch.

const HUGE: usize = 2 << 20;

/// `len` elements, element `i` being `value(i)`, in a fresh mapping on huge pages where `huge`
/// (`MADV_HUGEPAGE`, else `MADV_NOHUGEPAGE`). Leaked: an example ends after its measurement.
pub fn filled<T>(len: usize, huge: bool, value: impl Fn(usize) -> T) -> &'static [T] {
    let bytes = len * std::mem::size_of::<T>();
    // SAFETY: a fresh private anonymous mapping of `bytes + HUGE`, 2 MiB-aligned inside it (T's
    // alignment is at most a page), every element written before the slice is made of it.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            bytes + HUGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(p, libc::MAP_FAILED, "mmap failed");
        let start = (p as usize).next_multiple_of(HUGE) as *mut T;
        let advice = if huge {
            libc::MADV_HUGEPAGE
        } else {
            libc::MADV_NOHUGEPAGE
        };
        libc::madvise(start.cast(), bytes, advice);
        for i in 0..len {
            start.add(i).write(value(i));
        }
        std::slice::from_raw_parts(start, len)
    }
}
