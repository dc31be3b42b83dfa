//! The container runtime as the runner agent asks things of it: one
//! object-safe trait per handle ([`ContainerRuntime`] for the runtime,
//! [`Container`] for one sandbox's container, [`RunningCommand`] for one
//! exec), so that the agent holds `Arc<dyn ContainerRuntime>` and its tests
//! can put a recording, fault-injecting fake where runc or crun would be.
//!
//! The runc/crun driver ([`Runtime`], [`Sandbox`], [`Execution`]) is the
//! real implementation; each method here is the driver's method of the
//! same name, nothing more. The futures are boxed (no `async fn` in a
//! `dyn` trait) and `Send`, as the agent runs them in spawned tasks.
//! Nothing in the crate imports this module: it sits above the driver.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::agent::files_client::{
    AgentDownload, FileInfo, FileListing, FileWriter, TarSummary, TarWriter,
};
use crate::config::{SandboxConfig, SandboxId, SandboxPaths};
use crate::error::Result;
use crate::exec::{CommandEnd, CommandSpec, Execution, Signaller, Stream};
use crate::signal::Signal;
use crate::state::{DeathCause, Observation, RuntimeState};

use crate::runtime::{Runtime, Sandbox};

/// A boxed `Send` future, as the traits here return.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the agent asks of the runtime as a whole.
pub trait ContainerRuntime: Send + Sync {
    /// The runtime's name (`runc`, `crun`, or a fake's), for the logs.
    fn name(&self) -> &'static str;
    /// Whether sandboxes can have `bridge` networking here.
    fn bridge_available(&self) -> bool;
    /// The ids of every container under this runtime's root.
    fn container_ids(&self) -> Result<Vec<String>>;
    /// A handle to the container `id` (whether or not it exists).
    fn container(&self, id: SandboxId, paths: SandboxPaths) -> Arc<dyn Container>;
    /// Creates and starts the container `config` describes.
    fn launch<'a>(&'a self, config: &'a SandboxConfig)
    -> BoxFuture<'a, Result<Arc<dyn Container>>>;
}

/// What the agent asks of one sandbox's container.
pub trait Container: Send + Sync + std::fmt::Debug {
    fn id(&self) -> &SandboxId;
    fn paths(&self) -> &SandboxPaths;
    fn start(&self) -> BoxFuture<'_, Result<()>>;
    /// `None`: the runtime has no such container.
    fn state(&self) -> BoxFuture<'_, Result<Option<RuntimeState>>>;
    fn observe(&self) -> BoxFuture<'_, Result<Observation>>;
    fn kill(&self, signal: Signal) -> BoxFuture<'_, Result<()>>;
    fn pause(&self) -> BoxFuture<'_, Result<()>>;
    fn resume(&self) -> BoxFuture<'_, Result<()>>;
    /// SIGTERM, then SIGKILL after `grace`; the container stays.
    fn stop(&self, grace: Duration) -> BoxFuture<'_, Result<DeathCause>>;
    /// Resolves when the init dies, with the cause.
    fn wait_for_exit(&self) -> BoxFuture<'_, Result<DeathCause>>;
    /// Kills what runs and removes the container (its files stay).
    fn delete(&self) -> BoxFuture<'_, Result<()>>;
    /// Removes the container's files (the bundle, its root directory).
    fn remove_files(&self) -> BoxFuture<'_, Result<()>>;
    /// Execs `command` in a container just seen running.
    fn exec_seen_running<'a>(
        &'a self,
        command: &'a CommandSpec,
    ) -> BoxFuture<'a, Result<Box<dyn RunningCommand>>>;
    /// The incarnation of the container's agent; `None`: the container
    /// has no agent (its commands go through the runtime's exec).
    fn agent_incarnation(&self) -> BoxFuture<'_, Result<Option<String>>>;
    /// Runs command `id` through the agent of `incarnation`, or attaches
    /// to it when the agent knows it already, with output from `from`.
    fn run_in_agent<'a>(
        &'a self,
        id: &'a str,
        incarnation: &'a str,
        command: &'a CommandSpec,
        from: [u64; 2],
    ) -> BoxFuture<'a, Result<Box<dyn RunningCommand>>>;
    /// Tells the agent the end of `id` is recorded: it may drop it.
    fn forget_command<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>>;
    /// Opens the stdin of command `id` (run with one) for writing.
    fn open_stdin<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Box<dyn CommandStdin>>>;
    /// Sets the size of command `id`'s terminal.
    fn resize_terminal<'a>(
        &'a self,
        id: &'a str,
        rows: u16,
        cols: u16,
    ) -> BoxFuture<'a, Result<()>>;
    /// Reads file `path` in the sandbox through its agent, from `offset`,
    /// at most `length` bytes (to the end without).
    fn read_file<'a>(
        &'a self,
        path: &'a str,
        offset: u64,
        length: Option<u64>,
    ) -> BoxFuture<'a, Result<(FileInfo, Box<dyn FileDownload>)>>;
    /// Writes file `path` in the sandbox through its agent (in place only
    /// once whole).
    fn write_file<'a>(
        &'a self,
        path: &'a str,
        mode: Option<u32>,
        parents: bool,
    ) -> BoxFuture<'a, Result<Box<dyn FileUpload>>>;
    /// Lists `path` in the sandbox, `depth` levels down.
    fn list_files<'a>(&'a self, path: &'a str, depth: u32) -> BoxFuture<'a, Result<FileListing>>;
    /// Removes `path` in the sandbox (a non-empty directory with `recursive`).
    fn remove_file<'a>(&'a self, path: &'a str, recursive: bool) -> BoxFuture<'a, Result<()>>;
    /// Renames `from` to `to` in the sandbox.
    fn move_file<'a>(
        &'a self,
        from: &'a str,
        to: &'a str,
        overwrite: bool,
    ) -> BoxFuture<'a, Result<()>>;
    /// Makes directory `path` in the sandbox; whether it was made.
    fn make_dir<'a>(
        &'a self,
        path: &'a str,
        parents: bool,
        mode: Option<u32>,
    ) -> BoxFuture<'a, Result<bool>>;
    /// Directory `path` of the sandbox as a tar stream.
    fn tar_read<'a>(&'a self, path: &'a str) -> BoxFuture<'a, Result<Box<dyn FileDownload>>>;
    /// Unpacks a tar stream under directory `path` of the sandbox.
    fn tar_write<'a>(&'a self, path: &'a str) -> BoxFuture<'a, Result<Box<dyn TarUpload>>>;
}

/// Bytes of a sandbox's file (or a directory's tar stream) coming from its
/// agent.
pub trait FileDownload: Send {
    /// The next bytes, or `None` once all came.
    fn next_chunk(&mut self) -> BoxFuture<'_, Result<Option<Vec<u8>>>>;
    /// A tar stream's summary, once it is complete.
    fn tar_summary(&self) -> Option<TarSummary>;
}

/// A file being written in a sandbox through its agent; dropped before
/// `finish`, it is abandoned (nothing under its name changes).
pub trait FileUpload: Send {
    /// Writes `bytes`, waiting while the agent writes what came before.
    fn write<'a>(&'a mut self, bytes: &'a [u8]) -> BoxFuture<'a, Result<()>>;
    /// Puts the file in place; its size.
    fn finish(self: Box<Self>) -> BoxFuture<'static, Result<u64>>;
}

/// A tar stream being unpacked in a sandbox through its agent.
pub trait TarUpload: Send {
    fn write<'a>(&'a mut self, bytes: &'a [u8]) -> BoxFuture<'a, Result<()>>;
    /// Ends the stream: what was unpacked.
    fn finish(self: Box<Self>) -> BoxFuture<'static, Result<TarSummary>>;
}

impl FileDownload for AgentDownload {
    fn next_chunk(&mut self) -> BoxFuture<'_, Result<Option<Vec<u8>>>> {
        Box::pin(AgentDownload::next_chunk(self))
    }

    fn tar_summary(&self) -> Option<TarSummary> {
        AgentDownload::tar_summary(self)
    }
}

impl FileUpload for FileWriter {
    fn write<'a>(&'a mut self, bytes: &'a [u8]) -> BoxFuture<'a, Result<()>> {
        Box::pin(FileWriter::write(self, bytes))
    }

    fn finish(self: Box<Self>) -> BoxFuture<'static, Result<u64>> {
        Box::pin(FileWriter::finish(*self))
    }
}

impl TarUpload for TarWriter {
    fn write<'a>(&'a mut self, bytes: &'a [u8]) -> BoxFuture<'a, Result<()>> {
        Box::pin(TarWriter::write(self, bytes))
    }

    fn finish(self: Box<Self>) -> BoxFuture<'static, Result<TarSummary>> {
        Box::pin(TarWriter::finish(*self))
    }
}

/// A command's stdin, written through the sandbox's agent.
pub trait CommandStdin: Send {
    /// Writes `bytes`, waiting while the command does not read.
    fn write<'a>(&'a mut self, bytes: &'a [u8]) -> BoxFuture<'a, Result<()>>;
    /// Closes the stdin: the command reads end of file.
    fn close(self: Box<Self>) -> BoxFuture<'static, Result<()>>;
}

impl CommandStdin for crate::agent::client::AgentStdin {
    fn write<'a>(&'a mut self, bytes: &'a [u8]) -> BoxFuture<'a, Result<()>> {
        Box::pin(crate::agent::client::AgentStdin::write(self, bytes))
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, Result<()>> {
        Box::pin(crate::agent::client::AgentStdin::close(*self))
    }
}

/// Output chunks as a command hands them over.
pub type OnOutput<'a> = Box<dyn FnMut(Stream, &[u8]) + Send + 'a>;

/// One command running in a container.
pub trait RunningCommand: Send {
    /// Signals the command while [`RunningCommand::wait`] runs.
    fn signaller(&self) -> Signaller;
    /// Its pid inside the sandbox, when known (the agent runs it).
    fn pid(&self) -> Option<i32>;
    /// Drives the command to its end, handing output to `on_output`.
    fn wait<'a>(self: Box<Self>, on_output: OnOutput<'a>) -> BoxFuture<'a, Result<CommandEnd>>;
}

impl ContainerRuntime for Runtime {
    fn name(&self) -> &'static str {
        self.kind().name()
    }

    fn bridge_available(&self) -> bool {
        Runtime::bridge_available(self)
    }

    fn container_ids(&self) -> Result<Vec<String>> {
        Runtime::container_ids(self)
    }

    fn container(&self, id: SandboxId, paths: SandboxPaths) -> Arc<dyn Container> {
        Arc::new(self.sandbox(id, paths))
    }

    fn launch<'a>(
        &'a self,
        config: &'a SandboxConfig,
    ) -> BoxFuture<'a, Result<Arc<dyn Container>>> {
        Box::pin(async move {
            let sandbox = Runtime::launch(self, config).await?;
            Ok(Arc::new(sandbox) as Arc<dyn Container>)
        })
    }
}

impl Container for Sandbox {
    fn id(&self) -> &SandboxId {
        Sandbox::id(self)
    }

    fn paths(&self) -> &SandboxPaths {
        Sandbox::paths(self)
    }

    fn start(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(Sandbox::start(self))
    }

    fn state(&self) -> BoxFuture<'_, Result<Option<RuntimeState>>> {
        Box::pin(Sandbox::state(self))
    }

    fn observe(&self) -> BoxFuture<'_, Result<Observation>> {
        Box::pin(Sandbox::observe(self))
    }

    fn kill(&self, signal: Signal) -> BoxFuture<'_, Result<()>> {
        Box::pin(Sandbox::kill(self, signal))
    }

    fn pause(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(Sandbox::pause(self))
    }

    fn resume(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(Sandbox::resume(self))
    }

    fn stop(&self, grace: Duration) -> BoxFuture<'_, Result<DeathCause>> {
        Box::pin(Sandbox::stop(self, grace))
    }

    fn wait_for_exit(&self) -> BoxFuture<'_, Result<DeathCause>> {
        Box::pin(Sandbox::wait_for_exit(self))
    }

    fn delete(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(Sandbox::delete(self))
    }

    fn remove_files(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(Sandbox::remove_files(self))
    }

    fn exec_seen_running<'a>(
        &'a self,
        command: &'a CommandSpec,
    ) -> BoxFuture<'a, Result<Box<dyn RunningCommand>>> {
        Box::pin(async move {
            let execution = Sandbox::exec_seen_running(self, command).await?;
            Ok(Box::new(execution) as Box<dyn RunningCommand>)
        })
    }

    fn agent_incarnation(&self) -> BoxFuture<'_, Result<Option<String>>> {
        Box::pin(async move {
            if !self.has_agent() {
                return Ok(None);
            }
            Ok(Some(self.agent_listing().await?.incarnation))
        })
    }

    fn run_in_agent<'a>(
        &'a self,
        id: &'a str,
        incarnation: &'a str,
        command: &'a CommandSpec,
        from: [u64; 2],
    ) -> BoxFuture<'a, Result<Box<dyn RunningCommand>>> {
        Box::pin(async move {
            let execution = Sandbox::run_in_agent(self, id, incarnation, command, from).await?;
            Ok(Box::new(Execution::Agent(execution)) as Box<dyn RunningCommand>)
        })
    }

    fn forget_command<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.agent_forget(id))
    }

    fn open_stdin<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<Box<dyn CommandStdin>>> {
        Box::pin(async move {
            let stdin = self.agent_stdin(id).await?;
            Ok(Box::new(stdin) as Box<dyn CommandStdin>)
        })
    }

    fn resize_terminal<'a>(
        &'a self,
        id: &'a str,
        rows: u16,
        cols: u16,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.agent_resize(id, rows, cols))
    }

    fn read_file<'a>(
        &'a self,
        path: &'a str,
        offset: u64,
        length: Option<u64>,
    ) -> BoxFuture<'a, Result<(FileInfo, Box<dyn FileDownload>)>> {
        Box::pin(async move {
            let (info, download) = self.agent_read_file(path, offset, length).await?;
            Ok((info, Box::new(download) as Box<dyn FileDownload>))
        })
    }

    fn write_file<'a>(
        &'a self,
        path: &'a str,
        mode: Option<u32>,
        parents: bool,
    ) -> BoxFuture<'a, Result<Box<dyn FileUpload>>> {
        Box::pin(async move {
            let writer = self.agent_write_file(path, mode, parents).await?;
            Ok(Box::new(writer) as Box<dyn FileUpload>)
        })
    }

    fn list_files<'a>(&'a self, path: &'a str, depth: u32) -> BoxFuture<'a, Result<FileListing>> {
        Box::pin(self.agent_list(path, depth))
    }

    fn remove_file<'a>(&'a self, path: &'a str, recursive: bool) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.agent_remove(path, recursive))
    }

    fn move_file<'a>(
        &'a self,
        from: &'a str,
        to: &'a str,
        overwrite: bool,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.agent_move(from, to, overwrite))
    }

    fn make_dir<'a>(
        &'a self,
        path: &'a str,
        parents: bool,
        mode: Option<u32>,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(self.agent_mkdir(path, parents, mode))
    }

    fn tar_read<'a>(&'a self, path: &'a str) -> BoxFuture<'a, Result<Box<dyn FileDownload>>> {
        Box::pin(async move {
            let download = self.agent_tar_read(path).await?;
            Ok(Box::new(download) as Box<dyn FileDownload>)
        })
    }

    fn tar_write<'a>(&'a self, path: &'a str) -> BoxFuture<'a, Result<Box<dyn TarUpload>>> {
        Box::pin(async move {
            let writer = self.agent_tar_write(path).await?;
            Ok(Box::new(writer) as Box<dyn TarUpload>)
        })
    }
}

impl RunningCommand for Execution {
    fn signaller(&self) -> Signaller {
        Execution::signaller(self)
    }

    fn pid(&self) -> Option<i32> {
        Execution::pid(self)
    }

    fn wait<'a>(self: Box<Self>, on_output: OnOutput<'a>) -> BoxFuture<'a, Result<CommandEnd>> {
        Box::pin(Execution::wait(*self, on_output))
    }
}
