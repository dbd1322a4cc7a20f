//! A stand-in for a test binary that uses the control plane, for the harness's own tests
//! of what a test process leaves behind (`tests/tests/controlplane*.rs`): it starts the
//! shared plane as any test binary's first cluster test does, prints
//! `PLANE <dir> <pid>...` (its directory and its daemons), then waits until its stdin
//! closes and exits as a test binary does, without dropping the plane (the shared plane is
//! a static: only its watchdog stops it). Killed instead, it ends as a crashed test does.

use std::io::{Read, Write};
use std::process::ExitCode;

use integration_tests::harness::ControlPlane;

fn main() -> ExitCode {
    let plane = match ControlPlane::shared() {
        Ok(plane) => plane,
        Err(e) => {
            eprintln!("plane-holder: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let Some(dir) = plane.dir() else {
        eprintln!("plane-holder: KUBECONFIG names an external cluster; no plane to hold");
        return ExitCode::FAILURE;
    };
    let pids: Vec<String> = plane.pids().iter().map(u32::to_string).collect();
    let mut out = std::io::stdout();
    if writeln!(out, "PLANE {} {}", dir.display(), pids.join(" "))
        .and_then(|()| out.flush())
        .is_err()
    {
        return ExitCode::FAILURE;
    }
    // Until the parent closes our stdin (or dies): the rest is its to decide.
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    ExitCode::SUCCESS
}
