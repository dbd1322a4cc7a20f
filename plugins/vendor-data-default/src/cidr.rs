//! Networks in CIDR notation, parsed strictly and written back in one canonical form.
//!
//! Every network that reaches tinyproxy's config or the nftables ruleset is written from
//! the parsed value, never from the settings text, so nothing but digits, hex, `.`, `:`
//! and `/` can get there.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// An IPv4 or IPv6 network: an address with the host bits cleared and a prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cidr {
    addr: IpAddr,
    len: u8,
}

impl Cidr {
    /// Parses `address/prefix-length`. The address is what Rust's parser accepts (no
    /// `127.1` or octal shorthands); the length is plain digits within the family's width.
    /// Host bits are cleared: `10.1.2.3/8` is `10.0.0.0/8`, as tinyproxy reads it too.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (addr, len) = text
            .split_once('/')
            .ok_or_else(|| format!("{text:?} is not in CIDR notation (address/prefix-length)"))?;
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{addr:?} is not an IP address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let len = match len.parse::<u8>() {
            Ok(n) if n <= max && !len.is_empty() && len.bytes().all(|b| b.is_ascii_digit()) => n,
            _ => return Err(format!("prefix length {len:?} is not in 0..={max}")),
        };
        Ok(Self {
            addr: mask(addr, len),
            len,
        })
    }

    /// Whether this is an IPv4 network.
    pub fn is_ipv4(&self) -> bool {
        self.addr.is_ipv4()
    }

    /// Whether this is an IPv6 network inside `::ffff:0:0/96` (IPv4-mapped). A socket
    /// connecting to such an address sends IPv4 packets, so an IPv6 rule for it would
    /// never match anything.
    pub fn is_ipv4_mapped(&self) -> bool {
        match self.addr {
            IpAddr::V6(a) => self.len >= 96 && a.to_ipv4_mapped().is_some(),
            IpAddr::V4(_) => false,
        }
    }

    /// The nftables match for this network (`ip daddr …` or `ip6 daddr …`).
    pub fn nft_daddr(&self) -> String {
        let family = if self.is_ipv4() { "ip" } else { "ip6" };
        format!("{family} daddr {self}")
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.len)
    }
}

/// Clears the bits after the first `len`.
fn mask(addr: IpAddr, len: u8) -> IpAddr {
    match addr {
        IpAddr::V4(a) => {
            let bits = u32::from(a);
            let keep = u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from(bits & keep))
        }
        IpAddr::V6(a) => {
            let bits = u128::from(a);
            let keep = u128::MAX.checked_shl(128 - u32::from(len)).unwrap_or(0);
            IpAddr::V6(Ipv6Addr::from(bits & keep))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_form() {
        for (text, canonical) in [
            ("10.0.0.0/8", "10.0.0.0/8"),
            ("10.1.2.3/8", "10.0.0.0/8"),
            ("192.168.1.77/32", "192.168.1.77/32"),
            ("0.0.0.0/0", "0.0.0.0/0"),
            ("1.2.3.4/0", "0.0.0.0/0"),
            ("fd00:EC2::254/128", "fd00:ec2::254/128"),
            ("fe80::1/10", "fe80::/10"),
            ("::1/0", "::/0"),
        ] {
            assert_eq!(Cidr::parse(text).unwrap().to_string(), canonical, "{text}");
        }
    }

    #[test]
    fn refused() {
        for text in [
            "10.0.0.0",
            "10.0.0.0/33",
            "::/129",
            "10.0.0.0/",
            "10.0.0.0/+8",
            "10.0.0.0/ 8",
            "10.0.0.0/8 ",
            " 10.0.0.0/8",
            "127.1/32",
            "010.0.0.1/32",
            "x/8",
            "10.0.0.0/8\nAllow 0.0.0.0/0",
            "10.0.0.0/8;reboot",
            "10.0.0.0/8/8",
            "",
        ] {
            assert!(Cidr::parse(text).is_err(), "{text:?} was accepted");
        }
    }

    #[test]
    fn families_and_mapped() {
        let v4 = Cidr::parse("127.0.0.0/8").unwrap();
        assert!(v4.is_ipv4() && !v4.is_ipv4_mapped());
        assert_eq!(v4.nft_daddr(), "ip daddr 127.0.0.0/8");
        let v6 = Cidr::parse("fd00::/8").unwrap();
        assert_eq!(v6.nft_daddr(), "ip6 daddr fd00::/8");
        assert!(!v6.is_ipv4_mapped());
        assert!(
            Cidr::parse("::ffff:127.0.0.1/128")
                .unwrap()
                .is_ipv4_mapped()
        );
        assert!(Cidr::parse("::ffff:0:0/96").unwrap().is_ipv4_mapped());
    }
}
