//! A file's bytes read into anonymous memory that Linux backs with 2 MB pages (transparent
//! huge pages, asked for with `madvise`). A decode step streams every weight once, and on
//! 4 KB pages each page's first lines wait for a TLB walk and a restarted hardware
//! prefetcher; on 2 MB pages the 8-bit GGUF decode ran 9-17% faster and the exact one 5-18%
//! (see docs/performance-archive.md). Where transparent huge pages are off, or the file would take
//! more than half the memory available, the caller maps the file instead (a map's clean
//! pages the kernel can drop; anonymous memory it cannot).

use std::io::Read;

/// Bytes of a 2 MB page.
const HUGE_PAGE: usize = 2 << 20;

/// `len` bytes read from a file into memory aligned to [`HUGE_PAGE`] and advised for huge
/// pages.
pub(crate) struct HugeBytes {
    map: memmap2::MmapMut,
    start: usize,
    len: usize,
}

impl HugeBytes {
    /// The bytes.
    pub(crate) fn as_slice(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }

    /// The bytes, to fill.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map[self.start..self.start + self.len]
    }
}

/// `len` zero bytes, on huge pages where [`read`] would put a file of that length, else on
/// ordinary anonymous pages.
pub(crate) fn zeroed(len: usize) -> std::io::Result<HugeBytes> {
    if let Some(bytes) = huge(len) {
        return Ok(bytes);
    }
    let map = memmap2::MmapMut::map_anon(len.max(1))?;
    Ok(HugeBytes { map, start: 0, len })
}

/// The first `len` bytes of `file` (from its current position) in huge-page memory:
/// `Ok(None)` where transparent huge pages are off or not Linux's, or `len` is more than
/// half the memory available, so the caller maps the file instead; an error when reading
/// fails.
pub(crate) fn read(file: &mut std::fs::File, len: usize) -> std::io::Result<Option<HugeBytes>> {
    let Some(mut bytes) = huge(len) else {
        return Ok(None);
    };
    file.read_exact(bytes.as_mut_slice())?;
    Ok(Some(bytes))
}

/// `len` zero bytes from a 2 MB boundary, advised for huge pages: `None` where they are off,
/// `len` is 0 or more than half the memory available, or the memory cannot be had.
fn huge(len: usize) -> Option<HugeBytes> {
    if !available() || len == 0 || !fits_in_memory(len, meminfo_available()) {
        return None;
    }
    // One page more than needed, so the bytes can start on a 2 MB boundary.
    let cap = len
        .div_ceil(HUGE_PAGE)
        .checked_add(1)?
        .checked_mul(HUGE_PAGE)?;
    let map = memmap2::MmapMut::map_anon(cap).ok()?;
    advise(&map);
    let start = (HUGE_PAGE - map.as_ptr() as usize % HUGE_PAGE) % HUGE_PAGE;
    Some(HugeBytes { map, start, len })
}

/// Whether this kernel gives huge pages to memory advised for them: Linux with
/// `transparent_hugepage/enabled` set to `always` or `madvise`.
fn available() -> bool {
    cfg!(target_os = "linux")
        && std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|mode| thp_allows_madvise(&mode))
}

/// Whether `len` bytes take at most half of `available` bytes (unknown: no).
fn fits_in_memory(len: usize, available: Option<u64>) -> bool {
    available.is_some_and(|a| (len as u64).saturating_mul(2) <= a)
}

/// `MemAvailable` from `/proc/meminfo`, in bytes.
fn meminfo_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo_field(&info, "MemAvailable:")
}

/// A `/proc/meminfo` field (`key` with its colon) in bytes (the file gives kB).
fn meminfo_field(info: &str, key: &str) -> Option<u64> {
    let kb: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix(key))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    kb.checked_mul(1024)
}

/// Whether a `transparent_hugepage/enabled` setting (`always [madvise] never`: the chosen
/// one in brackets) gives huge pages to advised memory.
fn thp_allows_madvise(mode: &str) -> bool {
    mode.contains("[always]") || mode.contains("[madvise]")
}

#[cfg(target_os = "linux")]
fn advise(map: &memmap2::MmapMut) {
    // A hint: without it (or refused) the bytes sit on 4 KB pages, only slower to stream.
    let _ = map.advise(memmap2::Advice::HugePage);
}

#[cfg(not(target_os = "linux"))]
fn advise(_: &memmap2::MmapMut) {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The setting's chosen mode is the bracketed one.
    #[test]
    fn reads_the_transparent_huge_page_setting() {
        assert!(thp_allows_madvise("always [madvise] never\n"));
        assert!(thp_allows_madvise("[always] madvise never\n"));
        assert!(!thp_allows_madvise("always madvise [never]\n"));
        assert!(!thp_allows_madvise(""));
    }

    /// A zeroed buffer of the length asked, writable, on a 2 MB boundary where huge pages
    /// are given.
    #[test]
    fn zeroed_buffers_are_writable() -> std::io::Result<()> {
        for len in [0usize, 1, HUGE_PAGE + 3] {
            let mut b = zeroed(len)?;
            assert_eq!(b.as_slice().len(), len);
            assert!(b.as_slice().iter().all(|&v| v == 0));
            if let Some(last) = b.as_mut_slice().last_mut() {
                *last = 9;
            }
            assert_eq!(b.as_slice().last(), (len > 0).then_some(&9));
            if available() && len > 0 && fits_in_memory(len, meminfo_available()) {
                assert_eq!(b.as_slice().as_ptr() as usize % HUGE_PAGE, 0);
            }
        }
        Ok(())
    }

    /// Files of more than half the available memory are left to a map.
    #[test]
    fn reads_only_what_fits_in_memory() {
        let info = "MemTotal:       24000000 kB\nMemAvailable:   1000 kB\nBuffers: 3 kB\n";
        assert_eq!(meminfo_field(info, "MemAvailable:"), Some(1_024_000));
        assert_eq!(meminfo_field(info, "Cached:"), None);
        assert!(fits_in_memory(512_000, Some(1_024_000)));
        assert!(!fits_in_memory(512_001, Some(1_024_000)));
        assert!(!fits_in_memory(1, None));
    }

    /// The bytes read are the file's, from a 2 MB boundary, whatever the length.
    #[test]
    fn reads_the_files_bytes() -> std::io::Result<()> {
        let dir = std::env::temp_dir().join(format!("huge-pages-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        for len in [1usize, 4095, HUGE_PAGE + 17] {
            let path = dir.join(format!("{len}.bin"));
            let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            std::fs::write(&path, &data)?;
            let mut file = std::fs::File::open(&path)?;
            match read(&mut file, len)? {
                Some(b) => {
                    assert_eq!(b.as_slice(), &data[..]);
                    assert_eq!(b.as_slice().as_ptr() as usize % HUGE_PAGE, 0);
                }
                None => assert!(!available() || !fits_in_memory(len, meminfo_available())),
            }
        }
        // Asking for more than the file holds is an error, not a short read.
        let mut file = std::fs::File::open(dir.join("1.bin"))?;
        if available() && fits_in_memory(2, meminfo_available()) {
            assert!(read(&mut file, 2).is_err());
        }
        std::fs::remove_dir_all(&dir)
    }
}
