//! The OCI runtime configuration (`config.json`, runtime-spec 1.0.2, the
//! subset crun 1.8 needs) and how cairn builds it from an image config and
//! the `cairn run` flags.
//!
//! Only the types and a pure builder live here: no I/O, so every default
//! (mounts, capabilities, masked paths) is pinned by unit tests. The
//! defaults follow podman's: its default capability set, its masked and
//! read-only paths, tmpfs `/dev`, a private `/dev/shm`, read-only `/sys`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The runtime-spec version written into `config.json`.
pub const OCI_VERSION: &str = "1.0.2";

/// podman's default capabilities (containers.conf `default_capabilities`).
pub const DEFAULT_CAPABILITIES: [&str; 11] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_NET_BIND_SERVICE",
    "CAP_SETFCAP",
    "CAP_SETGID",
    "CAP_SETPCAP",
    "CAP_SETUID",
    "CAP_SYS_CHROOT",
];

/// Paths hidden from the container (an empty file or tmpfs over them).
pub const MASKED_PATHS: [&str; 11] = [
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/fs/selinux",
    "/sys/dev/block",
];

/// Paths the container sees read-only.
pub const READONLY_PATHS: [&str; 6] = [
    "/proc/asound",
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// The PATH a container gets when its image sets none.
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Spec {
    pub oci_version: String,
    pub process: Process,
    pub root: Root,
    pub hostname: String,
    pub mounts: Vec<Mount>,
    pub linux: Linux,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Process {
    pub terminal: bool,
    pub user: User,
    pub args: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    pub capabilities: Capabilities,
    pub rlimits: Vec<Rlimit>,
    pub no_new_privileges: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct User {
    pub uid: u32,
    pub gid: u32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub additional_gids: Vec<u32>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    pub bounding: Vec<String>,
    pub effective: Vec<String>,
    pub inheritable: Vec<String>,
    pub permitted: Vec<String>,
    pub ambient: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rlimit {
    #[serde(rename = "type")]
    pub kind: String,
    pub hard: u64,
    pub soft: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Root {
    pub path: String,
    pub readonly: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mount {
    pub destination: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub source: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Linux {
    pub namespaces: Vec<Namespace>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub uid_mappings: Vec<IdMapping>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gid_mappings: Vec<IdMapping>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroups_path: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<Resources>,
    pub masked_paths: Vec<String>,
    pub readonly_paths: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Namespace {
    #[serde(rename = "type")]
    pub kind: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IdMapping {
    #[serde(rename = "containerID")]
    pub container_id: u32,
    #[serde(rename = "hostID")]
    pub host_id: u32,
    pub size: u32,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Resources {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceRule>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryLimit>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuLimit>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pids: Option<PidsLimit>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceRule {
    pub allow: bool,
    pub access: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryLimit {
    pub limit: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuLimit {
    pub quota: i64,
    pub period: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PidsLimit {
    pub limit: i64,
}

/// Resource limits as the flags give them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    /// `--memory`, bytes.
    pub memory: Option<u64>,
    /// `--cpus`, in CPUs (1.5 = 150 ms of CPU time every 100 ms).
    pub cpus: Option<f64>,
    /// `--pids-limit`.
    pub pids: Option<i64>,
}

/// The CFS period cairn uses for `--cpus`, as docker and podman do.
pub const CPU_PERIOD_US: u64 = 100_000;

impl Limits {
    pub fn is_empty(&self) -> bool {
        self.memory.is_none() && self.cpus.is_none() && self.pids.is_none()
    }

    /// The CFS quota for `--cpus` (at least 1 ms, the kernel's minimum).
    pub fn cpu_quota_us(&self) -> Option<i64> {
        self.cpus
            .map(|c| ((c * CPU_PERIOD_US as f64).round() as i64).max(1000))
    }
}

/// A `-v HOST:CTR[:ro]` bind mount.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    pub host: String,
    pub container: String,
    pub readonly: bool,
}

/// Which network the container gets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Network {
    /// A new network namespace with only `lo` (crun brings it up).
    #[default]
    None,
    /// The host's network namespace.
    Host,
}

/// Everything [`build_spec`] needs, already resolved (user names looked up,
/// environment merged, limits decided).
#[derive(Debug, Clone)]
pub struct SpecInput {
    pub args: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    pub user: User,
    pub terminal: bool,
    pub hostname: String,
    pub readonly_root: bool,
    pub network: Network,
    pub volumes: Vec<Volume>,
    /// Files of the container directory bind-mounted over /etc/hosts,
    /// /etc/resolv.conf, /etc/hostname.
    pub etc_files: Vec<(String, String)>,
    /// Container id 0 maps to this host id range (`--userns`).
    pub idmap: Option<cairn_mount::IdMap>,
    /// `linux.cgroupsPath`, when crun is to make the cgroup.
    pub cgroups_path: Option<String>,
    /// Limits crun applies itself (pure v1 or pure v2 hosts); on a hybrid
    /// host cairn applies them through v1 controllers and this is empty.
    pub resources: Option<Resources>,
    /// RLIMIT_NOFILE for the container (soft = hard).
    pub nofile: u64,
}

/// Builds the runtime config.
pub fn build_spec(input: &SpecInput) -> Spec {
    let caps: Vec<String> = DEFAULT_CAPABILITIES.iter().map(|s| s.to_string()).collect();
    // As podman: a non-root user keeps the bounding set but starts with no
    // effective capabilities.
    let live = if input.user.uid == 0 {
        caps.clone()
    } else {
        Vec::new()
    };
    let mut namespaces: Vec<Namespace> = ["pid", "ipc", "uts", "mount", "cgroup"]
        .iter()
        .map(|k| Namespace {
            kind: k.to_string(),
        })
        .collect();
    if input.network == Network::None {
        namespaces.push(Namespace {
            kind: "network".into(),
        });
    }
    let mut uid_mappings = Vec::new();
    let mut gid_mappings = Vec::new();
    if let Some(map) = input.idmap {
        namespaces.push(Namespace {
            kind: "user".into(),
        });
        uid_mappings.push(IdMapping {
            container_id: 0,
            host_id: map.uid,
            size: map.count,
        });
        gid_mappings.push(IdMapping {
            container_id: 0,
            host_id: map.gid,
            size: map.count,
        });
    }
    Spec {
        oci_version: OCI_VERSION.into(),
        process: Process {
            terminal: input.terminal,
            user: input.user.clone(),
            args: input.args.clone(),
            env: input.env.clone(),
            cwd: input.cwd.clone(),
            capabilities: Capabilities {
                bounding: caps,
                effective: live.clone(),
                inheritable: Vec::new(),
                permitted: live,
                ambient: Vec::new(),
            },
            rlimits: vec![Rlimit {
                kind: "RLIMIT_NOFILE".into(),
                hard: input.nofile,
                soft: input.nofile,
            }],
            no_new_privileges: false,
        },
        root: Root {
            path: "rootfs".into(),
            readonly: input.readonly_root,
        },
        hostname: input.hostname.clone(),
        mounts: default_mounts(input),
        linux: Linux {
            namespaces,
            uid_mappings,
            gid_mappings,
            cgroups_path: input.cgroups_path.clone(),
            resources: input.resources.clone(),
            masked_paths: MASKED_PATHS.iter().map(|s| s.to_string()).collect(),
            readonly_paths: READONLY_PATHS.iter().map(|s| s.to_string()).collect(),
        },
    }
}

fn mount(dest: &str, kind: &str, source: &str, options: &[&str]) -> Mount {
    Mount {
        destination: dest.into(),
        kind: kind.into(),
        source: source.into(),
        options: options.iter().map(|s| s.to_string()).collect(),
    }
}

fn default_mounts(input: &SpecInput) -> Vec<Mount> {
    let mut mounts = vec![
        mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"]),
        mount(
            "/dev",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        ),
        mount(
            "/dev/pts",
            "devpts",
            "devpts",
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
            ],
        ),
        mount(
            "/dev/shm",
            "tmpfs",
            "shm",
            &["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        ),
        mount(
            "/dev/mqueue",
            "mqueue",
            "mqueue",
            &["nosuid", "noexec", "nodev"],
        ),
    ];
    // sysfs can be mounted only by the owner of the network namespace; with
    // a user namespace and the host's network, bind the host's (read-only).
    if input.idmap.is_some() && input.network == Network::Host {
        mounts.push(mount(
            "/sys",
            "bind",
            "/sys",
            &["rbind", "nosuid", "noexec", "nodev", "ro"],
        ));
    } else {
        mounts.push(mount(
            "/sys",
            "sysfs",
            "sysfs",
            &["nosuid", "noexec", "nodev", "ro"],
        ));
        mounts.push(mount(
            "/sys/fs/cgroup",
            "cgroup",
            "cgroup",
            &["nosuid", "noexec", "nodev", "relatime", "ro"],
        ));
    }
    // gid=5 (tty) only means something where the container maps gid 5.
    if input.idmap.is_none_or(|m| m.count > 5) {
        mounts[2].options.push("gid=5".into());
    }
    for (dest, source) in &input.etc_files {
        let mut opts = vec!["bind", "rprivate"];
        if input.readonly_root {
            opts.push("ro");
        }
        mounts.push(mount(dest, "bind", source, &opts));
    }
    for v in &input.volumes {
        let mut opts = vec!["rbind", "rprivate"];
        if v.readonly {
            opts.push("ro");
        }
        mounts.push(mount(&v.container, "bind", &v.host, &opts));
    }
    mounts
}

/// The resources section for a runtime that applies limits itself.
pub fn resources_for(limits: &Limits, device_rules: bool) -> Option<Resources> {
    if limits.is_empty() && !device_rules {
        return None;
    }
    Some(Resources {
        devices: if device_rules {
            vec![DeviceRule {
                allow: false,
                access: "rwm".into(),
            }]
        } else {
            Vec::new()
        },
        memory: limits.memory.map(|m| MemoryLimit {
            limit: i64::try_from(m).unwrap_or(i64::MAX),
        }),
        cpu: limits.cpu_quota_us().map(|quota| CpuLimit {
            quota,
            period: CPU_PERIOD_US,
        }),
        pids: limits.pids.map(|limit| PidsLimit { limit }),
    })
}

/// Merges environment lists: later entries replace earlier ones with the
/// same key; order of first appearance is kept.
pub fn merge_env<'a>(layers: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut order: Vec<String> = Vec::new();
    let mut values: BTreeMap<String, String> = BTreeMap::new();
    for entry in layers {
        let key = entry.split_once('=').map_or(entry, |(k, _)| k).to_string();
        if key.is_empty() {
            continue;
        }
        if !values.contains_key(&key) {
            order.push(key.clone());
        }
        values.insert(key, entry.to_string());
    }
    order
        .into_iter()
        .filter_map(|k| values.remove(&k))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input() -> SpecInput {
        SpecInput {
            args: vec!["/bin/sh".into()],
            env: vec![format!("PATH={DEFAULT_PATH}")],
            cwd: "/".into(),
            user: User::default(),
            terminal: false,
            hostname: "abc".into(),
            readonly_root: false,
            network: Network::None,
            volumes: vec![],
            etc_files: vec![("/etc/hosts".into(), "/c/hosts".into())],
            idmap: None,
            cgroups_path: None,
            resources: None,
            nofile: 1024,
        }
    }

    #[test]
    fn root_gets_podman_capabilities_and_private_namespaces() {
        let spec = build_spec(&input());
        assert_eq!(spec.process.capabilities.effective.len(), 11);
        assert!(spec.process.capabilities.ambient.is_empty());
        let ns: Vec<&str> = spec
            .linux
            .namespaces
            .iter()
            .map(|n| n.kind.as_str())
            .collect();
        assert_eq!(ns, ["pid", "ipc", "uts", "mount", "cgroup", "network"]);
        assert!(spec.linux.uid_mappings.is_empty());
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["ociVersion"], "1.0.2");
        assert_eq!(json["process"]["noNewPrivileges"], false);
        assert_eq!(json["process"]["rlimits"][0]["type"], "RLIMIT_NOFILE");
        assert!(json["linux"].get("resources").is_none());
        let dests: Vec<&str> = spec.mounts.iter().map(|m| m.destination.as_str()).collect();
        assert_eq!(
            dests,
            [
                "/proc",
                "/dev",
                "/dev/pts",
                "/dev/shm",
                "/dev/mqueue",
                "/sys",
                "/sys/fs/cgroup",
                "/etc/hosts"
            ]
        );
    }

    #[test]
    fn non_root_user_has_no_effective_capabilities() {
        let mut i = input();
        i.user = User {
            uid: 1000,
            gid: 1000,
            additional_gids: vec![],
        };
        let spec = build_spec(&i);
        assert!(spec.process.capabilities.effective.is_empty());
        assert_eq!(spec.process.capabilities.bounding.len(), 11);
    }

    #[test]
    fn userns_adds_namespace_and_mappings() {
        let mut i = input();
        i.idmap = Some(cairn_mount::IdMap {
            uid: 100_000,
            gid: 100_000,
            count: 65_536,
        });
        i.network = Network::Host;
        let spec = build_spec(&i);
        let json = serde_json::to_value(&spec).unwrap();
        assert_eq!(json["linux"]["uidMappings"][0]["hostID"], 100_000);
        assert_eq!(json["linux"]["gidMappings"][0]["containerID"], 0);
        assert_eq!(json["linux"]["uidMappings"][0]["size"], 65_536);
        assert!(spec.linux.namespaces.iter().any(|n| n.kind == "user"));
        assert!(!spec.linux.namespaces.iter().any(|n| n.kind == "network"));
        let sys = spec
            .mounts
            .iter()
            .find(|m| m.destination == "/sys")
            .unwrap();
        assert_eq!(sys.kind, "bind");
    }

    #[test]
    fn volumes_and_readonly_root() {
        let mut i = input();
        i.readonly_root = true;
        i.volumes = vec![Volume {
            host: "/data".into(),
            container: "/mnt".into(),
            readonly: true,
        }];
        let spec = build_spec(&i);
        assert!(spec.root.readonly);
        let v = spec.mounts.last().unwrap();
        assert_eq!(v.destination, "/mnt");
        assert_eq!(v.options, ["rbind", "rprivate", "ro"]);
    }

    #[test]
    fn resources_translate_limits() {
        let limits = Limits {
            memory: Some(64 << 20),
            cpus: Some(1.5),
            pids: Some(100),
        };
        let r = resources_for(&limits, true).unwrap();
        assert_eq!(r.memory.unwrap().limit, 64 << 20);
        assert_eq!(r.cpu.unwrap().quota, 150_000);
        assert_eq!(r.pids.unwrap().limit, 100);
        assert_eq!(r.devices.len(), 1);
        assert_eq!(resources_for(&Limits::default(), false), None);
    }

    #[test]
    fn env_merge_replaces_by_key_and_keeps_order() {
        let env = merge_env(["PATH=/bin", "A=1", "B=2", "A=3", "=x"]);
        assert_eq!(env, ["PATH=/bin", "A=3", "B=2"]);
    }
}
