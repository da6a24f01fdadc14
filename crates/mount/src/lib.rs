//! Mounting cairn images: the composefs stack, built with the new mount API.
//!
//! An image is an EROFS metadata file whose regular files carry
//! `trusted.overlay.redirect=/ab/cdef…` and `trusted.overlay.metacopy`; the
//! file contents live in the store's `objects/` directory. [`mount_image`]
//! mounts the EROFS file directly (or, on kernels without file-backed EROFS
//! or with `CAIRN_EROFS_LOOP=1`, from a read-only autoclear loop device), stacks overlayfs on it
//! with `objects/` as a data-only lower layer, adds an optional upper layer
//! (tmpfs or a host directory) and an optional id mapping, and attaches the
//! result — see [`stack`] for the picture and for why nothing is left behind
//! when any step fails.
//!
//! Layers:
//! - [`mod@probe`]: what the running kernel can do, tried at run time and cached;
//!   [`KernelFeatures::require`] names what is missing and what to do.
//! - [`stack`]: [`mount_image`], [`prepare_image`] and their options.
//! - `privns`: where overlayfs refuses detached layers (before Linux 6.15),
//!   the layers are attached in a private mount namespace of one
//!   short-lived thread while the overlay is made.
//! - [`mountinfo`]: the mount table ([`find_mount`], [`is_mountpoint`];
//!   cairn's one parser of `mountinfo`, which the store's gc and the cgroup
//!   setup use too) and [`umount`]; [`mounted_image`] reads back which image
//!   a mount was made from.
//! - [`userns`]: user namespaces that carry an [`IdMap`].
//! - [`readonly_bind`]: a detached read-only bind of a file (crun runs from one).
//! - [`disk`]: size-capped disk upper layers (a sparse ext4 file on a loop device).
//! - `sys`: the only `unsafe` code (`mount_setattr`, `fork`, one ioctl).
//!
//! This crate never uses the legacy `mount(2)` call, creates loop devices
//! only for [`disk`] uppers and EROFS images on the loop path ([`loopdev`];
//! autoclear: they go with their mount or with the fd on error), never
//! creates temporary directories, and never logs an error it returns.
#![deny(unsafe_code)]

mod bind;
pub mod disk;
mod error;
mod fscontext;
pub mod loopdev;
pub mod mountinfo;
mod privns;
pub mod probe;
pub mod stack;
mod sys;
pub mod userns;

pub use bind::readonly_bind;
pub use disk::{mount_sized_upper, MIN_DISK_UPPER};
pub use error::{Action, MountError};
pub use mountinfo::{
    find_mount, is_mountpoint, mount_table, mount_table_of, parse_mountinfo, umount, umount_with,
    MountEntry, UmountOptions,
};
pub use privns::{private_ns_forced, PRIVATE_NS_ENV};
pub use probe::{
    erofs_loop_forced, probe, ErofsPath, Feature, KernelFeatures, LayerPath, MissingFeature,
    Support, EROFS_LOOP_ENV,
};
pub use stack::{
    mount_image, mounted_image, prepare_image, DetachedLayers, MountOptions, PreparedMount,
    UpperSpec, VerityMode, STACK_FEATURES,
};
pub use userns::{IdMap, UserNamespace};
