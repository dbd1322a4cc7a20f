//! Types of the objects users write: the `Proxy` resource.

pub mod proxy;
