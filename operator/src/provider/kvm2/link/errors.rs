//! Errors of the SSH layer, each with a stable reason code and an error class.
//!
//! The reason code feeds `egress-operator check` and metrics labels; the class feeds the
//! controller's requeue policy. Messages name the host, the file or the key fingerprint a
//! person needs to act, and never any private key material (invariant 7).

use std::path::PathBuf;
use std::time::Duration;

use thiserror::Error;

use super::known_hosts::HostKeyError;
use crate::error::{Classified, ErrorClass};

/// A failure to reach, authenticate to or use an SSH host.
#[derive(Debug, Error)]
pub enum SshError {
    /// The host's address in the config cannot be used (config validation normally
    /// catches this first).
    #[error("invalid SSH address {address:?}: {reason}")]
    Config {
        /// The address as configured.
        address: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The host name did not resolve.
    #[error("cannot resolve {host}: {source}")]
    Dns {
        /// The name that was looked up.
        host: String,
        /// The resolver's answer.
        #[source]
        source: std::io::Error,
    },
    /// The TCP connection failed (refused, unreachable, reset).
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// `host:port`.
        addr: String,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// The SSH handshake failed after TCP connected (protocol error, no common algorithm,
    /// the server hung up).
    #[error("SSH handshake with {addr} failed: {source}")]
    Handshake {
        /// `host:port`.
        addr: String,
        /// russh's reason (boxed: russh's error is large).
        #[source]
        source: Box<russh::Error>,
    },
    /// A deadline passed: connecting (TCP + handshake + auth), opening a channel, or a
    /// keepalive probe.
    #[error("SSH to {addr}: {stage} did not finish within {}", humantime::format_duration(*after))]
    Timeout {
        /// `host:port`.
        addr: String,
        /// What was under way: `dns lookup`, `tcp connect`, `ssh handshake`, ...
        stage: &'static str,
        /// The deadline that passed.
        after: Duration,
    },
    /// The server refused our key (or asked for more than one method).
    #[error("SSH authentication as {user:?} to {addr} failed: {reason}")]
    Auth {
        /// The remote user.
        user: String,
        /// `host:port`.
        addr: String,
        /// What the server said, with our public key's fingerprint.
        reason: String,
    },
    /// The server's host key is not trusted, or the known_hosts file is unreadable.
    #[error("SSH to {addr} refused: {source}")]
    HostKey {
        /// `host:port`.
        addr: String,
        /// Unknown, changed or revoked key (with fingerprint and known_hosts path).
        #[source]
        source: HostKeyError,
    },
    /// The private key file is unusable: unreadable, too open, encrypted or malformed.
    #[error("SSH private key file {}: {reason}", path.display())]
    KeyFile {
        /// The file.
        path: PathBuf,
        /// What is wrong (never the key's content).
        reason: String,
    },
    /// The server refused to open a channel (e.g. the socket does not exist, or
    /// streamlocal forwarding is disabled in sshd_config).
    #[error(
        "SSH to {addr}: cannot open a channel to {target}: {source}{}",
        channel_hint(source)
    )]
    Channel {
        /// `host:port`.
        addr: String,
        /// What the channel was for: the remote socket path.
        target: String,
        /// russh's reason (boxed: russh's error is large).
        #[source]
        source: Box<russh::Error>,
    },
    /// The SSH session is gone (keepalive timeout, server hung up, closed by us).
    #[error("SSH session to {addr} is closed: {reason}")]
    Disconnected {
        /// `host:port`.
        addr: String,
        /// Why, as far as known.
        reason: String,
    },
    /// The local end of a tunnel could not be set up (temp dir, socket).
    #[error("cannot set up the local tunnel socket {}: {source}", path.display())]
    Tunnel {
        /// The directory or socket.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

impl SshError {
    /// A short stable code for `check` output and metrics labels.
    pub fn reason_code(&self) -> &'static str {
        match self {
            SshError::Config { .. } => "config",
            SshError::Dns { .. } => "dns",
            SshError::Connect { .. } | SshError::Handshake { .. } => "connect",
            SshError::Timeout { .. } => "timeout",
            SshError::Auth { .. } => "auth",
            SshError::HostKey { .. } => "host-key",
            SshError::KeyFile { .. } => "key-file",
            SshError::Channel { source, .. } if is_prohibited(source) => "forwarding-disabled",
            SshError::Channel { .. } => "libvirt-socket",
            SshError::Disconnected { .. } => "disconnected",
            SshError::Tunnel { .. } => "tunnel",
        }
    }

    /// The stage of a dial this error belongs to, as a stable code for `check` and the
    /// health status: `key-files`, `dns`, `tcp-connect`, `ssh-handshake`, `ssh-auth`,
    /// `channel`, `tunnel` (or `keepalive` for a failed probe of a live session).
    pub fn stage(&self) -> Option<&'static str> {
        Some(match self {
            SshError::Config { .. } => "config",
            SshError::KeyFile { .. } => "key-files",
            SshError::Dns { .. } => "dns",
            SshError::Connect { .. } => "tcp-connect",
            SshError::Handshake { .. } | SshError::HostKey { .. } => "ssh-handshake",
            SshError::Auth { .. } => "ssh-auth",
            SshError::Channel { .. } => "channel",
            SshError::Tunnel { .. } => "tunnel",
            SshError::Disconnected { .. } => return None,
            SshError::Timeout { stage, .. } => match *stage {
                "reading the key files" => "key-files",
                "dns lookup" => "dns",
                "tcp connect" => "tcp-connect",
                "ssh handshake" => "ssh-handshake",
                "ssh authentication" => "ssh-auth",
                "opening a channel" => "channel",
                "keepalive probe" => "keepalive",
                _ => return None,
            },
        })
    }
}

/// What a person should check after a refused channel. OpenSSH (9.2 at least) answers
/// "connect failed" both for a socket it cannot connect to and for forwarding its config
/// forbids, so both are named; "administratively prohibited" is unambiguous.
fn channel_hint(e: &russh::Error) -> &'static str {
    match e {
        russh::Error::ChannelOpenFailure(russh::ChannelOpenFailure::AdministrativelyProhibited) => {
            "; sshd forbids streamlocal forwarding (AllowStreamLocalForwarding, \
             DisableForwarding)"
        }
        russh::Error::ChannelOpenFailure(_) => {
            "; check that libvirtSocket names the host's libvirt socket and that the SSH user \
             may connect to it, and that sshd allows streamlocal forwarding \
             (AllowStreamLocalForwarding, AllowTcpForwarding, DisableForwarding)"
        }
        _ => "",
    }
}

/// sshd answered a channel open with "administratively prohibited": its config forbids
/// streamlocal forwarding (`AllowStreamLocalForwarding no`, `DisableForwarding yes`).
fn is_prohibited(e: &russh::Error) -> bool {
    matches!(
        e,
        russh::Error::ChannelOpenFailure(russh::ChannelOpenFailure::AdministrativelyProhibited)
    )
}

impl Classified for SshError {
    fn class(&self) -> ErrorClass {
        match self {
            // Someone must change the config, the Secret or the host: retrying the same
            // dial gives the same answer.
            SshError::Config { .. }
            | SshError::Auth { .. }
            | SshError::HostKey { .. }
            | SshError::KeyFile { .. } => ErrorClass::Permanent,
            // No common algorithm or a non-SSH server will not fix itself.
            SshError::Handshake { source, .. } => match source.as_ref() {
                russh::Error::NoCommonAlgo { .. } | russh::Error::Version => ErrorClass::Permanent,
                _ => ErrorClass::Transient,
            },
            // sshd_config forbids streamlocal forwarding, or the configured libvirt socket
            // does not answer: an admin must change the host or the config. (A socket that
            // answered before in this process is libvirtd restarting, and one that never
            // did is asked again for a while: the hosts table reports both as transient,
            // `HostError::SocketGone` and `HostError::SocketNotYet`.) A channel that failed
            // for any other reason (the session broke meanwhile) may pass.
            SshError::Channel { source, .. } => match source.as_ref() {
                russh::Error::ChannelOpenFailure(_) => ErrorClass::Permanent,
                _ => ErrorClass::Transient,
            },
            SshError::Dns { .. }
            | SshError::Connect { .. }
            | SshError::Timeout { .. }
            | SshError::Disconnected { .. }
            | SshError::Tunnel { .. } => ErrorClass::Transient,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn io() -> std::io::Error {
        std::io::Error::other("x")
    }

    #[test]
    fn codes_and_classes() {
        let addr = || "h:22".to_string();
        let cases: Vec<(SshError, &str, ErrorClass)> = vec![
            (
                SshError::Config {
                    address: "a".into(),
                    reason: "r".into(),
                },
                "config",
                ErrorClass::Permanent,
            ),
            (
                SshError::Dns {
                    host: "h".into(),
                    source: io(),
                },
                "dns",
                ErrorClass::Transient,
            ),
            (
                SshError::Connect {
                    addr: addr(),
                    source: io(),
                },
                "connect",
                ErrorClass::Transient,
            ),
            (
                SshError::Handshake {
                    addr: addr(),
                    source: Box::new(russh::Error::HUP),
                },
                "connect",
                ErrorClass::Transient,
            ),
            (
                SshError::Handshake {
                    addr: addr(),
                    source: Box::new(russh::Error::Version),
                },
                "connect",
                ErrorClass::Permanent,
            ),
            (
                SshError::Timeout {
                    addr: addr(),
                    stage: "ssh handshake",
                    after: Duration::from_secs(2),
                },
                "timeout",
                ErrorClass::Transient,
            ),
            (
                SshError::Auth {
                    user: "u".into(),
                    addr: addr(),
                    reason: "r".into(),
                },
                "auth",
                ErrorClass::Permanent,
            ),
            (
                SshError::HostKey {
                    addr: addr(),
                    source: HostKeyError::File {
                        path: "/k".into(),
                        source: io(),
                    },
                },
                "host-key",
                ErrorClass::Permanent,
            ),
            (
                SshError::KeyFile {
                    path: "/k".into(),
                    reason: "r".into(),
                },
                "key-file",
                ErrorClass::Permanent,
            ),
            (
                SshError::Channel {
                    addr: addr(),
                    target: "/s".into(),
                    source: Box::new(russh::Error::ChannelOpenFailure(
                        russh::ChannelOpenFailure::ConnectFailed,
                    )),
                },
                "libvirt-socket",
                ErrorClass::Permanent,
            ),
            (
                SshError::Channel {
                    addr: addr(),
                    target: "/s".into(),
                    source: Box::new(russh::Error::ChannelOpenFailure(
                        russh::ChannelOpenFailure::AdministrativelyProhibited,
                    )),
                },
                "forwarding-disabled",
                ErrorClass::Permanent,
            ),
            (
                SshError::Channel {
                    addr: addr(),
                    target: "/s".into(),
                    source: Box::new(russh::Error::HUP),
                },
                "libvirt-socket",
                ErrorClass::Transient,
            ),
            (
                SshError::Disconnected {
                    addr: addr(),
                    reason: "r".into(),
                },
                "disconnected",
                ErrorClass::Transient,
            ),
            (
                SshError::Tunnel {
                    path: "/t".into(),
                    source: io(),
                },
                "tunnel",
                ErrorClass::Transient,
            ),
        ];
        for (e, code, class) in cases {
            assert_eq!(e.reason_code(), code, "{e}");
            assert_eq!(e.class(), class, "{e}");
        }
    }

    #[test]
    fn timeout_message_reads_well() {
        let e = SshError::Timeout {
            addr: "127.0.0.1:2222".into(),
            stage: "ssh handshake",
            after: Duration::from_secs(2),
        };
        assert_eq!(
            e.to_string(),
            "SSH to 127.0.0.1:2222: ssh handshake did not finish within 2s"
        );
    }
}
