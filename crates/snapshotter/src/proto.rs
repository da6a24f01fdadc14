//! containerd's snapshots API (`containerd.services.snapshots.v1`) and its
//! `containerd.types.Mount`, written by hand as prost messages.
//!
//! The field numbers and types are those of containerd's
//! `api/services/snapshots/v1/snapshots.proto` and `api/types/mount.proto`
//! (containerd 1.6; the API has been stable since 1.0). Writing them here
//! instead of generating them keeps the workspace buildable without
//! `protoc` and without containerd's proto files at build time.

use std::collections::HashMap;

/// `containerd.types.Mount`: what containerd passes to mount(2).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Mount {
    #[prost(string, tag = "1")]
    pub r#type: String,
    #[prost(string, tag = "2")]
    pub source: String,
    #[prost(string, tag = "3")]
    pub target: String,
    #[prost(string, repeated, tag = "4")]
    pub options: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct PrepareSnapshotRequest {
    #[prost(string, tag = "1")]
    pub snapshotter: String,
    #[prost(string, tag = "2")]
    pub key: String,
    #[prost(string, tag = "3")]
    pub parent: String,
    #[prost(map = "string, string", tag = "4")]
    pub labels: HashMap<String, String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct MountsResponse {
    #[prost(message, repeated, tag = "1")]
    pub mounts: Vec<Mount>,
}

/// `ViewSnapshotRequest` has the same fields as `PrepareSnapshotRequest`;
/// `PrepareSnapshotResponse` and `ViewSnapshotResponse` those of
/// `MountsResponse`.
pub type ViewSnapshotRequest = PrepareSnapshotRequest;

#[derive(Clone, PartialEq, prost::Message)]
pub struct KeyRequest {
    #[prost(string, tag = "1")]
    pub snapshotter: String,
    #[prost(string, tag = "2")]
    pub key: String,
}

/// `MountsRequest`, `RemoveSnapshotRequest`, `StatSnapshotRequest` and
/// `UsageRequest` are all `{snapshotter = 1, key = 2}`.
pub type MountsRequest = KeyRequest;

#[derive(Clone, PartialEq, prost::Message)]
pub struct CommitSnapshotRequest {
    #[prost(string, tag = "1")]
    pub snapshotter: String,
    #[prost(string, tag = "2")]
    pub name: String,
    #[prost(string, tag = "3")]
    pub key: String,
    #[prost(map = "string, string", tag = "4")]
    pub labels: HashMap<String, String>,
}

/// `containerd.services.snapshots.v1.Kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, prost::Enumeration)]
#[repr(i32)]
pub enum Kind {
    Unknown = 0,
    View = 1,
    Active = 2,
    Committed = 3,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Info {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub parent: String,
    #[prost(enumeration = "Kind", tag = "3")]
    pub kind: i32,
    #[prost(message, optional, tag = "4")]
    pub created_at: Option<prost_types::Timestamp>,
    #[prost(message, optional, tag = "5")]
    pub updated_at: Option<prost_types::Timestamp>,
    #[prost(map = "string, string", tag = "6")]
    pub labels: HashMap<String, String>,
}

/// `StatSnapshotResponse` and `UpdateSnapshotResponse`: `{Info info = 1}`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct InfoResponse {
    #[prost(message, optional, tag = "1")]
    pub info: Option<Info>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct UpdateSnapshotRequest {
    #[prost(string, tag = "1")]
    pub snapshotter: String,
    #[prost(message, optional, tag = "2")]
    pub info: Option<Info>,
    #[prost(message, optional, tag = "3")]
    pub update_mask: Option<prost_types::FieldMask>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ListSnapshotsRequest {
    #[prost(string, tag = "1")]
    pub snapshotter: String,
    #[prost(string, repeated, tag = "2")]
    pub filters: Vec<String>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ListSnapshotsResponse {
    #[prost(message, repeated, tag = "1")]
    pub info: Vec<Info>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct UsageResponse {
    #[prost(int64, tag = "1")]
    pub size: i64,
    #[prost(int64, tag = "2")]
    pub inodes: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CleanupRequest {
    #[prost(string, tag = "1")]
    pub snapshotter: String,
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn mount_wire_format() {
        let m = Mount {
            r#type: "bind".into(),
            source: "/s".into(),
            target: String::new(),
            options: vec!["rbind".into(), "ro".into()],
        };
        // tag 1 (type), len 4; tag 2 (source), len 2; tag 4 twice.
        let mut want = vec![0x0a, 4];
        want.extend_from_slice(b"bind");
        want.extend_from_slice(&[0x12, 2]);
        want.extend_from_slice(b"/s");
        want.extend_from_slice(&[0x22, 5]);
        want.extend_from_slice(b"rbind");
        want.extend_from_slice(&[0x22, 2]);
        want.extend_from_slice(b"ro");
        assert_eq!(m.encode_to_vec(), want);
    }
}
