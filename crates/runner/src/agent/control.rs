//! The control plane as the agent speaks to it: [`ControlPlane`], one
//! method per runner-protocol call the agent makes, so that the agent
//! holds `Arc<dyn ControlPlane>` and its tests can answer from a script
//! (`testing::FakeControl`) instead of a live server.
//!
//! [`Client`] is the real implementation: each method is the client's
//! method of the same name. Answers the agent never reads (the records a
//! report returns) are dropped here, so a fake need not build them.
//!
//! Block transfers (homes and images through the store) are not
//! abstracted: [`ControlPlane::blocks`] hands out the block service's
//! client, `RemoteBackend`, which speaks HTTP to the server. A fake gives
//! one whose every transfer fails as unreachable.

use api::blocks::RemoteBackend;
use api::client::{Client, ClientError, OutputStream};
use api::runners::{
    Assignments, CommandReport, HeartbeatRequest, KeptCopyAnswer, KeptCopyReport, PreemptRequest,
    RegisterRequest, RegisterResponse, RunnerRecord, SandboxReport, SaveReport, SnapshotReport,
};
use oci::seam::BoxFuture;

/// A call's answer.
pub(crate) type Answer<'a, T> = BoxFuture<'a, Result<T, ClientError>>;

/// Every call the agent makes to the control plane.
pub(crate) trait ControlPlane: Send + Sync {
    fn runner_register<'a>(&'a self, request: &'a RegisterRequest) -> Answer<'a, RegisterResponse>;
    fn runner_heartbeat<'a>(&'a self, request: &'a HeartbeatRequest) -> Answer<'a, ()>;
    fn runner_preempt<'a>(&'a self, request: &'a PreemptRequest) -> Answer<'a, RunnerRecord>;
    /// Long-polls the assignments: answers when they differ from `etag`
    /// or after `wait_s`.
    fn runner_assignments<'a>(
        &'a self,
        runner_id: &'a str,
        etag: &'a str,
        wait_s: u64,
    ) -> Answer<'a, Assignments>;
    fn runner_report_sandbox<'a>(
        &'a self,
        sandbox_id: &'a str,
        report: &'a SandboxReport,
    ) -> Answer<'a, ()>;
    fn runner_report_command<'a>(
        &'a self,
        command_id: &'a str,
        report: &'a CommandReport,
    ) -> Answer<'a, ()>;
    /// Appends `data` at `offset` of a command's output; the server's new
    /// length.
    fn runner_append_output<'a>(
        &'a self,
        command_id: &'a str,
        stream: OutputStream,
        placement: (&'a str, u64),
        offset: u64,
        data: Vec<u8>,
    ) -> Answer<'a, u64>;
    fn runner_report_save<'a>(
        &'a self,
        sandbox_id: &'a str,
        report: &'a SaveReport,
    ) -> Answer<'a, ()>;
    fn runner_report_snapshot<'a>(
        &'a self,
        snapshot_id: &'a str,
        report: &'a SnapshotReport,
    ) -> Answer<'a, ()>;
    /// Reports a home kept aside; the answer says whether to keep it.
    fn runner_report_kept<'a>(&'a self, report: &'a KeptCopyReport) -> Answer<'a, KeptCopyAnswer>;
    /// The block service's client, for moving homes and images.
    fn blocks(&self) -> RemoteBackend;
}

impl ControlPlane for Client {
    fn runner_register<'a>(&'a self, request: &'a RegisterRequest) -> Answer<'a, RegisterResponse> {
        Box::pin(Client::runner_register(self, request))
    }

    fn runner_heartbeat<'a>(&'a self, request: &'a HeartbeatRequest) -> Answer<'a, ()> {
        Box::pin(async move { Client::runner_heartbeat(self, request).await.map(drop) })
    }

    fn runner_preempt<'a>(&'a self, request: &'a PreemptRequest) -> Answer<'a, RunnerRecord> {
        Box::pin(Client::runner_preempt(self, request))
    }

    fn runner_assignments<'a>(
        &'a self,
        runner_id: &'a str,
        etag: &'a str,
        wait_s: u64,
    ) -> Answer<'a, Assignments> {
        Box::pin(Client::runner_assignments(self, runner_id, etag, wait_s))
    }

    fn runner_report_sandbox<'a>(
        &'a self,
        sandbox_id: &'a str,
        report: &'a SandboxReport,
    ) -> Answer<'a, ()> {
        Box::pin(async move {
            Client::runner_report_sandbox(self, sandbox_id, report)
                .await
                .map(drop)
        })
    }

    fn runner_report_command<'a>(
        &'a self,
        command_id: &'a str,
        report: &'a CommandReport,
    ) -> Answer<'a, ()> {
        Box::pin(async move {
            Client::runner_report_command(self, command_id, report)
                .await
                .map(drop)
        })
    }

    fn runner_append_output<'a>(
        &'a self,
        command_id: &'a str,
        stream: OutputStream,
        placement: (&'a str, u64),
        offset: u64,
        data: Vec<u8>,
    ) -> Answer<'a, u64> {
        Box::pin(Client::runner_append_output(
            self, command_id, stream, placement, offset, data,
        ))
    }

    fn runner_report_save<'a>(
        &'a self,
        sandbox_id: &'a str,
        report: &'a SaveReport,
    ) -> Answer<'a, ()> {
        Box::pin(async move {
            Client::runner_report_save(self, sandbox_id, report)
                .await
                .map(drop)
        })
    }

    fn runner_report_snapshot<'a>(
        &'a self,
        snapshot_id: &'a str,
        report: &'a SnapshotReport,
    ) -> Answer<'a, ()> {
        Box::pin(async move {
            Client::runner_report_snapshot(self, snapshot_id, report)
                .await
                .map(drop)
        })
    }

    fn runner_report_kept<'a>(&'a self, report: &'a KeptCopyReport) -> Answer<'a, KeptCopyAnswer> {
        Box::pin(Client::runner_report_kept(self, report))
    }

    fn blocks(&self) -> RemoteBackend {
        RemoteBackend::new(self.clone(), tokio::runtime::Handle::current())
    }
}
