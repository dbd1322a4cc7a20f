//! The `egress-operator` binary, built inside this package so process-level tests get its
//! path from Cargo (`CARGO_BIN_EXE_operator-under-test`) and it is always fresh.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    egress_operator::cli::run(egress_operator::cli::Cli::parse())
}
