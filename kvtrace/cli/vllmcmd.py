"""``kvtrace vllm``: vLLM releases installed beside the project's vLLM."""

from __future__ import annotations

import click

from kvtrace.vllm_release_table import RELEASES, SUPPORTED_VLLM_VERSIONS


@click.group("vllm", help=f"""vLLM releases beside the project's: for replay variants and
    kvtrace engine --vllm.

    kvtrace supports vLLM {RELEASES[0].version} to {RELEASES[-1].version}. A release other
    than the one in kvtrace's own environment is installed into its own directory
    (~/.cache/kvtrace/vllm/VERSION, or $KVTRACE_VLLM_RELEASES/VERSION) and runs in a process
    of its own with that directory first on sys.path: `kvtrace replay W --variant
    vllm-0.30.0`, `kvtrace engine W --vllm 0.30.0`, and lockstep of a capture recorded on it.

    \b
    Examples:
        kvtrace vllm list
        kvtrace vllm install 0.30.0 0.31.0 --dry-run
        kvtrace vllm install 0.30.0 0.31.0 0.32.0
    """)
def command() -> None:
    """The group; its help (above) names the first and the last release of the table."""


@command.command("install")
@click.argument("versions", nargs=-1, metavar="VERSION...")
@click.option("--all", "every", is_flag=True, help="Every supported release.")
@click.option("--dry-run", is_flag=True,
              help="Say what each install would download and where; install nothing.")
def install(versions: tuple[str, ...], every: bool, dry_run: bool) -> None:
    """Install each VERSION beside the project's vLLM (pip install --no-deps --target), with
    pip's progress; one already there is left as it is.

    \b
    Example:
        kvtrace vllm install 0.30.0 0.31.0 0.32.0
        kvtrace vllm install --all
    """
    from kvtrace.probes.signatures import check_supported
    from kvtrace.vllm_releases import install as install_release
    from kvtrace.vllm_releases import is_installed, plan

    if every == bool(versions):
        raise click.UsageError("give the versions to install, or --all")
    versions = versions or SUPPORTED_VLLM_VERSIONS
    for version in versions:
        check_supported(version)  # all refused before anything is downloaded
    for version in versions:
        if dry_run:
            click.echo(f"installed: {plan(version)}" if is_installed(version) else plan(version))
            continue
        install_release(version, lambda line: click.echo(f"kvtrace: {line}", err=True))


@command.command("list")
def list_releases() -> None:
    """Each supported release: the project's own, installed (where), or not.

    \b
    Example:
        kvtrace vllm list
    """
    from kvtrace.vllm_releases import is_installed, release_dir, running_vllm_version

    for row in RELEASES:
        version = row.version
        if version == running_vllm_version():
            state = "the project's own vLLM"
        elif is_installed(version):
            state = f"installed in {release_dir(version)}"
        else:
            state = (f"not installed (kvtrace vllm install {version}: about "
                     f"{row.wheel_mb} MB)")
        click.echo(f"{version}  {state}")
