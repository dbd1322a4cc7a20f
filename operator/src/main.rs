//! The `egress-operator` binary: parse the command line, hand off to the library.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = egress_operator::cli::Cli::parse();
    egress_operator::cli::run(cli)
}
