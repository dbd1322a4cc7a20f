//! Error classes: the one thing the controller reads from an error to decide what to do.
//!
//! Every typed error in the crate maps to one class; requeue policy, metrics labels and
//! condition reasons are derived from the class, never from message text.

use std::fmt;

/// What kind of failure an error is, from the caller's point of view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// May succeed if retried later (network, timeouts, a busy host): back off and retry.
    Transient,
    /// Will fail the same way until someone changes input or config: do not hot-loop.
    Permanent,
    /// The object does not exist (any more).
    NotFound,
    /// A capacity limit was hit (host full, pool out of space): retry slowly.
    Quota,
}

impl ErrorClass {
    /// Stable lower-case label for metrics and condition reasons.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Transient => "transient",
            ErrorClass::Permanent => "permanent",
            ErrorClass::NotFound => "not_found",
            ErrorClass::Quota => "quota",
        }
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Implemented by every error type the controller may see.
pub trait Classified {
    /// The class of this error.
    fn class(&self) -> ErrorClass;
}
