//! Which runtime runs the sandboxes on this host, and how a wrong choice
//! fails.

use oci::{Error, Limits, Network, Runtime, RuntimeChoice, RuntimeConfig, RuntimeKind};

use crate::support::{TestSandbox, prepare, runtime_in};

#[tokio::test]
async fn auto_picks_the_runtime_that_works_here() {
    let (dir, _) = prepare("auto", Limits::default());
    let runtime = runtime_in(dir.path(), RuntimeChoice::Auto).expect("auto finds a runtime");
    let crun_installed =
        oci::host::find_binary(&std::env::var_os("PATH").unwrap_or_default(), "crun").is_some();
    if runtime.cgroups().is_pure_v2() && crun_installed {
        assert_eq!(runtime.kind(), RuntimeKind::Crun);
    } else {
        // This machine: cgroup v1 with a v2 hierarchy beside it (hybrid).
        assert_eq!(runtime.kind(), RuntimeKind::Runc);
    }
    assert!(runtime.binary().ends_with(runtime.kind().name()));
}

#[tokio::test]
async fn an_explicit_crun_runs_or_fails_naming_the_reason() {
    let (dir, config) = prepare("crun", Limits::default());
    let runtime = match runtime_in(dir.path(), RuntimeChoice::Crun) {
        Ok(runtime) => runtime,
        Err(e @ Error::RuntimeNotFound { .. }) => {
            panic!("crun is not installed (scripts/test.sh installs it): {e}")
        }
        Err(e) => panic!("{e}"),
    };
    assert_eq!(runtime.kind(), RuntimeKind::Crun);
    match runtime.launch(&config).await {
        Ok(sandbox) => {
            // Works where crun works (a pure cgroup v2 host).
            let t = TestSandbox::from_parts(sandbox, runtime.clone(), config, dir);
            assert_eq!(t.sh_ok("echo ok").await, "ok\n");
            t.sandbox.delete().await.expect("delete");
        }
        Err(error) => {
            assert!(
                !runtime.cgroups().is_pure_v2(),
                "crun failed on a pure v2 host: {error}"
            );
            let Error::Runtime {
                runtime: "crun",
                op: "create",
                message,
                ..
            } = &error
            else {
                panic!("unexpected error: {error}");
            };
            assert!(message.contains("hybrid"), "{message}");
            let text = error.to_string();
            assert!(
                text.starts_with("crun create failed for sandbox t-crun-"),
                "{text}"
            );
            // Nothing is left behind by the failed create.
            assert!(runtime.container_ids().expect("list").is_empty());
        }
    }
}

#[test]
fn a_missing_runtime_binary_is_named() {
    let empty = tempfile::tempdir().expect("temp dir");
    for (choice, name) in [(RuntimeChoice::Runc, "runc"), (RuntimeChoice::Crun, "crun")] {
        let mut config = RuntimeConfig::new(choice, empty.path().join("state"));
        config.search_path = Some(empty.path().as_os_str().to_owned());
        let error = Runtime::open(config).expect_err("no binary there");
        assert!(
            matches!(error, Error::RuntimeNotFound { name: n, .. } if n == name),
            "{error}"
        );
        assert!(
            error
                .to_string()
                .contains(&format!("OCI runtime {name} not found")),
            "{error}"
        );
        assert!(error.is_permanent());
    }
    let mut config = RuntimeConfig::new(RuntimeChoice::Auto, empty.path().join("state"));
    config.search_path = Some(empty.path().as_os_str().to_owned());
    assert!(matches!(
        Runtime::open(config),
        Err(Error::NoRuntime { .. })
    ));
}

#[tokio::test]
async fn a_bridge_network_is_refused_before_anything_runs() {
    let (dir, mut config) = prepare("bridge", Limits::default());
    config.network = Network::Bridge;
    let runtime = runtime_in(dir.path(), RuntimeChoice::Runc).expect("runc");
    let error = runtime.create(&config).await.expect_err("bridge refused");
    assert!(matches!(error, Error::Unsupported(_)), "{error}");
    assert!(error.to_string().contains("bridge"), "{error}");
    assert!(runtime.container_ids().expect("list").is_empty());
    assert!(
        !config.paths.dir().exists(),
        "files written for a refused sandbox"
    );
}
