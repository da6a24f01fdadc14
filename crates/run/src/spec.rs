//! The OCI runtime configuration (`config.json`, runtime-spec 1.0.2, the
//! subset crun 1.8 needs) and how cairn builds it from an image config and
//! the `cairn run` flags.
//!
//! The document is the `oci-spec` crate's typed runtime [`Spec`], so every
//! field name and shape is the spec's, not a copy kept by hand. Its types
//! come with defaults of their own (youki's: a hostname, mounts, a
//! capability set, `noNewPrivileges`); [`build_spec`] sets every field it
//! writes and clears the others, so what crun gets is only what is built
//! here. The test `config_json_is_unchanged` pins the JSON for
//! representative containers.
//!
//! Only a pure builder lives here: no I/O, so every default (mounts,
//! capabilities, masked paths) is pinned by unit tests. The defaults follow
//! podman's: its default capability set, its masked and read-only paths,
//! tmpfs `/dev`, a private `/dev/shm`, read-only `/sys`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use oci_spec::runtime::{
    Capabilities, Capability, Linux, LinuxCapabilities, LinuxCpu, LinuxDeviceCgroup,
    LinuxIdMapping, LinuxIdMappingBuilder, LinuxMemory, LinuxNamespace, LinuxNamespaceType,
    LinuxPids, LinuxResources, Mount, PosixRlimitBuilder, PosixRlimitType, Process, Root, Spec,
};
use serde::{Deserialize, Serialize};

/// The runtime-spec version written into `config.json`.
pub const OCI_VERSION: &str = "1.0.2";

/// podman's default capabilities (containers.conf `default_capabilities`).
pub const DEFAULT_CAPABILITIES: [Capability; 11] = [
    Capability::Chown,
    Capability::DacOverride,
    Capability::Fowner,
    Capability::Fsetid,
    Capability::Kill,
    Capability::NetBindService,
    Capability::Setfcap,
    Capability::Setgid,
    Capability::Setpcap,
    Capability::Setuid,
    Capability::SysChroot,
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

/// The user the container's process runs as, resolved from the image and
/// `--user` (an input: the runtime config's `process.user` is made from it).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct User {
    pub uid: u32,
    pub gid: u32,
    pub additional_gids: Vec<u32>,
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
    pub resources: Option<LinuxResources>,
    /// RLIMIT_NOFILE for the container (soft = hard).
    pub nofile: u64,
}

/// Builds the runtime config.
pub fn build_spec(input: &SpecInput) -> Spec {
    let caps: Capabilities = DEFAULT_CAPABILITIES.into_iter().collect();
    // As podman: a non-root user keeps the bounding set but starts with no
    // effective capabilities.
    let live = if input.user.uid == 0 {
        caps.clone()
    } else {
        Capabilities::new()
    };
    let mut capabilities = LinuxCapabilities::default();
    capabilities
        .set_bounding(Some(caps))
        .set_effective(Some(live.clone()))
        .set_inheritable(Some(Capabilities::new()))
        .set_permitted(Some(live))
        .set_ambient(Some(Capabilities::new()));

    let mut user = oci_spec::runtime::User::default();
    user.set_uid(input.user.uid)
        .set_gid(input.user.gid)
        .set_additional_gids(Some(input.user.additional_gids.clone()).filter(|g| !g.is_empty()));

    // These builders fail only when a field without a default is missing;
    // every field is given.
    let nofile = PosixRlimitBuilder::default()
        .typ(PosixRlimitType::RlimitNofile)
        .hard(input.nofile)
        .soft(input.nofile)
        .build()
        .expect("every field of the rlimit is set");

    // Every field of the process is set: the type's defaults are not ours.
    let mut process = Process::default();
    process
        .set_terminal(Some(input.terminal))
        .set_console_size(None)
        .set_user(user)
        .set_args(Some(input.args.clone()))
        .set_command_line(None)
        .set_env(Some(input.env.clone()))
        .set_cwd(PathBuf::from(&input.cwd))
        .set_capabilities(Some(capabilities))
        .set_rlimits(Some(vec![nofile]))
        .set_no_new_privileges(Some(false))
        .set_apparmor_profile(None)
        .set_oom_score_adj(None)
        .set_selinux_label(None)
        .set_io_priority(None)
        .set_scheduler(None)
        .set_exec_cpu_affinity(None);

    let mut namespaces: Vec<LinuxNamespaceType> = vec![
        LinuxNamespaceType::Pid,
        LinuxNamespaceType::Ipc,
        LinuxNamespaceType::Uts,
        LinuxNamespaceType::Mount,
        LinuxNamespaceType::Cgroup,
    ];
    if input.network == Network::None {
        namespaces.push(LinuxNamespaceType::Network);
    }
    let mut uid_mappings = None;
    let mut gid_mappings = None;
    if let Some(map) = input.idmap {
        namespaces.push(LinuxNamespaceType::User);
        let mapping = |host_id: u32| -> LinuxIdMapping {
            LinuxIdMappingBuilder::default()
                .container_id(0u32)
                .host_id(host_id)
                .size(map.count)
                .build()
                .expect("every field of the id mapping is set")
        };
        uid_mappings = Some(vec![mapping(map.uid)]);
        gid_mappings = Some(vec![mapping(map.gid)]);
    }
    let namespaces = namespaces
        .into_iter()
        .map(|typ| {
            let mut ns = LinuxNamespace::default();
            ns.set_typ(typ).set_path(None);
            ns
        })
        .collect();

    let mut linux = Linux::default();
    linux
        .set_uid_mappings(uid_mappings)
        .set_gid_mappings(gid_mappings)
        .set_sysctl(None)
        .set_resources(input.resources.clone())
        .set_cgroups_path(input.cgroups_path.as_ref().map(PathBuf::from))
        .set_namespaces(Some(namespaces))
        .set_devices(None)
        .set_rootfs_propagation(None)
        .set_masked_paths(Some(MASKED_PATHS.iter().map(|s| s.to_string()).collect()))
        .set_readonly_paths(Some(READONLY_PATHS.iter().map(|s| s.to_string()).collect()))
        .set_mount_label(None)
        .set_seccomp(None)
        .set_intel_rdt(None)
        .set_personality(None)
        .set_time_offsets(None)
        .set_net_devices(None)
        .set_memory_policy(None);

    let mut root = Root::default();
    root.set_path(PathBuf::from("rootfs"))
        .set_readonly(Some(input.readonly_root));

    let mut spec = Spec::default();
    spec.set_version(OCI_VERSION.to_string())
        .set_process(Some(process))
        .set_root(Some(root))
        .set_hostname(Some(input.hostname.clone()))
        .set_domainname(None)
        .set_mounts(Some(
            default_mounts(input)
                .into_iter()
                .map(MountEntry::into_mount)
                .collect(),
        ))
        .set_annotations(None)
        .set_linux(Some(linux))
        .set_hooks(None);
    spec
}

/// `spec` as the bytes of `config.json`. Capability lists are sets in the
/// runtime spec and `oci-spec` keeps them in `HashSet`s, whose order varies
/// from run to run; they are written sorted, so the same container gets
/// the same file.
pub fn config_json(spec: &Spec) -> Vec<u8> {
    let mut value = serde_json::to_value(spec).expect("a runtime spec serialises");
    sort_capabilities(&mut value);
    serde_json::to_vec_pretty(&value).expect("a JSON value serialises")
}

fn sort_capabilities(v: &mut serde_json::Value) {
    if let Some(serde_json::Value::Object(caps)) = v.pointer_mut("/process/capabilities") {
        for list in caps.values_mut() {
            if let serde_json::Value::Array(a) = list {
                a.sort_by(|x, y| x.as_str().cmp(&y.as_str()));
            }
        }
    }
}

/// A mount as [`default_mounts`] lists it, before it is a runtime-spec
/// [`Mount`] (whose options are easier to add to here).
struct MountEntry {
    destination: String,
    kind: String,
    source: String,
    options: Vec<String>,
}

impl MountEntry {
    fn into_mount(self) -> Mount {
        let mut m = Mount::default();
        m.set_destination(PathBuf::from(self.destination))
            .set_typ(Some(self.kind))
            .set_source(Some(PathBuf::from(self.source)))
            .set_options(Some(self.options).filter(|o| !o.is_empty()))
            .set_uid_mappings(None)
            .set_gid_mappings(None);
        m
    }
}

fn mount(dest: &str, kind: &str, source: &str, options: &[&str]) -> MountEntry {
    MountEntry {
        destination: dest.into(),
        kind: kind.into(),
        source: source.into(),
        options: options.iter().map(|s| s.to_string()).collect(),
    }
}

fn default_mounts(input: &SpecInput) -> Vec<MountEntry> {
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
pub fn resources_for(limits: &Limits, device_rules: bool) -> Option<LinuxResources> {
    if limits.is_empty() && !device_rules {
        return None;
    }
    let mut r = LinuxResources::default();
    if device_rules {
        let mut deny_all = LinuxDeviceCgroup::default();
        deny_all.set_allow(false).set_access(Some("rwm".into()));
        r.set_devices(Some(vec![deny_all]));
    }
    if let Some(m) = limits.memory {
        let mut memory = LinuxMemory::default();
        memory.set_limit(Some(i64::try_from(m).unwrap_or(i64::MAX)));
        r.set_memory(Some(memory));
    }
    if let Some(quota) = limits.cpu_quota_us() {
        let mut cpu = LinuxCpu::default();
        cpu.set_quota(Some(quota)).set_period(Some(CPU_PERIOD_US));
        r.set_cpu(Some(cpu));
    }
    if let Some(limit) = limits.pids {
        let mut pids = LinuxPids::default();
        pids.set_limit(limit);
        r.set_pids(Some(pids));
    }
    Some(r)
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
    use serde_json::Value;

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

    /// The config.json [`config_json`] writes for `i`, as JSON.
    fn json(i: &SpecInput) -> Value {
        serde_json::from_slice(&config_json(&build_spec(i))).unwrap()
    }

    fn strings(v: &Value) -> Vec<&str> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap())
            .collect()
    }

    /// The config.json of representative containers is what cairn wrote
    /// when its runtime-spec types were its own structs (the files in
    /// `testdata/` are that output): same fields, same values. The only
    /// difference is the order of capabilities, now sorted (see
    /// [`config_json`]), which the runtime spec and crun treat as sets.
    #[test]
    fn config_json_is_unchanged() {
        let root = SpecInput {
            args: vec!["/bin/sh".into(), "-c".into(), "echo hi".into()],
            env: vec![format!("PATH={DEFAULT_PATH}"), "HOME=/root".into()],
            hostname: "c0ffee".into(),
            etc_files: vec![
                ("/etc/hosts".into(), "/b/hosts".into()),
                ("/etc/resolv.conf".into(), "/b/resolv.conf".into()),
            ],
            ..input()
        };
        let user = SpecInput {
            args: vec!["/srv/app".into(), "--port=80".into()],
            env: vec!["PATH=/bin".into(), "TERM=xterm".into()],
            cwd: "/srv".into(),
            user: User {
                uid: 1000,
                gid: 100,
                additional_gids: vec![10, 50],
            },
            terminal: true,
            hostname: "web".into(),
            readonly_root: true,
            network: Network::Host,
            volumes: vec![
                Volume {
                    host: "/data".into(),
                    container: "/mnt/data".into(),
                    readonly: true,
                },
                Volume {
                    host: "/cache".into(),
                    container: "/cache".into(),
                    readonly: false,
                },
            ],
            etc_files: vec![
                ("/etc/hosts".into(), "/b/hosts".into()),
                ("/etc/hostname".into(), "/b/hostname".into()),
            ],
            idmap: Some(cairn_mount::IdMap {
                uid: 100_000,
                gid: 200_000,
                count: 65_536,
            }),
            cgroups_path: Some("/cairn/web".into()),
            resources: resources_for(
                &Limits {
                    memory: Some(256 << 20),
                    cpus: Some(0.5),
                    pids: Some(64),
                },
                true,
            ),
            nofile: 524_288,
        };
        let one_id = SpecInput {
            idmap: Some(cairn_mount::IdMap {
                uid: 300_000,
                gid: 300_000,
                count: 1,
            }),
            resources: resources_for(&Limits::default(), true),
            ..root.clone()
        };
        for (input, expected) in [
            (root, include_str!("../testdata/runtime-config-root.json")),
            (
                user,
                include_str!("../testdata/runtime-config-user-userns-limits.json"),
            ),
            (
                one_id,
                include_str!("../testdata/runtime-config-userns-one-id.json"),
            ),
        ] {
            let mut expected: Value = serde_json::from_str(expected).unwrap();
            sort_capabilities(&mut expected);
            assert_eq!(
                json(&input),
                expected,
                "\n{}",
                serde_json::to_string_pretty(&json(&input)).unwrap()
            );
        }
    }

    #[test]
    fn root_gets_podman_capabilities_and_private_namespaces() {
        let spec = json(&input());
        assert_eq!(
            strings(&spec["process"]["capabilities"]["effective"]).len(),
            11
        );
        assert!(strings(&spec["process"]["capabilities"]["ambient"]).is_empty());
        let ns: Vec<&str> = spec["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["type"].as_str().unwrap())
            .collect();
        assert_eq!(ns, ["pid", "ipc", "uts", "mount", "cgroup", "network"]);
        assert!(spec["linux"].get("uidMappings").is_none());
        assert_eq!(spec["ociVersion"], "1.0.2");
        assert_eq!(spec["process"]["noNewPrivileges"], false);
        assert_eq!(spec["process"]["rlimits"][0]["type"], "RLIMIT_NOFILE");
        assert!(spec["linux"].get("resources").is_none());
        let dests: Vec<&str> = spec["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["destination"].as_str().unwrap())
            .collect();
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
        let spec = json(&i);
        assert!(strings(&spec["process"]["capabilities"]["effective"]).is_empty());
        assert_eq!(
            strings(&spec["process"]["capabilities"]["bounding"]).len(),
            11
        );
        assert!(spec["process"]["user"].get("additionalGids").is_none());
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
        let json = json(&i);
        assert_eq!(json["linux"]["uidMappings"][0]["hostID"], 100_000);
        assert_eq!(json["linux"]["gidMappings"][0]["containerID"], 0);
        assert_eq!(json["linux"]["uidMappings"][0]["size"], 65_536);
        let ns = json["linux"]["namespaces"].as_array().unwrap();
        assert!(ns.iter().any(|n| n["type"] == "user"));
        assert!(!ns.iter().any(|n| n["type"] == "network"));
        let sys = json["mounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["destination"] == "/sys")
            .unwrap();
        assert_eq!(sys["type"], "bind");
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
        let json = json(&i);
        assert_eq!(json["root"]["readonly"], true);
        let v = json["mounts"].as_array().unwrap().last().unwrap();
        assert_eq!(v["destination"], "/mnt");
        assert_eq!(strings(&v["options"]), ["rbind", "rprivate", "ro"]);
    }

    #[test]
    fn resources_translate_limits() {
        let limits = Limits {
            memory: Some(64 << 20),
            cpus: Some(1.5),
            pids: Some(100),
        };
        let r = resources_for(&limits, true).unwrap();
        assert_eq!(r.memory().unwrap().limit(), Some(64 << 20));
        assert_eq!(r.cpu().as_ref().unwrap().quota(), Some(150_000));
        assert_eq!(r.pids().unwrap().limit(), 100);
        assert_eq!(r.devices().as_ref().unwrap().len(), 1);
        assert_eq!(resources_for(&Limits::default(), false), None);
    }

    #[test]
    fn env_merge_replaces_by_key_and_keeps_order() {
        let env = merge_env(["PATH=/bin", "A=1", "B=2", "A=3", "=x"]);
        assert_eq!(env, ["PATH=/bin", "A=3", "B=2"]);
    }
}
