//! Plain scalars read the way cloud-init's PyYAML reads them: YAML 1.1's implicit types.
//!
//! cloud-init loads cloud-config with PyYAML's `SafeLoader`, which resolves an unquoted
//! (plain) scalar by YAML 1.1 rules: `yes` and `on` are booleans, `0644` is the octal 420,
//! `1:30` is 90, `2027-01-01` a date and `=` a tag it cannot construct. A YAML 1.2 reader
//! (serde_yaml_ng, or the plugin author's intuition) reads several of those differently.
//! This module restates PyYAML 6's rules (`yaml.resolver.Resolver`'s implicit resolvers and
//! `SafeConstructor`'s int, float, bool and null constructors) in our own code, so the
//! checker decides on cloud-init's reading, and says where the 1.2 reading differs.

/// A scalar value as PyYAML's `safe_load` constructs it.
#[derive(Debug, Clone, PartialEq)]
pub enum Scalar {
    /// `tag:yaml.org,2002:null` (`~`, `null`, `Null`, `NULL`, nothing).
    Null,
    /// `tag:yaml.org,2002:bool`.
    Bool(bool),
    /// `tag:yaml.org,2002:int`, within `i64` (Python's larger ones are refused).
    Int(i64),
    /// `tag:yaml.org,2002:float`.
    Float(f64),
    /// `tag:yaml.org,2002:str`.
    Str(String),
}

impl Scalar {
    /// Same type and value; NaN equals NaN, since both readers make the same NaN.
    pub fn same_as(&self, other: &Scalar) -> bool {
        match (self, other) {
            (Scalar::Float(a), Scalar::Float(b)) => a == b || (a.is_nan() && b.is_nan()),
            (a, b) => a == b,
        }
    }

    /// The value's type and value, for refusals.
    pub fn describe(&self) -> String {
        match self {
            Scalar::Null => "null".to_string(),
            Scalar::Bool(b) => format!("the boolean {b}"),
            Scalar::Int(i) => format!("the integer {i}"),
            Scalar::Float(f) => format!("the float {f}"),
            Scalar::Str(s) => format!("the string {}", super::show(s)),
        }
    }
}

/// What PyYAML makes of one plain scalar.
#[derive(Debug, Clone, PartialEq)]
pub enum Plain {
    /// A value `safe_load` constructs.
    Value(Scalar),
    /// `tag:yaml.org,2002:timestamp`: a `date` or `datetime` (or a load error for an
    /// impossible date such as `2027-13-45`).
    Timestamp,
    /// `<<`, `tag:yaml.org,2002:merge`.
    Merge,
    /// `=`, `tag:yaml.org,2002:value`: `SafeLoader` has no constructor for it and fails.
    ValueTag,
    /// An integer the constructor fails on (`0b_`, `0x_`: no digits once `_` is dropped).
    BrokenInt,
    /// An integer outside `i64` (Python's integers are unbounded, ours are not).
    BigInt,
}

/// Resolves and constructs a plain scalar as PyYAML 6's `SafeLoader` does. The implicit
/// resolvers are tried in PyYAML's registration order (bool, float, int, merge, null,
/// timestamp, value); each is anchored at both ends, so the first that matches decides.
pub fn resolve(plain: &str) -> Plain {
    let b = plain.as_bytes();
    if is_bool(plain) {
        return Plain::Value(Scalar::Bool(matches!(
            plain,
            "yes" | "Yes" | "YES" | "true" | "True" | "TRUE" | "on" | "On" | "ON"
        )));
    }
    if is_float(b) {
        return Plain::Value(Scalar::Float(construct_float(plain)));
    }
    if is_int(b) {
        return construct_int(plain);
    }
    if plain == "<<" {
        return Plain::Merge;
    }
    if matches!(plain, "" | "~" | "null" | "Null" | "NULL") {
        return Plain::Value(Scalar::Null);
    }
    if is_timestamp(b) {
        return Plain::Timestamp;
    }
    if plain == "=" {
        return Plain::ValueTag;
    }
    Plain::Value(Scalar::Str(plain.to_string()))
}

fn is_bool(s: &str) -> bool {
    const WORDS: [&str; 18] = [
        "yes", "Yes", "YES", "no", "No", "NO", "true", "True", "TRUE", "false", "False", "FALSE",
        "on", "On", "ON", "off", "Off", "OFF",
    ];
    WORDS.contains(&s)
}

/// A cursor over the scalar's bytes; each step consumes what a regex atom would.
struct Cursor<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Cursor<'a> {
    fn new(s: &'a [u8]) -> Self {
        Cursor { s, i: 0 }
    }
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }
    fn eat(&mut self, pred: impl Fn(u8) -> bool) -> bool {
        match self.peek() {
            Some(c) if pred(c) => {
                self.i += 1;
                true
            }
            _ => false,
        }
    }
    fn eat_str(&mut self, text: &str) -> bool {
        if self.s[self.i..].starts_with(text.as_bytes()) {
            self.i += text.len();
            true
        } else {
            false
        }
    }
    /// `pred*`: how many were consumed.
    fn many(&mut self, pred: impl Fn(u8) -> bool) -> usize {
        let start = self.i;
        while self.eat(&pred) {}
        self.i - start
    }
    fn sign(&mut self) {
        self.eat(|c| c == b'+' || c == b'-');
    }
    fn done(&self) -> bool {
        self.i == self.s.len()
    }
    /// `(:[0-5]?[0-9])+`; greedy is exact here because a digit can never follow the group.
    fn sexagesimal(&mut self) -> bool {
        let mut groups = 0;
        loop {
            let save = self.i;
            if !self.eat(|c| c == b':') {
                break;
            }
            let two = matches!(self.s.get(self.i..self.i + 2), Some([a, b])
                if (b'0'..=b'5').contains(a) && b.is_ascii_digit());
            if two {
                self.i += 2;
            } else if !self.eat(|c| c.is_ascii_digit()) {
                self.i = save;
                break;
            }
            groups += 1;
        }
        groups > 0
    }
    /// `([eE][-+][0-9]+)?`.
    fn exponent(&mut self) {
        let save = self.i;
        if self.eat(|c| c == b'e' || c == b'E')
            && self.eat(|c| c == b'+' || c == b'-')
            && self.many(|c| c.is_ascii_digit()) > 0
        {
            return;
        }
        self.i = save;
    }
}

fn digit(c: u8) -> bool {
    c.is_ascii_digit()
}
fn digit_(c: u8) -> bool {
    c.is_ascii_digit() || c == b'_'
}

/// Runs `alternative` from the start; true if it consumes the whole scalar.
fn whole(s: &[u8], alternative: impl Fn(&mut Cursor<'_>) -> bool) -> bool {
    let mut c = Cursor::new(s);
    alternative(&mut c) && c.done()
}

/// PyYAML's float resolver: `[-+]?[0-9][0-9_]*\.[0-9_]*([eE][-+][0-9]+)?`,
/// `\.[0-9][0-9_]*([eE][-+][0-9]+)?`, `[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+\.[0-9_]*`,
/// `[-+]?\.(inf|Inf|INF)`, `\.(nan|NaN|NAN)`.
fn is_float(s: &[u8]) -> bool {
    whole(s, |c| {
        c.sign();
        c.eat(digit)
            && {
                c.many(digit_);
                c.eat(|x| x == b'.')
            }
            && {
                c.many(digit_);
                c.exponent();
                true
            }
    }) || whole(s, |c| {
        c.eat(|x| x == b'.') && c.eat(digit) && {
            c.many(digit_);
            c.exponent();
            true
        }
    }) || whole(s, |c| {
        c.sign();
        c.eat(digit)
            && {
                c.many(digit_);
                c.sexagesimal()
            }
            && c.eat(|x| x == b'.')
            && {
                c.many(digit_);
                true
            }
    }) || whole(s, |c| {
        c.sign();
        c.eat(|x| x == b'.') && (c.eat_str("inf") || c.eat_str("Inf") || c.eat_str("INF"))
    }) || whole(s, |c| {
        c.eat(|x| x == b'.') && (c.eat_str("nan") || c.eat_str("NaN") || c.eat_str("NAN"))
    })
}

/// PyYAML's int resolver: `[-+]?0b[0-1_]+`, `[-+]?0[0-7_]+`, `[-+]?(0|[1-9][0-9_]*)`,
/// `[-+]?0x[0-9a-fA-F_]+`, `[-+]?[1-9][0-9_]*(:[0-5]?[0-9])+`.
fn is_int(s: &[u8]) -> bool {
    let nonzero = |x: u8| (b'1'..=b'9').contains(&x);
    whole(s, |c| {
        c.sign();
        c.eat_str("0b") && c.many(|x| x == b'0' || x == b'1' || x == b'_') > 0
    }) || whole(s, |c| {
        c.sign();
        c.eat(|x| x == b'0') && c.many(|x| (b'0'..=b'7').contains(&x) || x == b'_') > 0
    }) || whole(s, |c| {
        c.sign();
        c.eat(|x| x == b'0')
    }) || whole(s, |c| {
        c.sign();
        c.eat(nonzero) && {
            c.many(digit_);
            true
        }
    }) || whole(s, |c| {
        c.sign();
        c.eat_str("0x") && c.many(|x| x.is_ascii_hexdigit() || x == b'_') > 0
    }) || whole(s, |c| {
        c.sign();
        c.eat(nonzero) && {
            c.many(digit_);
            c.sexagesimal()
        }
    })
}

/// PyYAML's timestamp resolver: `YYYY-MM-DD`, or `YYYY-M-D` with a time
/// (`[Tt]` or blanks, `H:MM:SS`, an optional fraction and an optional zone).
fn is_timestamp(s: &[u8]) -> bool {
    let blank = |x: u8| x == b' ' || x == b'\t';
    let one_or_two = |c: &mut Cursor<'_>| {
        let ok = c.eat(digit);
        c.eat(digit);
        ok
    };
    let exactly = |c: &mut Cursor<'_>, n: usize| (0..n).all(|_| c.eat(digit));
    whole(s, |c| {
        exactly(c, 4) && c.eat_str("-") && exactly(c, 2) && c.eat_str("-") && exactly(c, 2)
    }) || whole(s, |c| {
        exactly(c, 4)
            && c.eat_str("-")
            && one_or_two(c)
            && c.eat_str("-")
            && one_or_two(c)
            && (c.eat(|x| x == b'T' || x == b't') || c.many(blank) > 0)
            && one_or_two(c)
            && c.eat_str(":")
            && exactly(c, 2)
            && c.eat_str(":")
            && exactly(c, 2)
            && {
                if c.eat_str(".") {
                    c.many(digit);
                }
                let save = c.i;
                c.many(blank);
                let zone = c.eat_str("Z")
                    || (c.eat(|x| x == b'+' || x == b'-') && one_or_two(c) && {
                        let at = c.i;
                        if !(c.eat_str(":") && exactly(c, 2)) {
                            c.i = at;
                        }
                        true
                    });
                if !zone {
                    c.i = save;
                }
                true
            }
    })
}

/// `SafeConstructor.construct_yaml_int`: `_` dropped, then binary, hex, octal (a leading
/// `0`), base 60 (`:`) or decimal.
fn construct_int(plain: &str) -> Plain {
    let value: String = plain.chars().filter(|&c| c != '_').collect();
    let (negative, digits) = match value.as_bytes().first() {
        Some(b'-') => (true, &value[1..]),
        Some(b'+') => (false, &value[1..]),
        _ => (false, value.as_str()),
    };
    let magnitude: Option<u128> = if digits == "0" {
        Some(0)
    } else if let Some(bin) = digits.strip_prefix("0b") {
        if bin.is_empty() {
            return Plain::BrokenInt;
        }
        u128::from_str_radix(bin, 2).ok()
    } else if let Some(hex) = digits.strip_prefix("0x") {
        if hex.is_empty() {
            return Plain::BrokenInt;
        }
        u128::from_str_radix(hex, 16).ok()
    } else if digits.starts_with('0') {
        u128::from_str_radix(digits, 8).ok()
    } else if digits.contains(':') {
        digits.split(':').try_fold(0u128, |acc, part| {
            acc.checked_mul(60)?.checked_add(part.parse::<u128>().ok()?)
        })
    } else {
        digits.parse::<u128>().ok()
    };
    let signed = magnitude
        .and_then(|m| i128::try_from(m).ok())
        .map(|m| if negative { -m } else { m })
        .and_then(|m| i64::try_from(m).ok());
    match signed {
        Some(i) => Plain::Value(Scalar::Int(i)),
        None => Plain::BigInt,
    }
}

/// `SafeConstructor.construct_yaml_float`: `_` dropped, lower-cased, `.inf`, `.nan`,
/// base 60 (summed from the last group, as PyYAML does) or Python's `float()`, which
/// rounds decimal text exactly as Rust's parser does.
fn construct_float(plain: &str) -> f64 {
    let value: String = plain
        .chars()
        .filter(|&c| c != '_')
        .collect::<String>()
        .to_ascii_lowercase();
    let (sign, rest) = match value.as_bytes().first() {
        Some(b'-') => (-1.0, &value[1..]),
        Some(b'+') => (1.0, &value[1..]),
        _ => (1.0, value.as_str()),
    };
    if rest == ".inf" {
        return sign * f64::INFINITY;
    }
    if rest == ".nan" {
        return f64::NAN;
    }
    if rest.contains(':') {
        let mut total = 0.0;
        let mut base = 1.0;
        for part in rest.split(':').rev() {
            total += part.parse::<f64>().unwrap_or(f64::NAN) * base;
            base *= 60.0;
        }
        return sign * total;
    }
    // The resolver admitted only digits, `.` and an exponent, all of which Rust parses.
    sign * rest.parse::<f64>().unwrap_or(f64::NAN)
}

/// How a YAML 1.2 reader (serde_yaml_ng, the core schema) reads the same plain scalar on
/// its own, or `None` if it reads no scalar from it.
pub fn yaml12(plain: &str) -> Option<Scalar> {
    use serde_yaml_ng::Value;
    match serde_yaml_ng::from_str::<Value>(plain).ok()? {
        Value::Null => Some(Scalar::Null),
        Value::Bool(b) => Some(Scalar::Bool(b)),
        Value::Number(n) => match n.as_i64() {
            Some(i) => Some(Scalar::Int(i)),
            None if n.is_f64() => n.as_f64().map(Scalar::Float),
            None => None,
        },
        Value::String(s) => Some(Scalar::Str(s)),
        _ => None,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn int(i: i64) -> Plain {
        Plain::Value(Scalar::Int(i))
    }
    fn float(f: f64) -> Plain {
        Plain::Value(Scalar::Float(f))
    }
    fn string(s: &str) -> Plain {
        Plain::Value(Scalar::Str(s.to_string()))
    }

    #[test]
    fn the_classes_where_yaml_1_1_differs_read_as_pyyaml_reads_them() {
        let cases: Vec<(&str, Plain)> = vec![
            ("yes", Plain::Value(Scalar::Bool(true))),
            ("Off", Plain::Value(Scalar::Bool(false))),
            ("y", string("y")),
            ("n", string("n")),
            ("tRue", string("tRue")),
            ("0644", int(420)),
            ("-0_17", int(-15)),
            ("0o644", string("0o644")),
            ("08", string("08")),
            ("1:30", int(90)),
            ("-1:30:00", int(-5400)),
            ("1:30.5", float(90.5)),
            ("1:60", string("1:60")),
            ("1e3", string("1e3")),
            ("1.0e+3", float(1000.0)),
            ("1.e+3", float(1000.0)),
            ("1.0e3", string("1.0e3")),
            (".5", float(0.5)),
            ("1_000_000", int(1_000_000)),
            ("0x_FF", int(255)),
            ("0b1010", int(10)),
            ("0b_", Plain::BrokenInt),
            ("0x_", Plain::BrokenInt),
            ("+1", int(1)),
            ("0", int(0)),
            ("-0", int(0)),
            ("0_", int(0)),
            ("9223372036854775808", Plain::BigInt),
            ("-9223372036854775808", int(i64::MIN)),
            ("+.inf", float(f64::INFINITY)),
            ("-.Inf", float(f64::NEG_INFINITY)),
            (".iNf", string(".iNf")),
            ("~", Plain::Value(Scalar::Null)),
            ("", Plain::Value(Scalar::Null)),
            ("nULL", string("nULL")),
            ("2027-01-01", Plain::Timestamp),
            ("2027-1-1 1:02:03.5 +01:00", Plain::Timestamp),
            ("2027-1-1t01:02:03Z", Plain::Timestamp),
            ("2027-1-1", string("2027-1-1")),
            ("=", Plain::ValueTag),
            ("<<", Plain::Merge),
            ("1.2.3", string("1.2.3")),
            ("192.0.2.1", string("192.0.2.1")),
        ];
        for (plain, want) in cases {
            let got = resolve(plain);
            let same = match (&got, &want) {
                (Plain::Value(a), Plain::Value(b)) => a.same_as(b),
                (a, b) => a == b,
            };
            assert!(same, "{plain:?}: {got:?}, want {want:?}");
        }
        assert!(matches!(resolve(".NaN"), Plain::Value(Scalar::Float(f)) if f.is_nan()));
    }

    #[test]
    fn the_yaml_1_2_reading_is_serde_yaml_ngs() {
        assert_eq!(yaml12("yes"), Some(Scalar::Str("yes".into())));
        assert_eq!(yaml12("0o644"), Some(Scalar::Int(420)));
        assert_eq!(yaml12("1e3"), Some(Scalar::Float(1000.0)));
        assert_eq!(yaml12("true"), Some(Scalar::Bool(true)));
    }
}
