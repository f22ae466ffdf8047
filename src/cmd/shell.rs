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
            write_pages(command, dir)
                .with_context(|| format!("writing manual pages into {}", dir.display()))?;
        }
        None => {
            let page = render_page(command, &[]).context("rendering the manual page")?;
            super::pipe::emit(&String::from_utf8_lossy(&page))
                .context("writing the manual page")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `headroom.1` and one `headroom-SUBCOMMAND.1` per subcommand (hidden ones left out).
fn write_pages(command: clap::Command, dir: &std::path::Path) -> std::io::Result<()> {
    let mut command = command.disable_help_subcommand(true);
    command.build();
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
        let path = dir.join(clap_mangen::Man::new(sub.clone()).get_filename());
        std::fs::write(path, render_page(sub.clone(), &[sub.get_name()])?)?;
    }
    let path = dir.join(clap_mangen::Man::new(command.clone()).get_filename());
    std::fs::write(path, render_page(command, &[])?)
}

/// One page as clap_mangen renders it, with an EXIT STATUS section (man-pages(7) order: after
/// the options and subcommands, before the version).
fn render_page(command: clap::Command, path: &[&str]) -> std::io::Result<Vec<u8>> {
    let man = clap_mangen::Man::new(command.clone());
    let mut page = Vec::new();
    man.render_title(&mut page)?;
    man.render_name_section(&mut page)?;
    man.render_synopsis_section(&mut page)?;
    man.render_description_section(&mut page)?;
    if command.get_arguments().any(|a| !a.is_hide_set()) {
        man.render_options_section(&mut page)?;
    }
    if command.has_subcommands() {
        man.render_subcommands_section(&mut page)?;
    }
    if command.get_after_long_help().is_some() || command.get_after_help().is_some() {
        man.render_extra_section(&mut page)?;
    }
    page.extend_from_slice(exit_status_section(path.first().copied()).as_bytes());
    if command.get_version().is_some() || command.get_long_version().is_some() {
        man.render_version_section(&mut page)?;
    }
    Ok(page)
}

/// The exit codes of `headroom` (`None`) or one subcommand, as roff.
fn exit_status_section(subcommand: Option<&str>) -> String {
    let ok = ("0", "success");
    let bad = (
        "2",
        "bad input (one line on standard error) or an unusable environment",
    );
    let pipe = (
        "141",
        "standard output was closed (`| head`); plan and doctor keep their own code instead",
    );
    let codes: Vec<(&str, &str)> = match subcommand {
        Some("plan") => vec![
            ("0", "the plan fits the card"),
            bad,
            (
                "3",
                "the plan does not fit, or vLLM would refuse the settings; the options that fit are printed",
            ),
        ],
        Some("doctor") => vec![
            ("0", "nothing wrong was found"),
            (
                "1",
                "the log or the metrics show a problem; the findings are printed",
            ),
            bad,
        ],
        Some("up") => vec![
            ("0", "stopped on request after running"),
            (
                "1",
                "a backend or the gateway failed; every process it started is stopped",
            ),
            bad,
            ("3", "the box does not fit the card"),
        ],
        Some("bench") | Some("soak") => {
            vec![
                ok,
                bad,
                ("130", "interrupted; the partial report is written"),
                pipe,
            ]
        }
        Some(_) => vec![ok, bad, pipe],
        None => vec![
            ok,
            (
                "1",
                "doctor found a problem; up saw a backend or the gateway fail",
            ),
            bad,
            ("3", "plan: the plan does not fit; up: the box does not fit"),
            ("130", "bench or soak interrupted"),
            pipe,
        ],
    };
    let mut roff = String::from(".SH \"EXIT STATUS\"\n");
    for (code, meaning) in codes {
        roff.push_str(&format!(".TP\n\\fB{code}\\fR\n{}\n", roff_text(meaning)));
    }
    roff
}

/// Text safe as a roff text line: backslashes doubled, a leading dot or quote escaped.
fn roff_text(text: &str) -> String {
    let t = text.replace('\\', "\\\\");
    if t.starts_with(['.', '\'']) {
        format!("\\&{t}")
    } else {
        t
    }
}
