//! `roost secret set|list|delete`: the org's secrets. A value is read from
//! stdin or `--from-file`, never from the command line (where `ps` and
//! shell history would show it), and never printed: `list` shows names,
//! versions and times.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use api::secrets::{SECRET_VALUE_BYTES_MAX, SecretRecord, SetSecretRequest};
use clap::Subcommand;

use crate::control::runtime;
use crate::output::{age, print_record, print_table};
use crate::sandbox::OrgTarget;

#[derive(Subcommand)]
pub enum SecretCommand {
    /// Set NAME (made, or rotated to a new version) from stdin or a file.
    #[command(
        after_help = "The value is taken byte for byte (a trailing newline included: use \
                      `printf %s \"$TOKEN\" | roost secret set NAME`). Sandboxes created with \
                      `--secret-env NAME=VAR` or `--secret-file NAME` receive the version current \
                      when they launch."
    )]
    Set {
        /// The secret's name (what `--secret-env` and `--secret-file` take).
        name: String,
        /// Read the value from this file instead of stdin.
        #[arg(long, value_name = "PATH")]
        from_file: Option<PathBuf>,
        #[command(flatten)]
        target: OrgTarget,
    },
    /// List the org's secrets: names, versions, times (never values).
    List {
        #[command(flatten)]
        target: OrgTarget,
    },
    /// Delete NAME. Running sandboxes keep what they were given; a later
    /// launch of a sandbox that asks for it fails (`secret_unavailable`).
    Delete {
        /// The secret's name.
        name: String,
        #[command(flatten)]
        target: OrgTarget,
    },
}

fn read_value(from_file: Option<&PathBuf>) -> Result<String> {
    let mut bytes = Vec::new();
    let limit = SECRET_VALUE_BYTES_MAX as u64 + 1;
    match from_file {
        Some(path) => {
            std::fs::File::open(path)
                .with_context(|| format!("reading {}", path.display()))?
                .take(limit)
                .read_to_end(&mut bytes)
                .with_context(|| format!("reading {}", path.display()))?;
        }
        None => {
            std::io::stdin()
                .take(limit)
                .read_to_end(&mut bytes)
                .context("reading the value from stdin")?;
        }
    }
    if bytes.len() > SECRET_VALUE_BYTES_MAX {
        bail!("the value is longer than {SECRET_VALUE_BYTES_MAX} bytes");
    }
    String::from_utf8(bytes).context("the value is not UTF-8 text")
}

fn print_secret(secret: &SecretRecord, json: bool, verb: &str) -> Result<()> {
    if json {
        return print_record(secret);
    }
    println!("{verb} secret {} (version {})", secret.name, secret.version);
    Ok(())
}

pub fn run(command: SecretCommand) -> Result<ExitCode> {
    match command {
        SecretCommand::Set {
            name,
            from_file,
            target,
        } => {
            let value = read_value(from_file.as_ref())?;
            let client = target.client()?;
            let request = SetSecretRequest { value };
            let secret = runtime()?
                .block_on(client.set_secret(&name, &request))
                .context("secret set failed")?;
            print_secret(&secret, target.json, "set")?;
        }
        SecretCommand::List { target } => {
            let client = target.client()?;
            let list = runtime()?
                .block_on(client.list_secrets())
                .context("secret list failed")?;
            if target.json {
                print_record(&list)?;
            } else {
                let rows: Vec<Vec<String>> = list
                    .secrets
                    .iter()
                    .map(|s| {
                        vec![
                            s.name.clone(),
                            s.version.to_string(),
                            age(&s.created_at),
                            age(&s.updated_at),
                        ]
                    })
                    .collect();
                print_table(&["NAME", "VERSION", "CREATED", "UPDATED"], &rows);
            }
        }
        SecretCommand::Delete { name, target } => {
            let client = target.client()?;
            let secret = runtime()?
                .block_on(client.delete_secret(&name))
                .context("secret delete failed")?;
            print_secret(&secret, target.json, "deleted")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
