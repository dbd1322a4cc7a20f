//! Classes of libvirt errors, by error code.
//!
//! The controller acts only on a class, so this table decides whether a failed libvirt call
//! is retried with backoff (transient), reported and left alone (permanent), treated as
//! "the object is gone" (not found), or retried slowly (quota). It also says which errors
//! mean the *link* is broken, so the connection is marked dead and redialled.

use virt::error::{Error as VirtError, ErrorDomain, ErrorNumber};

use crate::error::ErrorClass;

/// The class of a libvirt error code.
pub fn class_of(code: ErrorNumber) -> ErrorClass {
    use ErrorNumber::*;
    match code {
        NoDomain | NoNetwork | NoStoragePool | NoStorageVolume | NoSecret | NoInterface
        | NoNodeDevice | NoDomainSnapshot | NoDomainMetadata | NoNwfilter | NoDomainCheckpoint
        | NoNetworkPort | NoNwfilterBinding => ErrorClass::NotFound,
        // The link, the daemon or a guest agent is busy, slow or gone: retrying can work.
        SystemError | Rpc | NoConnect | InvalidConn | OperationTimeout | AgentUnresponsive
        | AgentUnsynced | AgentCommandTimeout | ResourceBusy | OperationAborted | NoMemory
        | NoServer | NoClient => ErrorClass::Transient,
        // Everything else is about what we asked for (bad XML, a name in use, a feature the
        // host lacks, access denied): the same call fails the same way.
        _ => ErrorClass::Permanent,
    }
}

/// Whether an error means the connection itself is unusable (redial before the next call).
pub fn is_link_failure(e: &VirtError) -> bool {
    match e.code() {
        ErrorNumber::Rpc | ErrorNumber::NoConnect | ErrorNumber::InvalidConn => true,
        // I/O errors on the RPC channel (not e.g. a failed file operation on the host),
        // and the RPC client's "client socket is closed", which libvirt reports as an
        // internal error of the RPC domain after the daemon went away.
        ErrorNumber::SystemError | ErrorNumber::InternalError => {
            matches!(e.domain(), ErrorDomain::Rpc | ErrorDomain::Remote)
        }
        _ => false,
    }
}

/// The class of a libvirt error (codes not in the table are permanent).
pub fn classify(e: &VirtError) -> ErrorClass {
    if is_link_failure(e) {
        return ErrorClass::Transient;
    }
    class_of(e.code())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_table() {
        use ErrorNumber::*;
        let table = [
            (NoDomain, ErrorClass::NotFound),
            (NoStorageVolume, ErrorClass::NotFound),
            (NoStoragePool, ErrorClass::NotFound),
            (NoNetwork, ErrorClass::NotFound),
            (NoDomainMetadata, ErrorClass::NotFound),
            (SystemError, ErrorClass::Transient),
            (Rpc, ErrorClass::Transient),
            (NoConnect, ErrorClass::Transient),
            (InvalidConn, ErrorClass::Transient),
            (OperationTimeout, ErrorClass::Transient),
            (AgentUnresponsive, ErrorClass::Transient),
            (ResourceBusy, ErrorClass::Transient),
            (XmlError, ErrorClass::Permanent),
            (XmlInvalidSchema, ErrorClass::Permanent),
            (DomExist, ErrorClass::Permanent),
            (StorageVolExist, ErrorClass::Permanent),
            (OperationInvalid, ErrorClass::Permanent),
            (OperationDenied, ErrorClass::Permanent),
            (AccessDenied, ErrorClass::Permanent),
            (AuthFailed, ErrorClass::Permanent),
            (ConfigUnsupported, ErrorClass::Permanent),
            (NoSupport, ErrorClass::Permanent),
            (InvalidArg, ErrorClass::Permanent),
            (InternalError, ErrorClass::Permanent),
        ];
        for (code, class) in table {
            assert_eq!(class_of(code), class, "{code:?}");
        }
    }
}
