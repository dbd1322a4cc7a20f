//! The command line: one subcommand per job, each a thin layer over the library.
//!
//! Commands print results on stdout and problems on stderr, and return the process exit
//! code, so they can be tested in-process and scripted in CI.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config;

/// Operator for egress proxy VMs on remote KVM/libvirt hosts.
#[derive(Debug, Parser)]
#[command(name = "egress-operator", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the JSON Schema of the providers config.
    ConfigSchema,
    /// Validate a providers config file and print every problem it has.
    ValidateConfig {
        /// The providers config (YAML).
        file: PathBuf,
        /// Also check Proxy manifests against the config.
        #[arg(long = "proxy", value_name = "FILE")]
        proxies: Vec<PathBuf>,
    },
}

/// Runs one command, writing to the process's stdout and stderr.
pub fn run(cli: Cli) -> ExitCode {
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr().lock();
    ExitCode::from(execute(cli.command, &mut out, &mut err))
}

/// Runs one command against the given writers and returns the exit code
/// (0 success, 1 the input was refused, 2 an output error).
pub fn execute(command: Command, out: &mut dyn Write, err: &mut dyn Write) -> u8 {
    let result = match command {
        Command::ConfigSchema => out.write_all(config::json_schema().as_bytes()).map(|_| 0),
        Command::ValidateConfig { file, proxies } => validate_config(&file, &proxies, out, err),
    };
    result.unwrap_or(2)
}

fn validate_config(
    file: &std::path::Path,
    proxies: &[PathBuf],
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> std::io::Result<u8> {
    let config = match config::load_file(file) {
        Ok(c) => c,
        Err(e) => {
            report(&e, err)?;
            return Ok(1);
        }
    };
    let mut failed = false;
    for proxy in proxies {
        if let Err(e) = crate::api::proxy::load_manifest(proxy, &config) {
            report(&e, err)?;
            failed = true;
        }
    }
    if failed {
        return Ok(1);
    }
    let extra = match proxies.len() {
        0 => String::new(),
        n => format!(", {n} Proxy manifest(s) checked"),
    };
    writeln!(
        out,
        "{}: valid: {}{extra}",
        file.display(),
        config.summary()
    )?;
    Ok(0)
}

fn report(e: &config::ConfigError, err: &mut dyn Write) -> std::io::Result<()> {
    match e {
        config::ConfigError::Invalid { document, problems } => {
            writeln!(err, "{document}: {} problem(s)", problems.len())?;
            for p in problems {
                writeln!(err, "  {p}")?;
            }
            Ok(())
        }
        other => writeln!(err, "{other}"),
    }
}
