//! What the benches in `tests/benches/` share: whether this is the full run of `make bench`
//! or the quick run of `make test`, and a qcow2 image of incompressible bytes.
//!
//! `cargo bench` runs a bench binary with `--bench`; `cargo test --benches` (the quick run
//! `make test` makes, so a broken bench fails CI) runs it without. A quick run does every
//! step of its bench a few times on small inputs and prints the same lines; its figures
//! are not meant to be read.

use std::io::Write as _;
use std::path::Path;

use anyhow::{Context, Result, ensure};

/// Whether `cargo bench` started this binary (`--bench`): the full run, else the quick one.
pub fn full() -> bool {
    std::env::args().any(|a| a == "--bench")
}

/// `full` in the full run, `quick` in the quick one.
pub fn pick<T>(full_value: T, quick: T) -> T {
    if full() { full_value } else { quick }
}

/// Prints which run this is, so a log shows that a quick run's figures are not figures.
pub fn announce(name: &str) {
    if !full() {
        println!(
            "{name} bench: quick run (cargo test --benches): every step, small inputs, figures not meaningful"
        );
    }
}

/// `met` or `NOT met`, the word every goal line ends with.
pub fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "NOT met" }
}

/// Writes `mib` MiB of pseudo-random bytes (xorshift: nothing compresses) to `raw`. With
/// `repeat`, one random MiB is written over and over (fast to make, still incompressible to
/// any stream compressor with a window under 1 MiB).
pub fn write_random_file(raw: &Path, mib: u64, repeat: bool) -> Result<()> {
    const MIB: usize = 1024 * 1024;
    let mut file = std::fs::File::create(raw).with_context(|| format!("{}", raw.display()))?;
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15 ^ u64::from(std::process::id());
    let mut block = vec![0u8; MIB];
    let mut fill = |block: &mut [u8]| {
        for word in block.chunks_exact_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes());
        }
    };
    fill(&mut block);
    for i in 0..mib {
        if !repeat && i > 0 {
            fill(&mut block);
        }
        file.write_all(&block)?;
    }
    file.sync_all()?;
    Ok(())
}

/// A qcow2 image at `path` whose clusters hold `mib` MiB of incompressible bytes (see
/// [`write_random_file`]): random bytes made into a real qcow2 by `qemu-img convert`, as
/// the image cache requires. Returns its sha256. The raw file is removed.
pub fn random_qcow2(path: &Path, mib: u64, repeat: bool) -> Result<String> {
    let raw = path.with_extension("raw");
    write_random_file(&raw, mib, repeat)?;
    let out = std::process::Command::new("qemu-img")
        .args(["convert", "-q", "-f", "raw", "-O", "qcow2"])
        .arg(&raw)
        .arg(path)
        .output()
        .context("running qemu-img (make setup installs it)")?;
    std::fs::remove_file(&raw)?;
    ensure!(
        out.status.success(),
        "qemu-img convert failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = std::process::Command::new("sha256sum").arg(path).output()?;
    ensure!(out.status.success(), "sha256sum failed: {out:?}");
    let text = String::from_utf8(out.stdout)?;
    Ok(text
        .get(..64)
        .context("short sha256sum output")?
        .to_string())
}
