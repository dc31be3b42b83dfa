//! Validated names for organisations and homes. They become parts of
//! object keys, so they are restricted to a small alphabet: no name can
//! reach outside its own prefix.

use std::fmt;
use std::str::FromStr;

const NAME_BYTES_MAX: usize = 64;

fn validate(kind: &'static str, text: &str) -> Result<(), crate::Error> {
    let ok_char = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-' || c == b'_';
    let bytes = text.as_bytes();
    if bytes.is_empty()
        || bytes.len() > NAME_BYTES_MAX
        || !bytes.iter().all(|&c| ok_char(c))
        || !bytes[0].is_ascii_alphanumeric()
    {
        return Err(crate::Error::InvalidName {
            kind,
            name: text.chars().take(80).collect(),
        });
    }
    Ok(())
}

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
        pub struct $name(String);

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl FromStr for $name {
            type Err = crate::Error;
            fn from_str(text: &str) -> Result<Self, crate::Error> {
                validate($kind, text)?;
                Ok($name(text.to_owned()))
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

name_type!(
    /// An organisation: the unit of deduplication and of isolation.
    OrgId,
    "org"
);
name_type!(
    /// A home within an organisation; it has one current root pointer.
    HomeName,
    "home"
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_restricted() {
        for good in ["acme", "a", "org-1_x", "9lives"] {
            assert!(good.parse::<OrgId>().is_ok(), "{good}");
        }
        for bad in [
            "",
            "..",
            "a/b",
            "A",
            "-x",
            "_x",
            "a b",
            &"x".repeat(65),
            "é",
        ] {
            assert!(bad.parse::<OrgId>().is_err(), "{bad}");
        }
    }
}
