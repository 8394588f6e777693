//! A file's bytes read into anonymous memory that Linux backs with 2 MB pages (transparent
//! huge pages, asked for with `madvise`). A decode step streams every weight once, and on
//! 4 KB pages each page's first lines wait for a TLB walk and a restarted hardware
//! prefetcher; on 2 MB pages the 8-bit GGUF decode ran 9-17% faster and the exact one 5-18%
//! (see docs/performance.md). Where the kernel has no huge pages for us, the caller maps
//! the file instead.

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
}

/// The first `len` bytes of `file` (from its current position) in huge-page memory:
/// `Ok(None)` where transparent huge pages are off or not Linux's, so the caller maps the
/// file instead; an error when reading fails.
pub(crate) fn read(file: &mut std::fs::File, len: usize) -> std::io::Result<Option<HugeBytes>> {
    if !available() || len == 0 {
        return Ok(None);
    }
    // One page more than needed, so the bytes can start on a 2 MB boundary.
    let Some(cap) = len
        .div_ceil(HUGE_PAGE)
        .checked_add(1)
        .and_then(|p| p.checked_mul(HUGE_PAGE))
    else {
        return Ok(None);
    };
    let Ok(mut map) = memmap2::MmapMut::map_anon(cap) else {
        return Ok(None);
    };
    advise(&map);
    let start = (HUGE_PAGE - map.as_ptr() as usize % HUGE_PAGE) % HUGE_PAGE;
    file.read_exact(&mut map[start..start + len])?;
    Ok(Some(HugeBytes { map, start, len }))
}

/// Whether this kernel gives huge pages to memory advised for them: Linux with
/// `transparent_hugepage/enabled` set to `always` or `madvise`.
fn available() -> bool {
    cfg!(target_os = "linux")
        && std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|mode| thp_allows_madvise(&mode))
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
                None => assert!(!available()),
            }
        }
        // Asking for more than the file holds is an error, not a short read.
        let mut file = std::fs::File::open(dir.join("1.bin"))?;
        if available() {
            assert!(read(&mut file, 2).is_err());
        }
        std::fs::remove_dir_all(&dir)
    }
}
