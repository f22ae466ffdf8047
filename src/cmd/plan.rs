//! `headroom plan`: flags → validated plan request → `headroom-plan` → table, JSON or shell output.

use std::process::ExitCode;

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// Hugging Face id, local directory or file, or a catalog name.
    #[arg(long)]
    pub model: String,
}

pub fn run(_args: PlanArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("plan is being built")
}
