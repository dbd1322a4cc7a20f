//! The `UpToDate` condition: was the instance made from what is configured now?
//!
//! The revision recorded at Create ([`crate::revision`]) is compared at every reconcile
//! with the one the provider would make now, part by part, so the condition names what
//! changed ("domainPlugin, image"). A pool replaces members whose condition is False as it
//! rolls a template change; a standalone Proxy only shows it.

use super::Context;
use super::status::{UP_TO_DATE, set_condition};
use crate::api::proxy::{Proxy, ProxyStatus};
use crate::provider::Instance;
use crate::revision::Revision;

/// Reason: the instance was made from the current inputs.
pub const CURRENT: &str = "Current";
/// Reason: made before revisions were kept; the current revision was recorded as its own.
pub const ADOPTED: &str = "Adopted";
/// Reason: inputs changed since the instance was made.
pub const INPUTS_CHANGED: &str = "InputsChanged";

/// Sets `new`'s revision (adopting one for an instance made before revisions were kept)
/// and its `UpToDate` condition, from what the Proxy's provider would make now. Leaves both
/// as they are when the provider cannot tell (a plugin still loading).
pub(super) fn judge(
    ctx: &Context,
    proxy: &Proxy,
    instance: &Instance,
    new: &mut ProxyStatus,
    now: jiff::Timestamp,
) {
    let Ok(provider) = super::provider_for(ctx, &proxy.spec.provider) else {
        return;
    };
    let compared = crate::revision::compare(
        provider.as_ref(),
        &proxy.spec,
        &instance.id.host,
        new.revision.as_ref(),
    );
    if let Some((rev, _)) = compared {
        apply(new, &rev, proxy.metadata.generation, now);
    }
}

/// The inputs that changed since `instance` was made, when the Proxy asks for such an
/// instance to be replaced (`spec.updatePolicy: Replace`) and no pool controls it (a pool
/// rolls its members surge-first instead); else `None`.
pub(super) fn replace_due(
    ctx: &Context,
    proxy: &Proxy,
    instance: &Instance,
    recorded: Option<&crate::api::proxy::ProxyRevision>,
) -> Option<Vec<&'static str>> {
    if proxy.spec.update_policy != Some(crate::api::proxy::UpdatePolicy::Replace) {
        return None;
    }
    let in_pool = proxy
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.kind == "ProxyPool");
    if in_pool {
        return None;
    }
    let provider = super::provider_for(ctx, &proxy.spec.provider).ok()?;
    let (_, changed) = crate::revision::compare(
        provider.as_ref(),
        &proxy.spec,
        &instance.id.host,
        Some(recorded?),
    )?;
    (!changed.is_empty()).then_some(changed)
}

/// The pure half of [`judge`]: compares `rev` (what would be made now) with the recorded
/// revision and writes the condition.
pub fn apply(new: &mut ProxyStatus, rev: &Revision, generation: Option<i64>, now: jiff::Timestamp) {
    let (ok, reason, message) = match &new.revision {
        None => {
            new.revision = Some(rev.to_status(true));
            (
                true,
                ADOPTED,
                format!(
                    "made before revisions were kept; revision {} (the current one) recorded as \
                     its own, so it is not rolled on that account",
                    rev.hash()
                ),
            )
        }
        Some(recorded) => {
            let changed = rev.changed_from(recorded);
            if changed.is_empty() {
                let reason = if recorded.adopted == Some(true) {
                    ADOPTED
                } else {
                    CURRENT
                };
                (
                    true,
                    reason,
                    format!("made from the current inputs (revision {})", recorded.hash),
                )
            } else {
                (
                    false,
                    INPUTS_CHANGED,
                    format!(
                        "changed since the instance was made: {} (revision {} now, {} when made)",
                        changed.join(", "),
                        rev.hash(),
                        recorded.hash
                    ),
                )
            }
        }
    };
    set_condition(
        &mut new.conditions,
        UP_TO_DATE,
        ok,
        reason,
        &message,
        generation,
        now,
    );
}
