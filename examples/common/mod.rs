//! Sentences for the examples that take a corpus (`embed`, `attention_dump`): the ones on
//! the command line, then a file's lines, read a window at a time so memory does not grow
//! with the file, with a progress bar on stderr when stderr is a terminal.

use std::fs::File;
use std::io::{BufRead, BufReader, IsTerminal};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};

/// Sentences from the command line, then from a UTF-8 file, one per line (blank lines
/// skipped, a trailing `\r` dropped).
pub struct Sentences {
    given: std::vec::IntoIter<String>,
    file: Option<(BufReader<File>, PathBuf)>,
    /// Bytes of the file read so far.
    offset: u64,
    progress: Option<ProgressBar>,
    produced: usize,
}

impl Sentences {
    /// `given` first, then `file`'s lines; errors when there is no sentence at all.
    pub fn open(given: Vec<String>, file: Option<&Path>) -> anyhow::Result<Self> {
        let file = file
            .map(|path| {
                let f =
                    File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
                anyhow::Ok((f, path.to_path_buf()))
            })
            .transpose()?;
        let progress = match &file {
            Some((f, _)) if std::io::stderr().is_terminal() => {
                let len = f.metadata().map(|m| m.len()).unwrap_or(0);
                let bar = ProgressBar::new(len).with_style(ProgressStyle::with_template(
                    "{bar:40} {percent:>3}% {msg} sentences, {elapsed} (eta {eta})",
                )?);
                Some(bar)
            }
            _ => None,
        };
        Ok(Self {
            given: given.into_iter(),
            file: file.map(|(f, p)| (BufReader::new(f), p)),
            offset: 0,
            progress,
            produced: 0,
        })
    }

    /// Up to `n` more sentences; empty at the end. The first call errors when there are
    /// none at all.
    pub fn next_window(&mut self, n: usize) -> anyhow::Result<Vec<String>> {
        let mut out: Vec<String> = self.given.by_ref().take(n).collect();
        if let Some((reader, path)) = &mut self.file {
            let mut line = Vec::new();
            while out.len() < n {
                line.clear();
                let read = reader
                    .read_until(b'\n', &mut line)
                    .with_context(|| format!("cannot read {}", path.display()))?;
                if read == 0 {
                    break;
                }
                let text = std::str::from_utf8(&line).map_err(|e| {
                    anyhow::anyhow!(
                        "{} is not valid UTF-8 (first bad byte at offset {})",
                        path.display(),
                        self.offset + e.valid_up_to() as u64
                    )
                })?;
                self.offset += read as u64;
                let text = text.trim_end_matches('\n').trim_end_matches('\r');
                if !text.trim().is_empty() {
                    out.push(text.to_string());
                }
            }
        }
        if self.produced == 0 && out.is_empty() {
            bail!("no sentence given: pass one or more sentences, or --file FILE");
        }
        self.produced += out.len();
        Ok(out)
    }

    /// Reports that the sentences handed out so far are done.
    pub fn advance_progress(&self) {
        if let Some(bar) = &self.progress {
            bar.set_position(self.offset);
            bar.set_message(self.produced.to_string());
        }
    }

    /// Removes the progress bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.progress {
            bar.finish_and_clear();
        }
    }

    /// Sentences handed out so far.
    pub fn produced(&self) -> usize {
        self.produced
    }
}
