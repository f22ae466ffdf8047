//! `headroom completions bash|zsh|fish` and `headroom man`: both generated from the binary's own
//! clap definition at the moment they are asked for, so they can never disagree with the flags.
//! `headroom man` needs no build step or network: `headroom man | man -l -`, or
//! `headroom man --out-dir DIR` writes `headroom.1` and one page per subcommand.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;

#[derive(Debug, clap::Args)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

#[derive(Debug, clap::Args)]
pub struct ManArgs {
    /// Write headroom.1 and headroom-SUBCOMMAND.1 into this folder instead of printing headroom.1.
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
}

pub fn completions(args: &CompletionsArgs, mut command: clap::Command) -> anyhow::Result<ExitCode> {
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut command, "headroom", &mut script);
    super::pipe::emit(&String::from_utf8_lossy(&script))
        .context("writing the completion script")?;
    Ok(ExitCode::SUCCESS)
}

pub fn man(args: &ManArgs, command: clap::Command) -> anyhow::Result<ExitCode> {
    match &args.out_dir {
        Some(dir) => {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
            clap_mangen::generate_to(command, dir)
                .with_context(|| format!("writing manual pages into {}", dir.display()))?;
        }
        None => {
            let mut page = Vec::new();
            clap_mangen::Man::new(command)
                .render(&mut page)
                .context("rendering the manual page")?;
            super::pipe::emit(&String::from_utf8_lossy(&page))
                .context("writing the manual page")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}
