//! What a sandbox's processes may do: capabilities, no new privileges, the
//! seccomp filter. Checked from inside, on the init and on commands.

use oci::{Limits, Outcome};

use crate::support::TestSandbox;

/// Docker's default set minus CAP_NET_RAW, by capability number (from
/// linux/capability.h), written out independently of the crate's list.
const EXPECTED_CAPABILITY_BITS: &[u32] = &[
    0,  // CHOWN
    1,  // DAC_OVERRIDE
    3,  // FOWNER
    4,  // FSETID
    5,  // KILL
    6,  // SETGID
    7,  // SETUID
    8,  // SETPCAP
    10, // NET_BIND_SERVICE
    18, // SYS_CHROOT
    27, // MKNOD
    29, // AUDIT_WRITE
    31, // SETFCAP
];

fn status_field(status: &str, name: &str) -> String {
    status
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{name}:")))
        .unwrap_or_else(|| panic!("no {name} in {status}"))
        .trim()
        .to_owned()
}

#[tokio::test]
async fn only_the_minimal_capabilities_no_new_privileges_and_seccomp() {
    let t = TestSandbox::start("caps", Limits::default()).await;
    let expected: u64 = EXPECTED_CAPABILITY_BITS.iter().map(|bit| 1u64 << bit).sum();
    let expected = format!("{expected:016x}");
    for who in ["self", "1"] {
        let status = t.sh_ok(&format!("cat /proc/{who}/status")).await;
        for set in ["CapEff", "CapPrm", "CapBnd"] {
            assert_eq!(status_field(&status, set), expected, "{set} of {who}");
        }
        for set in ["CapInh", "CapAmb"] {
            assert_eq!(
                status_field(&status, set),
                "0000000000000000",
                "{set} of {who}"
            );
        }
        assert_eq!(status_field(&status, "NoNewPrivs"), "1", "{who}");
        assert_eq!(
            status_field(&status, "Seccomp"),
            "2",
            "{who} runs unfiltered"
        );
    }
    // Root in the sandbox, but not root of the host.
    assert_eq!(t.sh_ok("id -u").await, "0\n");
    let ran = t.sh("mount -t tmpfs none /mnt").await;
    assert_ne!(ran.end.outcome, Outcome::Exited { code: 0 }, "mount worked");
}

#[tokio::test]
async fn the_seccomp_filter_refuses_what_capabilities_would_not() {
    let t = TestSandbox::start("seccomp", Limits::default()).await;
    // Creating a user namespace needs no capability: only the filter stops
    // it, with EPERM.
    let ran = t.sh("unshare --user true").await;
    assert_ne!(
        ran.end.outcome,
        Outcome::Exited { code: 0 },
        "user namespace created"
    );
    assert!(
        ran.stderr.contains("Operation not permitted"),
        "{}",
        ran.stderr
    );

    // PTRACE_TRACEME and clone3 need nothing either; the filter answers
    // EPERM and ENOSYS. (python3 is the host's: the default image is the
    // host system.)
    let script = "import ctypes, os\n\
        libc = ctypes.CDLL(None, use_errno=True)\n\
        libc.syscall.restype = ctypes.c_long\n\
        r = libc.ptrace(0, 0, 0, 0); print('ptrace', r, ctypes.get_errno())\n\
        r = libc.syscall(435, 0, 0); print('clone3', r, ctypes.get_errno())\n\
        r = libc.syscall(39); print('getpid', r > 0)\n";
    let ran = t
        .run(&oci::CommandSpec::new(["python3", "-c", script]))
        .await;
    assert_eq!(
        ran.end.outcome,
        Outcome::Exited { code: 0 },
        "{}",
        ran.stderr
    );
    assert_eq!(ran.stdout, "ptrace -1 1\nclone3 -1 38\ngetpid True\n");
}

/// A file made for the test in the host's `/etc`, removed when dropped.
struct HostFile(std::path::PathBuf);

impl Drop for HostFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Issue 14: the default image mounted the host's `/etc` read-only, and
/// root in a sandbox (which holds `CAP_DAC_OVERRIDE`) read its private
/// files: `/etc/ssl/private`'s keys, a database's access rules, a token an
/// operator left there. The sandbox now reads under `/etc` exactly what an
/// unprivileged host user could: every path others cannot read (found here
/// with `find`, independently of the crate's walk) reads as nothing, and a
/// secret planted before the sandbox starts is masked too.
#[tokio::test]
async fn the_default_image_shows_no_host_file_others_cannot_read() {
    use std::os::unix::fs::PermissionsExt;
    let planted = HostFile(std::path::PathBuf::from(format!(
        "/etc/roost-test-secret-{}",
        std::process::id()
    )));
    std::fs::write(&planted.0, "s3cret\n").expect("plant a secret in /etc");
    std::fs::set_permissions(&planted.0, std::fs::Permissions::from_mode(0o600))
        .expect("chmod 600");
    let t = TestSandbox::start("etc", Limits::default()).await;

    let found = std::process::Command::new("find")
        .args([
            "/etc", "(", "-type", "f", "-o", "-type", "d", ")", "!", "-perm", "-o=r",
        ])
        .output()
        .expect("find");
    let private: Vec<String> = String::from_utf8_lossy(&found.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    let planted_path = planted.0.to_str().expect("utf-8").to_owned();
    assert!(private.contains(&planted_path), "{private:?}");
    for path in &private {
        // A masked file reads as empty; a masked directory is an empty
        // read-only tmpfs; anything else is a leak.
        let script = format!(
            "if [ -d '{path}' ]; then ls -A '{path}' | wc -l; else cat '{path}' 2>/dev/null | wc -c; fi"
        );
        let ran = t.sh(&script).await;
        assert_eq!(
            ran.stdout.trim(),
            "0",
            "{path} is readable in the sandbox: {}",
            ran.stderr
        );
    }
    // What others may read stays visible: programs need it.
    assert!(!t.sh_ok("cat /etc/passwd").await.is_empty());
    assert_eq!(
        t.sh(&format!("cat {planted_path}")).await.stdout,
        "",
        "the planted secret leaked"
    );
}
