//! Host bindings generated from `templates-sdk/wit`, the one source of the plugin ABI.
//!
//! Kept private to the templates module: the rest of the operator sees only the input
//! types re-exported from [`super`], never wasmtime's generated plumbing.

/// The `domain` world; it owns the shared `types` interface.
pub(crate) mod domain {
    wasmtime::component::bindgen!({
        path: "../templates-sdk/wit",
        world: "domain",
    });
}

/// The `vendor-data` world, reusing the `types` generated for the domain world so both
/// worlds take the same Rust types.
pub(crate) mod vendor_data {
    wasmtime::component::bindgen!({
        path: "../templates-sdk/wit",
        world: "vendor-data",
        with: {
            "egress:templates/types": super::domain::egress::templates::types,
        },
    });
}

pub use domain::egress::templates::types;

/// Name of the WIT package, without version.
pub const PACKAGE: &str = "egress:templates";
/// Version of the WIT package this operator was built against.
pub const PACKAGE_VERSION: &str = "0.2.0";

/// Plugin results lifted with their size checked **before** anything is copied into host
/// memory.
///
/// The generated bindings lift a `string` or `list` result into a host `String`/`Vec`
/// first, so a plugin returning 64 MiB made the host allocate 64 MiB before any cap could
/// refuse it. Reading the result as [`WasmStr`](wasmtime::component::WasmStr) after the
/// call is no answer either: wasmtime 48 runs the guest's post-return (which frees the
/// string) inside `TypedFunc::call`, so the bytes may already be overwritten by the
/// guest's allocator. These types therefore check inside the lift itself, while the
/// result still belongs to the caller: [`Capped`] reads the declared length and lifts only
/// when it is within `MAX`; [`CappedList`] lifts at most `MAX` elements and counts the
/// rest.
///
/// They implement wasmtime's lifting traits, whose methods are `#[doc(hidden)]` but
/// public; the canonical-ABI layout, the type check, the bounds checks against guest
/// memory and the hostcall-fuel charge are all wasmtime's own `String`/`Vec<T>` ones
/// (same `Lower` type, `ABI`, `typecheck`, and their lifts do the reading), so no memory is
/// read here that wasmtime did not check. An over-cap result is refused from its length
/// word alone: nothing is copied and no fuel is charged for it. A future wasmtime that
/// changes those hidden items fails to compile here rather than misbehaving (the `Lower`
/// types are spelled out, and must unify).
pub(crate) mod capped {
    use wasmtime::ValRaw;
    use wasmtime::component::__internal::{
        CanonicalAbiInfo, InstanceType, InterfaceType, LiftContext,
    };
    use wasmtime::component::{ComponentType, Lift};

    /// A `string` result of a plugin, copied into host memory only when it is at most
    /// `MAX` bytes.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub(crate) enum Capped<const MAX: usize> {
        /// The string, at most `MAX` bytes.
        Text(String),
        /// Longer than `MAX`; nothing was copied. `len` is the length the plugin declared:
        /// bytes for UTF-8 (what Rust and C guests use), code units otherwise (a guest
        /// using UTF-16 or Latin-1 is lifted when it declares at most `MAX` units and then
        /// refused by its UTF-8 length, so the host copy stays within `3 * MAX` bytes).
        Over {
            /// Declared length.
            len: usize,
        },
    }

    impl<const MAX: usize> Capped<MAX> {
        /// The text, or how long it was when it was over the cap.
        pub(crate) fn into_result(self) -> Result<String, usize> {
            match self {
                Capped::Text(s) => Ok(s),
                Capped::Over { len } => Err(len),
            }
        }

        /// `declared` is the length word of the string's (pointer, length) pair; `copy` is
        /// wasmtime's own lift, which checks the pair against the guest's memory, charges
        /// the store's hostcall fuel and copies.
        fn lift(
            cx: &mut LiftContext<'_>,
            declared: u32,
            copy: impl FnOnce(&mut LiftContext<'_>) -> wasmtime::Result<String>,
        ) -> wasmtime::Result<Self> {
            let declared = usize::try_from(declared)?;
            if declared > MAX {
                return Ok(Capped::Over { len: declared });
            }
            let text = copy(cx)?;
            lift_counter::add(text.len());
            if text.len() > MAX {
                return Ok(Capped::Over { len: text.len() });
            }
            Ok(Capped::Text(text))
        }
    }

    // SAFETY: the layout (`Lower`, `ABI`) and the type check are exactly those of `String`,
    // which wasmtime implements for the component-model `string`.
    #[allow(unsafe_code)]
    unsafe impl<const MAX: usize> ComponentType for Capped<MAX> {
        type Lower = [ValRaw; 2];
        const ABI: CanonicalAbiInfo = <String as ComponentType>::ABI;

        fn typecheck(ty: &InterfaceType, types: &InstanceType<'_>) -> wasmtime::Result<()> {
            <String as ComponentType>::typecheck(ty, types)
        }
    }

    // SAFETY: every read of guest memory goes through wasmtime's own `String` lift, with
    // the arguments wasmtime passed; the only value read here directly is the length word
    // of the (pointer, length) pair wasmtime handed over.
    #[allow(unsafe_code)]
    unsafe impl<const MAX: usize> Lift for Capped<MAX> {
        fn linear_lift_from_flat(
            cx: &mut LiftContext<'_>,
            ty: InterfaceType,
            src: &Self::Lower,
        ) -> wasmtime::Result<Self> {
            Self::lift(cx, src[1].get_u32(), |cx| {
                <String as Lift>::linear_lift_from_flat(cx, ty, src)
            })
        }

        fn linear_lift_from_memory(
            cx: &mut LiftContext<'_>,
            ty: InterfaceType,
            bytes: &[u8],
        ) -> wasmtime::Result<Self> {
            Self::lift(cx, length_word(bytes)?, |cx| {
                <String as Lift>::linear_lift_from_memory(cx, ty, bytes)
            })
        }
    }

    /// A `list` result of a plugin: at most `MAX` elements lifted into host memory, and how
    /// many the plugin returned.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub(crate) struct CappedList<T, const MAX: usize> {
        /// The first `MAX` elements (or all, when fewer).
        pub(crate) items: Vec<T>,
        /// How many elements the plugin returned.
        pub(crate) total: usize,
    }

    /// The (pointer, length) pair of a list in guest memory, aligned as wasmtime's lifts
    /// expect (they assert it in debug builds).
    #[repr(C, align(8))]
    struct PairBytes([u8; 8]);

    // SAFETY: the layout (`Lower`, `ABI`) and the type check are exactly those of `Vec<T>`,
    // which wasmtime implements for the component-model `list<T>`.
    #[allow(unsafe_code)]
    unsafe impl<T: ComponentType, const MAX: usize> ComponentType for CappedList<T, MAX> {
        type Lower = [ValRaw; 2];
        const ABI: CanonicalAbiInfo = <Vec<T> as ComponentType>::ABI;

        fn typecheck(ty: &InterfaceType, types: &InstanceType<'_>) -> wasmtime::Result<()> {
            <Vec<T> as ComponentType>::typecheck(ty, types)
        }
    }

    // SAFETY: the first `MAX` elements are lifted by wasmtime's own `Vec<T>` lift, from the
    // pointer the plugin returned with a length of at most what it declared (a prefix of
    // its list), which that lift checks against the guest's memory; the only values read
    // here directly are the words of the (pointer, length) pair wasmtime handed over.
    #[allow(unsafe_code)]
    unsafe impl<T: Lift, const MAX: usize> Lift for CappedList<T, MAX> {
        fn linear_lift_from_flat(
            cx: &mut LiftContext<'_>,
            ty: InterfaceType,
            src: &Self::Lower,
        ) -> wasmtime::Result<Self> {
            let total = usize::try_from(src[1].get_u32())?;
            let mut prefix = *src;
            prefix[1] = ValRaw::u32(u32::try_from(total.min(MAX))?);
            let items = <Vec<T> as Lift>::linear_lift_from_flat(cx, ty, &prefix)?;
            Ok(Self { items, total })
        }

        fn linear_lift_from_memory(
            cx: &mut LiftContext<'_>,
            ty: InterfaceType,
            bytes: &[u8],
        ) -> wasmtime::Result<Self> {
            let total = usize::try_from(length_word(bytes)?)?;
            let pointer = bytes
                .get(..4)
                .ok_or_else(|| wasmtime::format_err!("list pointer/length pair cut short"))?;
            let mut prefix = PairBytes([0; 8]);
            prefix.0[..4].copy_from_slice(pointer);
            prefix.0[4..].copy_from_slice(&u32::try_from(total.min(MAX))?.to_le_bytes());
            let items = <Vec<T> as Lift>::linear_lift_from_memory(cx, ty, &prefix.0)?;
            Ok(Self { items, total })
        }
    }

    /// One `settings-error` of `validate-settings`, each text lifted only within
    /// [`ISSUE_TEXT_LIFT_MAX`](crate::templates::ISSUE_TEXT_LIFT_MAX).
    #[derive(
        Debug, Clone, PartialEq, Eq, wasmtime::component::ComponentType, wasmtime::component::Lift,
    )]
    #[component(record)]
    pub(crate) struct Issue {
        /// JSON pointer to the refused value.
        pub(crate) pointer: Capped<{ crate::templates::ISSUE_TEXT_LIFT_MAX }>,
        /// Why.
        pub(crate) message: Capped<{ crate::templates::ISSUE_TEXT_LIFT_MAX }>,
    }

    /// The length word of a (pointer, length) pair stored in memory (little-endian).
    fn length_word(bytes: &[u8]) -> wasmtime::Result<u32> {
        let word: [u8; 4] = bytes
            .get(4..8)
            .and_then(|w| w.try_into().ok())
            .ok_or_else(|| wasmtime::format_err!("string pointer/length pair cut short"))?;
        Ok(u32::from_le_bytes(word))
    }

    /// A test-only count of plugin bytes copied into host strings on this thread, so a test
    /// can prove an oversized result was refused without being copied (nothing is counted
    /// outside tests).
    pub(crate) mod lift_counter {
        #[cfg(test)]
        thread_local! {
            static LIFTED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
        }

        /// Adds `n` bytes to this thread's count.
        #[inline]
        pub(crate) fn add(n: usize) {
            #[cfg(test)]
            LIFTED.with(|c| c.set(c.get().saturating_add(n)));
            #[cfg(not(test))]
            let _ = n;
        }

        /// Bytes copied on this thread so far.
        #[cfg(test)]
        pub(crate) fn total() -> usize {
            LIFTED.with(std::cell::Cell::get)
        }
    }
}
