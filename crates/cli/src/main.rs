//! The `roost` binary: parses the command line and hands each subcommand
//! to its module. No logic lives here.

mod control;
mod home;
mod output;
mod store_admin;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "roost",
    version,
    about = "Sandboxes for AI coding agents whose homes persist"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Save a home directory to a store, or materialise it from one.
    #[command(subcommand)]
    Home(home::HomeCommand),
    /// Maintain a store: garbage-collect, verify, report usage.
    #[command(subcommand)]
    Store(store_admin::StoreCommand),
    /// Run the control plane.
    Server(control::ServerArgs),
    /// Administer a running control plane (organisations, runner tokens).
    #[command(subcommand)]
    Admin(control::AdminCommand),
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ROOST_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Home(command) => home::run(command),
        Command::Store(command) => store_admin::run(command),
        Command::Server(args) => control::run_server(args),
        Command::Admin(command) => control::run_admin(command),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            // One line naming the problem: the outermost context and its cause.
            let mut message = err.to_string();
            if let Some(cause) = err.chain().nth(1) {
                message = format!("{message}: {cause}");
            }
            eprintln!("roost: error: {}", message.replace('\n', " "));
            std::process::ExitCode::FAILURE
        }
    }
}
