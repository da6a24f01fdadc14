//! The composefs dumpfile: a text form of a [`Tree`](crate::tree::Tree), one line per path.
//!
//! ```text
//! PATH SIZE MODE NLINK UID GID RDEV MTIME PAYLOAD CONTENT DIGEST [XATTR...]
//! /usr/bin/ls 142024 100755 1 0 0 0 1633950376.0 45/6d3b…28 - 6d3b…28 user.foo=bar
//! /usr/bin/ls-hardlink 142024 @100755 2 0 0 0 1633950376.0 /usr/bin/ls - -
//! ```
//!
//! This module owns reading that format ([`parse_dump`]) and writing it
//! ([`print_dump`]). It reads what the reference `mkcomposefs --from-file`
//! reads and rejects what it rejects (its strict mode is `CFS_PARSE_STRICT`),
//! with one difference in spirit: where the reference would silently truncate
//! a value (a uid above `u32::MAX`, a name cut at an escaped NUL) this parser
//! says so instead. It prints what `composefs-info dump` prints, so a tree
//! survives parse → print → parse unchanged.
//!
//! A dumpfile is untrusted input: every limit is checked, no arithmetic can
//! overflow, nothing indexes out of bounds, and every error names the line
//! and what was wrong with it. This module never touches the filesystem.
//!
//! The reading half is in `parse` and the writing half in `print`. `parse`
//! borrows two things from `print`: its escaping, to quote input in error
//! messages, and its walk over a tree, so that a parsed tree's inodes are
//! numbered in the order they are printed.

mod parse;
mod print;
#[cfg(test)]
mod tests;

pub use parse::{
    parse_dump, parse_dump_bytes, parse_line, DumpError, Line, ParseOptions, MAX_LINE_LEN,
};
pub use print::{format_entry_line, print_dump, tree_to_dump_string};
