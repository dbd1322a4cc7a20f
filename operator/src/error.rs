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

/// Class of a Kubernetes API failure, one table for the controller, the garbage
/// collector and leader election: a missing object is `NotFound`; timeouts, conflicts
/// with another writer, an expired resource version and throttling pass (`Transient`);
/// any other refusal (RBAC, a missing CRD's 404 aside, invalid requests) repeats until
/// someone changes something (`Permanent`); server errors and transport failures pass.
pub fn kube_error_class(e: &kube::Error) -> ErrorClass {
    match e {
        kube::Error::Api(status) => match status.code {
            404 => ErrorClass::NotFound,
            408 | 409 | 410 | 429 => ErrorClass::Transient,
            400..=499 => ErrorClass::Permanent,
            _ => ErrorClass::Transient,
        },
        _ => ErrorClass::Transient,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubernetes_api_codes_map_to_classes() {
        let table = [
            (400, ErrorClass::Permanent),
            (401, ErrorClass::Permanent),
            (403, ErrorClass::Permanent),
            (404, ErrorClass::NotFound),
            (408, ErrorClass::Transient),
            (409, ErrorClass::Transient),
            (410, ErrorClass::Transient),
            (422, ErrorClass::Permanent),
            (429, ErrorClass::Transient),
            (500, ErrorClass::Transient),
            (503, ErrorClass::Transient),
        ];
        for (code, class) in table {
            let e = kube::Error::Api(Box::new(kube::core::Status {
                code,
                ..Default::default()
            }));
            assert_eq!(kube_error_class(&e), class, "HTTP {code}");
        }
        let transport = kube::Error::Service("connection refused".into());
        assert_eq!(kube_error_class(&transport), ErrorClass::Transient);
    }
}
